"""Measuring a DFlash draft: conversations decoded turn by turn, and the metrics (the prompt sets they come
from: `evaluation.prompt_sets`).

What a figure means depends on how it was taken (answer length, turns, temperature, block),
so every result carries its `EvalProtocol`. tau grows with answer length and loops are trivially
easy to draft, so next to tau this reports tau over the first 256 tokens of each answer, the share
of answers that loop and tau over the answers that do not. Definitions: docs/evaluate.md.
The command around it is `python -m nemo_dflash.recipes.evaluate`.
"""

from __future__ import annotations

import inspect
import logging
import statistics
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from nemo_dflash.data.chat_template import stop_token_ids
from nemo_dflash.data.loops import find_loop_start
from nemo_dflash.draft.model import DFlashDraftModel
from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder, autoregressive_generate
from nemo_dflash.engine.sampling import GREEDY, SamplingParams
from nemo_dflash.evaluation.prompt_sets import (  # noqa: F401  (the prompt sets' old import path)
    MTBENCH_FILE, EvalPrompt, PromptLike, as_eval_prompt, encode_chat, load_chat_file, load_humaneval, load_mtbench,
    load_prompt_set,
)

logger = logging.getLogger(__name__)

WARMUP_TOKENS = 16
# tokens an earlier answer may take in a later turn's prompt beyond the cap (re-encoded text, end of turn)
ANSWER_MARGIN = 32
FIRST_TOKENS = 256  # the "first 256 tokens" column: steps that start before this output index
STOP_RULE = "end of turn (EOS or the chat template's end-of-turn token) or max_new_tokens"


# ----------------------------------------------------------------------------- protocol


@dataclass(frozen=True)
class EvalProtocol:
    """How figures are taken. Printed beside every tau and stored in results.json as "protocol".

    `turns` caps the user turns decoded per conversation (MT-Bench has 2: turn 2 sees the target's
    own turn-1 answer). `num_prompts` None means every prompt of each dataset. `block_size` None
    means the draft's trained block. `speedup_prompts` is how many prompts per dataset are timed
    against plain decoding (0: none).
    """

    name: str
    max_new_tokens: int
    turns: int
    samplings: tuple[SamplingParams, ...]  # each a figure's sampling setting (results.json: "temperatures")
    datasets: tuple[str, ...]
    num_prompts: Optional[int]
    speedup_prompts: int
    block_size: Optional[int] = None
    decode: str = "eager"
    first_prompt: int = 0
    method: str = "sequential"  # how acceptance is measured: "sequential", "replay" (T=0 only) or "batched"
    overrides: tuple[str, ...] = ()  # the fields changed from the named protocol

    def label(self, sampling: SamplingParams, block_size: int, turns: Optional[int] = None) -> str:
        """The short protocol tag printed next to a figure (`turns`: those of its dataset, if fewer)."""
        n = self.turns if turns is None else min(turns, self.turns)
        return (f"{self.name}: {self.max_new_tokens} tok, {n} turn{'s' if n > 1 else ''}, "
                f"{sampling.label}, "
                f"B={block_size}, {self.decode}{'' if self.method == 'sequential' else ', ' + self.method}")

    def with_overrides(self, **changes: Any) -> "EvalProtocol":
        """This protocol with explicit values replacing its own; the changed fields are recorded (by the names
        results.json gives them: `RECORD_NAMES`)."""
        changed = tuple(RECORD_NAMES.get(k, k) for k, v in changes.items()
                        if v is not None and v != getattr(self, k))
        kept = {k: v for k, v in changes.items() if v is not None}
        return replace(self, **kept, overrides=tuple(dict.fromkeys(self.overrides + changed)))


# fields that results.json's "protocol" names otherwise (the name its readers know)
RECORD_NAMES = {"samplings": "temperatures"}

# replay: T=0 acceptance from batched greedy answers (evaluation.replay); batched: the speculative decoder
# on many conversations at once (engine.batched_static), any temperature
METHODS = ("sequential", "replay", "batched")

PROTOCOLS: dict[str, EvalProtocol] = {
    # The DFlash paper's Tables 1-2: up to 2048 new tokens, MT-Bench on both turns, T=0 and T=1.
    "paper": EvalProtocol("paper", max_new_tokens=2048, turns=2, samplings=(GREEDY, SamplingParams(1.0)),
                          datasets=("mtbench", "humaneval"), num_prompts=None, speedup_prompts=20),
    # CI and the demo: minutes on a CPU. Its figures are not comparable with the paper's.
    "quick": EvalProtocol("quick", max_new_tokens=64, turns=1, samplings=(GREEDY,),
                          datasets=("mtbench", "humaneval"), num_prompts=8, speedup_prompts=8),
}


@dataclass(frozen=True)
class EvalSettings:
    """How one set of prompts is decoded (the keyword arguments of `evaluate_acceptance`)."""

    max_new_tokens: int = 128
    sampling: SamplingParams = GREEDY
    block_size: Optional[int] = None
    turns: int = 1
    decode: str = "eager"
    measure_speedup: bool = False
    warmup: bool = True
    use_chat_template: bool = True
    seed: int = 0


# ----------------------------------------------------------------------------- decoding


@dataclass
class Answer:
    """One generated answer (one turn of one conversation) and how it was produced."""

    id: str
    turn: int  # 1-based
    output_ids: list[int]
    acceptance_lengths: list[int]
    stopped: bool  # ended at an end-of-turn token (else it reached max_new_tokens)
    loop_start: Optional[int] = None  # index of the first token of a degenerate repetition, if any
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    # speedup runs only: decode times (prefill excluded) and the plain decode of the same prompt
    decode_time_s: Optional[float] = None
    ar_decode_time_s: Optional[float] = None
    ar_new_tokens: Optional[int] = None
    ar_match: Optional[bool] = None

    def record(self) -> dict[str, Any]:
        """A JSON row (answers.jsonl): enough to recompute every metric."""
        row = asdict(self)
        row.pop("prompt_ids")
        return {k: v for k, v in row.items() if v is not None or k == "loop_start"}

    @classmethod
    def from_record(cls, row: dict[str, Any]) -> "Answer":
        return cls(**{k: v for k, v in row.items() if k != "prompt_ids"})


def answer_seed(seed: int, sampling: SamplingParams, prompt_id: str) -> int:
    """A sampling seed per conversation: results do not depend on which worker or order decoded it. Keyed by
    `SamplingParams.key` ("1" at a plain T=1, as a bare temperature always keyed it)."""
    return zlib.crc32(f"{seed}|{sampling.key}|{prompt_id}".encode())


def conversation_turns(prompt: EvalPrompt, turns: int) -> int:
    """How many answers a conversation gets: up to `turns` of its user turns (message lists: one)."""
    return 1 if prompt.messages is not None else min(max(turns, 1), len(prompt.turns))


def answer_text(tokenizer: Any, output_ids: Sequence[int], stops: Iterable[int]) -> str:
    """An answer as the next turn's history holds it: decoded text, stop and special tokens dropped."""
    stop = set(stops)
    return tokenizer.decode([i for i in output_ids if i not in stop], skip_special_tokens=True)


def _decode_kwargs(fn: Any, decode: str) -> dict[str, str]:
    """`decode=` for decoders that take it; only "eager" may be asked of one that does not."""
    try:
        takes = "decode" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover
        takes = False
    if takes:
        return {"decode": decode}
    if decode != "eager":
        raise ValueError(f"decode mode {decode!r} needs a decoder with a `decode` option (this install has none)")
    return {}


def _answer(prompt_id: str, turn: int, prompt_ids: Sequence[int], out: Any, ar: Any = None) -> Answer:
    """One decoded turn as an `Answer`; with `ar` (plain decoding of the same prompt) its timing too."""
    body = out.output_ids[:-1] if out.stopped else out.output_ids  # a stop token ends the output
    return Answer(
        id=prompt_id, turn=turn, output_ids=out.output_ids, acceptance_lengths=list(out.acceptance_lengths),
        stopped=out.stopped, loop_start=find_loop_start(body), prompt_ids=list(prompt_ids),
        decode_time_s=out.decode_time_s if ar else None, ar_decode_time_s=ar.decode_time_s if ar else None,
        ar_new_tokens=ar.num_new_tokens if ar else None, ar_match=ar.output_ids == out.output_ids if ar else None,
    )


class ConversationDecoder:
    """Decodes conversations turn by turn with one target and one draft.

    A turn's prompt is the chat so far through the chat template; after each turn the target's
    own answer (decoded text, stop tokens dropped) is appended as the assistant message, so turn 2
    sees exactly what the target said in this run.
    """

    def __init__(self, target_model: nn.Module, tokenizer: Any, draft: DFlashDraftModel,
                 settings: EvalSettings) -> None:
        self.target, self.tokenizer, self.settings = target_model, tokenizer, settings
        self.spec = DFlashSpeculativeDecoder(target_model, draft, settings.block_size)
        self.stops = stop_token_ids(target_model, tokenizer)
        device = self.spec.device
        self.gen_device = device if device.type == "cuda" else torch.device("cpu")
        self.spec_kw = _decode_kwargs(self.spec.generate, settings.decode)
        self.ar_kw = _decode_kwargs(autoregressive_generate, settings.decode) if settings.measure_speedup else {}

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def _kw(self, max_new_tokens: Optional[int] = None) -> dict[str, Any]:
        s = self.settings
        return dict(max_new_tokens=max_new_tokens or s.max_new_tokens, sampling=s.sampling,
                    stop_token_ids=self.stops)

    def warmup(self, prompt: EvalPrompt) -> None:
        """One short untimed decode with each decoder (allocator, kernels, graphs)."""
        first = prompt.history() + ([] if prompt.messages is not None else
                                    [{"role": "user", "content": prompt.turns[0]}])
        ids = encode_chat(self.tokenizer, first, self.settings.use_chat_template)
        kw = self._kw(min(self.settings.max_new_tokens, WARMUP_TOKENS))
        g = torch.Generator(device=self.gen_device).manual_seed(0)
        self.spec.generate(ids, generator=g, **kw, **self.spec_kw)
        if self.settings.measure_speedup:
            autoregressive_generate(self.target, ids, generator=g, **kw, **self.ar_kw)

    def answer_text(self, output_ids: Sequence[int]) -> str:
        return answer_text(self.tokenizer, output_ids, self.stops)

    @torch.no_grad()
    def run_batch(self, prompts: Sequence[EvalPrompt]) -> list[list[Answer]]:
        """`run` for many conversations at once, on the engine's continuous batching
        (`engine.batched_static`; `--decode graphs`: each step a captured CUDA graph): one row per
        conversation, and a conversation's next turn, built on its own answer, enters as soon as that
        answer ends. At T=0 the answers are `run`'s; at T > 0 they are samples of the same distribution
        from one generator (seeded by the first prompt), not `run`'s per-conversation samples. No timing:
        the rows share one clock."""
        from nemo_dflash.engine.batched_static import batched_static_speculative_generate

        s = self.settings
        g = torch.Generator(device=self.gen_device).manual_seed(answer_seed(s.seed, s.sampling, prompts[0].id))
        histories = [p.history() for p in prompts]
        turns = [conversation_turns(p, s.turns) for p in prompts]
        answers: list[list[Answer]] = [[] for _ in prompts]
        asked: list[tuple[int, list[int]]] = []  # each request of the engine: (conversation, its prompt ids)

        def ask(i: int) -> list[int]:  # conversation i's next turn as a prompt
            if prompts[i].messages is None:
                histories[i].append({"role": "user", "content": prompts[i].turns[len(answers[i])]})
            ids = encode_chat(self.tokenizer, histories[i], s.use_chat_template)
            asked.append((i, ids))
            return ids

        def on_done(k: int, out: Any) -> Optional[list[int]]:
            i, prompt_ids = asked[k]
            answers[i].append(_answer(prompts[i].id, len(answers[i]) + 1, prompt_ids, out))
            if len(answers[i]) == turns[i]:
                return None
            histories[i].append({"role": "assistant", "content": self.answer_text(out.output_ids)})
            return ask(i)

        firsts = [ask(i) for i in range(len(prompts))]
        batched_static_speculative_generate(
            self.spec, firsts, generator=g, use_graphs=s.decode == "graphs", on_done=on_done,
            max_prompt_tokens=max(self._longest_prompt(p, t) for p, t in zip(prompts, turns)), **self._kw())
        return answers

    def _longest_prompt(self, prompt: EvalPrompt, turns: int) -> int:
        """A bound on the tokens of `prompt`'s last turn's prompt: every user turn through the template, and
        each earlier answer at the token cap plus a margin for its end-of-turn tokens and re-encoding."""
        history = prompt.history()
        if prompt.messages is None:
            for t in range(turns):
                history += ([{"role": "assistant", "content": ""}] if t else []) + [
                    {"role": "user", "content": prompt.turns[t]}]
        return len(encode_chat(self.tokenizer, history, self.settings.use_chat_template)) + (turns - 1) * (
            self.settings.max_new_tokens + ANSWER_MARGIN)

    @torch.no_grad()
    def run(self, prompt: EvalPrompt) -> list[Answer]:
        """The answers to up to `settings.turns` user turns of `prompt` (message lists: one answer)."""
        s = self.settings
        seed = answer_seed(s.seed, s.sampling, prompt.id)
        g_spec = torch.Generator(device=self.gen_device).manual_seed(seed)
        g_ar = torch.Generator(device=self.gen_device).manual_seed(seed)
        history = prompt.history()
        turns = conversation_turns(prompt, s.turns)
        answers = []
        for t in range(turns):
            if prompt.messages is None:
                history.append({"role": "user", "content": prompt.turns[t]})
            ids = encode_chat(self.tokenizer, history, s.use_chat_template)
            out = self.spec.generate(ids, generator=g_spec, **self._kw(), **self.spec_kw)
            ar = (autoregressive_generate(self.target, ids, generator=g_ar, **self._kw(), **self.ar_kw)
                  if s.measure_speedup else None)
            answers.append(_answer(prompt.id, t + 1, ids, out, ar))
            if t + 1 < turns:
                history.append({"role": "assistant", "content": self.answer_text(out.output_ids)})
        return answers


# ----------------------------------------------------------------------------- metrics


def _mean(xs: Sequence[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


def steps_within(acceptance_lengths: Sequence[int], first_tokens: int = FIRST_TOKENS) -> list[int]:
    """The steps that start within the first `first_tokens` generated tokens.

    The prefill yields output token 0; step i's first token is output index
    1 + sum(acceptance_lengths[:i]). A step that starts at index 250 and yields 16 tokens counts
    (in full), one that starts at 256 does not.
    """
    kept, start = [], 1
    for a in acceptance_lengths:
        if start >= first_tokens:
            break
        kept.append(a)
        start += a
    return kept


def answer_metrics(a: Answer) -> dict[str, Any]:
    """One answer's row of `per_answer` in results.json."""
    first = steps_within(a.acceptance_lengths)
    return {
        "id": a.id, "turn": a.turn, "new_tokens": len(a.output_ids), "steps": len(a.acceptance_lengths),
        "acceptance_length": _mean(a.acceptance_lengths), "acceptance_length_first256": _mean(first),
        "stopped": a.stopped, "loop_start": a.loop_start,
    }


def summarize(answers: Sequence[Answer], block_size: int) -> dict[str, Any]:
    """Acceptance figures of a group of answers (a dataset, or one turn of it).

    tau (`mean_acceptance_length`) is each answer's mean over its steps, averaged over answers; the
    first-256 and no-loop columns are the same mean over the first-256 steps and over the answers
    with no loop. An answer with no step (it ended on its first token) is left out of the means.
    """
    taus = [_mean(a.acceptance_lengths) for a in answers]
    firsts = [_mean(steps_within(a.acceptance_lengths)) for a in answers]
    loops = [a.loop_start is not None for a in answers]
    steps = [s for a in answers for s in a.acceptance_lengths]
    hist = Counter(steps)
    n_tokens = sum(len(a.output_ids) for a in answers)
    text_tokens = n_tokens - sum(a.stopped for a in answers)  # the stop token is no part of a loop
    loop_tokens = sum(len(a.output_ids) - a.stopped - a.loop_start for a in answers if a.loop_start is not None)
    n = len(answers)
    return {
        "answers": n,
        "mean_acceptance_length": _mean([t for t in taus if t is not None]),
        "mean_acceptance_length_first256": _mean([t for t in firsts if t is not None]),
        "mean_acceptance_length_no_loop": _mean([t for t, lp in zip(taus, loops) if t is not None and not lp]),
        "answers_no_loop": n - sum(loops),
        "loop_share": sum(loops) / n if n else None,
        "loop_token_share": loop_tokens / text_tokens if text_tokens else None,
        "capped_share": sum(not a.stopped for a in answers) / n if n else None,
        "acceptance_length_per_step": _mean(steps),
        "acceptance_histogram": {str(k): hist.get(k, 0) for k in range(1, block_size + 1)},
        "num_target_forwards": len(steps),
        "new_tokens": n_tokens,
        "mean_new_tokens": n_tokens / n if n else None,
    }


def _timing(time_s: float, tokens: int) -> dict[str, Any]:
    return {"decode_time_s": time_s, "decode_tokens": tokens,
            "time_per_token_ms": 1e3 * time_s / tokens if tokens else None,
            "tokens_per_s": tokens / time_s if time_s > 0 else None}


def per_prompt_speedup(answers: Sequence[Answer]) -> dict[str, Any]:
    """The spread beside the mean speedup: each prompt's own speedup (its turns' plain time per output
    token / speculative time per output token), and its min / median / max over the prompts."""
    by_prompt: dict[str, list[Answer]] = {}
    for a in answers:
        by_prompt.setdefault(a.id, []).append(a)
    ratios = []
    for group in by_prompt.values():
        spec = _timing(sum(a.decode_time_s for a in group), sum(max(len(a.output_ids) - 1, 0) for a in group))
        ar = _timing(sum(a.ar_decode_time_s for a in group), sum(max(a.ar_new_tokens - 1, 0) for a in group))
        if spec["time_per_token_ms"] and ar["time_per_token_ms"] is not None:
            ratios.append(ar["time_per_token_ms"] / spec["time_per_token_ms"])
    return {"prompts": len(ratios), "min": min(ratios, default=None),
            "median": statistics.median(ratios) if ratios else None, "max": max(ratios, default=None)}


def _speedup_of(answers: Sequence[Answer]) -> tuple[dict[str, Any], dict[str, Any], Optional[float]]:
    """Speculative and plain timing over `answers`, and plain / speculative time per output token."""
    spec = _timing(sum(a.decode_time_s for a in answers), sum(max(len(a.output_ids) - 1, 0) for a in answers))
    ar = _timing(sum(a.ar_decode_time_s for a in answers), sum(max(a.ar_new_tokens - 1, 0) for a in answers))
    ratio = (ar["time_per_token_ms"] / spec["time_per_token_ms"]
             if spec["time_per_token_ms"] and ar["time_per_token_ms"] is not None else None)
    return spec, ar, ratio


def speedup_metrics(answers: Sequence[Answer], sampling: SamplingParams) -> dict[str, Any]:
    """Speculative vs plain decoding of the same prompts: time per output token, prefill excluded
    (the prefill yields the first token, so each answer counts its new tokens minus one).

    `speedup_no_loop` is the same ratio over the answers whose speculative output does not loop: a
    loop is easy to draft, so a few answers that loop to the cap can carry most tokens of a set and
    most of its mean speedup."""
    timed = [a for a in answers if a.decode_time_s is not None and a.ar_decode_time_s is not None]
    spec, ar, ratio = _speedup_of(timed)
    no_loop = [a for a in timed if a.loop_start is None]
    taus = [_mean(a.acceptance_lengths) for a in timed]
    res: dict[str, Any] = {"answers": len(timed), "mean_acceptance_length": _mean([t for t in taus if t is not None]),
                           "spec": spec, "ar": ar, "speedup": ratio, "per_prompt_speedup": per_prompt_speedup(timed),
                           "speedup_no_loop": _speedup_of(no_loop)[2] if no_loop else None,
                           "answers_no_loop": len(no_loop)}
    if sampling.greedy:
        matches = sum(bool(a.ar_match) for a in timed)
        res["greedy_match"] = matches / len(timed) if timed else None
        if matches != len(timed):
            logger.warning("%d/%d greedy generations differ from plain decoding (low-precision ties?)",
                           len(timed) - matches, len(timed))
    return res


def dataset_result(answers: Sequence[Answer], *, block_size: int, sampling: SamplingParams, max_new_tokens: int,
                   num_prompts: int) -> dict[str, Any]:
    """One dataset at one sampling setting: the figures over all answers, per turn, and per answer."""
    turns = sorted({a.turn for a in answers})
    return {
        "num_prompts": num_prompts,
        "turns": max(turns, default=0),
        **sampling.record(),
        "max_new_tokens": max_new_tokens,
        "block_size": block_size,
        **summarize(answers, block_size),
        "per_turn": {str(t): summarize([a for a in answers if a.turn == t], block_size) for t in turns},
        "per_answer": [answer_metrics(a) for a in answers],
    }


# ----------------------------------------------------------------------------- entry point


@torch.no_grad()
def evaluate_acceptance(
    target_model: nn.Module,
    tokenizer: Any,
    draft: DFlashDraftModel,
    prompts: Iterable[PromptLike],
    settings: Optional[EvalSettings] = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Speculative-decode `prompts` with `draft` and summarise acceptance (and speed).

    prompts: strings (one user turn), message lists, or `EvalPrompt`s (up to `turns` turns).
    Settings come from `settings` and/or keywords of `EvalSettings` (`max_new_tokens=64`, ...).
    With `measure_speedup`, each turn is also decoded plainly with the same target; a warm-up
    prompt runs first, uncounted. The draft's train/eval mode is restored afterwards, so a
    training loop can call this mid-run.
    """
    s = replace(settings or EvalSettings(), **overrides)
    items = [as_eval_prompt(p, i) for i, p in enumerate(prompts)]
    if not items:
        raise ValueError("evaluate_acceptance got no prompts")
    was_training = draft.training
    draft.eval()
    try:
        dec = ConversationDecoder(target_model, tokenizer, draft, s)
        if s.warmup:
            dec.warmup(items[0])
        answers = [a for item in items for a in dec.run(item)]
    finally:
        draft.train(was_training)
    res = dataset_result(answers, block_size=dec.block_size, sampling=s.sampling,
                         max_new_tokens=s.max_new_tokens, num_prompts=len(items))
    if s.measure_speedup:
        sp = speedup_metrics(answers, s.sampling)
        res.update({k: sp[k] for k in ("spec", "ar", "speedup", "greedy_match") if k in sp})
    return res


# ----------------------------------------------------------------------------- reporting


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _histogram_line(hist: dict[str, int]) -> str:
    total = max(sum(hist.values()), 1)
    return " ".join(f"{k}:{v / total:.0%}" for k, v in hist.items())


def format_table(results: dict[str, dict[str, dict[str, Any]]], protocol: EvalProtocol, block_size: int,
                 speedup: Optional[dict[str, dict[str, dict[str, Any]]]] = None) -> str:
    """The printed report: one row per temperature, dataset and turn, its protocol beside it,
    then each acceptance histogram (share of steps producing 1..B tokens).

    results / speedup: {temperature key: {dataset: dataset_result / speedup_metrics}}.
    """
    speedup = speedup or {}
    head = (f"{'dataset':<12}{'turn':>5}{'prompts':>8}{'answers':>8}{'tau':>7}{'tau@256':>8}{'tau noloop':>11}"
            f"{'loops':>7}{'capped':>7}{'speedup':>9}  protocol")
    lines = [head, "-" * (len(head) + 40)]
    hists = []
    for tkey, sets in results.items():
        for name, r in sets.items():
            label = protocol.label(SamplingParams.from_key(tkey), block_size, r["turns"])
            sp = speedup.get(tkey, {}).get(name)
            sp_txt = "-" if not sp or sp.get("speedup") is None else f"{sp['speedup']:.2f}x"
            rows = [("all", r, sp_txt)] + ([(t, pt, "") for t, pt in r["per_turn"].items()] if r["turns"] > 1 else [])
            for turn, s, sp_cell in rows:
                lines.append(
                    f"{name[:11]:<12}{turn:>5}{r['num_prompts']:>8}{s['answers']:>8}"
                    f"{_fmt(s['mean_acceptance_length'], '.2f'):>7}"
                    f"{_fmt(s['mean_acceptance_length_first256'], '.2f'):>8}"
                    f"{_fmt(s['mean_acceptance_length_no_loop'], '.2f'):>11}{_fmt(s['loop_share'], '.0%'):>7}"
                    f"{_fmt(s['capped_share'], '.0%'):>7}{sp_cell:>9}  {label}"
                )
            hists.append(f"{name} [{label}]: {_histogram_line(r['acceptance_histogram'])}")
    if speedup:
        lines.append("speedup: plain / speculative time per output token, first "
                     f"{protocol.speedup_prompts} prompts per dataset, measured alone on the device")
        for tkey, sets in speedup.items():
            for name, sp in sets.items():
                spread = sp.get("per_prompt_speedup") or {}
                if sp.get("speedup") is None or not spread.get("prompts"):
                    continue
                no_loop = (f"; answers without loops {sp['speedup_no_loop']:.2f}x ({sp['answers_no_loop']} of "
                           f"{sp['answers']})" if sp.get("speedup_no_loop") is not None else "")
                setting = SamplingParams.from_key(tkey).label
                lines.append(f"  {name} {setting}: mean {sp['speedup']:.2f}x; per prompt min "
                             f"{spread['min']:.2f}x, median {spread['median']:.2f}x, max {spread['max']:.2f}x "
                             f"({spread['prompts']} prompts){no_loop}")
                if sp["speedup"] < 1.0:  # the one figure a user acts on: say it plainly
                    hint = ("" if SamplingParams.from_key(tkey).greedy else
                            " (a draft for sampling: docs/train.md, \"Which loss, and which data\")")
                    lines.append(f"  {name} {setting}: speculative decoding with this draft is slower than "
                                 f"plain decoding; do not serve it at these sampling settings{hint}")
    lines.append("acceptance histogram (share of steps producing 1..B tokens):")
    lines.extend("  " + h for h in hists)
    return "\n".join(lines)


def plot_histograms(results: dict[str, dict[str, dict[str, Any]]], path: Union[str, Path],
                    protocol: Optional[EvalProtocol] = None) -> Path:
    """One bar chart per temperature and dataset of the per-step acceptance lengths, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(t, name, r) for t, sets in results.items() for name, r in sets.items()]
    n = max(len(panels), 1)
    fig, axes = plt.subplots(1, n, figsize=(4.5 * n, 3.8), squeeze=False)
    for ax, (tkey, name, res) in zip(axes[0], panels):
        hist = res["acceptance_histogram"]
        xs = [int(k) for k in hist]
        total = max(sum(hist.values()), 1)
        ax.bar(xs, [hist[str(x)] / total for x in xs], color="tab:blue")
        setting = SamplingParams.from_key(tkey)
        tag = protocol.label(setting, res["block_size"], res["turns"]) if protocol else setting.label
        ax.set_title(f"{name}: tau = {_fmt(res['mean_acceptance_length'], '.2f')}\n{tag}", fontsize=9)
        ax.set_xlabel("tokens per target forward")
        ax.set_ylabel("fraction of steps")
        ax.set_xticks(xs)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def protocol_record(protocol: EvalProtocol, block_size: int, trained_block_size: int,
                    prompt_counts: dict[str, dict[str, int]]) -> dict[str, Any]:
    """The "protocol" object of results.json."""
    rec = asdict(protocol)
    rec.pop("samplings")
    # a plain temperature as the number, any other setting as its key ("0.6,p0.95,k20"), as ever
    rec.update(temperatures=[t.temperature if t.plain else t.key for t in protocol.samplings],
               sampling={t.key: t.label for t in protocol.samplings}, datasets=prompt_counts, block_size=block_size,
               trained_block_size=trained_block_size, overrides=list(protocol.overrides), stop=STOP_RULE,
               first_tokens=FIRST_TOKENS)
    return rec


__all__ = [
    "Answer",
    "ConversationDecoder",
    "EvalPrompt",
    "EvalProtocol",
    "EvalSettings",
    "FIRST_TOKENS",
    "METHODS",
    "PROTOCOLS",
    "answer_metrics",
    "answer_text",
    "conversation_turns",
    "answer_seed",
    "as_eval_prompt",
    "dataset_result",
    "encode_chat",
    "evaluate_acceptance",
    "format_table",
    "load_chat_file",
    "load_humaneval",
    "load_mtbench",
    "load_prompt_set",
    "plot_histograms",
    "per_prompt_speedup",
    "protocol_record",
    "speedup_metrics",
    "steps_within",
    "summarize",
]
