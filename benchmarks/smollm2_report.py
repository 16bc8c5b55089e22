"""Tables and plots of a `benchmarks/smollm2_drafter.sh` run (the figures of docs/results.md).

    python benchmarks/smollm2_report.py OUT_DIR [--png-prefix docs/bench/smollm2_gpu]

Prints markdown tables: data, training runs, acceptance (T=0, T=1) with the histogram, the
speedup runs, and the ablations. Writes PREFIX_curves.png (held-out simulated acceptance against
training tokens, every run) and PREFIX_hist.png (acceptance histogram of the main draft, T=0).
Evaluations split over processes (main_t0_humaneval_a/_b) are merged prompt by prompt.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any, Optional

RUNS = {"main": "5 layers, decay gamma 7 (recipe)", "layers5": "5 layers, decay (recipe, ablation budget)",
        "layers1": "1 layer", "layers2": "2 layers", "nodecay": "5 layers, no loss decay"}


def _load(path: Path) -> Optional[dict[str, Any]]:
    return json.loads(path.read_text()) if path.is_file() else None


def merged(out: Path, prefix: str, dataset: str) -> Optional[dict[str, Any]]:
    """One dataset's per-prompt results and histogram, merged over eval/<prefix>* directories."""
    per_prompt: list[dict] = []
    hist: Counter = Counter()
    settings = None
    for d in sorted(out.glob(f"eval/{prefix}*")):
        res = _load(d / "results.json")
        if not res or dataset not in res["datasets"]:
            continue
        r = res["datasets"][dataset]
        settings = res["settings"]
        per_prompt += r["per_prompt"]
        hist.update({int(k): v for k, v in r["acceptance_histogram"].items()})
    if not per_prompt:
        return None
    taus = [p["acceptance_length"] for p in per_prompt if p["acceptance_length"] is not None]
    return {"n": len(per_prompt), "tau": sum(taus) / len(taus), "hist": hist, "per_prompt": per_prompt,
            "settings": settings}


def subset_tau(res: Optional[dict], n: int) -> Optional[float]:
    if not res:
        return None
    order = sorted(res["per_prompt"], key=lambda p: _prompt_index(p["id"]))[:n]
    taus = [p["acceptance_length"] for p in order if p["acceptance_length"] is not None]
    return sum(taus) / len(taus) if taus else None


def _prompt_index(pid: str) -> int:
    digits = "".join(c for c in pid.split("/")[-1] if c.isdigit())
    return int(digits) if digits else 0


def args_new(out: Path) -> Any:
    """max_new_tokens of the main draft's full-set runs."""
    r = merged(out, "main_t0_mtbench", "mtbench")
    return r["settings"]["max_new_tokens"] if r else "-"


def f(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--png-prefix", default=None, help="write PREFIX_curves.png and PREFIX_hist.png")
    args = p.parse_args()
    out = Path(args.out)
    lines: list[str] = []

    regen = out / "data" / "regen.jsonl"
    if regen.is_file():
        rows = [json.loads(line) for line in regen.read_text().split("\n") if line.strip()]
        fin = Counter(r.get("finish_reason") for r in rows)
        lines += [f"Data: {len(rows)} regenerated conversations (finish: {dict(fin)})", ""]

    lines += ["| run | draft | steps | training tokens | train min | stopped | held-out sim. tau (first -> last) |",
              "| --- | --- | ---: | ---: | ---: | --- | --- |"]
    curves: dict[str, list] = {}
    ev_steps: dict[str, list] = {}
    for name, label in RUNS.items():
        s = _load(out / "runs" / name / "summary.json")
        if s is None:
            continue
        recs = [json.loads(x) for x in (out / "runs" / name / "metrics.jsonl").read_text().split("\n") if x]
        ev = [(r["tokens"], r["eval_accept_len"]) for r in recs if "eval_accept_len" in r]
        curves[name] = ev
        ev_steps[name] = [(r["step"], r["eval_accept_len"]) for r in recs if "eval_accept_len" in r]
        lines.append(f"| {name} | {label} | {s['steps']} / {s['total_steps']} | {s['tokens_seen'] / 1e6:.1f} M | "
                     f"{s['train_seconds'] / 60:.1f} | {s.get('stopped_early') or 'no'} | "
                     f"{f(ev[0][1] if ev else None)} -> {f(ev[-1][1] if ev else None)} |")
    lines.append("")

    lines += ["Main draft, real speculative decoding (all prompts, acceptance only):", "",
              "| dataset | T | prompts | tau | tokens per target forward: histogram 1..16 (% of steps) |",
              "| --- | ---: | ---: | ---: | --- |"]
    for t in (0, 1):
        for ds in ("mtbench", "humaneval"):
            r = merged(out, f"main_t{t}_{ds}", ds)
            if r:
                tot = max(sum(r["hist"].values()), 1)
                h = " ".join(f"{100 * r['hist'].get(k, 0) / tot:.0f}" for k in range(1, 17))
                lines.append(f"| {ds} | {t} | {r['n']} | {r['tau']:.2f} | {h} |")
    lines.append("")

    lines += ["Speedup against plain decoding with the same target on the same GPU (runs alone):", "",
              "| dataset | T | prompts | tau | spec tok/s | AR tok/s | speedup | greedy == AR |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for t in (0, 1):
        res = _load(out / "eval" / f"speed_t{t}" / "results.json")
        for ds, r in (res or {}).get("datasets", {}).items():
            lines.append(f"| {ds} | {t} | {r['num_prompts']} | {f(r['mean_acceptance_length'])} | "
                         f"{f(r['spec']['tokens_per_s'], '.0f')} | {f(r.get('ar', {}).get('tokens_per_s'), '.0f')} | "
                         f"{f(r.get('speedup'))} | {f(r.get('greedy_match'), '.0%')} |")
    lines.append("")

    cost = _load(out / "eval" / "step_cost.json")
    if cost:
        lines += [f"One speculative step against one plain step (`benchmarks/spec_step_cost.py`, "
                  f"{cost['prompt_tokens']}-token prompt, median ms):", "", "| part | ms |", "| --- | ---: |"]
        lines += [f"| {k} | {v:.2f} |" for k, v in cost["ms"].items()]
        lines += [f"| break-even tau (verify + draft) / plain | {cost['break_even_tau']:.2f} |", ""]

    lines += ["Ablations (T=0, the first prompts of each set; each row next to the main draft on the same prompts):",
              "", "| variant | prompts | MT-Bench tau | HumanEval tau | main draft, same prompts: MT-Bench / HumanEval |",
              "| --- | ---: | ---: | ---: | --- |"]
    variants = [("5 layers, decay (the recipe at the ablation budget)", "layers5_t0"), ("1 layer", "layers1_t0"),
                ("2 layers", "layers2_t0"), ("5 layers, no loss decay", "nodecay_t0"),
                ("main draft, block 8 at inference", "main_t0_block8"),
                ("main draft, longer answers", "mainlong_t0")]
    main_mt, main_he = merged(out, "main_t0_mtbench", "mtbench"), merged(out, "main_t0_humaneval", "humaneval")
    for label, prefix in variants:
        m, h = merged(out, prefix, "mtbench"), merged(out, prefix, "humaneval")
        if not (m or h):
            continue
        n = (m or h)["n"]
        if prefix == "mainlong_t0":
            label = f"main draft, {(m or h)['settings']['max_new_tokens']} new tokens (elsewhere {args_new(out)})"
        lines.append(f"| {label} | {n} | {f((m or {}).get('tau'))} | {f((h or {}).get('tau'))} | "
                     f"{f(subset_tau(main_mt, n))} / {f(subset_tau(main_he, n))} |")
    lines.append("")
    lines += ["Held-out simulated acceptance at equal steps (every run's curve; the ablations' common budget):", "",
              "| run | " + " | ".join(f"step {s}" for s in (200, 400, 600)) + " |", "| --- | ---: | ---: | ---: |"]
    for name, ev in curves.items():
        at = {st: a for st, a in ev_steps.get(name, [])}
        cells = [f(next((a for st, a in sorted(at.items()) if abs(st - s) <= 1), None)) for s in (200, 400, 600)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    print("\n".join(lines))

    if args.png_prefix:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4))
        for name, ev in curves.items():
            if ev:
                ax.plot([t / 1e6 for t, _ in ev], [a for _, a in ev], marker=".", label=f"{name}: {RUNS[name]}")
        ax.set_xlabel("training tokens (M)")
        ax.set_ylabel("held-out simulated acceptance length")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(f"{args.png_prefix}_curves.png", dpi=110)
        plt.close(fig)

        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for ax, ds in zip(axes, ("mtbench", "humaneval")):
            r = merged(out, f"main_t0_{ds}", ds)
            if not r:
                continue
            tot = max(sum(r["hist"].values()), 1)
            ax.bar(range(1, 17), [r["hist"].get(k, 0) / tot for k in range(1, 17)])
            ax.set_title(f"{ds}, T=0: tau = {r['tau']:.2f} ({r['n']} prompts)")
            ax.set_xlabel("tokens per target forward")
            ax.set_ylabel("fraction of steps")
        fig.tight_layout()
        fig.savefig(f"{args.png_prefix}_hist.png", dpi=110)
        plt.close(fig)


if __name__ == "__main__":
    main()
