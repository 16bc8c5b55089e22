r"""Report what a regenerated file will teach a draft, per source (docs/data.md, "The data report").

    python -m nemo_dflash.recipes.data_report data/regen.jsonl --out data/regen_report \
        [--tokenizer pkg:smollm2]
    python -m nemo_dflash.recipes.data_report --config RECIPE --out DIR [KEY=VALUE ...]

Writes DIR/data_report.json (per source: conversations, turns, supervised tokens, unique 13-gram
share, loops, answer length percentiles) and DIR/data_report.png (the source mix, answer lengths,
and prompt against answer length). Lengths are in the tokenizer's tokens with --tokenizer (the
target's: a local HF dir, .gguf file or pkg:smollm2), in words without it. `regenerate` writes the
same report beside its output (OUT_STEM_report/). With --config, the recipe's one `data.sources` file is the
data (--data FILE picks another) and its target.path the tokenizer; a flag given here wins.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from nemo_dflash.recipes._cli import add_recipe_args, fail, parse_with_recipe, setup_logging, user_errors

if TYPE_CHECKING:
    from nemo_dflash.config import RecipeConfig

logger = logging.getLogger("nemo_dflash.data_report")


def build_parser(file: bool = True) -> argparse.ArgumentParser:
    """The flags; ``file``: the FILE positional too (without --config: with it, the words after the flags are
    the recipe's KEY=VALUE overrides, and --data names the file)."""
    p = argparse.ArgumentParser(prog="python -m nemo_dflash.recipes.data_report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if file:
        p.add_argument("file", nargs="?", default=None, metavar="FILE",
                       help="a regenerated FILE.jsonl (regenerate --out); the same as --data FILE (not with --config)")
    p.add_argument("--data", metavar="FILE", help="the regenerated file (default with --config: the recipe's "
                                                  "data.sources file, when it has one)")
    p.add_argument("--out", required=True, help="output directory (data_report.json, data_report.png)")
    p.add_argument("--tokenizer", default=None,
                   help="count tokens with this target's tokenizer (local HF dir, .gguf file or pkg:smollm2); "
                        "default: words (with --config: the recipe's target.path)")
    p.add_argument("--overwrite", action="store_true", help="replace a report already in --out")
    add_recipe_args(p, "data.sources", pick=recipe_inputs, example="target.path=pkg:smollm2")  # --config RECIPE
    return p


@dataclass
class ReportInputs:
    """What a recipe holds of this command's flags: the file (`data.sources`) and the tokenizer (`target.path`)."""

    data: Optional[str] = None
    tokenizer: Optional[str] = None


def recipe_inputs(cfg: RecipeConfig, args: argparse.Namespace, argv: Sequence[str]) -> tuple[ReportInputs, bool]:
    """With --config: --data, or else the recipe's only data source, and the recipe's target as the tokenizer."""
    paths = [s.path for s in cfg.data.sources]
    if args.data is None and len(paths) != 1:
        fail(f"--config {args.config}: the recipe's data.sources are {', '.join(paths) or 'empty'}: name the file "
             "to report with --data FILE")
    return ReportInputs(data=args.data or paths[0], tokenizer=cfg.target.path), False


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe = any(a == "--config" or a.startswith("--config=") for a in argv)
    args = parse_with_recipe(build_parser(file=not recipe), argv)  # --config: its data source and target
    setup_logging()
    from nemo_dflash.data import DataError
    from nemo_dflash.data.report import REPORT_JSON, REPORT_PNG, write_report

    file = getattr(args, "file", None)
    if (file is None) == (args.data is None):
        fail("give the regenerated file once: data_report FILE, --data FILE, or --config RECIPE")
    data, out = Path(file or args.data), Path(args.out)
    if not data.is_file():
        fail(f"{data} not found; give the .jsonl file regenerate wrote")
    if out.exists() and not out.is_dir():
        fail(f"--out {out} is a file; name a directory")
    existing = [out / n for n in (REPORT_JSON, REPORT_PNG) if (out / n).exists()]
    if existing and not args.overwrite:
        fail(f"{existing[0]} already exists; pass --overwrite to replace it or choose another --out")
    tokenizer = None
    if args.tokenizer is not None:
        from nemo_dflash.target.loading import load_tokenizer

        try:
            tokenizer = load_tokenizer(args.tokenizer)
        except (OSError, ValueError) as e:
            fail(f"cannot load the tokenizer of --tokenizer {args.tokenizer}: {e}")
    with user_errors(DataError, OSError, UnicodeDecodeError):
        written = write_report(data, out, tokenizer=tokenizer)
    logger.info("wrote %s%s", written["json"], f" and {written['png']}" if written["png"] else "")
    return written


if __name__ == "__main__":
    main()
