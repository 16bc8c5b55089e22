"""How much K/V a regeneration's decode steps must read: a floor under its GPU time.

    python benchmarks/regen_kv_model.py --data regen.jsonl [--tokenizer pkg:smollm2] [--conversations 4000]
        [--layers 30 --kv-heads 3 --head-dim 64 --bytes 2 --bandwidth-tbs 4.8 --tokens 5836597]

Every answer token of a regenerated set (its records: the target's own answers) is decoded over
its whole context: the prompt (the chat template's rendering of the history, as `regenerate`
tokenises it) and the answer so far. The table gives the mean context per generated token, the
K/V bytes one token reads (layers x 2 x KV heads x head dim x bytes x context), and the seconds
those reads take at --bandwidth-tbs for --tokens generated tokens (default: the whole-set bench
run of session 8). Kept answers only: cut loop tails, which run to the next loop check, are not in
the records. Defaults are SmolLM2-135M in bf16 on an H200.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a regenerated JSONL set (.gz too)")
    p.add_argument("--tokenizer", default="pkg:smollm2")
    p.add_argument("--conversations", type=int, default=4000)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--bytes", type=int, default=2)
    p.add_argument("--bandwidth-tbs", type=float, default=4.8)
    p.add_argument("--tokens", type=int, default=5_836_597)
    args = p.parse_args()
    from nemo_dflash.data.chat_template import encode_prompt_text
    from nemo_dflash.target.loading import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    opener = gzip.open if args.data.endswith(".gz") else open
    convs = turns = tokens = prompt_sum = 0
    context = 0.0
    with opener(args.data, "rt", encoding="utf-8") as f:
        for line in f:
            messages = json.loads(line)["messages"]
            previous = None
            for k, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                ids, text = encode_prompt_text(tok, messages[:k], previous)
                previous = (text, ids)
                answer = len(tok.encode(m["content"], add_special_tokens=False)) + 1  # + the end of turn
                tokens += answer
                context += answer * len(ids) + answer * (answer - 1) / 2  # token i reads prompt + i keys
                prompt_sum += len(ids)
                turns += 1
            convs += 1
            if convs >= args.conversations > 0:
                break
    mean_context = context / tokens
    per_token = args.layers * 2 * args.kv_heads * args.head_dim * args.bytes * mean_context
    total = per_token * args.tokens
    print(f"# {convs} conversations, {turns} answers, {tokens} answer tokens of {args.data}")
    print(f"{'mean prompt':>12} {'mean context':>13} {'K/V per token':>14} {'K/V total':>10} {'seconds':>8}")
    print(f"{prompt_sum / turns:>12.0f} {mean_context:>13.0f} {per_token / 1e6:>11.2f} MB {total / 1e12:>7.1f} TB "
          f"{total / (args.bandwidth_tbs * 1e12):>8.1f}")


if __name__ == "__main__":
    main()
