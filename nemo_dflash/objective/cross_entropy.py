"""The draft's cross-entropy over the frozen lm_head, chunk by chunk, never [tokens, vocab] at once: hard CE
mixed with soft CE against the target (distillation through the teacher's expected embeddings), its gradient
formed in the forward pass (`_FusedLinearCE`) or each chunk checkpointed.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nemo_dflash.engine.compiled import compiled
from nemo_dflash.engine.sampling import topk_ids


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
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """One chunk of `_FusedLinearCE`: per-row loss, argmax, dL/dh = (softmax - target) @ W in fp32, and with
    `top_k` the ids of each row's top-k logits (a candidate selector's candidates, from the same logits) and the
    logits [n, top_k + 1] of those candidates and of the label.

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
    cand_logits = torch.cat([logits.gather(1, cand), logit_y.unsqueeze(1)], dim=1) if top_k else None
    if not need_grad:
        return loss, pred, None, cand, cand_logits
    probs = torch.exp(logits - lse.unsqueeze(1))
    onehot = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0) == y.unsqueeze(1)
    probs = torch.where(onehot, probs - hard, probs)
    grad = torch.matmul(probs.to(mm_dtype), w_mm).float()
    return loss, pred, grad - soft_weight * te if te is not None else grad, cand, cand_logits


class _FusedLinearCE(torch.autograd.Function):
    """Cross-entropy of `hidden @ weight.T` whose input gradient is formed in the forward pass.

    Chunk by chunk: logits -> per-row loss and argmax -> dL/dhidden = (softmax - onehot) @ W,
    kept as one [N, H] fp32 tensor. Backward only scales it by the incoming per-row gradient,
    so the lm_head matmul is never recomputed (the checkpointed path runs it twice) and no
    [N, vocab] tensor outlives its chunk. `weight` is the frozen lm_head: it gets no gradient.
    With `teacher` (the target's expected embeddings for the same rows, `teacher_expected_embedding`),
    the soft CE against the target's distribution is mixed in with weight `soft_weight`.
    With `top_k`, the third output holds each row's top-k token ids from the same logits (DFlash2's
    candidates: no second pass over the vocabulary) and the fourth the logits [N, top_k + 1] of those candidates
    and of the label, differentiable: their gradient sum_k g_k W[id_k] is added in backward from the gathered
    head rows, so the selector's unary scores cost no lm_head pass and no recomputed chunk; else [N, 0] each.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                teacher: Optional[torch.Tensor] = None, soft_weight: float = 0.0, top_k: int = 0):
        n = hidden.shape[0]
        losses = hidden.new_empty(n, dtype=torch.float32)
        preds = torch.empty(n, dtype=torch.long, device=hidden.device)
        cands = torch.empty(n, top_k, dtype=torch.long, device=hidden.device)
        cand_logits = hidden.new_empty(n, top_k + 1 if top_k else 0, dtype=torch.float32)
        need_grad = ctx.needs_input_grad[0]
        grad = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if need_grad else None
        chunk_fn = _compiled_on_cuda(_ce_chunk, hidden.device)
        dev = hidden.device.type
        mm_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
        if chunk_fn is not None or teacher is not None:
            run = chunk_fn or _ce_chunk
            with torch.autocast(dev, enabled=False):
                for s in range(0, n, chunk_size):
                    th = teacher[s : s + chunk_size] if teacher is not None else None
                    loss, pred, g, cand, cl = run(hidden[s : s + chunk_size], weight, labels[s : s + chunk_size],
                                                  mm_dtype, need_grad, th, soft_weight, top_k)
                    losses[s : s + chunk_size] = loss
                    preds[s : s + chunk_size] = pred
                    if top_k:
                        cands[s : s + chunk_size] = cand
                        cand_logits[s : s + chunk_size] = cl
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
                    cand = topk_ids(logits, top_k)
                    cands[s : s + chunk_size] = cand
                    cand_logits[s : s + chunk_size] = torch.cat([logits.gather(1, cand), logits.gather(1, y.unsqueeze(1))], 1)
                if need_grad:
                    probs = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the logits
                    probs.scatter_add_(1, y.unsqueeze(1), probs.new_full((y.shape[0], 1), -1.0))
                    # bf16 under autocast, like the gradient the checkpointed path feeds back through lm_head
                    grad[s : s + chunk_size] = torch.matmul(probs.to(weight.dtype), weight).float()
        ctx.save_for_backward(grad, weight, cands, labels)
        ctx.hidden_dtype, ctx.mm_dtype, ctx.chunk_size = hidden.dtype, mm_dtype, chunk_size
        ctx.mark_non_differentiable(preds, cands)
        return losses, preds, cands, cand_logits

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_preds: Optional[torch.Tensor], grad_cands: Optional[torch.Tensor],
                 grad_cand_logits: Optional[torch.Tensor]):
        grad, weight, cands, labels = ctx.saved_tensors
        if grad is None:
            return None, None, None, None, None, None, None
        out = grad * grad_loss.unsqueeze(1)
        if grad_cand_logits is not None and cands.shape[1]:
            ids = torch.cat([cands, labels.unsqueeze(1)], dim=1)
            w = weight.to(ctx.mm_dtype)
            for s in range(0, ids.shape[0], ctx.chunk_size):  # d(h . W[id]) / dh = W[id], head rows a chunk at a time
                g = grad_cand_logits[s : s + ctx.chunk_size].to(w.dtype).unsqueeze(1)
                out[s : s + ctx.chunk_size] += torch.bmm(g, w[ids[s : s + ctx.chunk_size]]).squeeze(1).float()
        return out.to(ctx.hidden_dtype), None, None, None, None, None, None


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
    With `top_k` > 0 two more values are returned: each row's top-k token ids [N, top_k] and the logits
    [N, top_k + 1] of those ids and of the label (differentiable) when the fused path formed them from its logits,
    else None and None (the caller then runs `selector_loss.topk_rows`).
    """
    weight = getattr(lm_head, "weight", None)
    if (isinstance(weight, torch.Tensor) and hidden.dtype != weight.dtype
            and not torch.is_autocast_enabled(hidden.device.type)):
        hidden = hidden.to(weight.dtype)  # e.g. an fp32 draft over a bf16 target without autocast

    def done(loss: torch.Tensor, pred: torch.Tensor, cand: Optional[torch.Tensor] = None,
             cand_logits: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
        return (loss, pred, cand, cand_logits) if top_k else (loss, pred)

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
