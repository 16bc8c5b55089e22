"""The demo's plan and its report: the sizes per device, training's share of the time budget, and the closing
report (what ran, where its outputs are, the held-out curve, the before/after table)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

logger = logging.getLogger("nemo_dflash.demo")


# Sizes per device. CPU: answers as long as the evaluation's (64 new tokens), prompts <= 128 tokens,
# ShareGPT and HumanEval-style code prompts about half and half (1,413 and 1,383 in the pool).
# Regeneration stops generating after 2 minutes (it then finishes the answers in flight, and reading
# the prompt sources takes ~0.4 min: 3.2 minutes on a shared CPU). The evaluations by replay take
# ~0.5 min (greedy answers 19 s, each replay 11-13 s): training gets ~7 of the 11.5 minutes.
SIZES = {
    "cpu": dict(out="outputs/smollm2_demo", num_conversations=512, max_new_tokens=64, max_prompt_tokens=128,
                batch_size=128, data=("sharegpt@0.08", "code"), regenerate_minutes=2.0, train_minutes=None,
                budget_minutes=11.5, recipe="smollm2_135m.yaml"),
    # Training tokens are what moves acceptance (docs/train.md): 4 epochs of 14,200 ShareGPT answers
    # (11 M tokens) gave tau 1.34 and 0.87x at 64 new tokens, 6 epochs (17 M) 1.45 and 0.94-1.05x.
    # So the GPU demo takes every ShareGPT prompt up to 384 tokens plus the code prompts, and 8 epochs.
    "cuda": dict(out="outputs/smollm2_demo_gpu", num_conversations=25000, max_new_tokens=512, max_prompt_tokens=384,
                 batch_size=1024, data=("sharegpt", "code"), regenerate_minutes=None, train_minutes=9.0,
                 budget_minutes=None, recipe="smollm2_135m_gpu.yaml", recipe_overrides=("train.epochs=8",)),
}
EVAL_RESERVE_MIN = 0.5  # after training: the final held-out eval, the draft's save, curves; and a margin


def resolve_sizes(args: argparse.Namespace) -> tuple[str, dict]:
    """Fill the unset sizes from the device's column of SIZES (CUDA when `auto` finds it)."""
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = dict(SIZES[device])
    for key in ("out", "num_conversations", "max_new_tokens", "train_minutes", "budget_minutes"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    return device, sizes


def train_minutes_left(budget_min: float, elapsed_min: float, eval_min: float) -> float:
    """Training's share of a time budget: what is left after the phases so far, less one more
    evaluation (the after-training one costs about what the before one did) and a reserve."""
    return budget_min - elapsed_min - eval_min - EVAL_RESERVE_MIN


def fitted_train_minutes(budget_min: float, elapsed_min: float, eval_min: float) -> float:
    """`train_minutes_left`, at least 1 (with a warning naming --budget-minutes)."""
    minutes = train_minutes_left(budget_min, elapsed_min, eval_min)
    if minutes < 1.0:
        logger.warning("%.1f of the %.1f-minute budget already spent: training 1 minute anyway "
                       "(raise --budget-minutes on a slower machine)", elapsed_min, budget_min)
        return 1.0
    return minutes


def held_out_curve(metrics_file: Path) -> str:
    """The held-out simulated acceptance by step, from metrics.jsonl, as text: `0:1.00 50:1.07 ...`."""
    if not metrics_file.is_file():
        return ""
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    points = [(int(r.get("step", 0)), float(r["eval_accept_len"])) for r in rows if "eval_accept_len" in r]
    return " ".join(f"{s}:{v:.2f}" for s, v in points)


def report(result: dict, cfg, out: Path, prompt_sets: dict, eval_new_tokens: int) -> str:
    """The demo's closing report: what ran, where its outputs are, the curve, the before/after table."""
    summary, timings, before, after = result["train"], result["timings"], result["acceptance_before"], result[
        "acceptance_after"]
    mean = lambda d: sum(d.values()) / len(d)  # noqa: E731
    run = out / "run"
    evaluate_s = (timings.get("eval_greedy_s", 0.0) + timings["eval_before_s"] + timings["eval_after_s"]
                  + timings.get("speedup_s", 0.0))
    device = result["device"]
    on = f"{device}, {result['cpu']['threads']} thread(s), {result['cpu']['dtype']}" if result.get("cpu") else device
    lines = [
        "",
        "== nemo_dflash demo: SmolLM2-135M-Instruct target, DFlash draft "
        f"({cfg.draft.num_layers} layers, block {cfg.draft.block_size}) ==",
        f"data        {summary['data']['train_samples']} regenerated conversations "
        f"({summary['data']['supervised_tokens']} supervised tokens)",
        f"training    {summary['steps']} steps, {summary['tokens_seen']} tokens, {timings['train_s'] / 60:.1f} min; "
        f"held-out simulated acceptance {summary.get('eval_accept_len', float('nan')):.2f}",
        f"wall time   {timings['total_s'] / 60:.1f} min on {on} (regenerate {timings['regenerate_s'] / 60:.1f}, "
        f"train {timings['train_s'] / 60:.1f}, evaluate {evaluate_s / 60:.1f})",
        "outputs",
    ]
    outputs = [
        ("regenerated data", out / "data" / "regen.jsonl"),
        ("trained draft", Path(summary.get("final_draft") or run / "final")),
        ("run config", run / "config.yaml"),
        ("metrics", run / "metrics.jsonl"),
        ("curves (PNG)", run / "curves.png"),
        ("this summary", out / "demo_summary.json"),
    ]
    lines += [f"  {what:<17} {path}" for what, path in outputs if path.exists()]
    curve = held_out_curve(run / "metrics.jsonl")
    if curve:
        lines.append(f"held-out simulated acceptance by step: {curve}")
    lines += ["", f"{'benchmark':<11} {'before':>7} {'after':>7} {'gain':>6}"]
    for name in prompt_sets:
        gain = after[name] / before[name] if before[name] else float("nan")
        lines.append(f"{name:<11} {before[name]:>7.2f} {after[name]:>7.2f} {gain:>5.2f}x")
    for name, r in (result.get("speedup") or {}).items():
        median = (r.get("per_prompt_speedup") or {}).get("median", float("nan"))
        lines.append(f"{name:<11} tau {r['mean_acceptance_length']:.2f}, speedup {r['speedup']:.2f}x "
                     f"(median prompt {median:.2f}x; T=0, 1 turn, up to {eval_new_tokens} new tokens, "
                     "CUDA graphs on both sides, batch 1)")
    n_prompts = sorted({len(p) for p in prompt_sets.values()})
    lines.append(
        f"Mean acceptance length on held-out prompts (T=0 speculative decoding, by replay; "
        f"{'/'.join(map(str, n_prompts))} prompts "
        f"per benchmark, up to {eval_new_tokens} new tokens, 1 turn, T=0, block {cfg.draft.block_size}): "
        f"before {mean(before):.2f} -> after {mean(after):.2f} ({mean(after) / mean(before):.2f}x)"
    )
    return "\n".join(lines)
