"""Sizing advice from measurements: for each target, the training tokens a draft needed to pay, and the minutes
a GPU needs to regenerate and train them.

    python benchmarks/sizing.py [--drafter docs/bench/drafter_summary.json] [--train docs/bench/train_throughput.json]
        [--regen docs/bench/regen_summary.json] [--json docs/bench/sizing.json] [--package nemo_dflash/recipes/sizing.json]

Reads the measured rows only: the drafter rows (training tokens -> tau and T=0 speedup at batch 1, paper
protocol), the training-throughput rows (tokens/s a GPU) and the regeneration rows (generated tokens/s a GPU).
Prints one table row per measured draft and one summary row per target, and writes the summary rows to
docs/bench/sizing.json and, the same rows, to nemo_dflash/recipes/sizing.json: the copy that ships with the
package, which the pipeline reads at plan time to warn a run whose training budget is below a paying draft's.

A draft pays when its T=0 speedup is >= 1.0 on both MT-Bench and HumanEval (the smaller of the two counts);
the same count over the answers without loops is given where the row records it (loops inflate T=0).
Minutes per GPU = tokens / training tokens/s + tokens / regeneration tokens/s: one pass of regenerated data,
with every trained token counted as generated (prompts are not generated and later epochs reuse the data, so
this is an upper bound on the regeneration share).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _common, beside this file
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the package, from a checkout

from _common import REPO, provenance, read_rows, write_rows  # noqa: E402

log = logging.getLogger("sizing")

PAYS = (1.0, 1.5)  # the speedups a summary row names the smallest measured token count for

# The targets the table has a row for. `names`: the drafter rows' `target` values that are this target;
# `shape`: the train_throughput.json shape (and benchmarks/train_throughput.py SHAPES entry: the target's
# config.json dimensions); `recipe`: the recipe the drafter rows trained with (its draft.num_layers);
# `regen_target`: the regen_summary.json rows' `target`.
TARGETS: tuple[dict[str, Any], ...] = (
    {"target": "SmolLM2-135M-Instruct", "names": ("SmolLM2-135M-Instruct", "pkg:smollm2"), "shape": "smollm2_135m",
     "recipe": "smollm2_135m_gpu.yaml", "regen_target": "pkg:smollm2", "target_path": "pkg:smollm2"},
    {"target": "a 0.5B-class Qwen-family instruct GGUF (a user's own)", "names": (), "shape": None,
     "recipe": None, "regen_target": None, "target_path": None},
)


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def draft_points(rows: list[dict[str, Any]], names: Sequence[str]) -> list[dict[str, Any]]:
    """The target's measured drafts, by training tokens: tau and T=0 speedup on both sets. A later row of the
    same draft (same tokens, same `draft` name) replaces an earlier one: a continued evaluation supersedes it."""
    by_key: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        if r.get("target") not in names or not _num(r.get("train_tokens")):
            continue
        if r.get("variant") not in (None, "dflash"):
            continue  # another draft architecture than the one the pipeline trains by default
        point = {"train_tokens": int(r["train_tokens"]), "draft": r.get("draft"), "date": r.get("date"),
                 "commit": r.get("commit"), "device": r.get("device"),
                 "mtbench_t0_tau": _num(r.get("mtbench_t0_tau")), "humaneval_t0_tau": _num(r.get("humaneval_t0_tau")),
                 "mtbench_t0_speedup": _num(r.get("mtbench_t0_speedup")),
                 "humaneval_t0_speedup": _num(r.get("humaneval_t0_speedup")),
                 "mtbench_t0_speedup_no_loop": _num(r.get("mtbench_t0_speedup_no_loop")),
                 "humaneval_t0_speedup_no_loop": _num(r.get("humaneval_t0_speedup_no_loop"))}
        both = (point["mtbench_t0_speedup"], point["humaneval_t0_speedup"])
        point["speedup_t0_min"] = min(both) if None not in both else None  # type: ignore[type-var]
        free = (point["mtbench_t0_speedup_no_loop"], point["humaneval_t0_speedup_no_loop"])
        point["speedup_t0_no_loop_min"] = min(free) if None not in free else None  # type: ignore[type-var]
        by_key[(point["train_tokens"], point["draft"])] = point
    return sorted(by_key.values(), key=lambda p: p["train_tokens"])


def tokens_to_pay(points: list[dict[str, Any]], speedup: float, key: str = "speedup_t0_min") -> Optional[int]:
    """The smallest measured training-token count whose draft reached `speedup` on both sets (`key`: over all
    answers, or over the answers without loops)."""
    paying = [p["train_tokens"] for p in points if p[key] is not None and p[key] >= speedup]
    return min(paying) if paying else None


def latest(rows: list[dict[str, Any]], keep: Any, size: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The current figure among the rows `keep` accepts: the latest date, then (when `size` is named) the
    largest value of that key, then the last row written."""
    kept = [r for r in rows if keep(r) and _num(r.get("tokens_per_s"))]
    if not kept:
        return None
    day = max(str(r.get("date")) for r in kept)
    kept = [r for r in kept if str(r.get("date")) == day]
    if size:
        top = max(_num(r.get(size)) or 0 for r in kept)
        kept = [r for r in kept if (_num(r.get(size)) or 0) == top]
    return kept[-1]


def train_rate(rows: list[dict[str, Any]], shape: Optional[str]) -> Optional[dict[str, Any]]:
    """Training tokens/s a GPU: the current one-GPU H200 row of the target's shape (the default draft)."""
    return latest(rows, lambda r: r.get("shape") == shape and r.get("world") == 1
                  and "H200" in str(r.get("device")) and r.get("variant") in (None, "dflash"))


def regen_rate(rows: list[dict[str, Any]], target: Optional[str]) -> Optional[dict[str, Any]]:
    """Regeneration tokens/s a GPU: the current one-GPU H200 row of the target, at its largest prompt count."""
    return latest(rows, lambda r: r.get("target") == target and r.get("world", 1) == 1
                  and "H200" in str(r.get("device")), size="prompts")


def minutes_per_gpu(tokens: Optional[int], train_tps: Optional[float], regen_tps: Optional[float]) -> Optional[float]:
    if tokens is None or not train_tps or not regen_tps:
        return None
    return tokens / train_tps / 60 + tokens / regen_tps / 60


def _cite(row: Optional[dict[str, Any]], path: str) -> Optional[dict[str, Any]]:
    if row is None:
        return None
    return {"file": path, "date": row.get("date"), "commit": row.get("commit"), "device": row.get("device"),
            "command": row.get("command"), "tokens_per_s": row.get("tokens_per_s")}


def target_row(spec: dict[str, Any], drafter: list[dict[str, Any]], train: list[dict[str, Any]],
               regen: list[dict[str, Any]], dims: Optional[dict[str, int]], draft_layers: Optional[int],
               paths: dict[str, str]) -> dict[str, Any]:
    """One target's summary: its measured drafts, the tokens to a paying draft, the minutes a GPU needs."""
    points = draft_points(drafter, spec["names"])
    tr, rg = train_rate(train, spec["shape"]), regen_rate(regen, spec["regen_target"])
    train_tps, regen_tps = (_num(tr.get("tokens_per_s")) if tr else None), (_num(rg.get("tokens_per_s")) if rg else None)
    row: dict[str, Any] = {"target": spec["target"], "target_path": spec["target_path"],
                           "num_hidden_layers": (dims or {}).get("num_hidden_layers"),
                           "hidden_size": (dims or {}).get("hidden_size"), "vocab_size": (dims or {}).get("vocab_size"),
                           "draft_layers": draft_layers, "draft_width": (dims or {}).get("hidden_size"),
                           "recipe": spec["recipe"], "measured_drafts": len(points),
                           "max_measured_tokens": max((p["train_tokens"] for p in points), default=None),
                           "train_tokens_per_s": train_tps, "regen_tokens_per_s": regen_tps,
                           "train_rate_source": _cite(tr, paths["train"]), "regen_rate_source": _cite(rg, paths["regen"]),
                           "drafts_source": paths["drafter"], "points": points}
    for s in PAYS:
        key = f"{s:g}".replace(".", "_")
        tokens = tokens_to_pay(points, s)
        row[f"tokens_to_speedup_{key}"] = tokens
        row[f"minutes_per_gpu_to_speedup_{key}"] = minutes_per_gpu(tokens, train_tps, regen_tps)
        row[f"tokens_to_speedup_{key}_no_loop"] = tokens_to_pay(points, s, "speedup_t0_no_loop_min")
    free = [p["train_tokens"] for p in points if p["speedup_t0_no_loop_min"] is not None]
    row["measured_no_loop_drafts"], row["max_measured_no_loop_tokens"] = len(free), max(free, default=None)
    return row


def pay_cell(row: dict[str, Any], key: str) -> str:
    """'21.2 M' or, where no measured draft pays, what the measurements do say."""
    if row[f"tokens_to_speedup_{key}"] is not None:
        return f"{row[f'tokens_to_speedup_{key}'] / 1e6:.1f} M"
    if not row["measured_drafts"] or (key.endswith("no_loop") and not row["measured_no_loop_drafts"]):
        return "no run recorded"
    top = row["max_measured_no_loop_tokens" if key.endswith("no_loop") else "max_measured_tokens"]
    return f"> {top / 1e6:.1f} M (no measured run pays)"


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown tables docs/train.md shows: every measured draft, then one line per target."""
    out = ["| target | draft | training tokens | tau MT-Bench / HumanEval (T=0) | speedup MT-Bench / HumanEval "
           "(T=0, batch 1) | without loops | current figure measured |", "| --- | --- | ---: | ---: | ---: | ---: | --- |"]

    def pair(a: Optional[float], b: Optional[float], fmt: str) -> str:
        return "-" if a is None and b is None else " / ".join("-" if v is None else format(v, fmt) for v in (a, b))

    for row in rows:
        for p in row["points"]:
            out.append(f"| {row['target']} | {p['draft'] or 'main'} | {p['train_tokens'] / 1e6:.1f} M | "
                       f"{pair(p['mtbench_t0_tau'], p['humaneval_t0_tau'], '.2f')} | "
                       f"{pair(p['mtbench_t0_speedup'], p['humaneval_t0_speedup'], '.2f')} | "
                       f"{pair(p['mtbench_t0_speedup_no_loop'], p['humaneval_t0_speedup_no_loop'], '.2f')} | "
                       f"{p['date']}, {p['commit']}, {p['device']} |")
    out += ["", "| target | vocab | draft layers x width | tokens to speedup >= 1.0 | minutes a GPU | "
            "tokens to speedup >= 1.5 | minutes a GPU | the same without loops (>= 1.0 / >= 1.5) | "
            "training / regeneration tokens/s a GPU |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        shape = f"{row['draft_layers']} x {row['draft_width']}" if row["draft_layers"] else "-"
        vocab = f"{row['vocab_size']:,}" if row["vocab_size"] else "-"
        mins = ["-" if row[f"minutes_per_gpu_to_speedup_{k}"] is None else f"{row[f'minutes_per_gpu_to_speedup_{k}']:.1f}"
                for k in ("1", "1_5")]
        rates = ("-" if not row["train_tokens_per_s"] or not row["regen_tokens_per_s"]
                 else f"{row['train_tokens_per_s'] / 1e3:.1f}k / {row['regen_tokens_per_s'] / 1e3:.1f}k")
        out.append(f"| {row['target']} | {vocab} | {shape} | {pay_cell(row, '1')} | {mins[0]} | "
                   f"{pay_cell(row, '1_5')} | {mins[1]} | {pay_cell(row, '1_no_loop')} / {pay_cell(row, '1_5_no_loop')} | "
                   f"{rates} |")
    return out


def target_dims(shape: Optional[str]) -> Optional[dict[str, int]]:
    """The target's config.json dimensions, as benchmarks/train_throughput.py builds its shape."""
    if shape is None:
        return None
    from train_throughput import SHAPES

    s = SHAPES[shape]
    return {k: int(s[k]) for k in ("num_hidden_layers", "hidden_size", "vocab_size")}


def recipe_draft_layers(recipe: Optional[str]) -> Optional[int]:
    if recipe is None:
        return None
    from nemo_dflash.config import load_recipe

    return int(load_recipe(recipe, data_optional=True).draft.num_layers)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="sizing.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", type=Path, default=REPO / "docs/bench/drafter_summary.json")
    p.add_argument("--train", type=Path, default=REPO / "docs/bench/train_throughput.json")
    p.add_argument("--regen", type=Path, default=REPO / "docs/bench/regen_summary.json")
    p.add_argument("--json", type=Path, default=REPO / "docs/bench/sizing.json", help="the rows, for docs/bench")
    p.add_argument("--package", type=Path, default=REPO / "nemo_dflash/recipes/sizing.json",
                   help="the same rows, shipped with the package (the pipeline's plan-time warning reads them)")
    p.add_argument("--no-write", action="store_true", help="print the tables only")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    paths = {k: os.path.relpath(getattr(args, k), REPO) for k in ("drafter", "train", "regen")}
    drafter, train, regen = read_rows(args.drafter), read_rows(args.train), read_rows(args.regen)
    head = provenance("none (computed from the measured rows it cites)")
    rows = [{**head, **target_row(spec, drafter, train, regen, target_dims(spec["shape"]),
                                  recipe_draft_layers(spec["recipe"]), paths)} for spec in TARGETS]
    for line in table(rows):
        log.info("%s", line)
    if not args.no_write:
        for path in (args.json, args.package):
            write_rows(path, rows)
            log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
