"""The slot cache and the attention that reads and writes it, swapped into the target's own forward.

``SlotKVCache`` holds every slot's K/V; ``slot_attention`` is registered with transformers'
``AttentionInterface`` under ``ATTN_NAME`` and, for the forward in flight (``SlotPass``), writes
each new token's K/V into its slot and attends over the slot's filled prefix: a decode pass (one
token per slot; flex decoding on a GPU, SDPA with a length mask elsewhere) or a packed prefill
(``PackedRows``: attention by groups of rows, or one variable-length call). The engine that plans
and launches the passes is ``generation.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

ATTN_NAME = "nemo_dflash_slots"
KV_MEMORY_FRACTION = 0.85  # of the GPU memory free at start: the rest is for prefill activations


@dataclass
class AttentionGroup:
    """One attention group of a packed prefill: ``rows`` rows padded to ``width`` queries each."""

    rows: int
    width: int
    gather: torch.Tensor  # [rows * width] packed token of each padded query (pads: any token of the row)
    real: torch.Tensor  # [real tokens] the padded positions of the group's real tokens, in packed order
    slots: Optional[torch.Tensor] = None  # [rows] continuing rows: their slots (keys come from the cache)
    mask: Optional[torch.Tensor] = None  # [rows, 1, width, span] continuing rows: key k visible to query q


@dataclass
class VarlenRows:
    """A packed prefill's attention as one variable-length call: row r's queries are packed tokens
    ``cu_q[r]:cu_q[r+1]`` and its keys, gathered from its slot, are positions 0.. of ``kv_slot`` /
    ``kv_pos`` entries ``cu_k[r]:cu_k[r+1]`` (its prefix, then its new tokens): causal aligned at
    the end (query i of a row of q queries and k keys sees keys 0..k-q+i)."""

    kv_slot: torch.Tensor  # [keys] slot of each gathered key
    kv_pos: torch.Tensor  # [keys] its position in the slot
    cu_q: torch.Tensor  # [rows + 1] int32
    cu_k: torch.Tensor  # [rows + 1] int32
    max_q: int
    max_k: int


@dataclass
class PackedRows:
    """Where a packed prefill's tokens go: token t of the row is slot ``slot[t]`` position ``pos[t]``;
    the groups cover the tokens in order (or ``varlen`` attends over every row in one call)."""

    slot: torch.Tensor
    pos: torch.Tensor
    groups: list[AttentionGroup]
    varlen: Optional[VarlenRows] = None


@dataclass
class SlotPass:
    """What the swapped-in attention needs to know about the forward in flight."""

    cache: "SlotKVCache"
    decode: bool  # one token per slot at position ``lengths[slot]``; else a packed prefill (``packed``)
    block_mask: Any = None  # flex BlockMask of a decode pass on GPU
    kv_mask: Optional[torch.Tensor] = None  # [S, 1, 1, T] bool of a decode pass without flex
    packed: Optional[PackedRows] = None  # a prefill: one row of every prompt's tokens


def heads_for_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """(key, value, enable_gqa) for a prefill's SDPA call. On CUDA every query head gets its own
    K/V: a GQA call there may fall to the math kernel once cuDNN is excluded (nemo_dflash.attention)."""
    gqa = query.shape[1] != key.shape[1]
    if gqa and query.is_cuda:
        group = query.shape[1] // key.shape[1]
        return key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1), False
    return key, value, gqa


def slot_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    slot_pass: Optional[SlotPass] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: q [R, H, S, D], k/v [R, KVH, S, D] -> ([R, S, H, D], None).
    A decode pass (S = 1, one row per slot) or a packed prefill (R = 1, every prompt's tokens)."""
    if slot_pass is None:
        raise RuntimeError(f"attention '{ATTN_NAME}' runs only inside SlotEngine")
    cache, layer = slot_pass.cache, module.layer_idx
    if slot_pass.packed is not None:
        return packed_attention(cache.k[layer], cache.v[layer], slot_pass.packed, query, key, value, scaling), None
    if not slot_pass.decode:
        raise RuntimeError("a prefill pass needs its packed rows")
    rows = torch.arange(key.shape[0], device=key.device)
    cache.k[layer][rows, :, cache.lengths] = key[:, :, 0]
    cache.v[layer][rows, :, cache.lengths] = value[:, :, 0]
    k_all, v_all = cache.k[layer], cache.v[layer]  # the whole cache, no copy: the mask bounds each slot
    if slot_pass.block_mask is not None:
        # The query heads that share a KV head become that head's query rows: no GQA for flex
        # (its decoding kernel takes only power-of-two GQA ratios; SmolLM2's is 3), and q_len < 128
        # picks the decoding kernel, which reads each slot's filled KV blocks once for the group.
        rows, heads, _, dim = query.shape
        grouped = query.reshape(rows, k_all.shape[1], heads // k_all.shape[1], dim)
        out = cache.flex(grouped, k_all, v_all, block_mask=slot_pass.block_mask, scale=scaling)
        out = out.reshape(rows, heads, 1, dim)
    else:
        out = F.scaled_dot_product_attention(
            query, k_all, v_all, attn_mask=slot_pass.kv_mask, scale=scaling, enable_gqa=True
        )
    return out.transpose(1, 2).contiguous(), None


def packed_attention(cache_k: torch.Tensor, cache_v: torch.Tensor, packed: PackedRows, query: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor, scaling: Optional[float]) -> torch.Tensor:
    """A packed prefill's attention: q [1, H, N, D], k/v [1, KVH, N, D] -> [1, N, H, D]. Every token's
    K/V goes to its slot; each group's rows are gathered into a right-padded batch: fresh rows attend
    causally over their own keys, continuing rows over their slot's keys up to each query."""
    q_tok, k_tok, v_tok = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [N, heads, D]
    cache_k[packed.slot, :, packed.pos] = k_tok
    cache_v[packed.slot, :, packed.pos] = v_tok
    if packed.varlen is not None:
        vl = packed.varlen
        k = cache_k[vl.kv_slot, :, vl.kv_pos]  # [keys, KV heads, D]
        v = cache_v[vl.kv_slot, :, vl.kv_pos]
        return varlen_attention(q_tok, k, v, vl.cu_q, vl.cu_k, vl.max_q, vl.max_k, scaling)[None]
    heads, dim = q_tok.shape[1:]
    outs = []
    for g in packed.groups:
        q = q_tok[g.gather].view(g.rows, g.width, heads, dim).transpose(1, 2)
        if g.slots is None:  # fresh rows from position 0: right-padded, causal over the new keys
            k = k_tok[g.gather].view(g.rows, g.width, -1, dim).transpose(1, 2)
            v = v_tok[g.gather].view(g.rows, g.width, -1, dim).transpose(1, 2)
            k, v, gqa = heads_for_sdpa(q, k, v)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            span = g.mask.shape[-1]
            k, v, gqa = heads_for_sdpa(q, cache_k[g.slots, :, :span], cache_v[g.slots, :, :span])
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scaling, enable_gqa=gqa)
        outs.append(out.transpose(1, 2).reshape(g.rows * g.width, heads, dim)[g.real])
    return torch.cat(outs)[None]


def varlen_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor,
                               cu_k: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    """:func:`varlen_attention` one row at a time with SDPA and an explicit end-aligned causal mask."""
    outs = []
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for r in range(len(bounds_q) - 1):
        q = query[bounds_q[r]:bounds_q[r + 1]].transpose(0, 1)[None]  # [1, H, q, D]
        k = key[bounds_k[r]:bounds_k[r + 1]].transpose(0, 1)[None]
        v = value[bounds_k[r]:bounds_k[r + 1]].transpose(0, 1)[None]
        nq, nk = q.shape[2], k.shape[2]
        mask = torch.arange(nk, device=q.device)[None, :] <= torch.arange(nq, device=q.device)[:, None] + (nk - nq)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor,
                     cu_k: torch.Tensor, max_q: int, max_k: int, scale: Optional[float]) -> torch.Tensor:
    """Causal attention over packed rows of different lengths, aligned at each row's end:
    q [queries, H, D], k/v [keys, KV heads, D] -> [queries, H, D]. On CUDA in 16-bit, one flash
    call (PyTorch's own varlen kernel, GQA native); elsewhere :func:`varlen_attention_reference`."""
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        # is_causal: flash-attention 2 aligns the causal mask at the bottom right when rows have
        # fewer queries than keys, which is what a row continuing after its cached prefix needs
        return torch.ops.aten._flash_attention_forward(
            query.contiguous(), key, value, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)[0]
    return varlen_attention_reference(query, key, value, cu_q, cu_k, scale)


def register_slot_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, slot_attention)


def slots_that_fit(slot_bytes: int, free_bytes: int) -> int:
    """How many KV rows of ``slot_bytes`` fit in ``KV_MEMORY_FRACTION`` of ``free_bytes``."""
    return int(free_bytes * KV_MEMORY_FRACTION) // slot_bytes


def free_device_bytes(device: torch.device) -> int:
    """GPU memory a new KV cache can take: free by the driver, plus what PyTorch's allocator holds
    unused (an earlier engine's cache)."""
    return (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
            - torch.cuda.memory_allocated(device))


def check_kv_fits(num_slots: int, width: int, slot_bytes: int, free_bytes: int) -> None:
    """Raise ValueError (one line, naming the fix) if ``num_slots`` KV rows of ``slot_bytes`` each do
    not fit in ``KV_MEMORY_FRACTION`` of ``free_bytes``: caught before the cache is allocated."""
    fit = slots_that_fit(slot_bytes, free_bytes)
    if num_slots > fit:
        raise ValueError(f"{num_slots} slots x {width} tokens need a {num_slots * slot_bytes / 1e9:.1f} GB KV cache "
                         f"and {free_bytes / 1e9:.1f} GB is free: use --batch-size {max(fit, 1)} or less, or lower "
                         f"--max-prompt-tokens / --max-new-tokens")


class SlotKVCache:
    """Per-layer K/V of ``num_slots`` sequences of up to ``width`` tokens, and each slot's fill."""

    def __init__(self, config: Any, num_slots: int, width: int, device: torch.device, dtype: torch.dtype) -> None:
        layers, kv_heads, head_dim = self.kv_shape(config)
        shape = (num_slots, kv_heads, width, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.width = width
        self.flex: Optional[Callable[..., torch.Tensor]] = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @staticmethod
    def kv_shape(config: Any) -> tuple[int, int, int]:
        """(layers, KV heads, head dim) of a transformers config."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        return text.num_hidden_layers, kv_heads, getattr(text, "head_dim", None) or text.hidden_size // heads

    @classmethod
    def slot_bytes(cls, config: Any, width: int, dtype: torch.dtype) -> int:
        """Bytes of one slot's K and V over every layer."""
        layers, kv_heads, head_dim = cls.kv_shape(config)
        return 2 * layers * kv_heads * width * head_dim * torch.empty((), dtype=dtype).element_size()
