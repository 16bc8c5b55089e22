"""Token sampling shared by regeneration (`data.generation`) and speculative decoding (`inference`).

Bottom layer: imports torch only, so both sides take their noise and acceptance rule from one place.

- Keyed sampling: every uniform is a pure hash of (seed, key, position, token id), so a sampled token
  does not depend on batch composition or launch order, and a sampling step is one CUDA graph.
- `select_tokens` / `verify_block`: the one-prompt decoder's token choice (generator-driven) and the
  speculative acceptance rule (accept slot k with probability min(1, p/q), else sample the residual).
"""

from __future__ import annotations

from typing import Optional

import torch

_MASK32 = 0xFFFFFFFF


# ----------------------------------------------------------------------------- keyed sampling


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding 32-bit values (a cheap, well-mixed hash)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def keyed_uniform(seed: int, keys: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), one per (row, token): a pure function of (seed, key, position, token id).

    ``token_ids`` is [N, K] (the candidates of each row) or [V] (the whole vocabulary, every row).
    """
    row = _fmix32((keys.to(torch.int64) * 0x9E3779B1 + seed) & _MASK32)
    row = _fmix32((row ^ (positions.to(torch.int64) * 0x85EBCA77)) & _MASK32)
    cols = token_ids.to(torch.int64) * 0xC2B2AE3D
    h = _fmix32((row[:, None] + (cols if cols.dim() == 2 else cols[None, :])) & _MASK32)
    return ((h.to(torch.float64) + 0.5) / 2.0**32).to(torch.float32)


def gumbel(u: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise from uniforms: argmax(scores + gumbel(u)) is a draw from softmax(scores)."""
    return -torch.log(-torch.log(u))


def top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """``scores`` with the tokens outside the smallest set of probability >= top_p set to -inf."""
    if top_p >= 1.0:
        return scores
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    probs = sorted_scores.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    drop_sorted = before >= top_p  # the first token always stays (before == 0)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def sample_full(scores: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, seed: int, top_p: float):
    vocab = torch.arange(scores.shape[-1], device=scores.device)
    return (top_p_filter(scores, top_p) + gumbel(keyed_uniform(seed, keys, positions, vocab))).argmax(dim=-1)


def keyed_sample_candidates(
    logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, *, seed: int, temperature: float,
    top_p: float, candidates: int = 64,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(next token per row, rows whose nucleus is wider than ``candidates`` or None), branch-free.

    Gumbel-max with keyed noise: argmax(scores + Gumbel(u)) is distributed as softmax(scores).
    The nucleus almost always lies within a row's ``candidates`` best tokens, so noise is drawn
    for those only (the same noise the whole-vocabulary path draws for them). The token of a
    "wide" row is not exact: :func:`keyed_sample` redoes those rows over the whole vocabulary.
    """
    if temperature <= 0:
        return logits.argmax(dim=-1), None
    scores = logits.float() / temperature
    if top_p >= 1.0 or candidates >= scores.shape[-1]:
        return sample_full(scores, keys, positions, seed, top_p), None
    values, ids = scores.topk(candidates, dim=-1)
    probs = (values - torch.logsumexp(scores, dim=-1, keepdim=True)).exp()
    cum = probs.cumsum(dim=-1)
    keep = (cum - probs) < top_p
    noisy = values + gumbel(keyed_uniform(seed, keys, positions, ids))
    out = ids.gather(-1, noisy.masked_fill(~keep, float("-inf")).argmax(dim=-1, keepdim=True))[:, 0]
    return out, cum[:, -1] < top_p


def keyed_sample(
    logits: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    *,
    seed: int,
    temperature: float,
    top_p: float,
    candidates: int = 64,
) -> torch.Tensor:
    """Next token per row: argmax at temperature 0, else a sample of softmax(logits / T) within
    top-p, a pure function of (seed, key, position, logits); see :func:`keyed_sample_candidates`."""
    out, wide = keyed_sample_candidates(logits, keys, positions, seed=seed, temperature=temperature, top_p=top_p,
                                        candidates=candidates)
    redo_wide_rows(out, wide, logits, keys, positions, seed=seed, temperature=temperature, top_p=top_p)
    return out


def redo_wide_rows(
    out: torch.Tensor, wide: Optional[torch.Tensor], logits: torch.Tensor, keys: torch.Tensor,
    positions: torch.Tensor, *, seed: int, temperature: float, top_p: float,
) -> Optional[torch.Tensor]:
    """Redo, in ``out``, the rows of ``wide`` over the whole vocabulary (exact); the rows redone, or None."""
    if wide is None or not bool(wide.any()):
        return None
    rows = wide.nonzero()[:, 0]
    out[rows] = sample_full(logits[rows].float() / temperature, keys[rows], positions[rows], seed, top_p)
    return rows


# ----------------------------------------------------------------------------- generator-driven sampling


def probs_at(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample_from(probs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def select_tokens(
    logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator] = None
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """[N, V] logits -> (tokens [N], probs [N, V] or None at T=0)."""
    if temperature <= 0:
        return logits.argmax(dim=-1), None
    probs = probs_at(logits, temperature)
    return sample_from(probs, generator), probs


def verify_block(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: float = 0.0,
    draft_probs: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> tuple[int, int]:
    """Decide how much of a drafted block to keep: returns (num_accepted, next_token).

    draft_tokens: [K] proposals for block slots 1..K; target_logits: [K + 1, V], row k being
    the target's prediction after slot k (row k judges draft_tokens[k]; row K gives the bonus).
    T = 0: accept the longest prefix where draft == target argmax; the next token is the
    target's argmax after it. T > 0: accept slot k with probability min(1, p/q); on the first
    rejection sample from norm(max(p - q, 0)); if all pass, sample the bonus from p.
    """
    k_len = draft_tokens.shape[0]
    if temperature <= 0:
        target_tokens = target_logits.argmax(dim=-1)
        match = (draft_tokens == target_tokens[:k_len]).long()
        n_acc = int(match.cumprod(dim=0).sum()) if k_len else 0
        return n_acc, int(target_tokens[n_acc])
    if draft_probs is None and k_len:
        raise ValueError("Speculative sampling (temperature > 0) needs the draft's probabilities")
    p = probs_at(target_logits, temperature)  # [K + 1, V]
    if k_len:
        idx = draft_tokens.unsqueeze(-1)
        p_tok = p[:-1].gather(-1, idx).squeeze(-1)
        q_tok = draft_probs.float().gather(-1, idx).squeeze(-1)  # type: ignore[union-attr]
        u = torch.rand(k_len, device=p.device, generator=generator)
        accept = (u * q_tok < p_tok).long()  # u < p/q without dividing by a zero q
        n_acc = int(accept.cumprod(dim=0).sum())
    else:
        n_acc = 0
    if n_acc < k_len:
        residual = (p[n_acc] - draft_probs[n_acc].float()).clamp(min=0)  # type: ignore[index]
        total = residual.sum()
        dist = residual / total if total > 0 else p[n_acc]
        return n_acc, int(sample_from(dist, generator))
    return n_acc, int(sample_from(p[k_len], generator))


def verify_blocks(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: float,
    draft_probs: Optional[torch.Tensor],
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_block` for B rows at once, on the device: (num_accepted [B], next_token [B]).

    draft_tokens [B, K], target_logits [B, K + 1, V], draft_probs [B, K, V] (T > 0). The same rule
    per row (T = 0: the longest prefix equal to the argmax; T > 0: accept slot k with probability
    min(1, p/q), then a sample of the residual at the first rejection, or the bonus from p), drawn
    from one generator for the whole batch: the same distribution as `verify_block` row by row,
    without a host sync per row.
    """
    bsz, k_len = draft_tokens.shape
    if temperature <= 0:
        target_tokens = target_logits.argmax(dim=-1)  # [B, K + 1]
        n_acc = (draft_tokens == target_tokens[:, :k_len]).long().cumprod(dim=1).sum(dim=1)
        return n_acc, target_tokens.gather(1, n_acc.view(-1, 1)).squeeze(1)
    if draft_probs is None and k_len:
        raise ValueError("Speculative sampling (temperature > 0) needs the draft's probabilities")
    p = probs_at(target_logits, temperature)  # [B, K + 1, V]
    rows = torch.arange(bsz, device=p.device)
    if k_len:
        idx = draft_tokens.unsqueeze(-1)
        p_tok = p[:, :-1].gather(-1, idx).squeeze(-1)
        q = draft_probs.float()
        q_tok = q.gather(-1, idx).squeeze(-1)
        u = torch.rand(bsz, k_len, device=p.device, generator=generator)
        n_acc = (u * q_tok < p_tok).long().cumprod(dim=1).sum(dim=1)  # u < p/q without dividing by a zero q
        at = n_acc.clamp(max=k_len - 1)
        residual = (p[rows, at] - q[rows, at]).clamp(min=0)
        total = residual.sum(-1, keepdim=True)
        residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p[rows, at])
        dist = torch.where((n_acc < k_len).view(-1, 1), residual, p[rows, n_acc])
    else:
        n_acc = torch.zeros(bsz, dtype=torch.long, device=p.device)
        dist = p[:, 0]
    return n_acc, sample_from(dist, generator)

