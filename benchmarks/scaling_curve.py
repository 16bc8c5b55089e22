"""The SmolLM2 drafter's scaling curve: held-out simulated tau and real tau against training tokens.

    python benchmarks/scaling_curve.py \
        "21M ShareGPT=docs/bench/smollm2_drafter_run/main_metrics.jsonl" \
        "180M five sources=docs/bench/smollm2_drafter_180m_run/metrics.jsonl" \
        [--drafter-json docs/bench/drafter_summary.json] [--png docs/bench/smollm2_scaling.png]

Each LABEL=METRICS argument is a training run's `metrics.jsonl`: its held-out simulated acceptance
rows (`eval_accept_len` against `tokens`) make one curve. The real tau points are the rows of
`drafter_summary.json` (the paper's protocol, T=0: `humaneval_t0_tau`, `mtbench_t0_tau` against
`train_tokens`; the latest row per token count). Prints both as tables and draws them on one plot,
tokens on a log axis. Simulated tau is measured on each run's own held-out conversations (its data
mix), real tau on MT-Bench and HumanEval: compare shapes, not levels, across the two.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional, Sequence


def sim_curve(path: Path) -> list[tuple[float, float]]:
    """(training tokens, held-out simulated tau) per held-out evaluation, one per step."""
    points: dict[int, tuple[float, float]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "eval_accept_len" in row:
            points[int(row["step"])] = (float(row.get("tokens", 0.0)), float(row["eval_accept_len"]))
    return [points[s] for s in sorted(points)]


def real_points(path: Path) -> list[dict[str, Any]]:
    """The latest drafter_summary row per training-token count that has a T=0 tau."""
    latest: dict[int, dict[str, Any]] = {}
    for row in json.loads(path.read_text()):
        if row.get("train_tokens") and (row.get("humaneval_t0_tau") or row.get("mtbench_t0_tau")):
            latest[int(row["train_tokens"])] = row
    return [latest[t] for t in sorted(latest)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="LABEL=METRICS_JSONL")
    p.add_argument("--drafter-json", default=str(Path(__file__).resolve().parent.parent / "docs" / "bench"
                                                 / "drafter_summary.json"))
    p.add_argument("--png", default=None, help="write the plot here")
    args = p.parse_args(argv)
    curves = []
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep or not Path(path).is_file():
            raise SystemExit(f"error: {spec!r}: give LABEL=PATH of a metrics.jsonl that exists")
        curves.append((label, sim_curve(Path(path))))
    real = real_points(Path(args.drafter_json)) if Path(args.drafter_json).is_file() else []

    print("| run | M tokens | held-out sim. tau |\n| --- | ---: | ---: |")
    for label, pts in curves:
        for tok, tau in pts:
            print(f"| {label} | {tok / 1e6:.1f} | {tau:.3f} |")
    print("\n| M tokens | HumanEval tau (T=0) | MT-Bench tau (T=0) | commit |\n| ---: | ---: | ---: | --- |")
    for r in real:
        he, mt = r.get("humaneval_t0_tau"), r.get("mtbench_t0_tau")
        print(f"| {r['train_tokens'] / 1e6:.1f} | {he or float('nan'):.2f} | {mt or float('nan'):.2f} | {r.get('commit')} |")

    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2))
        for label, pts in curves:
            pts = [(t, a) for t, a in pts if t > 0]
            ax.plot([t / 1e6 for t, _ in pts], [a for _, a in pts], marker=".", label=f"held-out sim. tau: {label}")
        for key, name, marker in (("humaneval_t0_tau", "HumanEval", "s"), ("mtbench_t0_tau", "MT-Bench", "^")):
            pts = [(r["train_tokens"] / 1e6, r[key]) for r in real if r.get(key)]
            if pts:
                ax.plot(*zip(*pts), linestyle="none", marker=marker, markersize=8,
                        label=f"real tau, {name} (paper protocol, T=0)")
        ax.set_xscale("log")
        ax.set_xlabel("training tokens (M)")
        ax.set_ylabel("tau (accepted tokens per block)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"\nwrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
