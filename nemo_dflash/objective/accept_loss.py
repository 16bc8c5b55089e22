"""A loss on the expected acceptance itself (`loss.accept_weight`): LK-style training of the draft.

Hard CE teaches the target's argmax and soft CE (forward KL) its whole distribution; under speculative
sampling what a slot keeps is neither, but the accept probability a = sum_x min(p_T(x), q(x)) = 1 - TV(p_T, q)
of the target's distribution p_T (at the sampling temperature T) and the draft's q. A capacity-limited draft
that minimises KL need not maximise a (Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for
Speculative Decoding", arXiv 2602.23881), so this term trains on a directly, in one of two forms:

    log:  -log a      (the paper's LK^alpha; the default)
    tv:   1 - a       (total variation)

Both have the gradient of a, dz_j a = q_j (m_j - S) with m_j = [q_j < p_j] and S = sum_x m_x q_x (z: the
draft's logits); `log` divides it by a, so a slot the draft gets badly wrong (a small) still pulls hard,
where pure TV's gradient vanishes, and every logit's gradient stays within [-1, 1] as with CE. With a
one-hot p (T -> 0) `log` is exactly the hard CE of the target's token. Rows are formed `chunk_size` at a
time, the gradient in the forward pass (like `cross_entropy._FusedLinearCE`): no [rows, vocab] tensor outlives its
chunk, and the target's rows enter as its final hidden states (through the same frozen lm_head) or logits,
gathered by index per chunk, so no [rows, hidden] copy of the target's states is made either.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

ACCEPT_FORMS = ("log", "tv")
# below this, -log a and its 1/a scale are taken at this value: a in fp32 is never exactly 0 for a softmax
# q, but a draft's q can underflow where the target's p sits
_TINY = 1e-12


def accept_chunk(
    h: torch.Tensor,
    weight: torch.Tensor,
    teacher: torch.Tensor,
    teacher_is_logits: bool,
    temperature: float,
    form: str,
    mm_dtype: torch.dtype,
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """One chunk: per-row loss term, accept probability a, and dLoss/dh = (dLoss/dz) @ W, in fp32.

    `teacher`: the target's final hidden states [n, H] (logits formed through `weight`) or its logits
    [n, V]. Matmuls in `mm_dtype` (what autocast would pick), the rest in fp32; no in-place ops, so that
    `torch.compile` can fuse the passes over the [n, vocab] logits.
    """
    w_mm = weight.to(mm_dtype)
    q = F.linear(h.to(mm_dtype), w_mm).float().softmax(-1)
    t = teacher.float() if teacher_is_logits else F.linear(teacher.to(mm_dtype), w_mm).float()
    p = (t / temperature).softmax(-1)
    low = q < p  # where min(p, q) = q: only there does the draft's mass count toward a
    a = torch.where(low, q, p).sum(-1)
    a_safe = a.clamp(min=_TINY)
    loss = -torch.log(a_safe) if form == "log" else 1.0 - a
    if not need_grad:
        return loss, a, None
    s = torch.where(low, q, torch.zeros_like(q)).sum(-1, keepdim=True)
    g = q * (s - low.float())  # d(-a)/dz
    if form == "log":
        g = g / a_safe.unsqueeze(1)
    return loss, a, torch.matmul(g.to(mm_dtype), w_mm).float()


class _FusedAcceptLoss(torch.autograd.Function):
    """The acceptance term of `hidden @ weight.T` against the target's rows `teacher[index]`, chunk by chunk,
    with dLoss/dhidden formed in the forward pass; backward only scales it by the per-row incoming gradient.
    `weight` is the frozen lm_head (no gradient)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, teacher: torch.Tensor, index: Optional[torch.Tensor],
                teacher_is_logits: bool, temperature: float, form: str, chunk_size: int,
                compiled: Optional[Callable] = None):
        n = hidden.shape[0]
        dev = hidden.device.type
        mm_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
        need_grad = ctx.needs_input_grad[0]
        losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        accepts = torch.empty_like(losses)
        grad = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if need_grad else None
        run = compiled or accept_chunk
        with torch.autocast(dev, enabled=False):
            for s in range(0, n, chunk_size):
                rows = slice(s, s + chunk_size)
                t = teacher[rows] if index is None else teacher.index_select(0, index[rows])
                loss, a, g = run(hidden[rows], weight, t, teacher_is_logits, temperature, form, mm_dtype, need_grad)
                losses[rows] = loss
                accepts[rows] = a
                if need_grad:
                    grad[rows] = g
        ctx.save_for_backward(grad)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(accepts)
        return losses, accepts

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_accept: Optional[torch.Tensor]):
        (grad,) = ctx.saved_tensors
        g = None if grad is None else (grad * grad_loss.unsqueeze(1)).to(ctx.hidden_dtype)
        return g, None, None, None, None, None, None, None, None


def check_accept(weight: float, temperature: float, form: str) -> None:
    """ValueError unless 0 <= weight <= 1, temperature a finite number > 0 and form one of `ACCEPT_FORMS`."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"accept_weight must be in [0, 1], got {weight!r}")
    if not (temperature > 0 and temperature < float("inf")):
        raise ValueError(f"accept_temperature must be a finite number > 0, got {temperature!r}")
    if form not in ACCEPT_FORMS:
        raise ValueError(f"accept_form must be one of {list(ACCEPT_FORMS)}, got {form!r}")


def accept_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher: torch.Tensor,
    chunk_size: int,
    *,
    index: Optional[torch.Tensor] = None,
    teacher_is_logits: bool = False,
    temperature: float = 1.0,
    form: str = "log",
    compiled: Optional[Callable] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row acceptance loss term [N] fp32 (differentiable in `hidden`) and accept probability a [N] fp32.

    `hidden` [N, H]: the draft's final states; `weight` [V, H]: the frozen lm_head; `teacher`: the target's
    final hidden states [M, H] (or logits [M, V] with `teacher_is_logits`), row `index[i]` (default i) being
    the one row i is scored against; p_T = softmax(target logits / `temperature`), q = softmax(draft logits).
    `compiled`: `accept_chunk` compiled (GPUs).
    """
    if weight.requires_grad:
        raise ValueError("the acceptance loss needs a frozen lm_head (its gradient is not formed)")
    check_accept(0.0, temperature, form)
    return _FusedAcceptLoss.apply(hidden, weight, teacher, index, bool(teacher_is_logits), float(temperature), form,
                                  int(chunk_size), compiled)


__all__ = ["ACCEPT_FORMS", "accept_chunk", "accept_lm_loss", "check_accept"]
