"""The attention mask of a training step's blocks: each block sees the target context strictly before its
anchor and itself (bidirectionally); dense (SDPA) or a flex_attention `BlockMask` built at one address per shape.
"""

from __future__ import annotations

from typing import Optional

import torch

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask
except ImportError:  # pragma: no cover
    BlockMask = None  # type: ignore[assignment,misc]
    create_block_mask = None  # type: ignore[assignment]


def build_dense_block_mask(
    anchors: torch.Tensor,
    valid: torch.Tensor,
    key_valid: torch.Tensor,
    block_size: int,
    ctx_start: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dense boolean mask [B, 1, A*block, S + A*block] for SDPA (True = visible).

    Context key j is visible to block i iff ctx_start_i <= j < a_i and j is a real token
    (ctx_start: the block's document start in a packed row, else 0); a block key is visible
    iff it is in the same block; invalid blocks see nothing (their rows are empty, which the
    attention turns into zeros, never NaN).
    """
    bsz, n_blk = anchors.shape
    seq = key_valid.shape[1]
    q_blk = torch.arange(n_blk * block_size, device=anchors.device) // block_size  # [Q]
    a_q = anchors[:, q_blk]  # [B, Q]
    v_q = valid[:, q_blk]  # [B, Q]
    j = torch.arange(seq, device=anchors.device)
    ctx = (j.view(1, 1, -1) < a_q.unsqueeze(-1)) & key_valid.bool().unsqueeze(1)  # [B, Q, S]
    if ctx_start is not None:
        ctx &= j.view(1, 1, -1) >= ctx_start[:, q_blk].unsqueeze(-1)
    same = (q_blk.view(-1, 1) == q_blk.view(1, -1)).unsqueeze(0).expand(bsz, -1, -1)  # [B, Q, Q]
    mask = torch.cat([ctx, same], dim=-1) & v_q.unsqueeze(-1)
    return mask.unsqueeze(1)


FLEX_TILE = 128  # flex_attention's default BlockMask tile


class _MaskBuffers:
    """Per-query tensors a mask_mod reads, kept at one address per shape.

    A compiled step sees the same `mask_mod` function object and the same buffers on every
    step (refilled in place), so dynamo's guards hold and nothing recompiles; a fresh closure
    per step would be a new function for every call.
    """

    def __init__(self, bsz: int, q_len: int, seq: int, device: torch.device, block_size: int) -> None:
        self.a_q = torch.zeros(bsz, q_len, dtype=torch.long, device=device)
        self.s_q = torch.zeros(bsz, q_len, dtype=torch.long, device=device)
        self.v_q = torch.zeros(bsz, q_len, dtype=torch.bool, device=device)
        self.kv_ok = torch.zeros(bsz, seq, dtype=torch.bool, device=device)
        a_q, s_q, v_q, kv_ok = self.a_q, self.s_q, self.v_q, self.kv_ok

        def mask_mod(b, h, q_idx, kv_idx):
            is_ctx = kv_idx < seq
            kv = kv_idx.clamp(max=seq - 1)
            ctx_vis = (kv_idx < a_q[b, q_idx]) & (kv_idx >= s_q[b, q_idx]) & kv_ok[b, kv]
            blk_vis = ((kv_idx - seq) // block_size) == (q_idx // block_size)
            return v_q[b, q_idx] & torch.where(is_ctx, ctx_vis, blk_vis)

        self.mask_mod = mask_mod


_mask_buffers: dict[tuple, _MaskBuffers] = {}


def _buffers_for(anchors, valid, key_valid, ctx_start, block_size: int) -> _MaskBuffers:
    bsz, n_blk = anchors.shape
    seq = key_valid.shape[1]
    q_len = n_blk * block_size
    key = (bsz, q_len, seq, block_size, str(anchors.device))
    buf = _mask_buffers.get(key)
    if buf is None:
        if len(_mask_buffers) > 16:  # variable-length batches: keep the cache small
            _mask_buffers.clear()
        buf = _mask_buffers[key] = _MaskBuffers(bsz, q_len, seq, anchors.device, block_size)
    q_blk = torch.arange(q_len, device=anchors.device) // block_size
    buf.a_q.copy_(anchors[:, q_blk])
    buf.v_q.copy_(valid[:, q_blk])
    buf.kv_ok.copy_(key_valid.bool())
    if ctx_start is None:
        buf.s_q.zero_()
    else:
        buf.s_q.copy_(ctx_start[:, q_blk])
    return buf


def _tile_kv_blocks(anchors, valid, ctx_start, seq: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The BlockMask's tile lists computed from the anchors alone (no [Q, K] evaluation).

    A 128-query tile holds 128/block consecutive (sorted) blocks: it may see context tiles from
    the lowest document start to the tile of the highest `a - 1` among its valid blocks, and
    its own blocks' key tile (the block keys sit at `seq + q`). All tiles are partial: the
    mask_mod still decides every element, so an extra tile costs time, never correctness.
    """
    t = FLEX_TILE
    bsz, n_blk = anchors.shape
    per = t // block_size
    n_qt = n_blk * block_size // t
    n_kvt = (seq + n_blk * block_size) // t
    a = anchors.view(bsz, n_qt, per)
    v = valid.view(bsz, n_qt, per)
    s = (torch.zeros_like(anchors) if ctx_start is None else ctx_start).view(bsz, n_qt, per)
    has_ctx = v & (a > s)
    big = torch.full_like(a, n_kvt)
    lo = torch.where(has_ctx, s // t, big).amin(-1)
    hi = torch.where(has_ctx, (a - 1) // t, torch.full_like(a, -1)).amax(-1)
    n_ctx = (hi - lo + 1).clamp(min=0)
    diag = seq // t + torch.arange(n_qt, device=anchors.device).view(1, -1)
    idx = torch.arange(n_kvt, device=anchors.device).view(1, 1, -1)
    kv_idx = torch.where(idx < n_ctx.unsqueeze(-1), lo.unsqueeze(-1) + idx,
                         torch.where(idx == n_ctx.unsqueeze(-1), diag.unsqueeze(-1), torch.zeros_like(idx)))
    num = n_ctx + v.any(-1).long()
    return num.unsqueeze(1).to(torch.int32), kv_idx.clamp(max=n_kvt - 1).unsqueeze(1).to(torch.int32).contiguous()


def build_flex_block_mask(
    anchors: torch.Tensor,
    valid: torch.Tensor,
    key_valid: torch.Tensor,
    block_size: int,
    compile_mask: Optional[bool] = None,
    ctx_start: Optional[torch.Tensor] = None,
):
    """The same mask as `build_dense_block_mask`, as a flex_attention BlockMask.

    The dense mask is O(Q * K) memory (GBs at 512 anchors x 3072 tokens); the BlockMask
    stores only which 128x128 tiles are partly or fully visible, so the kernel skips the
    (mostly invisible) rest. When the shapes line up with the tiles (128 % block == 0, the
    sequence and the block queries multiples of 128: packed rows), the tile lists come straight
    from the anchors (`_tile_kv_blocks`), with no sync and no per-element pass; otherwise
    `create_block_mask` evaluates the mask.
    """
    if create_block_mask is None:  # pragma: no cover
        raise RuntimeError("flex_attention needs torch >= 2.5; use attn_backend=sdpa")
    bsz, n_blk = anchors.shape
    seq = key_valid.shape[1]
    q_len = n_blk * block_size
    buf = _buffers_for(anchors, valid, key_valid, ctx_start, block_size)
    t = FLEX_TILE
    if t % block_size == 0 and seq % t == 0 and q_len % t == 0:
        num, idx = _tile_kv_blocks(anchors, valid, ctx_start, seq, block_size)
        return BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=t, mask_mod=buf.mask_mod, seq_lengths=(q_len, seq + q_len))
    if compile_mask is None:
        # Eager by default: a compiled builder recompiles for every new (sequence, anchors) shape,
        # which costs tens of seconds per shape on variable-length data; eager costs milliseconds.
        compile_mask = False
    return create_block_mask(
        buf.mask_mod, B=bsz, H=None, Q_LEN=q_len, KV_LEN=seq + q_len, device=anchors.device, _compile=compile_mask
    )
