"""Export a trained draft for vLLM / SGLang.

    python -m nemo_dflash.recipes.export --checkpoint RUN/final/draft --out DIR [--overwrite]
        [--target PATH] [--serving-engine any|vllm|sglang]
    python -m nemo_dflash.recipes.export --config RECIPE --checkpoint RUN --out DIR [export.parity_prompts=3]

`--checkpoint` may be a training draft dir, a checkpoint dir containing `draft/`, or a run
dir (its `final/draft`, else its latest `checkpoints/step_N/draft`). With `--target`, the
draft is checked against the target's config (and tokenizer) before anything is written.

Refused in one line (exit 2) before the draft loads: an --out that is, contains or lies inside the
input (the draft, the training run it belongs to, or --target: --overwrite would delete it), a
non-empty --out without --overwrite, or with it one that is not an export this command wrote (a
target, a run, someone's files: --overwrite only replaces an export), an --out that cannot be
written, and a draft whose files differ from what its checkpoint's COMPLETE recorded.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence

from nemo_dflash.files import CHECKPOINTS_DIR, FINAL_DIR, DamagedFilesError, Output, guard_outputs, verify_marked_draft
from nemo_dflash.config import ExportConfig
from nemo_dflash.serving.engine_limits import ENGINES
from nemo_dflash.recipes._cli import (
    add_deprecated_flag, add_recipe_args, parse_with_recipe, section_defaults, setup_logging, user_errors,
)

logger = logging.getLogger("nemo_dflash.serving.export")
SERVING_ENGINES = ("any", *ENGINES)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nemo_dflash.recipes.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="training draft dir, checkpoint dir with draft/, or run dir")
    p.add_argument("--out", required=True, help="output directory (config.json + bf16 model.safetensors)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--target", help="optional target (local HF dir, .gguf or pkg:smollm2) to check the draft against")
    add_deprecated_flag(p, "--engine", "--serving-engine", "serving_engine", choices=SERVING_ENGINES)
    p.add_argument("--serving-engine", choices=SERVING_ENGINES,
                   help="the engine you serve with: its known limits refuse the export (others only warn)")
    p.add_argument("--parity-prompts", type=int, metavar="N",
                   help="with --target: before writing, decode N built-in prompts (at most 3) with our decoder and "
                        "with the DFlash rules applied to the exported config and weights; refuse on disagreement")
    p.add_argument("--any-target", action="store_true",
                   help="export against a --target other than the one the draft records it was trained on")
    add_recipe_args(p, "export")  # --config RECIPE [KEY=VALUE ...]
    section_defaults(p, ExportConfig)  # the recipe's `export` section is the source of the defaults
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


def check_out(out: Path, checkpoint: str, src: Path, target: Optional[str] = None, overwrite: bool = False) -> None:
    """The output guard (`guard_outputs`): `OutputError` for an --out that overlaps the input (the draft, its
    run, a local --target) or that --overwrite may not replace (not an export this product wrote); `OSError`
    (one line) for one that cannot be written."""
    from nemo_dflash.serving.export import is_export_dir

    inputs = [("--checkpoint", p) for p in protected_inputs(checkpoint, src)]
    if target and Path(target).exists():
        inputs.append(("--target", Path(target)))
    guard_outputs([Output(out, "--out", kind="dir", ours=is_export_dir)], inputs, overwrite)


def verify_draft_files(src: Path) -> None:
    """A draft inside a checkpoint (or final/) is checked against the sizes and CRC-32s its COMPLETE recorded."""
    verify_marked_draft(src)


def run_parity_check(draft: object, target: Optional[str], n_prompts: int, engine: str = "any",
                     target_vocab: Optional[int] = None) -> None:
    """The serving-parity check (`nemo_dflash.evaluation.parity`) on ``n_prompts`` prompts; ValueError on
    disagreement. The engines' limits are checked first: the check loads the target."""
    from nemo_dflash.data.chat_template import stop_token_ids
    from nemo_dflash.serving.engine_limits import check_engine_limits
    from nemo_dflash.serving.export import serving_config_dict
    from nemo_dflash.evaluation.parity import PARITY_PROMPTS, check_serving_parity, encode_parity_prompts

    if not target:
        raise ValueError("--parity-prompts needs --target: the check decodes with the target")
    if not 0 < n_prompts <= len(PARITY_PROMPTS):
        raise ValueError(f"--parity-prompts {n_prompts}: give 1 to {len(PARITY_PROMPTS)}")
    check_engine_limits(serving_config_dict(draft.config), engine, vocab=target_vocab, warn=False)
    from nemo_dflash.recipes._cli import resolve_device_dtype
    from nemo_dflash.target.loading import load_target

    device, dtype = resolve_device_dtype("auto", "auto")
    model, tokenizer = load_target(target, dtype=dtype, device=device)
    report = check_serving_parity(model, draft.to(device), encode_parity_prompts(tokenizer)[:n_prompts],
                                  cfg=serving_config_dict(draft.config), stop_ids=stop_token_ids(model, tokenizer),
                                  max_new_tokens=32)
    logger.info("%s: the engines' rules and our decoder agree", report.line())


def main(argv: Optional[Sequence[str]] = None) -> int:
    setup_logging()
    args = parse_with_recipe(build_parser(), argv)  # --config RECIPE: its `export` section, flags winning
    from nemo_dflash.draft.build import check_draft_fits_target, load_draft, resolve_draft_dir
    from nemo_dflash.serving.export import export_draft

    from safetensors import SafetensorError

    # paths, --out (overlapping the input, not writable, not empty), damaged files, a draft that does not fit
    with user_errors(FileNotFoundError, FileExistsError, ValueError, PermissionError, NotADirectoryError,
                     DamagedFilesError, OSError):
        src = resolve_draft_dir(args.checkpoint)
        check_out(Path(args.out), args.checkpoint, Path(src), args.target, args.overwrite)
        verify_draft_files(Path(src))
        from nemo_dflash.target.identity import check_trained_on, trained_on

        weights = Path(src) / "model.safetensors"
        recorded = trained_on(weights)
        try:
            draft = load_draft(src)
        except SafetensorError as e:
            raise DamagedFilesError(f"{src}'s weights cannot be read ({e}): export another checkpoint") from None
        target_vocab = None
        if args.target:
            from transformers import AutoConfig

            from nemo_dflash.target.loading import check_model_dir, load_tokenizer, resolve_model_dir

            target_dir = resolve_model_dir(args.target)
            check_model_dir(target_dir, "--target")
            check_trained_on(weights, args.target, flag="--target", allow=args.any_target)  # before its weights load
            try:
                tokenizer = load_tokenizer(target_dir)
            except (OSError, ValueError):
                logger.warning("No tokenizer in %s: checking the draft against the config only", target_dir)
                tokenizer = None
            target_config = AutoConfig.from_pretrained(target_dir, local_files_only=True)
            check_draft_fits_target(draft.config, target_config, tokenizer)
            target_vocab = int(target_config.get_text_config().vocab_size)
        if args.parity_prompts:
            run_parity_check(draft, args.target, args.parity_prompts, args.serving_engine, target_vocab)
        out = export_draft(draft, args.out, overwrite=args.overwrite, engine=args.serving_engine, target_vocab=target_vocab,
                           trained_on=recorded)
    logger.info("exported %s -> %s", src, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
