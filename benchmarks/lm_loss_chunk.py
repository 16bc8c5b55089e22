"""What one chunk of the fused lm_head loss costs on a GPU, hard CE and logit distillation, by formulation.

    python benchmarks/lm_loss_chunk.py [--rows 4096] [--hidden 576] [--vocab 49152] [--positions 32768] [--iters 20]

The trainer's loss (`nemo_dflash.core._ce_chunk`, compiled) forms each chunk's logits, reduces them
(logsumexp, label logit, argmax) and writes dL/dh = (softmax - target) @ W in the forward pass. At the
SmolLM2-135M shape a step runs 75 such chunks, so a chunk's milliseconds x 75 is the step's loss time.
Distillation, two ways: the library's (the target's expected embedding E_t = softmax(h_t W^T) W, formed
once per target position by `teacher_expected_embedding`, then a dot product a row in the chunk; the
step's cost is 75 chunks plus E_t over --positions rows) and the per-slot formulation it replaced (the
teacher's logits formed again in every chunk for every block slot), checked against each other before
they are timed (loss, argmax and gradient). Prints a table; not a test.
"""

from __future__ import annotations

import argparse
import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from nemo_dflash.core import _ce_chunk, teacher_expected_embedding

log = logging.getLogger("lm_loss_chunk")


def distill_per_slot(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, mm_dtype: torch.dtype, need_grad: bool,
                     th: Optional[torch.Tensor] = None, soft_weight: float = 0.0):
    """The replaced formulation: the teacher's logits th @ W.T and softmax p_t formed in the chunk for
    every row; loss lse - (1-w) logit_y - w sum_v p_t,v logit_v, gradient (softmax - (1-w) onehot - w p_t) @ W."""
    w_mm = weight.to(mm_dtype)
    logits = F.linear(h.to(mm_dtype), w_mm).float()
    lse = torch.logsumexp(logits, dim=-1)
    logit_y = logits.gather(1, y.unsqueeze(1)).squeeze(1)
    p_t = F.linear(th.to(mm_dtype), w_mm).float().softmax(-1)
    loss = lse - (1.0 - soft_weight) * logit_y - soft_weight * (p_t * logits).sum(-1)
    pred = logits.argmax(-1)
    if not need_grad:
        return loss, pred, None
    onehot = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0) == y.unsqueeze(1)
    probs = torch.exp(logits - lse.unsqueeze(1)) - soft_weight * p_t
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
    p.add_argument("--positions", type=int, default=32768,
                   help="target positions a step (E_t is formed once for each): 4 packed rows of 8192")
    p.add_argument("--chunks", type=int, default=75, help="loss chunks a step")
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
    te = teacher_expected_embedding(th.bfloat16(), weight, args.rows)
    cases = [("hard CE", "library", _ce_chunk, None, 0.0),
             ("distill", "library: expected embedding E_t, a dot product a row", _ce_chunk, te, w),
             ("distill", "replaced: the teacher's logits in every chunk", distill_per_slot, th.bfloat16(), w)]
    outs, rows = {}, []
    for kind, name, fn, teacher, sw in cases:
        compiled = torch.compile(fn)
        outs[name] = compiled(h, weight, y, bf16, True, teacher, sw)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        ms = time_ms(lambda: compiled(h, weight, y, bf16, True, teacher, sw), args.iters)
        rows.append([kind, name, ms, ms * args.chunks, torch.cuda.max_memory_allocated() / 2**30])
    new, old = (outs[name] for _, name, *_ in cases[1:])
    loss_err = (new[0] - old[0]).abs().max().item()
    grad_err = (new[2] - old[2]).abs().max().item() / old[2].abs().max().item()
    same_pred = (new[1] == old[1]).float().mean().item()
    if loss_err > 1e-2 or grad_err > 2e-2 or same_pred < 0.999:
        raise SystemExit(f"error: the two distillation formulations differ (loss {loss_err:.3g}, "
                         f"gradient {grad_err:.3g} relative, argmax equal {same_pred:.4f})")
    pos = torch.randn(args.positions, args.hidden, device=dev, generator=g).bfloat16()
    e_ms = time_ms(lambda: teacher_expected_embedding(pos, weight, args.rows), args.iters)
    rows[1][3] += e_ms
    mm = 2 * args.rows * args.hidden * args.vocab / 1e12
    log.info("%s, rows %d, hidden %d, vocab %d, distill weight %g; matmul floor of hard CE %.3f TFLOP a chunk; "
             "E_t over %d positions %.2f ms; the two distillations agree (loss %.2g, gradient %.2g relative)",
             torch.cuda.get_device_name(), args.rows, args.hidden, args.vocab, w, 2 * mm, args.positions, e_ms,
             loss_err, grad_err)
    log.info("| loss | formulation | ms a chunk | a step: x %d chunks (+ E_t) ms | peak GiB |\n"
             "| --- | --- | ---: | ---: | ---: |", args.chunks)
    for kind, name, ms, step_ms, gb in rows:
        log.info("| %s | %s | %.3f | %.1f | %.2f |", kind, name, ms, step_ms, gb)


if __name__ == "__main__":
    main()
