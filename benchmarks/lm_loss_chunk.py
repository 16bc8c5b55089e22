"""What one chunk of the fused lm_head loss costs on a GPU, hard CE and logit distillation, by formulation.

    python benchmarks/lm_loss_chunk.py [--rows 4096] [--hidden 576] [--vocab 49152] [--iters 20]

The trainer's loss (`nemo_dflash.core._ce_chunk`, compiled) forms each chunk's logits, reduces them
(logsumexp, label logit, argmax) and writes dL/dh = (softmax - target) @ W in the forward pass. At the
SmolLM2-135M shape a step runs 75 such chunks, so a chunk's milliseconds x 75 is the step's loss time.
Rows: the library's chunk, and candidate formulations of the distillation term, each checked against
the library's output before it is timed (loss, argmax and gradient). Prints a table; not a test.
"""

from __future__ import annotations

import argparse
import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from nemo_dflash.core import _ce_chunk

log = logging.getLogger("lm_loss_chunk")


def distill_explicit(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, mm_dtype: torch.dtype, need_grad: bool,
                     th: Optional[torch.Tensor] = None, soft_weight: float = 0.0):
    """The teacher's probabilities as exp(t - lse_t), written out where they are used (no softmax node),
    so the compiler can recompute them in each consumer instead of storing a [rows, vocab] fp32 tensor."""
    w_mm = weight.to(mm_dtype)
    logits = F.linear(h.to(mm_dtype), w_mm).float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    t = F.linear(th.to(mm_dtype), w_mm).float()
    lse_t = torch.logsumexp(t, dim=-1, keepdim=True)
    cross = (torch.exp(t - lse_t) * logits).sum(-1)
    logit_y = logits.gather(1, y.unsqueeze(1)).squeeze(1)
    loss = lse.squeeze(1) - (1.0 - soft_weight) * logit_y - soft_weight * cross
    pred = logits.argmax(-1)
    if not need_grad:
        return loss, pred, None
    onehot = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0) == y.unsqueeze(1)
    probs = torch.exp(logits - lse) - soft_weight * torch.exp(t - lse_t)
    probs = torch.where(onehot, probs - (1.0 - soft_weight), probs)
    return loss, pred, torch.matmul(probs.to(mm_dtype), w_mm).float()


def distill_bf16_teacher(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, mm_dtype: torch.dtype,
                         need_grad: bool, th: Optional[torch.Tensor] = None, soft_weight: float = 0.0):
    """The teacher's probabilities kept in the matmul dtype (half the bytes of fp32 if stored)."""
    w_mm = weight.to(mm_dtype)
    logits = F.linear(h.to(mm_dtype), w_mm).float()
    lse = torch.logsumexp(logits, dim=-1)
    p_t = F.linear(th.to(mm_dtype), w_mm).float().softmax(-1).to(mm_dtype)
    logit_y = logits.gather(1, y.unsqueeze(1)).squeeze(1)
    loss = lse - (1.0 - soft_weight) * logit_y - soft_weight * (p_t.float() * logits).sum(-1)
    pred = logits.argmax(-1)
    if not need_grad:
        return loss, pred, None
    onehot = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0) == y.unsqueeze(1)
    probs = torch.exp(logits - lse.unsqueeze(1)) - soft_weight * p_t.float()
    probs = torch.where(onehot, probs - (1.0 - soft_weight), probs)
    return loss, pred, torch.matmul(probs.to(mm_dtype), w_mm).float()


def time_ms(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--distill-weight", type=float, default=1.0)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("error: lm_loss_chunk.py times GPU kernels; run it on a machine with a CUDA GPU")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(args.rows, args.hidden, device=dev, generator=g)
    th = torch.randn(args.rows, args.hidden, device=dev, generator=g)
    weight = (torch.randn(args.vocab, args.hidden, device=dev, generator=g) * args.hidden ** -0.5).bfloat16()
    y = torch.randint(0, args.vocab, (args.rows,), device=dev, generator=g)
    bf16, w = torch.bfloat16, args.distill_weight
    cases = [("hard CE", "library", _ce_chunk, None, 0.0),
             ("distill", "library", _ce_chunk, th, w),
             ("distill", "explicit exp(t - lse_t)", distill_explicit, th, w),
             ("distill", "bf16 teacher probs", distill_bf16_teacher, th, w)]
    ref = {}
    rows = []
    for kind, name, fn, teacher, sw in cases:
        compiled = torch.compile(fn)
        out = compiled(h, weight, y, bf16, True, teacher, sw)
        torch.cuda.synchronize()
        if name == "library":
            ref[kind] = out
        else:
            r = ref[kind]
            loss_err = (out[0] - r[0]).abs().max().item()
            grad_err = (out[2] - r[2]).abs().max().item() / r[2].abs().max().item()
            same_pred = (out[1] == r[1]).float().mean().item()
            if loss_err > 1e-2 or grad_err > 2e-2 or same_pred < 0.999:
                raise SystemExit(f"error: {name} differs from the library's chunk (loss {loss_err:.3g}, "
                                 f"gradient {grad_err:.3g} relative, argmax equal {same_pred:.4f})")
        torch.cuda.reset_peak_memory_stats()
        ms = time_ms(lambda: compiled(h, weight, y, bf16, True, teacher, sw), args.iters)
        rows.append((kind, name, ms, torch.cuda.max_memory_allocated() / 2**30))
    mm = 3 * 2 * args.rows * args.hidden * args.vocab / 1e12
    log.info("%s, rows %d, hidden %d, vocab %d, distill weight %g; matmul floor of hard CE %.3f TFLOP a chunk",
             torch.cuda.get_device_name(), args.rows, args.hidden, args.vocab, w, mm * 2 / 3)
    log.info("| loss | formulation | ms a chunk | x 75 chunks (ms) | peak GiB |\n| --- | --- | ---: | ---: | ---: |")
    for kind, name, ms, gb in rows:
        log.info("| %s | %s | %.3f | %.1f | %.2f |", kind, name, ms, ms * 75, gb)


if __name__ == "__main__":
    main()
