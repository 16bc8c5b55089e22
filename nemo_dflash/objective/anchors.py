"""Where a training step's blocks start: anchors drawn per row or per packed document, the block inputs
`[token[a], MASK, ...]` at their positions, the labels and their decay weights, and the `BlockPlan` of a step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch
import torch.nn.functional as F


def sample_anchors(
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    block_size: int,
    num_anchors: int,
    generator: Optional[torch.Generator] = None,
    row_seeds: Optional[Sequence[int]] = None,
    doc_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to `num_anchors` anchors per row, uniformly without replacement.

    With `doc_ids` ([B, S] document index per token, -1 on padding: packed rows) the anchors are
    shared out over each row's documents instead (`_packed_anchors`).

    Candidates are supervised, real tokens that leave room for a whole block
    (a + block_size <= sequence length). Returns (anchors [B, A], valid [B, A]) sorted by
    position; rows with fewer candidates are padded with invalid anchors (position 0).
    A >= 1 always, so the draft runs (and its parameters join the graph) on every batch.

    With `row_seeds`, each row draws from its own seeded stream, so a sample gets the same
    anchors whatever batch, padding or rank it lands in (distributed runs then reproduce
    single-process losses, and resume needs no generator state).
    """
    if doc_ids is not None:
        return _packed_anchors(loss_mask, attention_mask, doc_ids, block_size, num_anchors, generator, row_seeds)
    bsz, seq = loss_mask.shape
    device = loss_mask.device
    cand = _candidates(loss_mask, attention_mask, block_size, attention_mask.long().sum(dim=1, keepdim=True))
    n_anchors = max(1, min(num_anchors, int(cand.sum(dim=1).max().item()) if cand.numel() else 0))
    if row_seeds is not None:
        scores = torch.stack([_seeded_draw(rs, seq, device) for rs in row_seeds])
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


def _candidates(loss_mask: torch.Tensor, attention_mask: torch.Tensor, block_size: int,
                end: torch.Tensor) -> torch.Tensor:
    """[B, S] where an anchor may stand: a supervised real token whose block fits before ``end`` (the row's
    length [B, 1], or each token's document end [B, S])."""
    pos = torch.arange(loss_mask.shape[1], device=loss_mask.device).unsqueeze(0)
    return loss_mask.bool() & attention_mask.bool() & (pos + block_size <= end)


def _seeded_draw(seed: int, n: int, device: torch.device) -> torch.Tensor:
    """``n`` uniform draws of a row's own stream ``seed`` (on the CPU, so any device draws the same), on ``device``."""
    return torch.rand(n, generator=torch.Generator().manual_seed(int(seed))).to(device)


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


def _packed_anchors(loss_mask: torch.Tensor, attention_mask: torch.Tensor, doc_ids: torch.Tensor, block_size: int,
                    num_anchors: int, generator: Optional[torch.Generator],
                    row_seeds: Optional[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
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
    cand = _candidates(loss_mask, attention_mask, block_size, end) & (doc_ids >= 0)
    n_anchors = max(1, int(num_anchors))
    anchors = torch.zeros(bsz, n_anchors, dtype=torch.long, device=loss_mask.device)
    valid = torch.zeros(bsz, n_anchors, dtype=torch.bool, device=loss_mask.device)
    for r in range(bsz):
        if row_seeds is not None:
            draw = _seeded_draw(row_seeds[r], seq + 1, loss_mask.device)
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
    drawn per document (`sample_anchors` with `doc_ids`), each block sees only its own document's
    context, and its positions come from `position_ids` (restarting per document).
    """
    if anchors is None:
        anchors, valid = sample_anchors(loss_mask, attention_mask, block_size, num_anchors, generator, row_seeds,
                                        doc_ids=doc_ids)
    assert valid is not None
    if doc_ids is None:
        labels, label_valid = build_labels(input_ids, loss_mask, attention_mask, anchors, valid, block_size)
        sel = label_valid.flatten().nonzero().squeeze(-1)
        return BlockPlan(anchors, valid, label_valid, sel, labels.flatten().index_select(0, sel))
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
