"""Kernel-time profile of one slot-engine decode step (random SmolLM2-shape weights, every slot filled).

    python benchmarks/regen_profile.py --batch-size 1024 --fill 700

Prints the top CUDA kernels by time over a few eager steps (a CUDA graph hides them from the
profiler), to see where a step goes: attention, matmuls, norms, sampling.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from regen_throughput import smollm2_shape  # noqa: E402
from nemo_dflash.data.generation import Request, SlotEngine  # noqa: E402


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--fill", type=int, default=700, help="tokens already in every slot's cache")
    p.add_argument("--width", type=int, default=2560, help="max prompt + max new tokens")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    model = smollm2_shape("cuda", torch.bfloat16)
    engine = SlotEngine(model, num_slots=args.batch_size, max_prompt_tokens=args.width - 1024, max_new_tokens=1024,
                        stop_ids=[2], temperature=0.2, top_p=0.9, cuda_graph=False)
    engine._start_state()
    chunk = max(1, 65536 // args.fill)
    g = torch.Generator().manual_seed(0)
    for k in range(0, args.batch_size, chunk):
        rows = list(range(k, min(args.batch_size, k + chunk)))
        engine._prefill(rows, [Request(i, torch.randint(3, 40000, (args.fill,), generator=g).tolist()) for i in rows])
    engine._active.fill_(1)
    engine._answer_pos.fill_(5)
    config = model.config
    config._attn_implementation = "nemo_dflash_slots"
    for _ in range(3):
        engine._step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine._step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))


if __name__ == "__main__":
    main()
