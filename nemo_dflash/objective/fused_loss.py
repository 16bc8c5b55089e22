"""Fused linear cross-entropy kernels for the draft's training loss (`loss.impl`).

The chunked path (`objective.cross_entropy.chunked_lm_loss`) forms every chunk's [rows, vocab] logits in PyTorch; on a
GPU over a 49k-151k vocabulary that loss is a large share of the step. Two Triton packages fuse the
lm_head matmul with the cross-entropy instead: Apple's cut-cross-entropy (`cce`) and liger-kernel's
fused linear cross-entropy (`liger`). Both give the per-token hard CE `lse - h . W_y`
(reduction "none"); that alone serves distillation too, because

    lse = ce_y + h . W_y                                  (a gather of the label's lm_head row)
    soft CE against the target = lse - h . E_t            (E_t: `objective.cross_entropy.teacher_expected_embedding`)
    (1 - d) * hard + d * soft = ce_y + d * (h . W_y - h . E_t)

so one fused call per step, plus two dot products a row, gives the mixed loss, and gradients reach
h (and W, when it is trained) through the kernel's backward and the gathers. Training steps only:
held-out evaluation (no grad) keeps the chunked reference path.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# chunked stays the default: on an H200 at SmolLM2's shape liger's step is 25% slower and cce's 80% slower, and
# cce's gradient of the draft's states is 2.4-4.8% from fp32 (bf16 accumulation; docs/train.md)
LOSS_IMPLS = ("chunked", "cce", "liger")
FUSED_IMPLS = ("liger", "cce")

# cut-cross-entropy skips gradient blocks whose |softmax - onehot| is below this everywhere ("high":
# bf16 eps / 32). A draft near initialisation has a flat softmax (49k entries of ~2e-5), so every
# block but the label's would be skipped and its gradient biased; None keeps the exact gradient.
CCE_FILTER_EPS: Optional[float] = None

_WARNED: set[tuple[str, str]] = set()


def fused_unavailable(impl: str, device: torch.device) -> Optional[str]:
    """Why `impl` (cce | liger) cannot run on `device`, or None when it can."""
    if device.type != "cuda":
        return f"{device.type} device (the kernels are Triton, GPU only)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    module = {"cce": "cut_cross_entropy", "liger": "liger_kernel"}[impl]
    if importlib.util.find_spec(module) is None:
        package = {"cce": "cut-cross-entropy", "liger": "liger-kernel"}[impl]
        return f"{package} is not installed"
    return None


def resolve_loss_impl(impl: str, device: torch.device) -> str:
    """`loss.impl` -> the implementation that runs on `device`: chunked | cce | liger.

    A named package that cannot run falls back to chunked with one warning a process (CPU runs, a GPU
    image without the package), so a recipe written for the GPU still runs elsewhere.
    """
    if impl not in LOSS_IMPLS:
        raise ValueError(f"loss.impl must be one of {list(LOSS_IMPLS)}, got {impl!r}")
    if impl == "chunked":
        return impl
    reason = fused_unavailable(impl, device)
    if reason is None:
        return impl
    if (impl, device.type) not in _WARNED:
        _WARNED.add((impl, device.type))
        logger.warning("loss.impl=%s cannot run (%s): using the chunked loss", impl, reason)
    return "chunked"


def per_token_ce(impl: str, hidden: torch.Tensor, weight: torch.Tensor,
                 labels: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-row hard CE `lse - h . W_y` [N] fp32 from the fused kernel `impl`, and the argmax when the
    kernel gives it (liger) else None. `hidden` and `weight` share one dtype."""
    if impl == "cce":
        from cut_cross_entropy import linear_cross_entropy

        ce = linear_cross_entropy(hidden, weight, labels, reduction="none", filter_eps=CCE_FILTER_EPS, impl="cce")
        return ce.float(), None
    if impl == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        out = liger_fused_linear_cross_entropy(hidden, weight, labels, reduction="none", return_predicted_tokens=True)
        return out.loss.float(), out.predicted_tokens
    raise ValueError(f"no fused kernel {impl!r}")


def ce_to_lse(ce: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """lse = ce_y + h . W_y per row, in fp32: the log-partition a per-token CE hides, recovered by
    gathering the label's lm_head row. Differentiable in all of `ce`, `hidden` and `weight`."""
    return ce + label_logit(hidden, weight, labels)


def label_logit(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """h . W_y per row in fp32 (the label's logit, without the [N, vocab] logits)."""
    return (hidden.float() * F.embedding(labels, weight).float()).sum(-1)


def mixed_loss(ce: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
               teacher_embedding: Optional[torch.Tensor], distill_weight: float) -> torch.Tensor:
    """(1 - d) * hard CE + d * soft CE per row from the per-token hard CE `ce`, the soft CE being
    lse - h . E_t with lse = `ce_to_lse`. `teacher_embedding` is a constant (the target's)."""
    if teacher_embedding is None or distill_weight <= 0:
        return ce
    soft = ce_to_lse(ce, hidden, weight, labels) - (hidden.float() * teacher_embedding.float()).sum(-1)
    return (1.0 - distill_weight) * ce + distill_weight * soft


def argmax_chunk(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One chunk of `argmax_rows` (a function of its own so that it can be compiled once)."""
    return F.linear(h, w).argmax(-1)


def argmax_rows(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int,
                compiled: Optional[Callable] = None) -> torch.Tensor:
    """argmax_v h . W_v per row, `chunk_size` rows at a time, no grad: the accuracy metric for a kernel
    that does not return it (cce). `compiled`: the chunk function compiled (fuses matmul output and argmax)."""
    run = compiled or argmax_chunk
    out = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
    with torch.no_grad():
        for s in range(0, hidden.shape[0], chunk_size):
            out[s : s + chunk_size] = run(hidden[s : s + chunk_size], weight)
    return out


def fused_lm_loss(
    impl: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    teacher_embedding: Optional[torch.Tensor] = None,
    distill_weight: float = 0.0,
    compiled_argmax: Optional[Callable] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss [N] fp32 and argmax [N] of `hidden @ weight.T` against `labels` with the fused kernel
    `impl` (cce | liger), mixed with the soft CE against `teacher_embedding` (the target's expected
    embeddings per row, [N, H]) at `distill_weight`: what `objective.cross_entropy.chunked_lm_loss` returns, without
    [rows, vocab] logits in PyTorch. The matmuls run in the autocast dtype when autocast is on (as
    `lm_head(h)` would), else in the weight's dtype. `weight` gets a gradient when it requires one
    (hard CE only: with distillation the head must be frozen, as the target's is in training)."""
    if teacher_embedding is not None and distill_weight > 0 and weight.requires_grad:
        # E_t = sum_v p_v W_v depends on W, but arrives here as a constant: W's gradient would miss it
        raise ValueError("distillation through expected embeddings needs a frozen lm_head")
    dev = hidden.device.type
    mm_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
    with torch.autocast(dev, enabled=False):
        h = hidden.to(mm_dtype)
        w = weight.to(mm_dtype)
        ce, pred = per_token_ce(impl, h, w, labels)
        if pred is None:
            pred = argmax_rows(h.detach(), w.detach(), chunk_size, compiled_argmax)
        loss = mixed_loss(ce, h, w, labels, teacher_embedding, distill_weight)
    return loss, pred
