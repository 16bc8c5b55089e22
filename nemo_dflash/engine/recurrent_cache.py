"""The target's own KV cache, and rollback for targets with recurrent (linear-attention / SSM) state.

Speculative decoding verifies B tokens in one forward and keeps only a prefix. Attention layers
roll back by cropping their K/V. Layers with a recurrent or conv state (Gated-DeltaNet in
Qwen3.5 / Qwen3-Next, Mamba in Nemotron-H / Jamba / Falcon-H1 ...) hold ONE state that already
folds in every verified token, rejected ones included; cropping cannot undo that
(transformers' `LinearAttentionCacheLayerMixin.is_croppable` is False once a recurrent state
exists).

Rollback chosen here: snapshot the conv + recurrent states before the verify forward; after a
partial acceptance restore the snapshot, crop the attention layers back to the pre-verify
length, and re-advance the target over the kept tokens (one extra forward of n_accepted + 1
tokens, only on steps that rejected something). Why this and not per-position states: it is
correct for every model whose layers use transformers' linear-attention cache layers without
touching the model's kernels (per-position states would need each family's recurrence to emit
intermediate states, which the reference kernels do not), and the snapshot is a copy of
fixed-size tensors, independent of the context length. The cost is the re-advance forward;
folding it into the next verify forward is the cheaper follow-up.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

try:  # transformers >= 5.x with linear-attention cache layers
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
except ImportError:  # pragma: no cover - older transformers: no hybrid targets at all
    LinearAttentionCacheLayerMixin = ()  # type: ignore[assignment,misc]

StateSnapshot = list[tuple[Any, dict[int, torch.Tensor], dict[int, torch.Tensor]]]


def make_target_cache(model: nn.Module) -> Cache:
    """The cache `generate()` would build for this target: `DynamicCache(config=...)` over the
    decoder's text config, so linear-attention / sliding layers get their own layer types.

    Refuses (one line) models whose cache transformers itself does not build as a DynamicCache.
    """
    supports = getattr(type(model), "_supports_default_dynamic_cache", None)
    if callable(supports) and not supports():
        raise ValueError(
            f"{type(model).__name__} keeps a custom cache that speculative decoding cannot roll back; "
            "use a target whose transformers cache is a DynamicCache."
        )
    config = model.config.get_text_config(decoder=True)
    return DynamicCache(config=config)


def has_recurrent_state(cache: Cache) -> bool:
    """Whether any layer of `cache` holds a conv / recurrent state (which cropping cannot undo)."""
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in getattr(cache, "layers", ()))


def model_has_recurrent_layers(model: nn.Module) -> bool:
    """Whether the target's config declares linear-attention / conv / SSM layers."""
    cfg = model.config.get_text_config(decoder=True)
    types = set(getattr(cfg, "layer_types", None) or ())
    recurrent = {"linear_attention", "conv", "mamba", "hybrid", "hybrid_sliding"}
    return bool(types & recurrent) or has_recurrent_state(make_target_cache(model))


def has_windowed_layers(model: nn.Module) -> bool:
    """Whether any attention layer sees a window (sliding / chunked) rather than the full causal past."""
    cfg = model.config.get_text_config(decoder=True)
    types = set(getattr(cfg, "layer_types", None) or ())
    if types & {"sliding_attention", "chunked_attention", "hybrid_sliding"}:
        return True
    return bool(getattr(cfg, "sliding_window", None) or getattr(cfg, "attention_chunk_size", None)) and not types


def snapshot_states(cache: Cache) -> StateSnapshot:
    """Copies of every initialised conv / recurrent state (fixed-size tensors, no K/V)."""
    snap: StateSnapshot = []
    for layer in getattr(cache, "layers", ()):
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        conv = {i: t.clone() for i, t in layer.conv_states.items() if t is not None}
        rec = {i: t.clone() for i, t in layer.recurrent_states.items() if t is not None}
        snap.append((layer, conv, rec))
    return snap


def restore_states(snap: StateSnapshot) -> None:
    """Put the snapshot back in place (copy_, so the cache tensors keep their addresses)."""
    for layer, conv, rec in snap:
        for i, t in conv.items():
            layer.conv_states[i].copy_(t)
        for i, t in rec.items():
            layer.recurrent_states[i].copy_(t)


def attention_length(cache: Cache) -> int:
    """Number of positions held by the cache's attention layers (0 before the prefill)."""
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, DynamicLayer) and getattr(layer, "keys", None) is not None and layer.keys.numel():
            return int(layer.get_seq_length())
    return 0


def crop_attention(cache: Cache, length: int) -> None:
    """Crop the attention K/V of every layer to `length` positions; conv / recurrent states are
    left alone (restore them with `restore_states`)."""
    for layer in getattr(cache, "layers", ()):
        if not isinstance(layer, DynamicLayer) or getattr(layer, "keys", None) is None or not layer.keys.numel():
            continue
        if isinstance(layer, DynamicSlidingWindowLayer):
            current = layer.get_seq_length()
            if length < current:
                DynamicSlidingWindowLayer.crop(layer, length - current)
            continue
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


__all__ = [
    "attention_length",
    "crop_attention",
    "has_recurrent_state",
    "has_windowed_layers",
    "make_target_cache",
    "model_has_recurrent_layers",
    "restore_states",
    "snapshot_states",
]
