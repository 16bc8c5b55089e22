"""Tables and plots of a SmolLM2 drafter run directory (data/, runs/NAME/, eval/NAME/: the figures of docs/results.md).

    python benchmarks/smollm2_report.py OUT_DIR [--png-prefix docs/bench/smollm2_drafter]

Prints markdown tables: the regenerated data (from the regenerate log's summary), each training
run (steps, tokens, held-out simulated acceptance), and each evaluation at its protocol (tau,
tau over the first 256 tokens, loop share, speedup), with the protocol beside every figure.
Writes PREFIX_curves.png: held-out simulated acceptance against training tokens, every run.
Reads `evaluate`'s results.json layout (docs/evaluation.md, "Evaluation protocol").
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any, Optional


def _load(path: Path) -> Optional[dict[str, Any]]:
    return json.loads(path.read_text()) if path.is_file() else None


def _f(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def data_table(out: Path) -> list[str]:
    log = out / "logs" / "regenerate.log"
    if not log.is_file():
        return []
    lines = [m.group(1) for m in re.finditer(r"nemo_dflash\.regenerate: (written .*)", log.read_text())]
    return ["## Data", "", lines[-1] if lines else "(no summary in the regenerate log)", ""]


def metrics(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().split("\n") if line] if path.is_file() else []


def train_table(out: Path) -> list[str]:
    rows = ["## Training", "", "| run | steps | M tokens | held-out sim. tau |", "| --- | ---: | ---: | ---: |"]
    for run in sorted((out / "runs").glob("*")):
        evals = [r for r in metrics(run) if "eval_accept_len" in r]
        if evals:
            last = evals[-1]
            rows.append(f"| {run.name} | {last.get('step')} | {last.get('tokens', 0) / 1e6:.2f} | "
                        f"{last['eval_accept_len']:.3f} |")
    return rows + [""]


def protocol_label(res: dict[str, Any]) -> str:
    p = res["protocol"]
    return f"{p['name']}: {p['max_new_tokens']} tok, {p['turns']} turn(s), B={p['block_size']}, {p['decode']}"


def eval_table(out: Path) -> list[str]:
    rows = ["## Evaluation", "", "| eval | dataset | T | answers | tau | tau@256 | tau no-loop | loops | speedup | "
            "protocol |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for d in sorted((out / "eval").glob("*")):
        res = _load(d / "results.json")
        if res is None:
            continue
        label = protocol_label(res) + ("" if res.get("complete", True) else ", partial")
        speed = res.get("speedup", {})
        temps = sorted(set(res.get("results", {})) | set(speed), key=float)
        for t in temps:
            for ds in sorted(set(res.get("results", {}).get(t, {})) | set(speed.get(t, {}))):
                r = res.get("results", {}).get(t, {}).get(ds, {})
                s = speed.get(t, {}).get(ds, {})
                rows.append(
                    f"| {d.name} | {ds} | {t} | {r.get('answers', s.get('answers', '-'))} | "
                    f"{_f(r.get('mean_acceptance_length', s.get('mean_acceptance_length')))} | "
                    f"{_f(r.get('mean_acceptance_length_first256'))} | {_f(r.get('mean_acceptance_length_no_loop'))} | "
                    f"{_f(r.get('loop_share'), '.0%')} | {_f(s.get('speedup'))} | {label} |")
    return rows + [""]


def plot_curves(out: Path, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for run in sorted((out / "runs").glob("*")):
        evals = [r for r in metrics(run) if "eval_accept_len" in r]
        if evals:
            ax.plot([r.get("tokens", 0) / 1e6 for r in evals], [r["eval_accept_len"] for r in evals], "o-",
                    label=run.name)
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("held-out simulated tau")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--png-prefix", default=None, help="write PREFIX_curves.png")
    args = p.parse_args()
    print("\n".join(data_table(args.out) + train_table(args.out) + eval_table(args.out)))
    if args.png_prefix:
        plot_curves(args.out, Path(f"{args.png_prefix}_curves.png"))


if __name__ == "__main__":
    main()
