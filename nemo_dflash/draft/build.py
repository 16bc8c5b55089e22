"""Make a draft for a target: build a fresh one, load a stored one, check that it fits.

The one module that turns a target (and a recipe's `draft:` section, or a draft directory) into
a `DFlashDraftModel`, so training, evaluation, export and inference all get drafts the same way:

- `build_draft_for_target`: a fresh draft shaped like the target, classes from the registry;
- `load_draft` / `load_draft_for_target`: a stored draft (exported, training or published
  DFlash-style), names and shapes checked against the serving contract before anything loads;
- `draft_for_recipe`: what the trainer calls (`draft.init_from` loads, otherwise builds);
- `check_draft_fits_target`, `check_mask_token_id` and (in `target/hooks.py`) `check_target_layer_ids`:
  the only checks of the draft/target contract, called by every path above.

The weight names and shapes of the serving contract live here too, since loading reads them;
`nemo_dflash.serving.export` only writes that format (and re-exports these names for old imports).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union

import torch
from safetensors import safe_open

from nemo_dflash.draft.model import DFlash2Config, DFlashConfig, DFlashDraftModel
from nemo_dflash.draft.registry import (
    DFLASH_DRAFT_REGISTRY, DRAFT_VARIANTS, DraftSpec, draft_kind, resolve_dflash_draft_spec, resolve_draft_variant,
    variant_of,
)
from nemo_dflash.files import COMPLETE, DRAFT_DIR, STEP_PREFIX, checkpoint_root, final_draft_dir
from nemo_dflash.target import LayerIdsError, build_target_layer_ids, check_target_layer_ids

if TYPE_CHECKING:
    from nemo_dflash.config import DraftConfig

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"

# Vocabulary rows that exist only to pad or reserve the table: never produced by the tokenizer on text.
_PLACEHOLDER = re.compile(r"^(\[PAD\d+\]|<\|?(reserved|unused|extra)[\w-]*\|?>|<unused\d+>|\[unused\d+\])$", re.IGNORECASE)

# Weights a published checkpoint may carry that the engines (and we) take from the target.
_SHARED_WITH_TARGET = re.compile(r"^(model\.)?(embed_tokens|lm_head)\.weight$")

# dflash_config options of other DFlash-family variants that this architecture does not have.
_UNSUPPORTED_VARIANT_FLAGS = ("causal", "use_swa", "sample_from_anchor", "attention_sink_bias")


class DraftError(ValueError):
    """A draft that cannot be built, loaded or used with this target: the user's to fix (one line)."""


class MaskTokenError(DraftError):
    """A mask token the user must fix in the recipe (one line, names the key)."""


# ----------------------------------------------------------------------------- the checks


def check_mask_token_id(mask_id: Optional[int], vocab: Optional[int] = None, source: str = "mask_token_id") -> int:
    """The one check of a mask token: set and, given the target's ``vocab``, a row of its embedding
    table (the mask embedding IS that row; a wrong id silently ruins acceptance)."""
    if mask_id is None:
        raise MaskTokenError(f"no mask_token_id (in {source}): give the draft a mask token (e.g. 151669 for Qwen3, "
                             "128002 for Llama-3), an id the chat data never uses")
    if int(mask_id) < 0 or (vocab is not None and int(mask_id) >= vocab):
        raise MaskTokenError(
            f"mask_token_id {mask_id} (from {source}) is not a row of the target's embedding table "
            f"[0, {vocab}): set draft.mask_token_id to a valid row (a reserved/unused special token)"
        )
    return int(mask_id)


def _refusal(check: Callable[[], Any], error: type[Exception]) -> list[str]:
    """`check`'s refusal as a one-line list (empty when it passes): the fit check lists every problem at once
    rather than stopping at the first."""
    try:
        check()
    except error as e:
        return [str(e)]
    return []


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
    problems += _refusal(lambda: check_target_layer_ids(draft_config.target_layer_ids, depth), LayerIdsError)
    if int(draft_config.num_target_layers) != depth:
        problems.append(
            f"num_target_layers {draft_config.num_target_layers} != the target's num_hidden_layers {depth}: "
            "this draft was trained for a different target"
        )
    mask_id = draft_config.mask_token_id
    problems += _refusal(lambda: check_mask_token_id(mask_id, vocab, source="the draft's dflash_config"),
                         MaskTokenError)
    if int(draft_config.vocab_size) != vocab:
        problems.append(
            f"draft vocab_size {draft_config.vocab_size} != target vocab_size {vocab} (the draft was trained on "
            "another target's token table): evaluate or serve it with the target it was trained for"
        )
    if problems:
        raise DraftError("The draft does not fit the target:\n  - " + "\n  - ".join(problems))
    if tokenizer is not None and int(mask_id) < len(tokenizer):
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        if int(mask_id) not in special and int(mask_id) not in added:
            logger.warning(
                "mask_token_id %d is the ordinary token %r of the tokenizer; DFlash expects a reserved/unused id "
                "(Qwen3: 151669, Llama-3: 128002).", mask_id, tokenizer.convert_ids_to_tokens(int(mask_id)),
            )


# ----------------------------------------------------------------------------- build


def placeholder_token_id(tokenizer: Any, vocab: int) -> Optional[int]:
    """The first never-used placeholder row (``[PAD151643]``, ``<|reserved_special_token_0|>``,
    ``<unused0>``) of ``tokenizer`` below ``vocab``: a safe mask token where the tokenizer fills the table."""
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return None
    found = [i for t, i in tokenizer.get_vocab().items() if i < vocab and _PLACEHOLDER.match(t)]
    return min(found) if found else None


def target_vocab_size(target_model: torch.nn.Module) -> int:
    """Rows of the embedding table the draft shares (may exceed the tokenizer's vocabulary)."""
    return int(target_model.get_input_embeddings().weight.shape[0])


def _meant_for(spec: str, archs: list[str], vocab: int) -> bool:
    """``spec`` is ``ARCH`` or ``ARCH/VOCAB`` (the target the id was chosen for)."""
    arch, _, size = spec.partition("/")
    return arch in archs and (not size or int(size) == vocab)


def resolve_mask_token_id(
    target_model: torch.nn.Module, tokenizer: Any, explicit: Optional[int] = None, explicit_for: Optional[str] = None
) -> int:
    """explicit id > tokenizer's mask token > the family's documented default > first row past the
    tokenizer > the first placeholder row ([PADn], reserved, unused) inside the tokenizer.

    An explicit id given ``explicit_for`` another target (``ARCH`` or ``ARCH/VOCAB``) is ignored:
    a recipe reused for another family must not carry its id over. The id must index the target's embedding table (the mask
    embedding IS that row); a wrong id silently ruins acceptance, so every choice is logged.
    """
    vocab = target_vocab_size(target_model)
    archs = getattr(target_model.config, "architectures", None) or [type(target_model).__name__]
    source, mask_id = "", None
    if explicit is not None and explicit_for and not _meant_for(explicit_for, archs, vocab):
        logger.warning("draft.mask_token_id %s was set for %s, not for this %s (vocab %d) target: resolving this "
                       "target's own", explicit, explicit_for, archs[0], vocab)
        explicit = None
    if explicit is not None:
        source, mask_id = "draft.mask_token_id", int(explicit)
    elif tokenizer is not None and getattr(tokenizer, "mask_token_id", None) is not None:
        source, mask_id = f"the tokenizer's mask token {tokenizer.mask_token!r}", int(tokenizer.mask_token_id)
    else:
        spec = resolve_dflash_draft_spec(archs)
        if spec.default_mask_token_id is not None and spec.default_mask_token_id < vocab:
            source, mask_id = f"the {archs[0]} default", spec.default_mask_token_id
        elif tokenizer is not None and len(tokenizer) < vocab:
            source, mask_id = "the first embedding row past the tokenizer", len(tokenizer)
        elif (placeholder := placeholder_token_id(tokenizer, vocab)) is not None:
            source, mask_id = f"the placeholder row {tokenizer.convert_ids_to_tokens(placeholder)!r}", placeholder
    if mask_id is None:
        raise MaskTokenError(
            f"No mask token for this target ({archs[0]}, vocab {vocab}): the tokenizer has no mask token and "
            "every embedding row is a real token. Set draft.mask_token_id to an id the chat data never uses "
            "(e.g. a reserved or unused special token)."
        )
    check_mask_token_id(mask_id, vocab, source)
    logger.info("Mask token id %d (from %s)", mask_id, source)
    return mask_id


def _architectures(config: Any, fallback: str) -> list[str]:
    """The config's `architectures`; a config saved without them (by `PretrainedConfig.save_pretrained` alone)
    names its causal-LM class through transformers' model-type table, else `fallback`."""
    archs = getattr(config, "architectures", None)
    if archs:
        return list(archs)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None))
    return [name] if isinstance(name, str) else [fallback]


def build_draft_for_target(
    target_model: torch.nn.Module,
    tokenizer: Any,
    *,
    num_layers: int,
    block_size: int,
    target_layer_ids: Optional[list[int]] = None,
    mask_token_id: Optional[int] = None,
    intermediate_size: Optional[int] = None,
    mask_token_for: Optional[str] = None,
    kind: str = "dflash",
    variant_options: Optional[Mapping[str, Any]] = None,
) -> DFlashDraftModel:
    """A fresh (randomly initialised, fp32) draft shaped like `target_model`: the family's registry classes for
    DFlash-1 (`kind="dflash"`), the variant's for another kind, its sizes from `variant_options` (the recipe's
    `draft.<kind>` section)."""
    tcfg = getattr(target_model.config, "text_config", None) or target_model.config
    spec = resolve_dflash_draft_spec(_architectures(target_model.config, type(target_model).__name__))
    try:
        variant = resolve_draft_variant(kind)
    except ValueError as e:
        raise DraftError(str(e)) from None
    config_cls, draft_cls = (spec.config_cls, spec.draft_cls) if kind == "dflash" else (variant.config_cls,
                                                                                        variant.draft_cls)
    n_target = int(tcfg.num_hidden_layers)
    if target_layer_ids:
        ids = check_target_layer_ids(target_layer_ids, n_target, key="draft.target_layer_ids")
    else:
        try:
            ids = build_target_layer_ids(n_target, num_layers)
        except ValueError:  # a target read only now (a .gguf): one line naming the key
            raise LayerIdsError(f"draft.num_layers={num_layers}: the draft fuses that many distinct layers of the "
                                f"target, which has {n_target}: give draft.num_layers <= {n_target}, or set "
                                "draft.target_layer_ids") from None
    overrides = {"intermediate_size": intermediate_size} if intermediate_size else {}
    try:
        cfg: DFlashConfig = config_cls.from_target_config(
            tcfg,
            num_hidden_layers=num_layers,
            block_size=block_size,
            mask_token_id=resolve_mask_token_id(target_model, tokenizer, mask_token_id, mask_token_for),
            target_layer_ids=ids,
            dflash_extra=dict(variant_options or {}) if kind != "dflash" else None,
            **overrides,
        )
    except ValueError as e:  # a variant's sizes that do not fit this target (a group size that does not divide)
        if isinstance(e, DraftError):
            raise
        raise DraftError(str(e)) from None
    return draft_cls(cfg).float()


def draft_for_recipe(draft_cfg: "DraftConfig", target_model: torch.nn.Module, tokenizer: Any) -> DFlashDraftModel:
    """The trainer's draft (fp32, CPU): `draft.init_from` loaded and checked against the target, else built."""
    if draft_cfg.init_from:
        check_draft_kind(draft_cfg.init_from, draft_cfg.kind, "draft.init_from")
        return load_draft_for_target(draft_cfg.init_from, target_model.config, tokenizer, device="cpu",
                                     dtype=torch.float32)
    variant = resolve_draft_variant(draft_cfg.kind)
    options = asdict(getattr(draft_cfg, variant.options)) if variant.options else None
    return build_draft_for_target(
        target_model,
        tokenizer,
        num_layers=draft_cfg.num_layers,
        block_size=draft_cfg.block_size,
        target_layer_ids=draft_cfg.target_layer_ids,
        mask_token_id=draft_cfg.mask_token_id,
        intermediate_size=draft_cfg.intermediate_size,
        mask_token_for=draft_cfg.mask_token_for,
        kind=draft_cfg.kind,
        variant_options=options,
    )


def stored_draft_kind(path: PathLike) -> str:
    """The `draft.kind` of a stored draft, from its config.json's `architectures` (no weights read)."""
    d = resolve_draft_dir(path)
    try:
        raw = json.loads((d / CONFIG_NAME).read_text())
    except json.JSONDecodeError as e:
        raise DraftError(f"{d / CONFIG_NAME} is not valid JSON: {e}") from None
    return variant_of(raw.get("architectures") if isinstance(raw, dict) else None)


def check_draft_kind(path: PathLike, kind: str, what: str) -> None:
    """A stored draft is only continued as the variant it is (a DFlash2 draft resumed as DFlash-1 would drop its
    selector; the reverse would start one from nothing): one line naming the key to set."""
    stored = stored_draft_kind(path)
    if stored != kind:
        raise DraftError(f"{what}={path} is a {stored} draft but draft.kind={kind}: set draft.kind={stored} "
                         f"(or start from a {kind} draft)")


def check_variant_fits(kind: str, options: Optional[Mapping[str, Any]], hidden_size: int, vocab_size: int,
                       block_size: int) -> None:
    """The variant's sizes against the target's hidden size and vocabulary, from its config alone (before any
    model loads): DraftError naming the key."""
    if kind != "dflash2":
        return
    from nemo_dflash.draft.model.dflash2 import check_dflash2_fields

    try:
        check_dflash2_fields(hidden_size, vocab_size, block_size, dict(options or {}))
    except ValueError as e:
        raise DraftError(str(e)) from None


# ----------------------------------------------------------------------------- the serving contract (read side)


def serving_weight_shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every weight name of the serving contract and its shape, for a given draft config (DFlash2's conv and
    selector tensors too, named as the engines' DFlash2 loaders read them)."""
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
        if isinstance(config, DFlash2Config) and config.conv_kernel_size:
            kc, groups = config.conv_kernel_size, h // config.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"{p}{conv}.base_kernel"] = (2, kc, h)
                shapes[f"{p}{conv}.kernel_projection.weight"] = (2 * kc * groups, h)
    if isinstance(config, DFlash2Config) and config.selector_rank:
        r, v = config.selector_rank, config.vocab_size
        shapes.update({
            "candidate_selector.hidden_projection.weight": (r, h),
            "candidate_selector.predecessor_codebook": (v, r),
            "candidate_selector.successor_codebook": (v, r),
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
        raise DraftError(f"{source} do not match the DFlash serving contract:\n  - " + "\n  - ".join(problems))


def _preview(names: list[str], n: int = 5) -> str:
    return ", ".join(repr(x) for x in names[:n]) + (f" ... ({len(names)} in all)" if len(names) > n else "")


def draft_config_from_dict(
    raw: Mapping[str, Any], source: str = "config.json", config_cls: type[DFlashConfig] = DFlashConfig
) -> DFlashConfig:
    """A draft config (the registry's ``config_cls``) from an exported, training or published-DFlash-style dict."""
    d = dict(raw)
    archs = d.get("architectures") or []
    kind = variant_of(archs)
    if kind != "dflash":  # a variant's stored config: its own classes, whatever the family's are
        config_cls = DRAFT_VARIANTS[kind].config_cls
    drafts = {config_cls.__name__, *(spec.draft_cls.__name__ for spec in DFLASH_DRAFT_REGISTRY.values()),
              *(v.architecture for v in DRAFT_VARIANTS.values())}
    if archs and not any("DFlash" in a or a in drafts for a in archs):  # save_pretrained writes the class name
        raise DraftError(
            f"{source} describes {archs}, not a DFlash draft: pass the draft directory (the one whose "
            "config.json says \"architectures\": [\"DFlashDraftModel\"]), not the target."
        )
    dflash = dict(d.pop("dflash_config", None) or {})
    on = [f for f in _UNSUPPORTED_VARIANT_FLAGS if dflash.get(f)]
    if on:
        raise DraftError(f"{source}: dflash_config enables {on}, a DFlash variant this loader does not implement.")
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
        raise DraftError(f"{source} lacks {missing}: a DFlash draft config needs them (see docs/serve.md).")
    if target_hidden is not None and int(target_hidden) != int(d["hidden_size"]):
        raise DraftError(
            f"{source}: target_hidden_size {target_hidden} != hidden_size {d['hidden_size']}; this draft "
            "architecture requires the draft and target hidden sizes to match."
        )
    for k in ("model_type", "auto_map", "transformers_version", "_name_or_path", "draft_vocab_size",
              "eagle_aux_hidden_state_layer_ids", "has_embed_tokens", "has_lm_head"):
        d.pop(k, None)
    d["architectures"] = [DRAFT_VARIANTS[kind].architecture]
    check_target_layer_ids(layer_ids, key=f"{source}: dflash_config.target_layer_ids")
    # a variant keeps its own dflash_config fields (DFlash2's sizes); DFlash-1 keeps the two it has
    extra = {k: v for k, v in dflash.items() if k not in ("mask_token_id", "target_layer_ids", "block_size")
             and k not in _UNSUPPORTED_VARIANT_FLAGS} if kind != "dflash" else {}
    try:
        return config_cls(
            block_size=int(block_size),
            num_target_layers=int(num_target_layers),
            dflash_config={**extra, "mask_token_id": int(mask_id), "target_layer_ids": [int(i) for i in layer_ids]},
            **d,
        )
    except ValueError as e:
        if isinstance(e, DraftError):
            raise
        raise DraftError(f"{source}: {e}") from None


# ----------------------------------------------------------------------------- locate / load


def resolve_draft_dir(path: PathLike) -> Path:
    """The directory holding the draft's config.json: the path itself, `<path>/draft`,
    `<run>/final/draft`, or the latest `<run>/checkpoints/step_N/draft` (the trainer's layout)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"Draft path {p} does not exist")
    if p.is_file():
        raise DraftError(f"Draft path {p} is a file; pass the directory that holds config.json and {WEIGHTS_NAME}")
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
        root = d.resolve()
        outside = [f for f in files if not isinstance(f, str) or root not in (d / f).resolve().parents]
        if outside:  # `../x`, an absolute path, a link out: a draft reads only its own directory's files
            raise DraftError(f"{d / WEIGHTS_INDEX_NAME} names shards outside {d} ({outside[0]!r}): a draft's index "
                             "may only name files in its own directory; re-save the draft")
        missing = [f for f in files if not (d / f).is_file()]
        if not files or missing:
            raise FileNotFoundError(f"{d / WEIGHTS_INDEX_NAME} lists missing shards {missing or '(none listed)'}")
        return [d / f for f in files]
    if any(d.glob("*.bin")) or any(d.glob("*.pt")):
        raise DraftError(
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


def draft_weights_sha256(path: PathLike) -> str:
    """A content hash of a stored draft's weight files (names and bytes): what an evaluation's answers
    are keyed on, so new weights at an old path are never mistaken for the old ones."""
    import hashlib

    h = hashlib.sha256()
    for f in _weight_files(resolve_draft_dir(path)):
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(16 << 20):
                h.update(chunk)
    return h.hexdigest()


def check_draft_weights(path: PathLike, allow_nonfinite: bool = False, flag: str = "--draft") -> None:
    """Every weight of a stored draft read once, before any target loads: a file cut short (a partial copy, a
    full disk) is one line instead of a `SafetensorError` after the target has loaded, and NaN or inf weights
    (a diverged training) are refused unless ``allow_nonfinite``: measuring them yields figures of nothing."""
    from safetensors import SafetensorError, safe_open

    d = resolve_draft_dir(path)
    for f in _weight_files(d):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    t = st.get_tensor(name)
                    if not allow_nonfinite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        raise DraftError(f"{flag} {path}: weight {name} in {f} holds NaN or inf (a diverged "
                                         "training): evaluate an earlier checkpoint, or pass --allow-nonfinite to "
                                         "measure it anyway")
        except SafetensorError as e:
            raise DraftError(f"{flag} {path}: {f} cannot be read ({e}): it is cut short or damaged; export or copy "
                             "the draft again") from None


def load_draft_config(path: PathLike, config_cls: type[DFlashConfig] = DFlashConfig) -> DFlashConfig:
    """A stored draft's config alone (no weights read): enough to check it against a target first."""
    d = resolve_draft_dir(path)
    try:
        raw = json.loads((d / CONFIG_NAME).read_text())
    except json.JSONDecodeError as e:
        raise DraftError(f"{d / CONFIG_NAME} is not valid JSON: {e}") from None
    return draft_config_from_dict(raw, source=str(d / CONFIG_NAME), config_cls=config_cls)


def load_draft(
    path: PathLike,
    device: Union[str, torch.device] = "cpu",
    dtype: Union[str, torch.dtype, None] = None,
    *,
    architectures: Optional[Sequence[str]] = None,
) -> DFlashDraftModel:
    """Load a DFlash draft from an exported dir, a training draft dir or a checkpoint root.

    `architectures` (the target's HF `architectures`) picks the registry's `draft_cls` and
    `config_cls` for that family, as building does; without it the stock classes are used
    (export needs no target). `dtype=None` keeps the stored dtype (bf16 for exports, fp32 for
    training checkpoints). Names and shapes are checked against the serving contract first, so
    a mismatched checkpoint fails with a message instead of a half-loaded model.
    """
    from nemo_dflash.target.loading import resolve_dtype

    spec = resolve_dflash_draft_spec(architectures) if architectures else DraftSpec()
    d = resolve_draft_dir(path)
    config = load_draft_config(d, config_cls=spec.config_cls)
    kind = draft_kind(config)
    draft_cls = spec.draft_cls if kind == "dflash" else DRAFT_VARIANTS[kind].draft_cls
    tensors = _read_safetensors(_weight_files(d))
    shared = sorted(k for k in tensors if _SHARED_WITH_TARGET.match(k))
    if shared:
        logger.warning("Ignoring %s in %s: the draft uses the target's embeddings and lm_head.", shared, d)
        for k in shared:
            tensors.pop(k)
    validate_serving_weights({k: tuple(v.shape) for k, v in tensors.items()}, config, source=f"Weights in {d}")
    with torch.device("meta"):
        model = draft_cls(config)
    model.load_state_dict(tensors, strict=True, assign=True)
    target_dtype = resolve_dtype(dtype) if dtype is not None else None
    model = model.to(device=device, dtype=target_dtype) if target_dtype is not None else model.to(device)
    return model.eval()


def load_draft_for_target(
    path: PathLike,
    target_config: Any,
    tokenizer: Any = None,
    *,
    device: Union[str, torch.device] = "cpu",
    dtype: Union[str, torch.dtype, None] = None,
) -> DFlashDraftModel:
    """A stored draft for this target: the family's registry classes, checked to fit before use."""
    draft = load_draft(path, device=device, dtype=dtype,
                       architectures=_architectures(target_config, type(target_config).__name__))
    check_draft_fits_target(draft.config, target_config, tokenizer)
    return draft


__all__ = [
    "CONFIG_NAME", "DraftError", "MaskTokenError", "WEIGHTS_INDEX_NAME", "WEIGHTS_NAME", "build_draft_for_target",
    "check_draft_weights",
    "check_draft_fits_target", "check_draft_kind", "check_variant_fits", "stored_draft_kind", "check_mask_token_id", "check_target_layer_ids", "draft_config_from_dict",
    "draft_for_recipe", "draft_weights_sha256", "load_draft", "load_draft_config", "load_draft_for_target", "placeholder_token_id", "resolve_draft_dir",
    "resolve_mask_token_id", "serving_weight_shapes", "target_vocab_size", "validate_serving_weights",
]
