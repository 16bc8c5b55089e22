"""DFlash2's training terms: the candidate selector's K-way cross-entropy, and D-PACE position weights.

The selector term (`selector_lm_loss`) scores each label slot's top-K unary candidates given the TRUE token before
it (teacher-forced: the anchor for the first slot), as the walk would once every slot before it was accepted, and
takes the cross-entropy of the true token's candidate index. A true token outside the top-K is either put in place
of the K-th candidate (``inject``: loss only) or leaves the slot out (``skip``). Its gradient reaches the backbone
through the unary logits of the candidates and the projected hidden state, and the selector's codebooks.

The same pass returns what the walk's metrics need (no gradient): the walk's teacher-forced choice (its T=0 pick
while every slot before it was accepted, so the simulated acceptance of the walk is exact), whether the true
token was a candidate (top-K recall, and the oracle walk that always picks it when it can), and the pair scores,
from which held-out evaluation forms q for the expected acceptance under speculative sampling.

D-PACE (`dpace_weights`): w_k = sum_{m >= k} prod_{i <= m} q~_i over a block's valid slots, q~ = (1 - a) exp(-CE) + a
(no gradient), the loss normalised by the number of valid slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nemo_dflash.engine.sampling import topk_ids

SELECTOR_OUTSIDE = ("inject", "skip")


def topk_rows(hidden: torch.Tensor, weight: torch.Tensor, k: int, chunk_size: int) -> torch.Tensor:
    """The top-k token ids [N, k] of each row's logits ``hidden @ weight.T``, ``chunk_size`` rows at a time, no
    grad: the unary logits' candidates (a positive output multiplier and a soft-cap keep the order)."""
    out = torch.empty(hidden.shape[0], k, dtype=torch.long, device=hidden.device)
    with torch.no_grad():
        for s in range(0, hidden.shape[0], chunk_size):
            logits = F.linear(hidden[s : s + chunk_size].to(weight.dtype), weight)
            out[s : s + chunk_size] = topk_ids(logits, k)
    return out


def _unary_at(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, multiplier: float,
              softcap: float) -> torch.Tensor:
    """u(ids) = softcap(multiplier * h . W[ids]) for ids [n, K] of each row: [n, K] fp32, W's rows gathered."""
    return _softcapped(torch.einsum("nh,nkh->nk", hidden.to(weight.dtype), weight[ids]).float() * multiplier, softcap)


def _softcapped(u: torch.Tensor, softcap: float) -> torch.Tensor:
    """softcap * tanh(u / softcap) when softcap > 0, else u (fp32)."""
    return softcap * torch.tanh(u.float() / softcap) if softcap > 0 else u.float()


def _selector_chunk(hidden: torch.Tensor, weight: torch.Tensor, selector: nn.Module, cand: torch.Tensor,
                    labels: torch.Tensor, prev: torch.Tensor, multiplier: float, softcap: float, inject: bool,
                    cand_logits: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: (selector CE per row [n], the pair scores of the true candidates plus the label [n, K + 1]).
    ``cand_logits`` [n, K + 1]: the multiplied unary logits of the candidates and the label, when the caller's
    cross-entropy formed them (then no lm_head row is gathered here); the soft-cap is applied here."""
    ids = torch.cat([cand, labels.unsqueeze(1)], dim=1)  # the K candidates, then the true token
    if cand_logits is None:
        u = _unary_at(hidden, weight, ids, multiplier, softcap)
    else:
        u = _softcapped(cand_logits, softcap)
    scores = selector.pair_scores(hidden, u, ids, prev)
    k = cand.shape[1]
    hit = cand == labels.unsqueeze(1)
    inside = hit.any(dim=1)
    if inject:  # the true token in place of the K-th candidate where it is not one
        trained = torch.where(inside.unsqueeze(1), scores[:, :k], torch.cat([scores[:, : k - 1], scores[:, k:]], 1))
        target = torch.where(inside, hit.float().argmax(dim=1), torch.full_like(labels, k - 1))
        loss = F.cross_entropy(trained, target, reduction="none")
    else:
        loss = F.cross_entropy(scores[:, :k], hit.float().argmax(dim=1), reduction="none") * inside
    return loss, scores


@dataclass
class SelectorTerm:
    """The selector's per-row outputs over the loss rows [N]."""

    loss: torch.Tensor  # K-way CE (0 on skipped rows), differentiable
    pick: torch.Tensor  # the walk's teacher-forced choice (token id)
    inside: torch.Tensor  # the true token is one of the candidates
    candidates: torch.Tensor  # [N, K] token ids
    scores: torch.Tensor  # [N, K] pair scores of the candidates (detached)


def selector_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, selector: nn.Module, labels: torch.Tensor,
                     prev: torch.Tensor, chunk_size: int, *, multiplier: float = 1.0, softcap: float = 0.0,
                     outside: str = "inject", candidates: Optional[torch.Tensor] = None,
                     candidate_logits: Optional[torch.Tensor] = None) -> SelectorTerm:
    """The selector term over loss rows: hidden [N, H] (the draft's final states), labels [N] (the true tokens),
    prev [N] (the true token of the slot before; the anchor for the first slot). Chunks of ``chunk_size`` rows,
    each checkpointed under grad: the gathered [n, K, H] lm_head rows never outlive their chunk. ``candidates``
    [N, K]: the unary top-K when the caller's cross-entropy already formed them (`cross_entropy.chunked_lm_loss`'s
    ``top_k``), else they are computed here; ``candidate_logits`` [N, K + 1] their multiplied unary logits and the
    label's (its fourth value, differentiable), else gathered here from the head's rows. Without the head's rows a
    row costs only its codebook rows, so those chunks are larger (fewer launches)."""
    if outside not in SELECTOR_OUTSIDE:
        raise ValueError(f"loss.selector_outside must be one of {SELECTOR_OUTSIDE}, got {outside!r}")
    cand = candidates if candidates is not None else topk_rows(hidden.detach(), weight, selector.top_k, chunk_size)
    inject = outside == "inject"
    run = _selector_chunk
    if torch.is_grad_enabled():
        def run(*args):  # noqa: E306  (checkpointed: recomputed in backward)
            return checkpoint(_selector_chunk, *args, use_reentrant=False)
    losses, scores = [], []
    if candidate_logits is not None:  # [n, K + 1, rank] codebook rows a chunk: about 2^27 of them at a time
        chunk_size = max(chunk_size, (1 << 27) // ((selector.top_k + 1) * selector.hidden_projection.out_features))
    for s in range(0, hidden.shape[0], chunk_size):
        sl = slice(s, s + chunk_size)
        cl = candidate_logits[sl] if candidate_logits is not None else None
        loss, sc = run(hidden[sl], weight, selector, cand[sl], labels[sl], prev[sl], multiplier, softcap, inject, cl)
        losses.append(loss)
        scores.append(sc.detach())
    k = selector.top_k
    if not losses:  # no loss rows: empty outputs of the right shapes
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return SelectorTerm(empty, cand[:, 0], cand[:, 0].bool(), cand, hidden.new_zeros(0, k, dtype=torch.float32))
    sc = torch.cat(scores)
    inside = (cand == labels.unsqueeze(1)).any(dim=1)
    pick = cand.gather(1, sc[:, :k].argmax(dim=1, keepdim=True)).squeeze(1)
    return SelectorTerm(torch.cat(losses), pick, inside, cand, sc[:, :k])


def selector_slot_acceptance(scores: torch.Tensor, candidates: torch.Tensor, pick: torch.Tensor,
                             teacher_hidden: torch.Tensor, lm_head: nn.Module, sampling, chunk_size: int
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per loss row, the accept probability of speculative sampling with the walk's proposal: (sum_x min(p, q),
    p(pick)). q = softmax(scores / T) over the candidates (temperature only, as the engines draw it), p the target's
    filtered distribution at the row (`sampling.probs` of its logits). No gradient."""
    a_sampled = torch.empty(scores.shape[0], dtype=torch.float32, device=scores.device)
    a_greedy = torch.empty_like(a_sampled)
    w = lm_head.weight
    with torch.no_grad():
        for s in range(0, scores.shape[0], chunk_size):
            sl = slice(s, s + chunk_size)
            p = sampling.probs(lm_head(teacher_hidden[sl].to(w.dtype)))
            q = torch.softmax(scores[sl].float() / sampling.temperature, dim=-1)
            a_sampled[sl] = torch.minimum(p.gather(1, candidates[sl]), q).sum(-1)
            a_greedy[sl] = p.gather(1, pick[sl].unsqueeze(1)).squeeze(1)
    return a_sampled, a_greedy


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE weights [..., K] of per-slot losses ``ce`` [..., K] over a block's label slots 1..K (``valid`` [..., K]
    bool): w_k = sum_{m >= k} prod_{i <= m} q~_i, q~_i = (1 - alpha) exp(-CE_i) + alpha on valid slots and 0 on
    invalid ones (a slot past the answer ends the block's run). No gradient."""
    with torch.no_grad():
        q = ((1.0 - alpha) * torch.exp(-ce.float()) + alpha) * valid
        survive = q.cumprod(dim=-1)
        return survive.flip(-1).cumsum(dim=-1).flip(-1) * valid


__all__ = ["SELECTOR_OUTSIDE", "SelectorTerm", "dpace_weights", "selector_lm_loss", "selector_slot_acceptance",
           "topk_rows"]
