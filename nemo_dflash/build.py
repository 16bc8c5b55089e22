"""Build a draft for a given target: registry lookup, mask token, layer ids, shape."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from nemo_dflash.model import DFlashConfig, DFlashDraftModel
from nemo_dflash.registry import build_target_layer_ids, resolve_dflash_draft_spec

logger = logging.getLogger(__name__)


def target_vocab_size(target_model: torch.nn.Module) -> int:
    return int(target_model.get_input_embeddings().weight.shape[0])


def resolve_mask_token_id(
    target_model: torch.nn.Module, tokenizer: Any, explicit: Optional[int] = None
) -> int:
    """explicit id > tokenizer's mask token > the family's documented default > first row past the tokenizer.

    The id must index the target's embedding table (the mask embedding IS that row); a
    wrong id silently ruins acceptance, so every choice is logged.
    """
    vocab = target_vocab_size(target_model)
    archs = getattr(target_model.config, "architectures", None) or [type(target_model).__name__]
    source, mask_id = "", None
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
    if mask_id is None:
        raise ValueError(
            f"No mask token for this target ({archs[0]}, vocab {vocab}): the tokenizer has no mask token and "
            "every embedding row is a real token. Set draft.mask_token_id to an id the chat data never uses "
            "(e.g. a reserved or unused special token)."
        )
    if not 0 <= mask_id < vocab:
        raise ValueError(
            f"Mask token id {mask_id} (from {source}) is outside the target's embedding table [0, {vocab}). "
            "Set draft.mask_token_id to a valid row (a reserved/unused special token)."
        )
    logger.info("Mask token id %d (from %s)", mask_id, source)
    return mask_id


def build_draft_for_target(
    target_model: torch.nn.Module,
    tokenizer: Any,
    *,
    num_layers: int,
    block_size: int,
    target_layer_ids: Optional[list[int]] = None,
    mask_token_id: Optional[int] = None,
    intermediate_size: Optional[int] = None,
) -> DFlashDraftModel:
    """A fresh (randomly initialised, fp32) draft shaped like `target_model`."""
    tcfg = getattr(target_model.config, "text_config", None) or target_model.config
    archs = getattr(target_model.config, "architectures", None) or [type(target_model).__name__]
    spec = resolve_dflash_draft_spec(archs)
    n_target = int(tcfg.num_hidden_layers)
    ids = list(target_layer_ids) if target_layer_ids else build_target_layer_ids(n_target, num_layers)
    bad = [i for i in ids if not 0 <= i < n_target]
    if bad or len(set(ids)) != len(ids):
        raise ValueError(
            f"draft.target_layer_ids {ids} must be distinct 0-based layer ids < {n_target} (the target's depth)"
        )
    overrides = {"intermediate_size": intermediate_size} if intermediate_size else {}
    cfg: DFlashConfig = spec.config_cls.from_target_config(
        tcfg,
        num_hidden_layers=num_layers,
        block_size=block_size,
        mask_token_id=resolve_mask_token_id(target_model, tokenizer, mask_token_id),
        target_layer_ids=ids,
        **overrides,
    )
    return spec.draft_cls(cfg).float()


__all__ = ["build_draft_for_target", "resolve_mask_token_id", "target_vocab_size"]
