"""Time the slot engine's prefill forwards (fresh prompts and continuations) and list their top
CUDA kernels: the regeneration spent half its time in prefill (docs/data.md).

    python benchmarks/regen_prefill.py --target SMOLLM2.gguf --prompts sharegpt_all.jsonl [--attention groups,varlen]

``--attention`` times each packed-prefill attention (generation.PREFILL_ATTENTION) on the same
cases, and prints how many first tokens each agrees on with the first one listed.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--rows", default="8,64,256")
    p.add_argument("--slots", type=int, default=1024)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--attention", default="groups", help="comma list of groups, varlen")
    args = p.parse_args()
    from nemo_dflash.data import read_conversations
    from nemo_dflash.data import generation
    from nemo_dflash.data.generation import ATTN_NAME, Request, SlotEngine
    from nemo_dflash.target.loading import load_target
    from nemo_dflash.data.regenerate import prompt_problem, split_prompt, stop_token_ids

    model, tok = load_target(args.target, dtype="bf16", device="cuda")
    prompts = []
    for conv in itertools.islice(read_conversations(args.prompts), 4000):
        system, users = split_prompt(conv.messages, "first")
        if users:
            ids, problem = prompt_problem(tok, system + [{"role": "user", "content": users[0]}], max_prompt_tokens=1536)
            if problem is None:
                prompts.append(ids)
    prompts.sort(key=len)
    engine = SlotEngine(model, num_slots=args.slots, max_prompt_tokens=1536, max_new_tokens=1024,
                        stop_ids=stop_token_ids(model, tok))
    config = model.config
    config._attn_implementation = ATTN_NAME  # what SlotEngine.generate sets around its loop
    engine._start_state()

    def timed(fn, n=5) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e3

    print(f"{'attention':<10} {'case':<34} {'rows':>5} {'tokens':>7} {'ms':>8} {'tokens/s':>10} {'agree':>7}")
    cases, first_of = [], {}

    def run(attention: str, name: str, slots: list, reqs: list, starts, n: int) -> None:
        ms = timed(lambda: engine._prefill(slots, reqs, starts))
        first = engine._prefill(slots, reqs, starts).tolist()
        ref = first_of.setdefault((name, len(reqs)), first)
        agree = sum(a == b for a, b in zip(first, ref)) / len(first)
        print(f"{attention:<10} {name:<34} {len(reqs):>5} {n:>7} {ms:>8.1f} {n / ms * 1e3:>10.0f} {agree:>7.3f}",
              flush=True)
        cases.append((f"{attention}: {name}", slots, reqs, starts))

    for attention in args.attention.split(","):
        generation.PREFILL_ATTENTION = {**generation.PREFILL_ATTENTION, "cuda": attention}
        for rows in map(int, args.rows.split(",")):
            for name, group in (("fresh, short prompts", prompts[len(prompts) // 3:][:rows]),
                                ("fresh, long prompts", prompts[-rows:])):
                run(attention, name, list(range(rows)), [Request(i, x) for i, x in enumerate(group)], None,
                    sum(map(len, group)))
            # continuations: slots hold the long prompts' first 80%; prefill the rest
            group = prompts[-rows:]
            reqs = [Request(i, x) for i, x in enumerate(group)]
            starts = [int(len(x) * 0.8) for x in group]
            slots = list(range(rows))
            engine._prefill(slots, reqs)
            run(attention, "continuation (last 20%)", slots, reqs, starts,
                sum(len(x) - s for x, s in zip(group, starts)))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, slots, reqs, starts in cases[-3:]:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine._prefill(slots, reqs, starts)
                torch.cuda.synchronize()
            print(f"\n## {name}, {len(reqs)} rows")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
