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
from nemo_dflash.recipes.sizing_advice import table, target_row  # noqa: E402

log = logging.getLogger("sizing")

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
