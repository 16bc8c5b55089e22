"""Build a draft for a given target: registry lookup, mask token, layer ids, shape."""

from __future__ import annotations

import logging
import re
from typing import Any, Optional

import torch

from nemo_dflash.model import DFlashConfig, DFlashDraftModel
from nemo_dflash.registry import build_target_layer_ids, resolve_dflash_draft_spec

logger = logging.getLogger(__name__)

# Vocabulary rows that exist only to pad or reserve the table: never produced by the tokenizer on text.
_PLACEHOLDER = re.compile(r"^(\[PAD\d+\]|<\|?(reserved|unused|extra)[\w-]*\|?>|<unused\d+>|\[unused\d+\])$", re.IGNORECASE)


class MaskTokenError(ValueError):
    """A mask token the user must fix in the recipe (one line, names the key)."""


def placeholder_token_id(tokenizer: Any, vocab: int) -> Optional[int]:
    """The first never-used placeholder row (``[PAD151643]``, ``<|reserved_special_token_0|>``,
    ``<unused0>``) of ``tokenizer`` below ``vocab``: a safe mask token where the tokenizer fills the table."""
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return None
    found = [i for t, i in tokenizer.get_vocab().items() if i < vocab and _PLACEHOLDER.match(t)]
    return min(found) if found else None


def target_vocab_size(target_model: torch.nn.Module) -> int:
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
    if not 0 <= mask_id < vocab:
        raise MaskTokenError(
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
    mask_token_for: Optional[str] = None,
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
        mask_token_id=resolve_mask_token_id(target_model, tokenizer, mask_token_id, mask_token_for),
        target_layer_ids=ids,
        **overrides,
    )
    return spec.draft_cls(cfg).float()


__all__ = ["MaskTokenError", "build_draft_for_target", "placeholder_token_id", "resolve_mask_token_id",
           "target_vocab_size"]
