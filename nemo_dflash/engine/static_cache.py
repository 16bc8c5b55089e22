"""Fixed-shape caches and attention masks for the static ("graphs") decoding path.

A CUDA graph replays the same kernels on the same addresses, so nothing in a captured step may
change shape: the target keeps HF's `StaticCache` (preallocated K/V, written in place) and the
draft a preallocated context cache, both indexed by absolute position. Rolling back rejected
draft tokens is then free: they stay in the buffers, hidden by the masks below (a key at
position j is visible to a query at position p iff j <= p for the target, j < p for the
draft's context), and the next step overwrites them. The same code runs eagerly on CPU, which
is how its exactness is tested without a GPU.

Both caches write into their whole buffer but hand attention only a view of its first
`view_len` positions (a Python int the caller sets per captured step, so each graph has fixed
shapes): a step early in a long generation then attends over the positions it can see, rounded
up to a bucket, not over every preallocated slot.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import StaticCache

from nemo_dflash.engine.attention import FilledBlocks

# Target attention implementations whose masks we can build: SDPA takes a boolean mask
# (True = visible), HF's eager attention adds a float mask.
SUPPORTED_ATTN = ("sdpa", "eager")
# The grouped-query fold (`EngineOptions.fold_gqa`, on by default): profiled on an H200, SmolLM2 shape (9 query heads
# on 3 K/V heads), 768-position view, HF's copies of every K/V head per query head were 70% of the plain step's GPU
# time at 256 rows; folded, the captured plain step takes 4.3 ms instead of 20.7 and the verify 8.3 instead of 26.7
# (docs/performance.md, `benchmarks/decode.py rows`).
FOLDED_SDPA = "nemo_dflash_folded_sdpa"  # its name in transformers' AttentionInterface
# Filled blocks (`EngineOptions.filled_blocks`, on by default on a GPU, where flex is compiled; eager flex on a CPU
# is slow): on an H200, SmolLM2, regeneration on the engine 22.0k -> 33.3k tokens/s (docs/data.md), and both sides
# of the concurrency table faster (docs/evaluate.md); `--filled-blocks 0|1` of `benchmarks/decode.py` and
# `benchmarks/regen.py` time both.
FILLED_NAME = "nemo_dflash_filled_blocks"  # its name in transformers' AttentionInterface


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


def folded_gqa_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function (q [R, H, Q, D], k/v [R, KVH, L, D], a boolean mask [R or 1, 1, Q, L])
    -> ([R, Q, H, D], None). The H / KVH query heads that share a K/V head become that head's query rows
    ([R, KVH, H/KVH * Q, D], the mask's rows tiled to match), so SDPA reads each K/V head once: the same dot
    products and softmaxes as HF's SDPA, which copies every K/V head per query head when it is given a mask."""
    rows, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    plain = heads == kv_heads or attention_mask is None or dropout
    if plain or kwargs.get("sliding_window") or kwargs.get("s_aux") is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    group = heads // kv_heads
    mask = attention_mask.unsqueeze(2).expand(*attention_mask.shape[:2], group, *attention_mask.shape[2:])
    out = F.scaled_dot_product_attention(query.reshape(rows, kv_heads, group * q_len, dim), key, value,
                                         attn_mask=mask.reshape(*attention_mask.shape[:2], group * q_len, -1),
                                         scale=scaling)
    return out.reshape(rows, heads, q_len, dim).transpose(1, 2).contiguous(), None


FLEX_MIN_HEAD_DIM = 16  # compiled flex_attention's smallest head dimension (inductor refuses less)


def filled_blocks_on(device: torch.device, model: Optional[nn.Module] = None, setting: Optional[bool] = None) -> bool:
    """Whether the engine's captured target steps on `device` read filled blocks only (`EngineOptions.filled_blocks`,
    `setting`, resolved): by default on a GPU, for a target (`model`) whose head dimension compiled flex takes."""
    if setting is not None:
        return bool(setting)
    return device.type == "cuda" and (model is None or _kv_shape(model)[1] >= FLEX_MIN_HEAD_DIM)


_FILLED: list[FilledBlocks] = []  # the step in flight's mask (`engine_attention`)


def filled_blocks_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                            scaling: Optional[float] = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function (q [R, H, Q, D], k/v [R, KVH, L, D], L the whole cache) -> ([R, Q, H, D],
    None): flex_attention over each row's filled blocks (the step's `FilledBlocks`), the H / KVH query heads that
    share a K/V head as that head's query rows (flex decoding reads each K/V block once for them). Layers it cannot
    serve (attention sinks) take `folded_gqa_sdpa` with the step's mask over the whole cache."""
    if kwargs.get("s_aux") is not None or dropout or not _FILLED:
        return folded_gqa_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    rows, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    fb = _FILLED[-1]
    out = fb.flex(query.reshape(rows, kv_heads, heads // kv_heads * q_len, dim), key, value, block_mask=fb.mask,
                  scale=scaling)
    return out.reshape(rows, heads, q_len, dim).transpose(1, 2).contiguous(), None


# Per target: the configs of its attention layers, each with whether its query heads are grouped (one walk).
_ATTN_CONFIGS: "weakref.WeakKeyDictionary[nn.Module, list[tuple[Any, bool]]]" = weakref.WeakKeyDictionary()


def _attention_configs(model: nn.Module) -> list[tuple[Any, bool]]:
    if model not in _ATTN_CONFIGS:  # walked once a model: this wraps every eager step
        from transformers import AttentionInterface

        AttentionInterface.register(FOLDED_SDPA, folded_gqa_sdpa)
        AttentionInterface.register(FILLED_NAME, filled_blocks_attention)
        found = {id(m.config): (m.config, getattr(m, "num_key_value_groups", 1) > 1) for m in model.modules()
                 if hasattr(m, "num_key_value_groups") and hasattr(m, "config")}
        _ATTN_CONFIGS[model] = list(found.values())
    return _ATTN_CONFIGS[model]


def query_groups(model: nn.Module) -> int:
    """Query heads per K/V head of the target."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return int(cfg.num_attention_heads) // _kv_shape(model)[0]


@contextmanager
def engine_attention(model: nn.Module, filled: Optional[FilledBlocks] = None, fold_gqa: bool = True
                     ) -> Iterator[None]:
    """Within: the target's SDPA attention layers run `filled_blocks_attention` over `filled` (a captured step's),
    or else, with `fold_gqa` (`EngineOptions.fold_gqa`), those with grouped-query heads run `folded_gqa_sdpa`
    (configs switched, then restored). A no-op for other attention implementations."""
    if filled is None and not fold_gqa:
        yield
        return
    name = FILLED_NAME if filled is not None else FOLDED_SDPA
    switched = [c for c, grouped in _attention_configs(model)
                if (grouped or filled is not None) and getattr(c, "_attn_implementation", None) == "sdpa"]
    for c in switched:
        c._attn_implementation = name
    if filled is not None:
        _FILLED.append(filled)
    try:
        yield
    finally:
        if filled is not None:
            _FILLED.pop()
        for c in switched:
            c._attn_implementation = "sdpa"


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


def write_at(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             positions: torch.Tensor, rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Write new K/V [R, H, Q, D] into preallocated [R, H, L, D] buffers at absolute positions, in place.

    `positions` is [Q] (every row at the same positions) or [R, Q] (each row at its own: batched
    decoding, rows drifting apart). `rows` ([k] indices) sends a forward of k rows (a batched runner's
    prefill of k prompts) into those rows of the buffers. Returns the buffers as written.
    """
    if rows is not None:
        idx = positions.unsqueeze(0) if positions.dim() == 1 else positions
        keys[rows.view(-1, 1), :, idx] = k.transpose(1, 2)  # [k, Q, H, D]: the advanced indices come first
        values[rows.view(-1, 1), :, idx] = v.transpose(1, 2)
        return keys, values
    if positions.dim() == 2 and positions.shape[0] == 1 == k.shape[0] == keys.shape[0]:
        positions = positions[0]  # one row: index_copy_, a lighter kernel than scatter_ over an expanded index
    if positions.dim() == 1:
        keys.index_copy_(2, positions, k)
        values.index_copy_(2, positions, v)
    else:
        idx = positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        keys.scatter_(2, idx, k)
        values.scatter_(2, idx, v)
    return keys, values


def write_and_view(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor, rows: Optional[torch.Tensor], view_len: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`write_at`, then what attention reads: the buffers' first `view_len` positions (of `rows` only, gathered,
    for a prefill sent to those rows)."""
    write_at(keys, values, k, v, positions, rows)
    keys, values = keys[:, :, :view_len], values[:, :, :view_len]
    return (keys, values) if rows is None else (keys[rows], values[rows])


class TargetStaticCache:
    """HF `StaticCache` (preallocated per-layer K/V) written at explicit positions.

    HF's StaticLayer writes at its own running length (`cumulative_length`, a tensor per layer
    since transformers 5; a `cache_position` argument before), which speculative decoding would
    have to rewind after every verify. Here every layer's `update` writes at `write_positions`,
    a [Q] long tensor the caller sets once per forward (the same for all layers): 2 kernels per
    layer instead of 5, no rewind, and no dependence on how a transformers version counts.
    `update` returns the first `view_len` positions only (default: all); the caller sets it
    with the matching mask length, and must cover every position its queries can see.
    With `batch` rows, `write_positions` may be [rows, Q] (`write_at`), and `rows` ([k] indices) directs
    a forward of k rows into those rows. With `fresh` (prompts prefilled whole, from position 0) attention reads
    the forward's own K/V: nothing before them is visible, so no gather of the rows' buffers.
    """

    def __init__(self, model: nn.Module, max_len: int, device: torch.device, dtype: torch.dtype,
                 batch: int = 1) -> None:
        check_static_target(model)
        self.max_len = int(max_len)
        self.cache = StaticCache(config=model.config, max_cache_len=self.max_len)
        heads, head_dim = _kv_shape(model)
        try:
            self.cache.early_initialization(batch, heads, head_dim, dtype, device)
        except AttributeError as e:  # pragma: no cover - transformers < 5
            raise ValueError(f"decode='graphs' needs transformers >= 5 ({e}): use decode='eager'.") from None
        self.write_positions: Optional[torch.Tensor] = None
        self.rows: Optional[torch.Tensor] = None
        self.view_len = self.max_len
        self.fresh = False  # a prefill of whole prompts: attention reads the forward's own K/V, not the buffers
        for layer in self.cache.layers:
            keys = getattr(layer, "keys", None)
            if not isinstance(keys, torch.Tensor) or tuple(keys.shape) != (batch, heads, self.max_len, head_dim):
                raise ValueError(
                    f"decode='graphs' could not preallocate a StaticCache for {type(model).__name__} "
                    f"(layer keys {getattr(keys, 'shape', None)}): use decode='eager'."
                )
            layer.update = self._writer(layer)  # our cache object: an instance attribute, not a patch of HF's class

    def _writer(self, layer: Any) -> Any:
        def update(key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            if self.fresh:
                write_at(layer.keys, layer.values, key_states, value_states, self.write_positions, self.rows)
                return key_states, value_states
            return write_and_view(layer.keys, layer.values, key_states, value_states, self.write_positions,
                                  self.rows, self.view_len)

        return update


class StaticDraftContextCache:
    """`DFlashContextCache`'s interface over preallocated per-layer K/V, index = position.

    The caller sets `write_positions` ([C] long, on the device) before each draft forward; the
    draft's attention writes the new context K/V there and gets the buffer's first `view_len`
    positions back (a Python int fixed per captured step), so its shapes never change within a
    graph. Slots at or after the current position hold stale or padding K/V that the mask hides.
    `batch` rows (default: the first forward's batch) and `rows` as in `TargetStaticCache`.
    """

    def __init__(self, num_layers: int, max_len: int, batch: Optional[int] = None) -> None:
        self.max_len = int(max_len)
        self.batch = batch
        self.keys: list[Optional[torch.Tensor]] = [None] * num_layers
        self.values: list[Optional[torch.Tensor]] = [None] * num_layers
        self.write_positions: Optional[torch.Tensor] = None
        self.rows: Optional[torch.Tensor] = None
        self.view_len = self.max_len

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.write_positions is None:
            raise RuntimeError("StaticDraftContextCache.write_positions must be set before the draft forward")
        if self.keys[layer] is None:
            rows = self.batch or k.shape[0]
            self.keys[layer] = k.new_zeros(rows, k.shape[1], self.max_len, k.shape[3])
            self.values[layer] = v.new_zeros(rows, v.shape[1], self.max_len, v.shape[3])
        return write_and_view(self.keys[layer], self.values[layer], k, v,  # type: ignore[arg-type]
                              self.write_positions, self.rows, self.view_len)

    def get_seq_length(self) -> int:
        return self.max_len


__all__ = [
    "SUPPORTED_ATTN",
    "StaticDraftContextCache",
    "TargetStaticCache",
    "attn_implementation",
    "causal_mask",
    "check_static_target",
    "FilledBlocks",
    "engine_attention",
    "filled_blocks_attention",
    "filled_blocks_on",
    "query_groups",
    "folded_gqa_sdpa",
    "visible_to_mask",
    "write_at",
]
