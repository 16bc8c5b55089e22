"""Train a DFlash draft from a YAML recipe.

    torchrun --nproc-per-node 8 -m nemo_dflash.recipes.train --config qwen3_8b.yaml \
        target.path=/models/Qwen3-8B data.sources='[{path: /data/regen.jsonl}]'
    python -m nemo_dflash.recipes.train --config smollm2_135m.yaml train.max_steps=50

A run starting afresh (checkpoint.resume=none, or auto with no checkpoint) is refused when
output_dir already holds a run; --overwrite replaces that run (renamed aside, then deleted).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from nemo_dflash.config import ConfigError, load_recipe
from nemo_dflash.recipes._cli import fail, set_threads, setup_logging, user_errors

logger = logging.getLogger("nemo_dflash.train")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", "-c", required=True, help="recipe YAML (working dir first, then the repo's recipes/)")
    p.add_argument("overrides", nargs="*", help="overrides in Hydra's grammar: key=value, ++key=value, ~key, "
                   "group=option, +group=option, ~group (e.g. optim.lr=1e-4 ~cluster)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per process (default: torch's)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in output_dir when this one starts afresh (default: refuse)")
    return p.parse_args(argv)


def check_paths(cfg) -> None:
    """Every data file and the target are checked before anything loads (an 8B target takes minutes)."""
    from pathlib import Path

    from nemo_dflash.target.loading import check_model_dir, resolve_target_path

    for i, src in enumerate(cfg.data.sources):
        if not Path(src.path).is_file():
            fail(f"data.sources[{i}].path {src.path} does not exist; point it at a regenerated .jsonl/.json/.parquet file")
    with user_errors(FileNotFoundError):
        target = resolve_target_path(cfg.target.path)
    if not (Path(target).is_dir() or (target.endswith(".gguf") and Path(target).is_file())):
        fail(f"target.path {cfg.target.path} is neither a local model directory nor a .gguf file; nemo_dflash "
             "never downloads: download the model first and point target.path at it")
    if Path(target).is_dir():
        with user_errors(FileNotFoundError):
            check_model_dir(target, "target.path")
    if cfg.draft.init_from:
        check_init_from(cfg.draft.init_from)
        from nemo_dflash.draft.build import DraftError, check_draft_kind

        with user_errors(DraftError):
            check_draft_kind(cfg.draft.init_from, cfg.draft.kind, "draft.init_from")
    if Path(target).is_dir():  # the variant's sizes, the draft's shape: against config.json, before the target loads
        check_variant_sizes(cfg, Path(target) / "config.json")
        check_draft_shape(cfg, Path(target) / "config.json")
    if cfg.data.decontaminate:  # the evaluation packages it reads: missing, refused now, not after the target loads
        from nemo_dflash.data import DataError
        from nemo_dflash.data.decontaminate import training_index

        with user_errors(DataError):
            training_index(True)
    block = cfg.draft.block_size
    if block is not None and cfg.data.max_length <= block:
        fail(f"data.max_length={cfg.data.max_length} leaves no room for a prompt and a block of draft.block_size="
             f"{block} tokens, so no conversation can be trained on: raise data.max_length (the recipes use 3072)")


def check_variant_sizes(cfg, config_json) -> None:
    """`draft.<kind>` sizes that cannot fit the target (a conv group size not dividing its hidden size, a top-K
    above its vocabulary): one line before the target loads."""
    import dataclasses
    import json

    from nemo_dflash.draft.build import DraftError, check_variant_fits
    from nemo_dflash.draft.registry import resolve_draft_variant

    variant = resolve_draft_variant(cfg.draft.kind)
    if not variant.options:
        return
    raw = json.loads(config_json.read_text())
    raw = raw.get("text_config") or raw
    if "hidden_size" not in raw or "vocab_size" not in raw:
        return  # the build checks them once the target's config is read whole
    with user_errors(DraftError):
        check_variant_fits(cfg.draft.kind, dataclasses.asdict(getattr(cfg.draft, variant.options)),
                           int(raw["hidden_size"]), int(raw["vocab_size"]), cfg.draft.block_size)


TRAINING_BYTES_PER_PARAM = 16  # fp32 weights, their gradients and Adam's two moments


def draft_layer_params(hidden: int, intermediate: int) -> int:
    """A lower bound on a draft layer's parameters: its MLP's three h x I matrices (attention and norms come on top)."""
    return 3 * hidden * intermediate


def check_draft_shape(cfg, config_json) -> None:
    """The draft's depth and size against the target's config.json (read as a file), before the target loads:
    more draft layers than the target has (each default layer id is a distinct target layer), layer ids past its
    depth, and a draft whose training state cannot fit this machine's free memory (a traceback, or the machine
    swapping, once the target has loaded)."""
    import json
    import os

    from nemo_dflash.train.device import free_memory_bytes
    from nemo_dflash.target import LayerIdsError, check_target_layer_ids

    d = cfg.draft
    if d.init_from:  # the draft's shape is init_from's, checked against the target when it loads
        return
    raw = json.loads(config_json.read_text())
    raw = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    layers = raw.get("num_hidden_layers")
    if isinstance(layers, int) and layers > 0:
        if d.target_layer_ids is None and d.num_layers > layers:
            fail(f"draft.num_layers={d.num_layers}: the draft fuses that many distinct layers of the target, which "
                 f"has {layers}: give draft.num_layers <= {layers}, or set draft.target_layer_ids")
        if d.target_layer_ids is not None:
            with user_errors(LayerIdsError):
                check_target_layer_ids(d.target_layer_ids, layers, key="draft.target_layer_ids")
    hidden = raw.get("hidden_size")
    intermediate = d.intermediate_size or raw.get("intermediate_size")
    if not (isinstance(hidden, int) and isinstance(intermediate, int)):
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and _cuda_available())
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else "cpu"
    need = TRAINING_BYTES_PER_PARAM * d.num_layers * draft_layer_params(hidden, intermediate)
    need = need // world if cuda else need  # a GPU holds at least its share; the host holds every rank's
    free = free_memory_bytes(device)
    if free is not None and need > free:
        key = "draft.intermediate_size" if d.intermediate_size else "draft.num_layers"
        fail(f"{key}: a draft of {d.num_layers} layers of {hidden} x {intermediate} needs at least "
             f"{need / 1e9:.1f} GB to train (weights, gradients, Adam's moments) and {device} has "
             f"{free / 1e9:.1f} GB free: lower {key}")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def check_init_from(init_from: str) -> None:
    """`draft.init_from` inside a checkpoint or a run's final/ is checked against its COMPLETE marker (the
    check export and evaluate make): damaged weights are never trained from."""
    from nemo_dflash.draft.build import DraftError, resolve_draft_dir
    from nemo_dflash.files import DamagedFilesError, verify_marked_draft

    try:
        draft_dir = resolve_draft_dir(init_from)
    except (DraftError, FileNotFoundError) as e:
        fail(f"draft.init_from={init_from}: {e}")
    try:
        verify_marked_draft(draft_dir)
    except DamagedFilesError as e:
        fail(f"draft.init_from={init_from}: {e}: start from another checkpoint of that run, or copy it again")


def user_error_types() -> tuple[type[BaseException], ...]:
    """What a training run raises for a mistake in the recipe, its files or its resume: one line, exit 2
    (also for `demo`, which trains through the same code). Imported late: they pull in torch."""
    from nemo_dflash.data import DataError
    from nemo_dflash.draft.build import DraftError
    from nemo_dflash.target import LayerIdsError
    from nemo_dflash.train.checkpoint import CheckpointError, ResumeMismatchError
    from nemo_dflash.train.run_dir import RunDirError

    return (ConfigError, DraftError, LayerIdsError, DataError, ResumeMismatchError, CheckpointError, RunDirError,
            FileNotFoundError)


def main(argv=None) -> dict:
    args = parse_args(argv)
    setup_logging()
    set_threads(args.threads)
    with user_errors(ConfigError, FileNotFoundError):
        cfg = load_recipe(args.config, args.overrides)
    if args.print_config:
        from nemo_dflash.config import to_yaml

        sys.stdout.write(to_yaml(cfg))
        return {}
    check_paths(cfg)
    from nemo_dflash.train.trainer import train

    with user_errors(*user_error_types()):  # settings (flex on CPU, ...), data, draft, resume
        summary = train(cfg, overwrite=args.overwrite)
    logger.info("summary: %s", json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
