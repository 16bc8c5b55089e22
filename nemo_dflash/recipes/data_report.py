r"""Report what a regenerated file will teach a draft, per source (docs/data.md, "The data report").

    python -m nemo_dflash.recipes.data_report data/regen.jsonl --out data/regen_report \
        [--tokenizer pkg:smollm2]

Writes DIR/data_report.json (per source: conversations, turns, supervised tokens, unique 13-gram
share, loops, answer length percentiles) and DIR/data_report.png (the source mix, answer lengths,
and prompt against answer length). Lengths are in the tokenizer's tokens with --tokenizer (the
target's: a local HF dir, .gguf file or pkg:smollm2), in words without it. `regenerate` writes the
same report beside its output (OUT_STEM_report/).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

from nemo_dflash.recipes._cli import fail, setup_logging, user_errors

logger = logging.getLogger("nemo_dflash.data_report")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nemo_dflash.recipes.data_report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="a regenerated FILE.jsonl (regenerate --out)")
    p.add_argument("--out", required=True, help="output directory (data_report.json, data_report.png)")
    p.add_argument("--tokenizer", default=None,
                   help="count tokens with this target's tokenizer (local HF dir, .gguf file or pkg:smollm2); "
                        "default: words")
    p.add_argument("--overwrite", action="store_true", help="replace a report already in --out")
    return p


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    setup_logging()
    from nemo_dflash.data import DataError
    from nemo_dflash.data.report import REPORT_JSON, REPORT_PNG, write_report

    data, out = Path(args.data), Path(args.out)
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
