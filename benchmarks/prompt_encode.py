"""Later-turn prompt encoding, whole against incremental (`encode_prompt_text(previous=)`), on real
regenerated conversations: both must give the same ids; prints ms per later turn for each.

    python benchmarks/prompt_encode.py --data regen.jsonl [--tokenizer pkg:smollm2|HF_DIR] [--turns 1500]

A later turn's prompt is its conversation's history (the target's earlier answers included) up to
that user turn, as `regenerate --turns all` asks it. Both timings include rendering the template.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a regenerated set (.jsonl or .jsonl.gz)")
    p.add_argument("--tokenizer", default="pkg:smollm2")
    p.add_argument("--turns", type=int, default=1500, help="later turns to encode")
    args = p.parse_args()
    from nemo_dflash.data.chat_template import encode_prompt_text
    from nemo_dflash.target.loading import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    opener = gzip.open if args.data.endswith(".gz") else open
    n, whole_s, incremental_s = 0, 0.0, 0.0
    with opener(args.data, "rt", encoding="utf-8") as f:
        for line in f:
            messages = json.loads(line)["messages"]
            previous = None
            for k, m in enumerate(messages):
                if m["role"] != "user":
                    continue
                history = messages[: k + 1]
                t0 = time.perf_counter()
                whole, text = encode_prompt_text(tok, history)
                t1 = time.perf_counter()
                if previous is not None:
                    ids, _ = encode_prompt_text(tok, history, previous)
                    incremental_s += time.perf_counter() - t1
                    whole_s += t1 - t0
                    n += 1
                    if ids != whole:
                        raise SystemExit(f"incremental encoding differs at line {line[:80]!r}, turn {k}")
                previous = (text, whole)
            if n >= args.turns:
                break
    print(f"# {n} later turns of {args.data}, tokenizer {args.tokenizer}: identical ids")
    print(f"{'encoding':<12} {'ms per turn':>12}")
    print(f"{'whole':<12} {whole_s / n * 1e3:>12.3f}")
    print(f"{'incremental':<12} {incremental_s / n * 1e3:>12.3f}")


if __name__ == "__main__":
    main()
