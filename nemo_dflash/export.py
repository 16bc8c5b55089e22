"""Export a trained draft to the serving contract of vLLM / SGLang, and load drafts back.

The contract (what `vllm --speculative-config '{"method": "dflash", ...}'` and SGLang's
`--speculative-algorithm DFLASH` load) is a directory with exactly:
- `config.json`: a Qwen3 config (`"model_type": "qwen3"`,
  `"architectures": ["DFlashDraftModel"]`) plus `block_size`, `num_target_layers` and
  `dflash_config = {mask_token_id, target_layer_ids}`;
- `model.safetensors`: bf16 weights with UNPREFIXED names (`fc.weight`, `layers.0...`) and no
  embed_tokens / lm_head (the engine shares the target's). vLLM rejects unknown names and a
  `model.` prefix, so the key set is validated before anything is written.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nemo_dflash.files import apply_umask
from nemo_dflash.model import DFlashConfig, DFlashDraftModel

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]

SERVING_DTYPE = torch.bfloat16
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"

# Keys of the exported config.json, in the order they are written. `rope_scaling` is added
# only for a non-default RoPE.
SERVING_CONFIG_KEYS = (
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "max_position_embeddings", "vocab_size", "hidden_act", "attention_bias", "tie_word_embeddings",
    "torch_dtype", "dtype", "block_size", "num_target_layers", "dflash_config",
)

# Weights a published checkpoint may carry that the engines (and we) take from the target.
_SHARED_WITH_TARGET = re.compile(r"^(model\.)?(embed_tokens|lm_head)\.weight$")

# dflash_config options of other DFlash-family variants that this architecture does not have.
_UNSUPPORTED_VARIANT_FLAGS = ("causal", "use_swa", "sample_from_anchor", "attention_sink_bias")


# ----------------------------------------------------------------------------- contract


def serving_weight_shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every weight name of the serving contract and its shape, for a given draft config."""
    h, inter = config.hidden_size, config.intermediate_size
    hd = config.head_dim or h // config.num_attention_heads
    nq, nkv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(config.target_layer_ids) * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nq, h),
            p + "self_attn.k_proj.weight": (nkv, h),
            p + "self_attn.v_proj.weight": (nkv, h),
            p + "self_attn.o_proj.weight": (h, nq),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if getattr(config, "attention_bias", False):
            shapes.update({
                p + "self_attn.q_proj.bias": (nq,), p + "self_attn.k_proj.bias": (nkv,),
                p + "self_attn.v_proj.bias": (nkv,), p + "self_attn.o_proj.bias": (h,),
            })
    return shapes


def validate_serving_weights(shapes: Mapping[str, tuple[int, ...]], config: DFlashConfig, source: str = "weights") -> None:
    """Check a name -> shape map against the contract; raise naming every problem."""
    expected = serving_weight_shapes(config)
    problems: list[str] = []
    prefixed = sorted(k for k in shapes if k.startswith("model.") and k[len("model."):] in expected)
    if prefixed:
        problems.append(
            f"{len(prefixed)} names carry a `model.` prefix (e.g. {prefixed[0]!r}); the contract (and vLLM's "
            "loader) wants unprefixed names: re-export with `python -m nemo_dflash.recipes.export`"
        )
    unknown = sorted(k for k in shapes if k not in expected and k not in prefixed)
    if unknown:
        problems.append(f"unknown names {_preview(unknown)} (vLLM rejects them)")
    missing = sorted(k for k in expected if k not in shapes and "model." + k not in shapes)
    if missing:
        problems.append(
            f"missing {_preview(missing)} (config: {config.num_hidden_layers} layers, "
            f"{len(config.target_layer_ids)} target layers)"
        )
    bad = [
        f"{k}: {tuple(shapes[k])} != expected {expected[k]}"
        for k in sorted(expected) if k in shapes and tuple(shapes[k]) != expected[k]
    ]
    if bad:
        problems.append("wrong shapes (does config.json match the weights?): " + "; ".join(bad[:5])
                        + (f"; ... {len(bad) - 5} more" if len(bad) > 5 else ""))
    if problems:
        raise ValueError(f"{source} do not match the DFlash serving contract:\n  - " + "\n  - ".join(problems))


def _preview(names: list[str], n: int = 5) -> str:
    return ", ".join(repr(x) for x in names[:n]) + (f" ... ({len(names)} in all)" if len(names) > n else "")


def serving_config_dict(config: DFlashConfig) -> dict[str, Any]:
    """The exported config.json, built field by field (never a dump of the training config)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_theta = rope.pop("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    mask_id = config.mask_token_id
    if mask_id is None:
        raise ValueError("The draft config has no dflash_config.mask_token_id: set it (e.g. 151669 for Qwen3).")
    if not config.target_layer_ids:
        raise ValueError("The draft config has no dflash_config.target_layer_ids: set the fused target layers.")
    out: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
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
            "mask_token_id": int(mask_id),
            "target_layer_ids": [int(i) for i in config.target_layer_ids],
        },
    }
    if rope_type != "default":
        out["rope_scaling"] = rope
    return out


def draft_config_from_dict(raw: Mapping[str, Any], source: str = "config.json") -> DFlashConfig:
    """A DFlashConfig from an exported, training or published-DFlash-style config dict."""
    d = dict(raw)
    archs = d.get("architectures") or []
    if archs and not any("DFlash" in a for a in archs):
        raise ValueError(
            f"{source} describes {archs}, not a DFlash draft: pass the draft directory (the one whose "
            "config.json says \"architectures\": [\"DFlashDraftModel\"]), not the target."
        )
    dflash = dict(d.pop("dflash_config", None) or {})
    on = [f for f in _UNSUPPORTED_VARIANT_FLAGS if dflash.get(f)]
    if on:
        raise ValueError(f"{source}: dflash_config enables {on}, a DFlash variant this loader does not implement.")
    mask_id = dflash.get("mask_token_id", d.pop("mask_token_id", None))
    layer_ids = dflash.get("target_layer_ids") or d.pop("target_layer_ids", None)
    block_size = d.pop("block_size", None) or dflash.get("block_size")
    num_target_layers = d.pop("num_target_layers", None)
    target_hidden = d.pop("target_hidden_size", None)
    missing = [n for n, v in (("dflash_config.mask_token_id", mask_id), ("dflash_config.target_layer_ids", layer_ids),
                              ("block_size", block_size), ("num_target_layers", num_target_layers),
                              ("hidden_size", d.get("hidden_size")), ("num_hidden_layers", d.get("num_hidden_layers")))
               if v is None]
    if missing:
        raise ValueError(f"{source} lacks {missing}: a DFlash draft config needs them (see docs/serving.md).")
    if target_hidden is not None and int(target_hidden) != int(d["hidden_size"]):
        raise ValueError(
            f"{source}: target_hidden_size {target_hidden} != hidden_size {d['hidden_size']}; this draft "
            "architecture requires the draft and target hidden sizes to match."
        )
    for k in ("model_type", "auto_map", "transformers_version", "_name_or_path", "draft_vocab_size",
              "eagle_aux_hidden_state_layer_ids", "has_embed_tokens", "has_lm_head"):
        d.pop(k, None)
    d["architectures"] = ["DFlashDraftModel"]
    return DFlashConfig(
        block_size=int(block_size),
        num_target_layers=int(num_target_layers),
        dflash_config={"mask_token_id": int(mask_id), "target_layer_ids": [int(i) for i in layer_ids]},
        **d,
    )


def check_draft_fits_target(draft_config: DFlashConfig, target_config: Any, tokenizer: Any = None) -> None:
    """Fail early, before any model runs, when a draft cannot serve a target.

    The draft embeds with the target's table, reads the target's lm_head and fuses the
    target's layers `target_layer_ids`, so hidden size, depth and vocab must agree.
    """
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    depth = int(tc.num_hidden_layers)
    vocab = int(tc.vocab_size)
    problems = []
    if int(draft_config.hidden_size) != int(tc.hidden_size):
        problems.append(
            f"draft hidden_size {draft_config.hidden_size} != target hidden_size {tc.hidden_size} (the draft uses "
            "the target's embeddings and lm_head): build the draft with DFlashConfig.from_target_config(target_config)"
        )
    ids = draft_config.target_layer_ids
    bad = [i for i in ids if not 0 <= int(i) < depth]
    if not ids or bad:
        problems.append(f"target_layer_ids {ids} must be non-empty 0-based layer indices < the target's depth {depth}")
    if int(draft_config.num_target_layers) != depth:
        problems.append(
            f"num_target_layers {draft_config.num_target_layers} != the target's num_hidden_layers {depth}: "
            "this draft was trained for a different target"
        )
    mask_id = draft_config.mask_token_id
    if mask_id is None or not 0 <= int(mask_id) < vocab:
        problems.append(f"mask_token_id {mask_id} is not a row of the target's embedding table (vocab {vocab})")
    if problems:
        raise ValueError("The draft does not fit the target:\n  - " + "\n  - ".join(problems))
    if int(draft_config.vocab_size) != vocab:
        logger.warning("Draft vocab_size %s != target vocab_size %s; engines size the shared head from the target.",
                       draft_config.vocab_size, vocab)
    if tokenizer is not None and int(mask_id) < len(tokenizer):
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        if int(mask_id) not in special and int(mask_id) not in added:
            logger.warning(
                "mask_token_id %d is the ordinary token %r of the tokenizer; DFlash expects a reserved/unused id "
                "(Qwen3: 151669, Llama-3: 128002).", mask_id, tokenizer.convert_ids_to_tokens(int(mask_id)),
            )


# ----------------------------------------------------------------------------- locate / load


def resolve_draft_dir(path: PathLike) -> Path:
    """The directory holding the draft's config.json: the path itself, `<path>/draft`,
    `<run>/final/draft`, or the latest `<run>/checkpoints/step_N/draft` (the trainer's layout)."""
    from nemo_dflash.train.checkpoint import COMPLETE, DRAFT_DIR, STEP_PREFIX, checkpoint_root, final_draft_dir

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"Draft path {p} does not exist")
    if p.is_file():
        raise ValueError(f"Draft path {p} is a file; pass the directory that holds config.json and {WEIGHTS_NAME}")
    for cand in (p, p / DRAFT_DIR, final_draft_dir(p)):
        if (cand / CONFIG_NAME).is_file():
            return cand
    steps = sorted(
        (d for d in checkpoint_root(p).glob(f"{STEP_PREFIX}*") if (d / DRAFT_DIR / CONFIG_NAME).is_file()),
        key=lambda d: int(d.name.split("_")[-1]) if d.name.split("_")[-1].isdigit() else -1,
    )
    complete = [d for d in steps if (d / COMPLETE).is_file()]  # the trainer marks finished checkpoints
    steps = complete or steps
    if steps:
        logger.info("Using the latest checkpoint %s", steps[-1])
        return steps[-1] / DRAFT_DIR
    raise FileNotFoundError(
        f"No {CONFIG_NAME} in {p}, {p}/{DRAFT_DIR}, {final_draft_dir(p)} or {checkpoint_root(p)}/{STEP_PREFIX}*/"
        f"{DRAFT_DIR}: pass an exported draft, a training draft dir (save_pretrained) or a checkpoint dir containing "
        f"{DRAFT_DIR}/."
    )


def _weight_files(d: Path) -> list[Path]:
    if (d / WEIGHTS_NAME).is_file():
        return [d / WEIGHTS_NAME]
    if (d / WEIGHTS_INDEX_NAME).is_file():
        index = json.loads((d / WEIGHTS_INDEX_NAME).read_text())
        files = sorted(set(index.get("weight_map", {}).values()))
        missing = [f for f in files if not (d / f).is_file()]
        if not files or missing:
            raise FileNotFoundError(f"{d / WEIGHTS_INDEX_NAME} lists missing shards {missing or '(none listed)'}")
        return [d / f for f in files]
    if any(d.glob("*.bin")) or any(d.glob("*.pt")):
        raise ValueError(
            f"{d} holds only pickle weights (.bin/.pt), which are never loaded here: save the draft with "
            "`save_pretrained(dir)` (safetensors)."
        )
    raise FileNotFoundError(f"{d} has {CONFIG_NAME} but no {WEIGHTS_NAME}")


def _read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def load_draft(
    path: PathLike, device: Union[str, torch.device] = "cpu", dtype: Union[str, torch.dtype, None] = None
) -> DFlashDraftModel:
    """Load a DFlash draft from an exported dir, a training draft dir or a checkpoint root.

    `dtype=None` keeps the stored dtype (bf16 for exports, fp32 for training checkpoints).
    Names and shapes are checked against the serving contract first, so a mismatched
    checkpoint fails with a message instead of a half-loaded model.
    """
    from nemo_dflash.loading import resolve_dtype

    d = resolve_draft_dir(path)
    try:
        raw = json.loads((d / CONFIG_NAME).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{d / CONFIG_NAME} is not valid JSON: {e}") from None
    config = draft_config_from_dict(raw, source=str(d / CONFIG_NAME))
    tensors = _read_safetensors(_weight_files(d))
    shared = sorted(k for k in tensors if _SHARED_WITH_TARGET.match(k))
    if shared:
        logger.warning("Ignoring %s in %s: the draft uses the target's embeddings and lm_head.", shared, d)
        for k in shared:
            tensors.pop(k)
    validate_serving_weights({k: tuple(v.shape) for k, v in tensors.items()}, config, source=f"Weights in {d}")
    with torch.device("meta"):
        model = DFlashDraftModel(config)
    model.load_state_dict(tensors, strict=True, assign=True)
    target_dtype = resolve_dtype(dtype) if dtype is not None else None
    model = model.to(device=device, dtype=target_dtype) if target_dtype is not None else model.to(device)
    return model.eval()


# ----------------------------------------------------------------------------- export


def _atomic_write_dir(out: Path, files: dict[str, Any], overwrite: bool) -> None:
    """Write into a temp dir next to `out`, then rename it into place."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty: choose another --out or pass --overwrite")
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
    draft: Union[DFlashDraftModel, PathLike], out_dir: PathLike, *, overwrite: bool = False
) -> Path:
    """Write `draft` (a model, or any path `load_draft` accepts) as a serving checkpoint.

    The output holds exactly `config.json` and a bf16 `model.safetensors` whose key set has
    been checked against the contract. Nothing is written on a validation error, and an
    existing non-empty `out_dir` is only replaced with `overwrite=True`.
    """
    if not isinstance(draft, DFlashDraftModel):
        draft = load_draft(draft)
    config = draft.config
    cfg = serving_config_dict(config)
    state = {k: v.detach().to(device="cpu", dtype=SERVING_DTYPE).contiguous() for k, v in draft.state_dict().items()}
    validate_serving_weights({k: tuple(v.shape) for k, v in state.items()}, config, source="The draft's weights")
    out = Path(out_dir)

    def write_config(p: Path) -> None:
        p.write_text(json.dumps(cfg, indent=2) + "\n")

    def write_weights(p: Path) -> None:
        save_file(state, str(p), metadata={"format": "pt"})

    _atomic_write_dir(out, {CONFIG_NAME: write_config, WEIGHTS_NAME: write_weights}, overwrite)
    n = sum(v.numel() for v in state.values())
    logger.info("Exported %d tensors (%.1fM params, bf16) to %s", len(state), n / 1e6, out)
    return out


__all__ = [
    "SERVING_CONFIG_KEYS",
    "check_draft_fits_target",
    "draft_config_from_dict",
    "export_draft",
    "load_draft",
    "resolve_draft_dir",
    "serving_config_dict",
    "serving_weight_shapes",
    "validate_serving_weights",
]
