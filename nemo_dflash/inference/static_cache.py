"""Fixed-shape caches and attention masks for the static ("graphs") decoding path.

A CUDA graph replays the same kernels on the same addresses, so nothing in a captured step may
change shape: the target keeps HF's `StaticCache` (preallocated K/V, written in place) and the
draft a preallocated context cache, both indexed by absolute position. Rolling back rejected
draft tokens is then free: they stay in the buffers, hidden by the masks below (a key at
position j is visible to a query at position p iff j <= p for the target, j < p for the
draft's context), and the next step overwrites them. The same code runs eagerly on CPU, which
is how its exactness is tested without a GPU.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import StaticCache

# Target attention implementations whose masks we can build: SDPA takes a boolean mask
# (True = visible), HF's eager attention adds a float mask.
SUPPORTED_ATTN = ("sdpa", "eager")


def attn_implementation(model: nn.Module) -> str:
    return str(getattr(model.config, "_attn_implementation", None) or "eager")


def visible_to_mask(visible: torch.Tensor, attn_impl: str, dtype: torch.dtype) -> torch.Tensor:
    """Boolean visibility [..., Q, K] -> the 4D mask HF passes straight to its attention
    (a 4D mask skips HF's own mask construction, which is Python work and host syncs)."""
    while visible.dim() < 4:
        visible = visible.unsqueeze(0)
    if attn_impl == "sdpa":
        return visible
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
        ~visible, torch.finfo(dtype).min
    )


def causal_mask(query_positions: torch.Tensor, kv_len: int, attn_impl: str, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, Q, kv_len] mask: key j visible to the query at absolute position p iff j <= p.

    Valid whenever the cache index of a key equals its absolute position (a StaticCache, or a
    DynamicCache that holds the whole sequence so far).
    """
    keys = torch.arange(kv_len, device=query_positions.device)
    return visible_to_mask(keys[None, :] <= query_positions.view(-1, 1), attn_impl, dtype)


def check_static_target(model: nn.Module) -> None:
    """Raise a one-line ValueError if the target cannot run on a StaticCache with our masks."""
    impl = attn_implementation(model)
    if impl not in SUPPORTED_ATTN:
        raise ValueError(
            f"decode='graphs' needs the target's attention to be one of {SUPPORTED_ATTN}, got '{impl}': reload the "
            "target with attn_implementation='sdpa', or use decode='eager'."
        )
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    layer_types = getattr(cfg, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other or (getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None)):
        raise ValueError(
            f"decode='graphs' supports full-attention targets only ({type(model).__name__} has "
            f"{other or ['sliding_window']} layers): use decode='eager'."
        )


def _kv_shape(model: nn.Module) -> tuple[int, int]:
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return heads, int(head_dim)


class TargetStaticCache:
    """HF `StaticCache` for one prompt, plus the one operation speculative decoding needs on
    top of it: set every layer's write position (its `cumulative_length`) from a device tensor,
    in one kernel, so that a captured step writes where the verified sequence ends."""

    def __init__(self, model: nn.Module, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        check_static_target(model)
        self.max_len = int(max_len)
        self.cache = StaticCache(config=model.config, max_cache_len=self.max_len)
        heads, head_dim = _kv_shape(model)
        self.cache.early_initialization(1, heads, head_dim, dtype, device)
        lengths = [getattr(layer, "cumulative_length", None) for layer in self.cache.layers]
        if any(t is None or t.device != device for t in lengths):
            raise ValueError(
                "decode='graphs' needs a transformers StaticCache whose layers track `cumulative_length` on the "
                "device (transformers >= 5): use decode='eager'."
            )
        self._lengths: list[torch.Tensor] = lengths  # type: ignore[assignment]

    def set_length(self, length: torch.Tensor) -> None:
        """Next write at position `length` (a 0-d long tensor on the device); no host sync."""
        torch._foreach_copy_(self._lengths, [length] * len(self._lengths))


class StaticDraftContextCache:
    """`DFlashContextCache`'s interface over preallocated per-layer K/V, index = position.

    The caller sets `write_positions` ([C] long, on the device) before each draft forward; the
    draft's attention writes the new context K/V there and gets the whole buffer back, so its
    shapes never change. Slots at or after the current position hold stale or padding K/V that
    the mask hides.
    """

    def __init__(self, num_layers: int, max_len: int) -> None:
        self.max_len = int(max_len)
        self.keys: list[Optional[torch.Tensor]] = [None] * num_layers
        self.values: list[Optional[torch.Tensor]] = [None] * num_layers
        self.write_positions: Optional[torch.Tensor] = None

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.write_positions is None:
            raise RuntimeError("StaticDraftContextCache.write_positions must be set before the draft forward")
        if self.keys[layer] is None:
            self.keys[layer] = k.new_zeros(k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.values[layer] = v.new_zeros(v.shape[0], v.shape[1], self.max_len, v.shape[3])
        keys, values = self.keys[layer], self.values[layer]
        keys.index_copy_(2, self.write_positions, k)  # type: ignore[union-attr]
        values.index_copy_(2, self.write_positions, v)  # type: ignore[union-attr]
        return keys, values  # type: ignore[return-value]

    def get_seq_length(self) -> int:
        return self.max_len


__all__ = [
    "SUPPORTED_ATTN",
    "StaticDraftContextCache",
    "TargetStaticCache",
    "attn_implementation",
    "causal_mask",
    "check_static_target",
    "visible_to_mask",
]
