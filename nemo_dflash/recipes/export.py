"""Export a trained draft for vLLM / SGLang.

    python -m nemo_dflash.recipes.export --checkpoint RUN/final/draft --out DIR [--overwrite]
        [--target PATH]

`--checkpoint` may be a training draft dir, a checkpoint dir containing `draft/`, or a run
dir (its `final/draft`, else its latest `checkpoints/step_N/draft`). With `--target`, the
draft is checked against the target's config (and tokenizer) before anything is written.

Refused in one line (exit 2) before the draft loads: an --out that is, contains or lies inside the
input (the draft, or the training run it belongs to: --overwrite would delete it), an --out that
cannot be written, and a draft whose files differ from what its checkpoint's COMPLETE recorded.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence

from nemo_dflash.files import (
    CHECKPOINTS_DIR, COMPLETE, FINAL_DIR, DamagedFilesError, check_writable_dir, paths_overlap, verify_complete,
)
from nemo_dflash.recipes._cli import UsageError, setup_logging, user_errors

logger = logging.getLogger("nemo_dflash.export")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nemo_dflash.recipes.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="training draft dir, checkpoint dir with draft/, or run dir")
    p.add_argument("--out", required=True, help="output directory (config.json + bf16 model.safetensors)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--target", default=None,
                   help="optional target (local HF dir, .gguf or pkg:smollm2) to check the draft against")
    return p


def protected_inputs(checkpoint: str | Path, src: Path) -> list[Path]:
    """What an export reads and must never overwrite: the --checkpoint given, the draft directory it
    resolved to and, for a draft inside a training run (final/draft, checkpoints/step_N/draft), the run."""
    found = [Path(checkpoint), src]
    if src.parent.name == FINAL_DIR:
        found.append(src.parent.parent)
    elif src.parent.parent.name == CHECKPOINTS_DIR:
        found.append(src.parent.parent.parent)
    return found


def check_out(out: Path, checkpoint: str, src: Path) -> None:
    """`UsageError` for an --out that overlaps the input; `OSError` (one line) for one that cannot be written."""
    for p in protected_inputs(checkpoint, src):
        if paths_overlap(out, p):
            raise UsageError(
                f"--out {out} overlaps the input {p} (it is, contains or lies inside it), so writing there would "
                f"destroy the input: choose an --out outside {p}"
            )
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a regular file, not a directory: choose another --out")
    check_writable_dir(out.parent, "--out's parent directory")


def verify_draft_files(src: Path) -> None:
    """A draft inside a checkpoint (or final/) is checked against the sizes and CRC-32s its COMPLETE recorded."""
    if (src.parent / COMPLETE).is_file():
        verify_complete(src.parent, prefix=f"{src.name}/")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    from nemo_dflash.draft.build import check_draft_fits_target, load_draft, resolve_draft_dir
    from nemo_dflash.export import export_draft

    from safetensors import SafetensorError

    # paths, --out (overlapping the input, not writable, not empty), damaged files, a draft that does not fit
    with user_errors(FileNotFoundError, FileExistsError, ValueError, PermissionError, NotADirectoryError,
                     DamagedFilesError):
        src = resolve_draft_dir(args.checkpoint)
        check_out(Path(args.out), args.checkpoint, Path(src))
        verify_draft_files(Path(src))
        try:
            draft = load_draft(src)
        except SafetensorError as e:
            raise DamagedFilesError(f"{src}'s weights cannot be read ({e}): export another checkpoint") from None
        if args.target:
            from transformers import AutoConfig

            from nemo_dflash.target.loading import check_model_dir, load_tokenizer, resolve_model_dir

            target_dir = resolve_model_dir(args.target)
            check_model_dir(target_dir, "--target")
            try:
                tokenizer = load_tokenizer(target_dir)
            except (OSError, ValueError):
                logger.warning("No tokenizer in %s: checking the draft against the config only", target_dir)
                tokenizer = None
            check_draft_fits_target(draft.config, AutoConfig.from_pretrained(target_dir, local_files_only=True),
                                    tokenizer)
        out = export_draft(draft, args.out, overwrite=args.overwrite)
    logger.info("exported %s -> %s", src, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
