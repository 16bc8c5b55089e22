"""The DFlash trainer module: anchors -> block inputs -> block attention mask -> draft -> loss.

Training runs many blocks per sequence in one draft forward. Each block i starts at an
anchor a_i (a supervised token), holds `[token[a_i], MASK, ..., MASK]` at positions
a_i..a_i+B-1, sees the target context strictly before a_i plus its own block
(bidirectionally), and slot k >= 1 predicts token[a_i + k] with weight exp(-(k-1)/gamma).
This batched formulation must equal running each block alone, the way inference does
(tests/test_core.py checks exactly that).
"""

from __future__ import annotations

from functools import partial


from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nemo_dflash.compiled import compiled
from nemo_dflash.engine.acceptance import accepted_prefix, expected_block_length
from nemo_dflash.target import DFlashTargetBatch
from nemo_dflash.sampling import SamplingParams, topk_ids
from nemo_dflash.fused_loss import LOSS_IMPLS, argmax_chunk, fused_lm_loss, resolve_loss_impl
from nemo_dflash.accept_loss import accept_chunk, accept_lm_loss, check_accept
from nemo_dflash.selector_loss import (
    SELECTOR_OUTSIDE, dpace_weights, selector_lm_loss, selector_slot_acceptance,
)

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask
except ImportError:  # pragma: no cover
    BlockMask = None  # type: ignore[assignment,misc]
    create_block_mask = None  # type: ignore[assignment]


# ----------------------------------------------------------------------------- anchors


def sample_anchors(
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    block_size: int,
    num_anchors: int,
    generator: Optional[torch.Generator] = None,
    row_seeds: Optional[Sequence[int]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to `num_anchors` anchors per row, uniformly without replacement.

    Candidates are supervised, real tokens that leave room for a whole block
    (a + block_size <= sequence length). Returns (anchors [B, A], valid [B, A]) sorted by
    position; rows with fewer candidates are padded with invalid anchors (position 0).
    A >= 1 always, so the draft runs (and its parameters join the graph) on every batch.

    With `row_seeds`, each row draws from its own seeded stream, so a sample gets the same
    anchors whatever batch, padding or rank it lands in (distributed runs then reproduce
    single-process losses, and resume needs no generator state).
    """
    bsz, seq = loss_mask.shape
    device = loss_mask.device
    lengths = attention_mask.long().sum(dim=1, keepdim=True)
    pos = torch.arange(seq, device=device).unsqueeze(0)
    cand = loss_mask.bool() & attention_mask.bool() & (pos + block_size <= lengths)
    n_anchors = max(1, min(num_anchors, int(cand.sum(dim=1).max().item()) if cand.numel() else 0))
    if row_seeds is not None:
        scores = torch.stack([
            torch.rand(seq, generator=torch.Generator().manual_seed(int(rs))) for rs in row_seeds
        ]).to(device)
    else:
        scores = torch.rand(bsz, seq, device=device, generator=generator)
    scores = scores.masked_fill(~cand, -1.0)
    top_scores, top_idx = scores.topk(min(n_anchors, seq), dim=1)
    valid = top_scores >= 0
    # Sort valid anchors by position; invalid ones go last at position 0.
    key = torch.where(valid, top_idx, torch.full_like(top_idx, seq))
    key, order = key.sort(dim=1)
    valid = valid.gather(1, order)
    anchors = torch.where(valid, key, torch.zeros_like(key))
    if anchors.shape[1] < n_anchors:  # seq shorter than requested anchors
        pad = n_anchors - anchors.shape[1]
        anchors = F.pad(anchors, (0, pad))
        valid = F.pad(valid, (0, pad), value=False)
    return anchors, valid


def document_bounds(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S] per-token document ids (documents contiguous, padding -1) -> (start, end) [B, S]:
    each token's document spans positions [start, end)."""
    bsz, seq = doc_ids.shape
    pos = torch.arange(seq, device=doc_ids.device).expand(bsz, -1)
    new = torch.ones_like(doc_ids, dtype=torch.bool)
    new[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.where(new, pos, torch.zeros_like(pos)).cummax(dim=1).values
    last = torch.ones_like(new)
    last[:, :-1] = new[:, 1:]
    end_at = torch.where(last, pos + 1, torch.full_like(pos, seq))
    end = end_at.flip(1).cummin(dim=1).values.flip(1)
    return start, end


def anchor_quotas(counts: torch.Tensor, total: int, offset: int = 0) -> torch.Tensor:
    """Split `total` anchors over documents in proportion to their candidate counts.

    Systematic rounding: document d gets floor((C_d * total + offset) / n) minus the same for
    C_(d-1) (C: cumulative counts, n: their sum). Every quota is the floor or the ceiling of
    its exact share `total * c_d / n` (so never above c_d when `total <= n`), the quotas add
    up to `total`, and with `offset` uniform in [0, n) each quota's mean is exactly its share:
    no document (say, the last short one in a row) is rounded down on every step.
    """
    counts = counts.long()
    n = int(counts.sum())
    total = min(int(total), n)
    if n == 0 or total == 0:
        return torch.zeros_like(counts)
    cum = torch.cumsum(counts, 0) * total + int(offset) % n
    edges = torch.cat([torch.zeros(1, dtype=torch.long, device=counts.device) + int(offset) % n, cum]) // n
    return edges[1:] - edges[:-1]


def sample_packed_anchors(
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    doc_ids: torch.Tensor,
    block_size: int,
    num_anchors: int,
    generator: Optional[torch.Generator] = None,
    row_seeds: Optional[Sequence[int]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors of packed rows: exactly `num_anchors` slots per row (a fixed shape), shared out
    over the row's documents in proportion to their candidates (`anchor_quotas`).

    Counting anchors per row and drawing them uniformly from the whole row would let long
    documents take most of a short row's budget only by chance; quotas make each document's
    coverage the row's coverage. A candidate is a supervised real token whose block stays inside
    its own document (a + block_size <= document end). Each document draws its quota uniformly
    without replacement. Returns (anchors [B, num_anchors], valid), sorted, invalid ones at 0.
    """
    bsz, seq = loss_mask.shape
    _, end = document_bounds(doc_ids)
    pos = torch.arange(seq, device=loss_mask.device).unsqueeze(0)
    cand = loss_mask.bool() & attention_mask.bool() & (doc_ids >= 0) & (pos + block_size <= end)
    n_anchors = max(1, int(num_anchors))
    anchors = torch.zeros(bsz, n_anchors, dtype=torch.long, device=loss_mask.device)
    valid = torch.zeros(bsz, n_anchors, dtype=torch.bool, device=loss_mask.device)
    for r in range(bsz):
        if row_seeds is not None:
            draw = torch.rand(seq + 1, generator=torch.Generator().manual_seed(int(row_seeds[r]))).to(loss_mask.device)
        else:
            draw = torch.rand(seq + 1, device=loss_mask.device, generator=generator)
        scores = draw[:seq]
        cp = cand[r].nonzero().squeeze(-1)
        if cp.numel() == 0:
            continue
        dd = doc_ids[r, cp].long()
        n_docs = int(dd.max()) + 1
        offset = min(int(float(draw[seq]) * cp.numel()), cp.numel() - 1)
        quota = anchor_quotas(torch.bincount(dd, minlength=n_docs), n_anchors, offset)
        # per document, its candidates by descending score: the first `quota` of them are drawn
        order = torch.argsort(dd.double() * 2.0 + (1.0 - scores[cp].double()))
        sd = dd[order]
        first = torch.searchsorted(sd, sd)
        rank = torch.arange(sd.numel(), device=sd.device) - first
        chosen = cp[order][rank < quota[sd]].sort().values
        anchors[r, : chosen.numel()] = chosen
        valid[r, : chosen.numel()] = True
    return anchors, valid


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, A] anchors -> [B, A, block] absolute positions a_i + k."""
    return anchors.unsqueeze(-1) + torch.arange(block_size, device=anchors.device)


def build_block_input_ids(
    input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> torch.Tensor:
    """[B, A, block]: the anchor's real token in slot 0, the mask token elsewhere."""
    block = torch.full((*anchors.shape, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    block[..., 0] = input_ids.gather(1, anchors)
    return block


def loss_decay_weights(block_size: int, gamma: Optional[float], device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for k >= 1; slot 0 (the anchor) has weight 0; no decay if gamma unset.

    Formed without writing a Python scalar into a device tensor: on a GPU that write is a
    pageable copy, which makes the host wait for every kernel queued before it (mid-step).
    """
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    w = torch.exp(-(k - 1) / gamma) if gamma else torch.ones(block_size, device=device)
    return torch.where(k > 0, w, torch.zeros_like(w))


def build_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same-position labels: slot k predicts token[a + k]. Returns (labels, label_valid) [B, A, block].

    Slot 0, unsupervised or padded targets, targets past the end and invalid blocks are invalid.
    """
    seq = input_ids.shape[1]
    pos = block_positions(anchors, block_size)  # [B, A, blk]
    in_range = pos < seq
    flat = pos.clamp(max=seq - 1).flatten(1)
    labels = input_ids.gather(1, flat).view_as(pos)
    supervised = (loss_mask.bool() & attention_mask.bool()).gather(1, flat).view_as(pos)
    slot = torch.arange(block_size, device=anchors.device)
    label_valid = in_range & supervised & (slot >= 1) & valid.unsqueeze(-1)
    return labels, label_valid


@dataclass
class BlockPlan:
    """Which blocks a batch trains and which of their slots carry a label.

    Everything here follows from the token ids, masks and anchor seeds alone, so the trainer
    builds it on the CPU from the loader's batch and ships it with the tokens: the GPU step
    then never waits on a data-dependent size (`nonzero`, anchor counts) mid-forward.

    Packed rows (`doc_ids` given to `plan_blocks`) keep every shape fixed: `sel` is None and
    `labels` holds slots 1..block-1 of every block (invalid ones weigh 0), so the loss has the
    same shape on every step and a compiled step never recompiles.
    """

    anchors: torch.Tensor  # [B, A] long, sorted; invalid ones at 0
    valid: torch.Tensor  # [B, A] bool
    label_valid: torch.Tensor  # [B, A, block] bool
    sel: Optional[torch.Tensor]  # [N] long: flat indices (into B*A*block) of the valid label slots; None: packed
    labels: torch.Tensor  # [N] long: their labels (packed: [B*A*(block-1)], slots 1.. of every block)
    ctx_start: Optional[torch.Tensor] = None  # [B, A] first context position a block may see (its document's start)
    anchor_pos: Optional[torch.Tensor] = None  # [B, A] the anchor's position id (position within its document)

    def to(self, device: torch.device, non_blocking: bool = False) -> "BlockPlan":
        pin = non_blocking and device.type == "cuda" and self.anchors.device.type == "cpu"

        def move(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            if t is None:
                return None
            return (t.pin_memory() if pin else t).to(device, non_blocking=non_blocking)

        return BlockPlan(*(move(getattr(self, f.name)) for f in fields(self)))


def plan_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    block_size: int,
    num_anchors: int,
    generator: Optional[torch.Generator] = None,
    row_seeds: Optional[Sequence[int]] = None,
    anchors: Optional[torch.Tensor] = None,
    valid: Optional[torch.Tensor] = None,
    doc_ids: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
) -> BlockPlan:
    """Anchors (sampled unless given) and the valid label slots, on the inputs' device.

    With `doc_ids` ([B, S] document index per token, -1 on padding: packed rows), anchors are
    drawn per document (`sample_packed_anchors`), each block sees only its own document's
    context, and its positions come from `position_ids` (restarting per document).
    """
    if doc_ids is None:
        if anchors is None:
            anchors, valid = sample_anchors(loss_mask, attention_mask, block_size, num_anchors, generator, row_seeds)
        assert valid is not None
        labels, label_valid = build_labels(input_ids, loss_mask, attention_mask, anchors, valid, block_size)
        sel = label_valid.flatten().nonzero().squeeze(-1)
        return BlockPlan(anchors, valid, label_valid, sel, labels.flatten().index_select(0, sel))
    if anchors is None:
        anchors, valid = sample_packed_anchors(
            loss_mask, attention_mask, doc_ids, block_size, num_anchors, generator, row_seeds
        )
    assert valid is not None
    start, end = document_bounds(doc_ids)
    labels, label_valid = build_labels(input_ids, loss_mask, attention_mask, anchors, valid, block_size)
    # a block slot past its document's end is another document's token: never a label
    label_valid &= block_positions(anchors, block_size) < end.gather(1, anchors).unsqueeze(-1)
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device) - start
    return BlockPlan(
        anchors, valid, label_valid, None, labels[..., 1:].flatten(),
        ctx_start=start.gather(1, anchors), anchor_pos=position_ids.gather(1, anchors),
    )


# ----------------------------------------------------------------------------- masks


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


# ----------------------------------------------------------------------------- loss


@dataclass(frozen=True)
class LossSums:
    """The loss output's sums on the host, after reducing over micro-steps and ranks.

    Rates (loss, accuracy, acceptance length) are formed only from these global sums, so they
    do not depend on how a batch was split between ranks and accumulation micro-steps.
    """

    weight_sum: float = 0.0
    loss_sum: float = 0.0
    correct: float = 0.0
    num_labels: float = 0.0
    accept_sum: float = 0.0
    num_blocks: float = 0.0
    sampled_accept_sum: float = 0.0  # expected block length under speculative sampling (held-out only)
    greedy_draft_accept_sum: float = 0.0  # the same with the draft proposing its argmax (one-hot q)
    sampled_blocks: float = 0.0
    # what a step's model FLOPs follow from (train/flops.py): blocks with a valid anchor, the keys their queries
    # see (block x (anchor's position in its document + block)), context tokens the target runs, and its causal
    # attention pairs (sum over documents of L(L+1)/2; unpacked rows count the batch's longest row, as padded)
    valid_blocks: float = 0.0
    visible_keys: float = 0.0
    context_tokens: float = 0.0
    context_pairs: float = 0.0
    # the acceptance loss term's accept probability a = sum_x min(p_T, q), summed over valid label slots, and
    # those slots' count (0 when `loss.accept_weight` is off)
    accept_prob_sum: float = 0.0
    accept_prob_slots: float = 0.0
    # a candidate selector's (DFlash2): its loss term (weighted like the unary loss), the unary argmax's simulated
    # acceptance beside the walk's (accept_sum is the walk's then), top-K recall, and the oracle walk that picks
    # the true token whenever it is a candidate
    selector_loss_sum: float = 0.0
    unary_accept_sum: float = 0.0
    topk_hits: float = 0.0
    oracle_accept_sum: float = 0.0
    # where the T=0 -> T>0 loss sits, held-out only (beside the sampled acceptance): per valid label slot, the
    # proposal's T=0 hit (teacher-forced: conditional on the slots before) and its accept probability under
    # speculative sampling, summed separately for the first label slot and the later ones
    slot1_greedy_sum: float = 0.0
    slot1_sampled_sum: float = 0.0
    slot1_slots: float = 0.0
    later_greedy_sum: float = 0.0
    later_sampled_sum: float = 0.0
    later_slots: float = 0.0

    @classmethod
    def size(cls) -> int:
        """Length of the vector `DFlashLossOutput.sums()` returns."""
        return len(fields(cls))

    @classmethod
    def from_vector(cls, vec: torch.Tensor) -> "LossSums":
        """Read back a (reduced) `DFlashLossOutput.sums()` vector."""
        return cls(*(float(x) for x in vec[: cls.size()].tolist()))

    @staticmethod
    def weight_of(vec: torch.Tensor) -> torch.Tensor:
        """The weight sum inside a sums vector, left on its device (the step decides on it without a sync)."""
        return vec[0]

    @staticmethod
    def loss_sum_of(vec: torch.Tensor) -> torch.Tensor:
        """The loss sum inside a sums vector, left on its device."""
        return vec[1]

    @property
    def loss(self) -> float:
        return self.loss_sum / self.weight_sum if self.weight_sum > 0 else 0.0

    def rates(self, prefix: str = "") -> dict[str, float]:
        """Loss per unit weight, label accuracy and simulated acceptance length per block; where the
        sampled acceptance was measured, its expected block length (draft sampled, and draft argmax)."""
        out = {
            f"{prefix}loss": self.loss,
            f"{prefix}accuracy": self.correct / max(self.num_labels, 1.0),
            f"{prefix}accept_len": self.accept_sum / max(self.num_blocks, 1.0),
        }
        if self.sampled_blocks > 0:
            out[f"{prefix}sampled_accept_len"] = self.sampled_accept_sum / self.sampled_blocks
            out[f"{prefix}sampled_accept_len_greedy_draft"] = self.greedy_draft_accept_sum / self.sampled_blocks
        if self.accept_prob_slots > 0:
            out[f"{prefix}accept_prob"] = self.accept_prob_sum / self.accept_prob_slots
        if self.topk_hits > 0 or self.selector_loss_sum > 0:
            out[f"{prefix}selector_loss"] = self.selector_loss_sum / self.weight_sum if self.weight_sum > 0 else 0.0
            out[f"{prefix}unary_accept_len"] = self.unary_accept_sum / max(self.num_blocks, 1.0)
            out[f"{prefix}topk_recall"] = self.topk_hits / max(self.num_labels, 1.0)
            out[f"{prefix}oracle_accept_len"] = self.oracle_accept_sum / max(self.num_blocks, 1.0)
        if self.slot1_slots > 0:
            out[f"{prefix}slot1_accept"] = self.slot1_greedy_sum / self.slot1_slots
            out[f"{prefix}sampled_slot1_accept"] = self.slot1_sampled_sum / self.slot1_slots
            if self.later_slots > 0:
                out[f"{prefix}later_accept"] = self.later_greedy_sum / self.later_slots
                out[f"{prefix}sampled_later_accept"] = self.later_sampled_sum / self.later_slots
        return out


@dataclass
class DFlashLossOutput:
    """Sums, so ranks and accumulation micro-steps can be reduced before normalising."""

    loss_sum: torch.Tensor  # sum_k w_k * loss_k (differentiable)
    weight_sum: torch.Tensor  # sum_k w_k
    correct: torch.Tensor  # argmax == label on valid label slots
    num_labels: torch.Tensor
    accept_sum: torch.Tensor  # sum over valid blocks of the simulated acceptance length
    num_blocks: torch.Tensor
    sampled_accept_sum: Optional[torch.Tensor] = None  # `expected_acceptance` summed over blocks, when measured
    greedy_draft_accept_sum: Optional[torch.Tensor] = None
    sampled_blocks: Optional[torch.Tensor] = None
    valid_blocks: Optional[torch.Tensor] = None
    visible_keys: Optional[torch.Tensor] = None
    context_tokens: Optional[torch.Tensor] = None
    context_pairs: Optional[torch.Tensor] = None
    accept_prob_sum: Optional[torch.Tensor] = None  # the acceptance term's a summed over valid label slots, when on
    accept_prob_slots: Optional[torch.Tensor] = None
    selector_loss_sum: Optional[torch.Tensor] = None  # a candidate selector's (DFlash2), as in `LossSums`
    unary_accept_sum: Optional[torch.Tensor] = None
    topk_hits: Optional[torch.Tensor] = None
    oracle_accept_sum: Optional[torch.Tensor] = None
    slot1_greedy_sum: Optional[torch.Tensor] = None  # the T=0 / T>0 split by slot, as in `LossSums`
    slot1_sampled_sum: Optional[torch.Tensor] = None
    slot1_slots: Optional[torch.Tensor] = None
    later_greedy_sum: Optional[torch.Tensor] = None
    later_sampled_sum: Optional[torch.Tensor] = None
    later_slots: Optional[torch.Tensor] = None

    @property
    def loss(self) -> torch.Tensor:
        return self.loss_sum / self.weight_sum.clamp(min=1e-12)

    def sums(self) -> torch.Tensor:
        """The detached sums as one float64 vector in `LossSums` order, on the loss's device:
        added over micro-steps and all-reduced in one call, then read with `LossSums.from_vector`."""
        zero = self.weight_sum.new_zeros(())
        return torch.stack([(getattr(self, f.name) if getattr(self, f.name) is not None else zero).detach().double()
                            for f in fields(LossSums)])


def _chunk_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    lm_head: nn.Module,
    teacher_logits: Optional[torch.Tensor],
    distill_weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(hidden).float()
    loss = F.cross_entropy(logits, labels, reduction="none")
    if teacher_logits is not None and distill_weight > 0:
        soft = -(teacher_logits.float().softmax(-1) * logits.log_softmax(-1)).sum(-1)
        loss = (1.0 - distill_weight) * loss + distill_weight * soft
    return loss, logits.argmax(-1)


def teacher_expected_embedding(final_hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """E_t = softmax(h_t @ W.T) @ W per row of the target's final hidden states [..., H]: the lm_head
    rows averaged under the target's next-token distribution, in `final_hidden`'s dtype.

    Soft cross-entropy against the target through the same frozen lm_head W needs nothing else:
    sum_v p_t,v * logit_v = h . E_t for a draft state h, so its value is lse - h . E_t and its
    gradient softmax @ W - E_t. E_t depends on the target position only, so it is formed once per
    position (a packed step's 32 k positions, not its 327 k block slots) and no [rows, vocab]
    teacher tensor is kept. Chunks of `chunk_size` rows; matmuls in the autocast dtype when on.
    """
    dev = final_hidden.device.type
    mm_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
    flat = final_hidden.reshape(-1, final_hidden.shape[-1])
    out = torch.empty_like(flat)
    w_mm = weight.to(mm_dtype)
    run = _compiled_on_cuda(_expected_chunk, final_hidden.device) or _expected_chunk
    with torch.no_grad(), torch.autocast(dev, enabled=False):
        for s in range(0, flat.shape[0], chunk_size):
            out[s : s + chunk_size] = run(flat[s : s + chunk_size], w_mm)
    return out.view(final_hidden.shape)


def _expected_chunk(h: torch.Tensor, w_mm: torch.Tensor) -> torch.Tensor:
    p_t = F.linear(h.to(w_mm.dtype), w_mm).float().softmax(-1)
    return torch.matmul(p_t.to(w_mm.dtype), w_mm).to(h.dtype)


def _compiled_on_cuda(fn, device: torch.device):
    """`fn` compiled once, on GPUs (the loss chunk's reductions, softmax and casts fused into passes);
    None elsewhere: the eager loops run there, in place, with less memory."""
    return compiled(fn) if device.type == "cuda" else None


def _ce_chunk(
    h: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    mm_dtype: torch.dtype,
    need_grad: bool,
    te: Optional[torch.Tensor] = None,
    soft_weight: float = 0.0,
    top_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """One chunk of `_FusedLinearCE`: per-row loss, argmax, dL/dh = (softmax - target) @ W in fp32, and with
    `top_k` the ids of each row's top-k logits (a candidate selector's candidates, from the same logits).

    Hard CE has target = onehot(y). With the teacher's expected embeddings `te`
    (`teacher_expected_embedding`), the soft cross-entropy is mixed in:
    loss = lse - (1-w) * logit_y - w * h . te, whose gradient is softmax @ W - (1-w) * W_y - w * te.
    So distillation costs a dot product a row on top of hard CE, and no [tokens, vocab] tensor.

    Written for `torch.compile` (the onehot as a `where`, no in-place ops), which fuses the
    reductions over the [rows, vocab] logits into one pass and the softmax, onehot and cast
    into another: the eager loop reads and writes those logits about ten times.
    The matmuls run in `mm_dtype` (what autocast would pick), the rest in fp32, as in the loop.
    """
    w_mm = weight.to(mm_dtype)
    h_mm = h.to(mm_dtype)
    logits = F.linear(h_mm, w_mm).float()
    lse = torch.logsumexp(logits, dim=-1)
    logit_y = logits.gather(1, y.unsqueeze(1)).squeeze(1)
    if te is not None:
        te = te.float()
        loss = lse - (1.0 - soft_weight) * logit_y - soft_weight * (h_mm.float() * te).sum(-1)
        hard = 1.0 - soft_weight
    else:
        loss = lse - logit_y
        hard = 1.0
    pred = logits.argmax(-1)
    cand = topk_ids(logits, top_k) if top_k else None
    if not need_grad:
        return loss, pred, None, cand
    probs = torch.exp(logits - lse.unsqueeze(1))
    onehot = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0) == y.unsqueeze(1)
    probs = torch.where(onehot, probs - hard, probs)
    grad = torch.matmul(probs.to(mm_dtype), w_mm).float()
    return loss, pred, grad - soft_weight * te if te is not None else grad, cand


class _FusedLinearCE(torch.autograd.Function):
    """Cross-entropy of `hidden @ weight.T` whose input gradient is formed in the forward pass.

    Chunk by chunk: logits -> per-row loss and argmax -> dL/dhidden = (softmax - onehot) @ W,
    kept as one [N, H] fp32 tensor. Backward only scales it by the incoming per-row gradient,
    so the lm_head matmul is never recomputed (the checkpointed path runs it twice) and no
    [N, vocab] tensor outlives its chunk. `weight` is the frozen lm_head: it gets no gradient.
    With `teacher` (the target's expected embeddings for the same rows, `teacher_expected_embedding`),
    the soft CE against the target's distribution is mixed in with weight `soft_weight`.
    With `top_k`, the third output holds each row's top-k token ids from the same logits (DFlash2's
    candidates: no second pass over the vocabulary); else it is [N, 0].
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                teacher: Optional[torch.Tensor] = None, soft_weight: float = 0.0, top_k: int = 0):
        n = hidden.shape[0]
        losses = hidden.new_empty(n, dtype=torch.float32)
        preds = torch.empty(n, dtype=torch.long, device=hidden.device)
        cands = torch.empty(n, top_k, dtype=torch.long, device=hidden.device)
        need_grad = ctx.needs_input_grad[0]
        grad = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if need_grad else None
        chunk_fn = _compiled_on_cuda(_ce_chunk, hidden.device)
        dev = hidden.device.type
        if chunk_fn is not None or teacher is not None:
            run = chunk_fn or _ce_chunk
            mm_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
            with torch.autocast(dev, enabled=False):
                for s in range(0, n, chunk_size):
                    th = teacher[s : s + chunk_size] if teacher is not None else None
                    loss, pred, g, cand = run(hidden[s : s + chunk_size], weight, labels[s : s + chunk_size], mm_dtype,
                                              need_grad, th, soft_weight, top_k)
                    losses[s : s + chunk_size] = loss
                    preds[s : s + chunk_size] = pred
                    if top_k:
                        cands[s : s + chunk_size] = cand
                    if need_grad:
                        grad[s : s + chunk_size] = g
        else:
            for s in range(0, n, chunk_size):
                h = hidden[s : s + chunk_size]
                y = labels[s : s + chunk_size]
                logits = F.linear(h, weight).float()  # autocast (if on) picks the matmul dtype, as lm_head(h) would
                lse = torch.logsumexp(logits, dim=-1)
                losses[s : s + chunk_size] = lse - logits.gather(1, y.unsqueeze(1)).squeeze(1)
                preds[s : s + chunk_size] = logits.argmax(-1)
                if top_k:
                    cands[s : s + chunk_size] = topk_ids(logits, top_k)
                if need_grad:
                    probs = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the logits
                    probs.scatter_add_(1, y.unsqueeze(1), probs.new_full((y.shape[0], 1), -1.0))
                    # bf16 under autocast, like the gradient the checkpointed path feeds back through lm_head
                    grad[s : s + chunk_size] = torch.matmul(probs.to(weight.dtype), weight).float()
        ctx.save_for_backward(grad)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(preds, cands)
        return losses, preds, cands

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_preds: Optional[torch.Tensor], grad_cands: Optional[torch.Tensor]):
        (grad,) = ctx.saved_tensors
        if grad is None:
            return None, None, None, None, None, None, None
        return (grad * grad_loss.unsqueeze(1)).to(ctx.hidden_dtype), None, None, None, None, None, None


def _fusable(lm_head: nn.Module, teacher_logits: Optional[torch.Tensor], distill_weight: float) -> bool:
    return (
        isinstance(lm_head, nn.Linear)
        and lm_head.bias is None
        and not lm_head.weight.requires_grad
        and (teacher_logits is None or distill_weight <= 0)
    )


def chunked_lm_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    lm_head: nn.Module,
    chunk_size: int,
    teacher_logits: Optional[torch.Tensor] = None,
    distill_weight: float = 0.0,
    fused: bool = True,
    teacher_hidden: Optional[torch.Tensor] = None,
    teacher_embedding: Optional[torch.Tensor] = None,
    top_k: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Per-token loss and argmax over [N, H] hidden states, `chunk_size` rows at a time.

    The [N, vocab] fp32 logits never exist whole. With `fused` (and a frozen, bias-free
    Linear lm_head) the gradient is formed in the forward pass (`_FusedLinearCE`), also for
    distillation against `teacher_embedding` (the target's expected embeddings per row, [N, H],
    `teacher_expected_embedding`) or `teacher_hidden` (its final hidden states, [N, H], from which
    they are formed here); otherwise each chunk is checkpointed and recomputed in backward
    (distillation then against `teacher_logits` [N, vocab]).
    With `top_k` > 0 a third value is returned: each row's top-k token ids [N, top_k] when the fused path
    formed them from its logits, else None (the caller then runs `selector_loss.topk_rows`).
    """
    weight = getattr(lm_head, "weight", None)
    if (isinstance(weight, torch.Tensor) and hidden.dtype != weight.dtype
            and not torch.is_autocast_enabled(hidden.device.type)):
        hidden = hidden.to(weight.dtype)  # e.g. an fp32 draft over a bf16 target without autocast

    def done(loss: torch.Tensor, pred: torch.Tensor, cand: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
        return (loss, pred, cand) if top_k else (loss, pred)

    n = hidden.shape[0]
    if teacher_embedding is not None and distill_weight > 0:
        if not _fusable(lm_head, None, 0.0):
            raise ValueError("teacher_embedding needs a frozen, bias-free Linear lm_head; give teacher_hidden")
        return done(*_FusedLinearCE.apply(hidden, lm_head.weight, labels, chunk_size, teacher_embedding,
                                          float(distill_weight), top_k))
    if teacher_hidden is not None and distill_weight > 0 and _fusable(lm_head, None, 0.0):
        te = teacher_expected_embedding(teacher_hidden, lm_head.weight, chunk_size)
        return done(*_FusedLinearCE.apply(hidden, lm_head.weight, labels, chunk_size, te, float(distill_weight),
                                          top_k))
    if teacher_hidden is not None and distill_weight > 0 and teacher_logits is None:
        teacher_logits = lm_head(teacher_hidden)
    if fused and torch.is_grad_enabled() and _fusable(lm_head, teacher_logits, distill_weight):
        return done(*_FusedLinearCE.apply(hidden, lm_head.weight, labels, chunk_size, None, 0.0, top_k))
    if n <= chunk_size:
        return done(*_chunk_loss(hidden, labels, lm_head, teacher_logits, distill_weight))
    # without grad (held-out evaluation) the chunks are plain calls: still never [N, vocab] at once
    run = partial(checkpoint, _chunk_loss, use_reentrant=False) if torch.is_grad_enabled() else _chunk_loss
    losses, preds = [], []
    for s in range(0, n, chunk_size):
        t = teacher_logits[s : s + chunk_size] if teacher_logits is not None else None
        l, p = run(hidden[s : s + chunk_size], labels[s : s + chunk_size], lm_head, t, distill_weight)
        losses.append(l)
        preds.append(p)
    return done(torch.cat(losses), torch.cat(preds))


def acceptance_lengths(correct: torch.Tensor, label_valid: torch.Tensor) -> torch.Tensor:
    """[B, A, block] -> [B, A]: 1 + length of the run of correct slots from slot 1."""
    return 1 + accepted_prefix((correct & label_valid)[..., 1:])


def slot_acceptance(
    draft_hidden: torch.Tensor, teacher_hidden: torch.Tensor, lm_head: nn.Module, sampling: SamplingParams,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per label slot, the probability speculative sampling accepts it: (sum_x min(p, q), p(argmax q)).

    p is the target's distribution at the slot (from its final hidden state there, through the shared
    lm_head), q the draft's, both at `sampling`'s temperature and filtered by its top-k / top-p; the
    second figure is the accept probability when the draft proposes its argmax as a one-hot q. Rows of
    [N, H] in, [N] fp32 out; `chunk_size` rows of logits at a time, no gradient.
    """
    a_sampled = torch.empty(draft_hidden.shape[0], dtype=torch.float32, device=draft_hidden.device)
    a_greedy = torch.empty_like(a_sampled)
    w = lm_head.weight
    with torch.no_grad():
        for s in range(0, draft_hidden.shape[0], chunk_size):
            q_logits = lm_head(draft_hidden[s : s + chunk_size].to(w.dtype)).float()
            p = sampling.probs(lm_head(teacher_hidden[s : s + chunk_size].to(w.dtype)))
            a_sampled[s : s + chunk_size] = torch.minimum(p, sampling.probs(q_logits)).sum(-1)
            a_greedy[s : s + chunk_size] = p.gather(-1, q_logits.argmax(-1, keepdim=True)).squeeze(-1)
    return a_sampled, a_greedy


def _rows_at(source: torch.Tensor, src: torch.Tensor, sel: Optional[torch.Tensor]) -> torch.Tensor:
    """[B, S, H] per-position rows -> [N, H] for the loss's label slots: the rows at `src` [B, L] (the position
    each slot's token is predicted from), then `sel`'s valid slots when the plan selects them."""
    rows = source.gather(1, src.unsqueeze(-1).expand(-1, -1, source.shape[-1])).reshape(-1, source.shape[-1])
    return rows if sel is None else rows.index_select(0, sel)


def draft_block_hidden(
    draft: nn.Module,
    embed_tokens: nn.Module,
    input_ids: torch.Tensor,
    target_hidden: torch.Tensor,
    key_valid: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    *,
    backend: str = "sdpa",
    ctx_pos: Optional[torch.Tensor] = None,
    anchor_pos: Optional[torch.Tensor] = None,
    ctx_start: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The draft's final hidden states of every block, [B, A*block, H]: block i is `[token[a_i], MASK...]`
    at positions a_i.., seeing the target features strictly before a_i and its own block.

    The training step's forward; evaluation's replay (`inference.replay`) runs the same one to read the
    draft's greedy block at every answer position. `ctx_pos` / `anchor_pos` default to absolute positions.
    """
    bsz, seq = input_ids.shape
    block_ids = build_block_input_ids(input_ids, anchors, block_size, mask_token_id)
    with torch.no_grad():
        noise = embed_tokens(block_ids.flatten(1))  # [B, A*blk, H], frozen
    if ctx_pos is None:
        ctx_pos = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(bsz, -1)
    anchor_pos = anchor_pos if anchor_pos is not None else anchors
    pos = torch.cat([ctx_pos, block_positions(anchor_pos, block_size).flatten(1)], dim=1)
    if backend == "flex":
        mask = build_flex_block_mask(anchors, valid, key_valid, block_size, ctx_start=ctx_start)
    else:
        mask = build_dense_block_mask(anchors, valid, key_valid, block_size, ctx_start=ctx_start)
    return draft(noise_embedding=noise, target_hidden=target_hidden, position_ids=pos, attention_mask=mask,
                 backend=backend, block_size=block_size)


# ----------------------------------------------------------------------------- module


class DFlashTrainerModule(nn.Module):
    """Wraps the draft with the target's frozen embedding and lm_head for one training step.

    The embedding and lm_head are held by reference (not registered as submodules), so
    DDP/FSDP wrapping, optimizers and checkpoints of this module see the draft only.
    """

    def __init__(
        self,
        draft: nn.Module,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        *,
        num_anchors: int = 512,
        loss_decay_gamma: Optional[float] = None,
        attn_backend: str = "sdpa",
        distill_weight: float = 0.0,
        ce_chunk_size: int = 4096,
        fused_ce: bool = True,
        accept_sampling: Optional[SamplingParams] = None,
        loss_impl: str = "chunked",
        accept_weight: float = 0.0,
        accept_temperature: float = 1.0,
        accept_form: str = "log",
        selector_weight: float = 1.0,
        selector_outside: str = "inject",
        position_weights: str = "decay",
        dpace_alpha: float = 0.5,
    ) -> None:
        super().__init__()
        if attn_backend not in ("sdpa", "eager", "flex"):
            raise ValueError(f"attn_backend must be 'sdpa', 'eager' or 'flex', got {attn_backend!r}")
        self.draft = draft
        self._frozen = (embed_tokens, lm_head)
        self.block_size = int(draft.config.block_size)
        self.mask_token_id = int(draft.config.mask_token_id)
        self.num_anchors = int(num_anchors)
        self.gamma = loss_decay_gamma
        self.attn_backend = attn_backend
        self.distill_weight = float(distill_weight)
        self.ce_chunk_size = int(ce_chunk_size)
        self.fused_ce = bool(fused_ce)
        if loss_impl not in LOSS_IMPLS:
            raise ValueError(f"loss_impl must be one of {list(LOSS_IMPLS)}, got {loss_impl!r}")
        self.loss_impl = loss_impl  # chunked | cce | liger | auto (`fused_loss`), resolved per device when run
        # held-out only (no grad, final hidden states given): the expected acceptance under speculative sampling
        self.accept_sampling = accept_sampling
        # the acceptance loss term (`accept_loss`): loss = (1 - d - w) hard CE + d soft CE + w accept term
        check_accept(float(accept_weight), float(accept_temperature), accept_form)
        if float(accept_weight) + self.distill_weight > 1.0 + 1e-9:
            raise ValueError(f"distill_weight + accept_weight must be <= 1, got {self.distill_weight} + "
                             f"{accept_weight}")
        self.accept_weight = float(accept_weight)
        self.accept_temperature = float(accept_temperature)
        self.accept_form = accept_form
        # DFlash2: the candidate selector's term, and the per-slot weights of every term
        if selector_outside not in SELECTOR_OUTSIDE:
            raise ValueError(f"selector_outside must be one of {list(SELECTOR_OUTSIDE)}, got {selector_outside!r}")
        if position_weights not in ("decay", "dpace"):
            raise ValueError(f"position_weights must be 'decay' or 'dpace', got {position_weights!r}")
        self.selector_weight = float(selector_weight)
        self.selector_outside = selector_outside
        self.position_weights = position_weights
        self.dpace_alpha = float(dpace_alpha)
        cfg = draft.config
        self.output_multiplier = float(getattr(cfg, "output_multiplier", 1.0))
        self.softcap = float(getattr(cfg, "final_logit_softcapping", 0.0) or 0.0)
        if self.softcap > 0:
            raise ValueError("training a draft with final_logit_softcapping > 0 is not supported (the fused "
                             "cross-entropy has no soft-cap): set draft.dflash2.final_logit_softcapping=0")
        if self.output_multiplier != 1.0 and (self.distill_weight > 0 or self.accept_weight > 0):
            raise ValueError("draft.dflash2.output_multiplier != 1 trains with hard cross-entropy only: set "
                             "loss.distill_weight=0 and loss.accept_weight=0, or output_multiplier=1")

    @property
    def embed_tokens(self) -> nn.Module:
        return self._frozen[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._frozen[1]

    def _fused_kernel(self, device: torch.device, expected_teacher: bool) -> Optional[str]:
        """The fused CE kernel (cce | liger) this step's loss runs with, or None for `chunked_lm_loss`:
        training steps only (held-out evaluation keeps the reference path), a frozen bias-free Linear
        lm_head, and distillation (if on) through the target's expected embeddings."""
        if self.loss_impl == "chunked" or not torch.is_grad_enabled() or not expected_teacher:
            return None
        if not _fusable(self.lm_head, None, 0.0):
            return None
        impl = resolve_loss_impl(self.loss_impl, device)
        return None if impl == "chunked" else impl

    def _accept_term(self, batch: DFlashTargetBatch, h_sel: torch.Tensor, src: torch.Tensor,
                     sel: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The acceptance loss term and a per loss row (`accept_loss.accept_lm_loss`): each row scored against
        the target's state (or logits) at `src` [B, L], the position that predicts the same token; the target's
        rows are gathered by index chunk by chunk, never copied out whole."""
        if batch.final_hidden is None and batch.logits is None:
            raise ValueError("accept_weight > 0 needs the target's distribution: call "
                             "generate_batch(return_final_hidden=True) (or return_logits=True)")
        if not _fusable(self.lm_head, None, 0.0):
            raise ValueError("accept_weight > 0 needs a frozen, bias-free Linear lm_head (the target's)")
        source = batch.final_hidden if batch.final_hidden is not None else batch.logits
        bsz, seq = source.shape[:2]
        index = (torch.arange(bsz, device=src.device).unsqueeze(1) * seq + src).flatten()
        if sel is not None:
            index = index.index_select(0, sel)
        return accept_lm_loss(
            h_sel, self.lm_head.weight, source.reshape(bsz * seq, -1), self.ce_chunk_size, index=index,
            teacher_is_logits=batch.final_hidden is None, temperature=self.accept_temperature, form=self.accept_form,
            compiled=_compiled_on_cuda(accept_chunk, h_sel.device),
        )

    def plan(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        attention_mask: torch.Tensor,
        generator: Optional[torch.Generator] = None,
        row_seeds: Optional[Sequence[int]] = None,
        doc_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> BlockPlan:
        """This module's `plan_blocks` (its block size and anchor count), e.g. on the CPU batch."""
        return plan_blocks(input_ids, loss_mask, attention_mask, self.block_size, self.num_anchors, generator, row_seeds,
                           doc_ids=doc_ids, position_ids=position_ids)

    def forward(
        self,
        batch: DFlashTargetBatch,
        generator: Optional[torch.Generator] = None,
        anchors: Optional[torch.Tensor] = None,
        valid: Optional[torch.Tensor] = None,
        row_seeds: Optional[Sequence[int]] = None,
        plan: Optional[BlockPlan] = None,
    ) -> DFlashLossOutput:
        input_ids, attn, loss_mask = batch.input_ids, batch.attention_mask, batch.loss_mask
        bsz, seq = input_ids.shape
        blk = self.block_size
        if plan is None:
            plan = plan_blocks(input_ids, loss_mask, attn, blk, self.num_anchors, generator, row_seeds, anchors, valid,
                               doc_ids=batch.doc_ids, position_ids=batch.position_ids)
        anchors, valid, label_valid, sel = plan.anchors, plan.valid, plan.label_valid, plan.sel
        n_blk = anchors.shape[1]

        hidden = draft_block_hidden(
            self.draft, self.embed_tokens, input_ids, batch.hidden_states, attn, anchors, valid, blk,
            self.mask_token_id, backend=self.attn_backend, ctx_pos=batch.position_ids, anchor_pos=plan.anchor_pos,
            ctx_start=plan.ctx_start,
        )  # [B, A*blk, H]

        decay = loss_decay_weights(blk, self.gamma, input_ids.device)
        if sel is None:
            # packed: every block's slots 1.. (fixed shape); invalid ones weigh 0
            w_sel = (decay[1:] * label_valid[..., 1:]).flatten()
            h_sel = hidden.view(bsz, n_blk, blk, -1)[:, :, 1:].reshape(bsz * n_blk * (blk - 1), -1)
            # The target predicts token[a+k] from position a+k-1, k = 1..blk-1.
            src = (anchors.unsqueeze(-1) + torch.arange(blk - 1, device=anchors.device)).clamp(max=seq - 1).flatten(1)
        else:
            # sel holds only valid label slots, whose weight is the slot's decay weight
            w_sel = decay[sel % blk]
            h_sel = hidden.reshape(bsz * n_blk * blk, -1).index_select(0, sel)
            src = None
        # with the acceptance term on, the CE part is (1 - w) * [(1 - d') hard + d' soft], d' = d / (1 - w)
        w_acc = self.accept_weight
        d_ce = self.distill_weight
        if w_acc > 0:
            d_ce = min(1.0, self.distill_weight / (1.0 - w_acc)) if w_acc < 1 else 0.0
        teacher = teacher_h = teacher_e = None
        if d_ce > 0:
            if batch.logits is None and batch.final_hidden is None:
                raise ValueError("distill_weight > 0 needs the target's distribution: call "
                                 "generate_batch(return_final_hidden=True) (or return_logits=True)")
            if src is None:
                src = (block_positions(anchors, blk) - 1).clamp(0, seq - 1).flatten(1)
            source = batch.final_hidden if batch.final_hidden is not None else batch.logits
            # through the shared frozen head, the target's distribution at a position enters the loss
            # only as its expected embedding: formed once per position, then gathered per block slot
            expected = batch.final_hidden is not None and _fusable(self.lm_head, None, 0.0)
            if expected:
                source = teacher_expected_embedding(source, self.lm_head.weight, self.ce_chunk_size)
            rows = _rows_at(source, src, sel)
            if expected:
                teacher_e = rows
            elif batch.final_hidden is not None:
                teacher_h = rows
            else:
                teacher = rows
        # the unary logits are output_multiplier * lm_head(h) (DFlash2's; 1 for DFlash-1): scale the rows
        h_ce = h_sel if self.output_multiplier == 1.0 else h_sel * self.output_multiplier
        kernel = self._fused_kernel(h_sel.device, teacher is None and teacher_h is None)
        selector = self.draft.candidate_selector if getattr(self.draft, "has_selector", False) else None
        candidates = None  # the selector's top-K unary candidates, from the CE's own logits where it forms them
        if kernel is not None:
            tok_loss, pred = fused_lm_loss(
                kernel, h_ce, self.lm_head.weight, plan.labels, self.ce_chunk_size, teacher_e, d_ce,
                compiled_argmax=_compiled_on_cuda(argmax_chunk, h_sel.device),
            )
        elif selector is not None:
            tok_loss, pred, candidates = chunked_lm_loss(
                h_ce, plan.labels, self.lm_head, self.ce_chunk_size, teacher, d_ce, fused=self.fused_ce,
                teacher_hidden=teacher_h, teacher_embedding=teacher_e, top_k=selector.top_k,
            )
        else:
            tok_loss, pred = chunked_lm_loss(
                h_ce, plan.labels, self.lm_head, self.ce_chunk_size, teacher, d_ce, fused=self.fused_ce,
                teacher_hidden=teacher_h, teacher_embedding=teacher_e,
            )
        accept = None
        if w_acc > 0:
            if src is None:
                src = (block_positions(anchors, blk) - 1).clamp(0, seq - 1).flatten(1)
            acc_term, accept = self._accept_term(batch, h_sel, src, sel)
            tok_loss = (1.0 - w_acc) * tok_loss + w_acc * acc_term
        weight_sum = w_sel.sum()
        if self.position_weights == "dpace":
            w_sel = _to_rows(dpace_weights(_to_slots(tok_loss.detach(), sel, bsz, n_blk, blk), label_valid[..., 1:],
                                           self.dpace_alpha), sel)
            weight_sum = label_valid.sum().to(w_sel.dtype)  # D-PACE normalises by the valid slots
        term = None
        if selector is not None:
            term = selector_lm_loss(
                h_sel, self.lm_head.weight, selector, plan.labels,
                _rows_at(input_ids.unsqueeze(-1), _predecessor_positions(anchors, blk, seq, sel), sel).squeeze(-1),
                self.ce_chunk_size, multiplier=self.output_multiplier, outside=self.selector_outside,
                candidates=candidates,
            )
        sampled = None
        if (self.accept_sampling is not None and not self.accept_sampling.greedy and not torch.is_grad_enabled()
                and batch.final_hidden is not None):
            if src is None:
                src = (block_positions(anchors, blk) - 1).clamp(0, seq - 1).flatten(1)
            t_rows = _rows_at(batch.final_hidden, src, sel)
            if term is not None:  # q from the walk given the true predecessor, as decoding proposes
                sampled = selector_slot_acceptance(term.scores, term.candidates, term.pick, t_rows, self.lm_head,
                                                   self.accept_sampling, self.ce_chunk_size)
            else:
                sampled = slot_acceptance(h_ce, t_rows, self.lm_head, self.accept_sampling, self.ce_chunk_size)
        # `0 * hidden.sum()` keeps every draft parameter in the graph when no label is valid,
        # so DDP/FSDP gradient collectives still run on this rank (no hang).
        loss_sum = (tok_loss * w_sel).sum() + 0.0 * hidden.sum()
        sel_sum = None
        if term is not None:
            sel_sum = (term.loss * w_sel).sum()
            loss_sum = loss_sum + self.selector_weight * sel_sum
            if h_sel.shape[0] == 0:  # no loss rows: the selector's parameters still join the gradient collectives
                loss_sum = loss_sum + 0.0 * sum(p.sum() for p in self.draft.candidate_selector.parameters())

        with torch.no_grad():
            def by_slot(ok: torch.Tensor) -> torch.Tensor:
                return F.pad(_to_slots(ok, sel, bsz, n_blk, blk), (1, 0), value=False)

            # a selector's walk proposes its pick; DFlash-1 each slot's argmax
            correct = by_slot((term.pick if term is not None else pred) == plan.labels)
            block_ok = label_valid.any(-1)
            acc_len = acceptance_lengths(correct, label_valid)
            return_out = DFlashLossOutput(
                loss_sum=loss_sum,
                weight_sum=weight_sum,
                correct=(correct & label_valid).sum(),
                num_labels=label_valid.sum(),
                accept_sum=(acc_len * block_ok).sum().float(),
                num_blocks=block_ok.sum(),
                **_flop_counts(batch, plan, blk),
            )
            if term is not None:
                return_out.selector_loss_sum = sel_sum.detach()
                return_out.unary_accept_sum = (acceptance_lengths(by_slot(pred == plan.labels), label_valid)
                                               * block_ok).sum().float()
                inside = by_slot(term.inside)
                return_out.topk_hits = (inside & label_valid).sum()
                return_out.oracle_accept_sum = (acceptance_lengths(inside, label_valid) * block_ok).sum().float()
            if accept is not None:
                on = label_valid[..., 1:].flatten() if sel is None else None
                return_out.accept_prob_sum = (accept * on).sum() if on is not None else accept.sum()
                return_out.accept_prob_slots = label_valid.sum()
            if sampled is not None:
                lengths = []
                for alpha in sampled:
                    per_slot = _to_slots(alpha, sel, bsz, n_blk, blk) * label_valid[..., 1:]
                    lengths.append((expected_block_length(per_slot) * block_ok).sum())
                return_out.sampled_accept_sum, return_out.greedy_draft_accept_sum = lengths
                return_out.sampled_blocks = block_ok.sum()
                on = label_valid[..., 1:]
                hit = (correct[..., 1:] & on).double()
                alpha = _to_slots(sampled[0], sel, bsz, n_blk, blk).double() * on
                return_out.slot1_greedy_sum, return_out.later_greedy_sum = hit[..., 0].sum(), hit[..., 1:].sum()
                return_out.slot1_sampled_sum, return_out.later_sampled_sum = alpha[..., 0].sum(), alpha[..., 1:].sum()
                return_out.slot1_slots, return_out.later_slots = on[..., 0].sum(), on[..., 1:].sum()
        return return_out


def _to_slots(rows: torch.Tensor, sel: Optional[torch.Tensor], bsz: int, n_blk: int, blk: int) -> torch.Tensor:
    """Per loss row values [N] -> [B, A, blk - 1] by label slot 1..blk-1 (zero / False where no row is)."""
    if sel is None:
        return rows.view(bsz, n_blk, blk - 1)
    full = torch.zeros(bsz * n_blk * blk, dtype=rows.dtype, device=rows.device)
    full[sel] = rows
    return full.view(bsz, n_blk, blk)[..., 1:]


def _to_rows(slots: torch.Tensor, sel: Optional[torch.Tensor]) -> torch.Tensor:
    """The inverse of `_to_slots`: [B, A, blk - 1] -> the loss rows [N]."""
    if sel is None:
        return slots.flatten()
    return F.pad(slots, (1, 0)).flatten().index_select(0, sel)


def _predecessor_positions(anchors: torch.Tensor, blk: int, seq: int, sel: Optional[torch.Tensor]) -> torch.Tensor:
    """[B, L] positions of the token before each label slot (a + k - 1: the anchor for slot 1), laid out as
    `_rows_at` reads them for the loss rows."""
    if sel is None:
        return (anchors.unsqueeze(-1) + torch.arange(blk - 1, device=anchors.device)).clamp(max=seq - 1).flatten(1)
    return (block_positions(anchors, blk) - 1).clamp(0, seq - 1).flatten(1)


def _flop_counts(batch: DFlashTargetBatch, plan: BlockPlan, block: int) -> dict[str, torch.Tensor]:
    """The `LossSums` counts a step's model FLOPs follow from, as tensors (no host sync)."""
    anchor_pos = plan.anchor_pos if plan.anchor_pos is not None else plan.anchors
    valid = plan.valid
    visible = (block * (anchor_pos + block) * valid).sum()
    if batch.doc_ids is not None and batch.position_ids is not None:  # packed: per document
        real = batch.doc_ids >= 0
        tokens = real.sum()
        pairs = ((batch.position_ids + 1) * real).sum()
    else:  # unpacked: every row as long as the longest, as the target runs them
        rows = batch.attention_mask.shape[0]
        length = batch.attention_mask.sum(1).max()
        tokens = rows * length
        pairs = rows * length * (length + 1) // 2
    return {"valid_blocks": valid.sum(), "visible_keys": visible, "context_tokens": tokens, "context_pairs": pairs}


__all__ = [
    "BlockPlan",
    "DFlashLossOutput",
    "DFlashTrainerModule",
    "LossSums",
    "acceptance_lengths",
    "expected_block_length",
    "slot_acceptance",
    "build_block_input_ids",
    "build_dense_block_mask",
    "build_flex_block_mask",
    "build_labels",
    "block_positions",
    "anchor_quotas",
    "document_bounds",
    "sample_packed_anchors",
    "chunked_lm_loss",
    "draft_block_hidden",
    "loss_decay_weights",
    "plan_blocks",
    "sample_anchors",
]
