"""Which SDPA kernels run attention whose shapes change call after call, the flex mask of the engine's decode steps
that read only each row's filled KV blocks (`FilledBlocks`), and causal attention over packed rows of different
lengths (`varlen_attention`: the target's packed training forward).

cuDNN's SDPA, which PyTorch picks first on Hopper, builds and caches an execution plan for every
new shape. Eager decoding changes the key length every step, and the engine's prefills
change (rows, tokens) every refill, so each of their calls can pay a plan build: on an H200,
Qwen3-8B-shape eager decoding of never-seen lengths ran at 55 ms per token against 26 ms once
the lengths had been seen (docs/performance.md), and a whole-set SmolLM2 regeneration spent 87 s
in prefills worth ~8 s of compute (docs/data.md). Flash and memory-efficient attention have no
per-shape cost. Captured CUDA graphs have fixed shapes and keep PyTorch's choice.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager, Optional

import torch
import torch.nn.functional as F

from nemo_dflash.engine.compiled import compiled

KV_BLOCK = 128  # flex's KV block: a decode step reads a row's blocks up to the one holding its furthest query


def eager_attention_backends(device: torch.device, avoid_cudnn: bool = True) -> ContextManager[Any]:
    """The SDPA backends for calls of ever-changing shapes on `device` (all but cuDNN on CUDA); `avoid_cudnn=False`
    (`EngineOptions.avoid_cudnn_attention`): PyTorch's own choice, for comparison."""
    if device.type != "cuda" or not avoid_cudnn:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class FilledBlocks:
    """A decode step's flex BlockMask over each row's filled KV blocks (the engine's plain step and verify): `rows` rows of `queries` queries each
    (at positions `q_pos` [rows, queries], key j visible to a query at p iff j <= p), `group` query heads a K/V
    head folded into its query rows, keys the whole cache of `max_len` positions. Its tensors are updated in place
    by `set` (a captured graph reads them), and a row's blocks past its furthest query are never read."""

    def __init__(self, rows: int, queries: int, max_len: int, group: int, device: torch.device) -> None:
        import inspect

        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        if max_len % KV_BLOCK:
            raise ValueError(f"filled-block attention needs a cache length that is a multiple of {KV_BLOCK}")
        q_rows = group * queries
        q_blocks, kv_blocks = -(-q_rows // KV_BLOCK), max_len // KV_BLOCK
        self.q_pos = torch.zeros(rows, queries, dtype=torch.long, device=device)
        self.kv_blocks = torch.ones(rows, 1, q_blocks, dtype=torch.int32, device=device)
        indices = torch.arange(kv_blocks, dtype=torch.int32, device=device).expand(rows, 1, q_blocks, -1).contiguous()
        q_pos = self.q_pos

        def mask_mod(b, h, q_idx, kv_idx):  # folded query row g * queries + i is the row's query i
            return kv_idx <= q_pos[b, q_idx % queries]

        extra = {}
        if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters:
            extra["compute_q_blocks"] = False  # only a backward pass reads them
        self.mask = BlockMask.from_kv_blocks(self.kv_blocks, indices, BLOCK_SIZE=KV_BLOCK, mask_mod=mask_mod,
                                             seq_lengths=(q_rows, max_len), **extra)
        self.flex = compiled(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention

    def set(self, q_pos: torch.Tensor) -> None:
        """The step's query positions [rows, queries] (device ops only: fine inside a captured step)."""
        self.q_pos.copy_(q_pos)
        self.kv_blocks.copy_((q_pos.max(dim=1).values // KV_BLOCK + 1).view(-1, 1, 1).expand_as(self.kv_blocks))


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
