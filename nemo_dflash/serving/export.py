"""Write a trained draft in the serving format of vLLM / SGLang.

The contract (what `vllm --speculative-config '{"method": "dflash", ...}'` and SGLang's
`--speculative-algorithm DFLASH` load) is a directory with exactly:
- `config.json`: a Qwen3 config (`"model_type": "qwen3"`,
  `"architectures": ["DFlashDraftModel"]`) plus `block_size`, `num_target_layers` and
  `dflash_config = {mask_token_id, target_layer_ids}`;
- `model.safetensors`: bf16 weights with UNPREFIXED names (`fc.weight`, `layers.0...`) and no
  embed_tokens / lm_head (the engine shares the target's). vLLM rejects unknown names and a
  `model.` prefix, so the key set is validated before anything is written.

Reading drafts back (`load_draft`, `resolve_draft_dir`), the contract's names and shapes and the
draft/target checks live in `nemo_dflash.draft.build`, the one place that makes a draft for a target;
they are re-exported here so `from nemo_dflash.serving.export import load_draft` keeps working.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from nemo_dflash.draft.build import (  # noqa: F401  (re-exported: the names' old home)
    CONFIG_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    check_draft_fits_target,
    check_mask_token_id,
    draft_config_from_dict,
    load_draft,
    resolve_draft_dir,
    serving_weight_shapes,
    validate_serving_weights,
)
from nemo_dflash.draft.model import DFlash2Config, DFlashConfig, DFlashDraftModel
from nemo_dflash.draft.registry import DRAFT_VARIANTS, draft_kind
from nemo_dflash.serving.engine_limits import check_engine_limits
from nemo_dflash.files import apply_umask, write_error_reason
from nemo_dflash.target import check_target_layer_ids

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]

SERVING_DTYPE = torch.bfloat16

# Keys of the exported config.json, in the order they are written. `rope_scaling` is added
# only for a non-default RoPE, `partial_rotary_factor` only when the target rotates part of each head, `is_causal`
# (false) only for a DFlash2 draft.
SERVING_CONFIG_KEYS = (
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "max_position_embeddings", "vocab_size", "hidden_act", "attention_bias", "tie_word_embeddings",
    "torch_dtype", "dtype", "block_size", "num_target_layers", "dflash_config",
)

# ----------------------------------------------------------------------------- contract


def serving_config_dict(config: DFlashConfig) -> dict[str, Any]:
    """The exported config.json, built field by field (never a dump of the training config)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_theta = rope.pop("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    # Written top-level, where transformers and vLLM read it into rope_parameters (rotary_dim =
    # int(head_dim * factor)); a draft served without it rotates the whole head and serves at tau ~1.
    partial = float(rope.pop("partial_rotary_factor", 1.0))
    mask_id = check_mask_token_id(config.mask_token_id, source="the draft config's dflash_config")
    layer_ids = check_target_layer_ids(config.target_layer_ids, key="the draft config's dflash_config.target_layer_ids")
    kind = draft_kind(config)
    out: dict[str, Any] = {
        "architectures": [DRAFT_VARIANTS[kind].architecture],
        "model_type": "qwen3",
        "hidden_size": int(config.hidden_size),
        "intermediate_size": int(config.intermediate_size),
        "num_hidden_layers": int(config.num_hidden_layers),
        "num_attention_heads": int(config.num_attention_heads),
        "num_key_value_heads": int(config.num_key_value_heads),
        "head_dim": int(config.head_dim or config.hidden_size // config.num_attention_heads),
        "rms_norm_eps": float(config.rms_norm_eps),
        "rope_theta": float(rope_theta),
        "max_position_embeddings": int(config.max_position_embeddings),
        "vocab_size": int(config.vocab_size),
        "hidden_act": str(config.hidden_act),
        "attention_bias": bool(getattr(config, "attention_bias", False)),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "block_size": int(config.block_size),
        "num_target_layers": int(config.num_target_layers),
        "dflash_config": {
            "mask_token_id": mask_id,
            "target_layer_ids": layer_ids,
        },
    }
    if isinstance(config, DFlash2Config):
        # the engines' DFlash2 fields, each pair written together (SGLang reads an absent field as 0)
        out["dflash_config"].update({
            "block_size": int(config.block_size),
            "conv_kernel_size": config.conv_kernel_size, "conv_group_size": config.conv_group_size,
            "selector_rank": config.selector_rank, "selector_top_k": config.selector_top_k,
            "output_multiplier": config.output_multiplier,
            "final_logit_softcapping": config.final_logit_softcapping,
        })
        out["is_causal"] = False
    if rope_type != "default":
        out["rope_scaling"] = rope
    if partial != 1.0:
        out["partial_rotary_factor"] = partial
    return out


# ----------------------------------------------------------------------------- export

# The mark an export leaves in its weights' header (safetensors metadata, which the engines ignore): how
# `--overwrite` recognises a directory it may replace without adding a file to the serving contract.
EXPORT_MARK = ("written_by", "nemo_dflash export")


def is_export_dir(path: PathLike) -> bool:
    """Whether ``path`` holds an export this product wrote and nothing else: exactly config.json and a
    model.safetensors whose header carries `EXPORT_MARK` (a target, a training run, data or a directory of
    someone else's files never does)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_dir() or sorted(p.name for p in path.iterdir()) != sorted((CONFIG_NAME, WEIGHTS_NAME)):
        return False
    try:
        with safe_open(str(path / WEIGHTS_NAME), framework="pt") as f:
            meta = f.metadata() or {}
    except (OSError, SafetensorError):
        return False
    return meta.get(EXPORT_MARK[0]) == EXPORT_MARK[1]


def canonical_header(path: Path) -> None:
    """Rewrite a safetensors file's JSON header with its keys sorted, in place: safetensors writes the header's
    maps in hash order, which differs from one process to the next, so two exports of one draft would differ in
    bytes. The header keeps its length (padded with spaces, as safetensors pads it) and every tensor its offsets,
    so the tensor data is not touched."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > n:  # never: the same content, written as compactly; left as it is if ever
            logger.warning("%s: the sorted header is longer than the written one, left as written", path)
            return
        f.seek(8)
        f.write(text + b" " * (n - len(text)))


def _atomic_write_dir(out: Path, files: dict[str, Any], overwrite: bool) -> None:
    """Write into a temp dir next to `out`, then rename it into place. A non-empty `out` is replaced only
    with `overwrite` and only when it is an export (`is_export_dir`): never a target, a run or data."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty: choose another --out or pass --overwrite")
        if not is_export_dir(out):
            raise FileExistsError(f"--overwrite refused: {out} holds files export did not write, and --overwrite "
                                  "only replaces an export: choose another --out, or empty it yourself")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp", dir=out.parent))
    old = None
    try:
        for name, writer in files.items():
            writer(tmp / name)
        apply_umask(tmp)  # mkdtemp's 0700 and safetensors' 0600 would lock out a server running as another user
        if out.exists():
            old = out.parent / f".{out.name}.old.{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException:
        if old is not None and old.exists() and not out.exists():
            os.replace(old, out)
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and old.exists():
            shutil.rmtree(old, ignore_errors=True)


def export_draft(
    draft: Union[DFlashDraftModel, PathLike], out_dir: PathLike, *, overwrite: bool = False, engine: str = "any",
    target_vocab: Optional[int] = None, trained_on: Optional[str] = None,
) -> Path:
    """Write `draft` (a model, or any path `load_draft` accepts) as a serving checkpoint.

    The output holds exactly `config.json` and a bf16 `model.safetensors` whose key set has
    been checked against the contract. Nothing is written on a validation error, and an
    existing non-empty `out_dir` is only replaced with `overwrite=True`. The engines' known limits
    (`nemo_dflash.serving.engine_limits`) refuse what breaks `engine` (every engine for "any") and warn of the rest.
    """
    if not isinstance(draft, DFlashDraftModel):
        draft = load_draft(draft)
    config = draft.config
    cfg = serving_config_dict(config)
    check_engine_limits(cfg, engine, vocab=target_vocab)
    state = {k: v.detach().to(device="cpu", dtype=SERVING_DTYPE).contiguous() for k, v in draft.state_dict().items()}
    validate_serving_weights({k: tuple(v.shape) for k, v in state.items()}, config, source="The draft's weights")
    out = Path(out_dir).resolve()  # through a symlink: the directory it points to is replaced, not the link

    def write_config(p: Path) -> None:
        p.write_text(json.dumps(cfg, indent=2) + "\n")

    def write_weights(p: Path) -> None:
        from nemo_dflash.target.identity import TRAINED_ON

        save_file(state, str(p), metadata={"format": "pt", EXPORT_MARK[0]: EXPORT_MARK[1],
                                           **({TRAINED_ON: trained_on} if trained_on else {})})
        canonical_header(p)

    try:
        _atomic_write_dir(out, {CONFIG_NAME: write_config, WEIGHTS_NAME: write_weights}, overwrite)
    except SafetensorError as e:  # safetensors wraps the OSError of a failed write (a full disk)
        reason = write_error_reason(e)
        if reason is None:
            raise
        raise OSError(f"cannot write {out} ({reason}): free space or fix the permissions, then export again") from None
    except OSError as e:
        reason = write_error_reason(e)
        if reason is None or isinstance(e, FileExistsError):
            raise
        raise OSError(f"cannot write {out} ({reason}): free space or fix the permissions, then export again") from None
    n = sum(v.numel() for v in state.values())
    logger.info("Exported %d tensors (%.1fM params, bf16) to %s", len(state), n / 1e6, out)
    return out


__all__ = [
    "SERVING_CONFIG_KEYS",
    "check_draft_fits_target",
    "draft_config_from_dict",
    "export_draft",
    "is_export_dir",
    "load_draft",
    "resolve_draft_dir",
    "serving_config_dict",
    "serving_weight_shapes",
    "validate_serving_weights",
]
