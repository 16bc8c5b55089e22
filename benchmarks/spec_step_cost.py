"""What one speculative step costs against one plain decoding step (explains a speedup figure).

    python benchmarks/spec_step_cost.py --target pkg:smollm2 --draft OUT/export/main [--json F]

Times, on a real prompt's KV cache and with the device synchronised around each repeat:
the plain 1-token target forward, the B-token verify forward with the feature hooks, the same
B tokens without hooks, and the draft's block forward (+ its lm_head). The speedup of a draft
with acceptance length tau is about tau * plain / (verify + draft + bookkeeping): the table
says how large tau must be before speculative decoding pays on this machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable

import torch

from nemo_dflash.export import load_draft
from nemo_dflash.inference import DFlashSpeculativeDecoder, autoregressive_generate
from nemo_dflash.inference.spec_decode import crop_dynamic_cache
from nemo_dflash.target.loading import load_target
from nemo_dflash.draft.model import DFlashContextCache
from nemo_dflash.inference.evaluate import encode_chat, load_mtbench
from transformers import DynamicCache


def timed(fn: Callable[[], None], device: torch.device, reps: int) -> float:
    """Median milliseconds of `fn` over `reps` synchronised repeats (after 3 warm-ups)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(1000 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--new-tokens", type=int, default=128, help="tokens for the whole-loop timing")
    p.add_argument("--json", default=None)
    p.add_argument("--append", default=None, type=Path,
                   help="also append one row to this JSON list of rows (e.g. docs/bench/decode_speed.json)")
    args = p.parse_args()
    device = torch.device(args.device)
    target, tok = load_target(args.target, dtype=args.dtype, device=device)
    draft = load_draft(args.draft, device=device, dtype=args.dtype)
    dec = DFlashSpeculativeDecoder(target, draft, args.block_size)
    blk = dec.block_size
    ids = torch.as_tensor(encode_chat(tok, [{"role": "user", "content": load_mtbench(1)[0].turns[0]}], True),
                          device=device).view(1, -1)
    plen = ids.shape[1]
    cache = DynamicCache()
    feats, _ = dec.target.forward_features(ids, need_logits=True, past_key_values=cache, use_cache=True,
                                           position_ids=torch.arange(plen, device=device).unsqueeze(0))
    block = torch.randint(0, target.config.vocab_size, (1, blk), device=device)
    pos_b = torch.arange(plen, plen + blk, device=device).unsqueeze(0)
    one, pos_1 = block[:, :1], pos_b[:, :1]

    def plain() -> None:
        target(input_ids=one, past_key_values=cache, use_cache=True, position_ids=pos_1)
        crop_dynamic_cache(cache, plen)

    def verify_hooks() -> None:
        dec.target.forward_features(block, need_logits=True, past_key_values=cache, use_cache=True, position_ids=pos_b)
        crop_dynamic_cache(cache, plen)

    def verify_plain() -> None:
        target(input_ids=block, past_key_values=cache, use_cache=True, position_ids=pos_b)
        crop_dynamic_cache(cache, plen)

    def draft_block() -> None:  # a fresh draft cache fed the whole prompt's features once, as at step 1
        dec.draft_logits(one[0], plen, feats, DFlashContextCache(len(draft.layers)), blk)

    last = feats[:, -1:]
    steady = DFlashContextCache(len(draft.layers))
    dec.draft_logits(one[0], plen - 1, feats[:, :-1], steady, blk)

    def draft_step() -> None:  # the steady state: one new verified position per step
        dec.draft_logits(one[0], plen, last, steady, blk)
        steady.crop(plen - 1)

    grow = {"len": plen}

    def plain_growing() -> None:  # a new KV length every call, as in real decoding
        pos = torch.tensor([[grow["len"]]], device=device)
        target(input_ids=one, past_key_values=cache, use_cache=True, position_ids=pos)
        grow["len"] += 1

    def verify_growing() -> None:  # 16 new tokens, keep 1: the KV length grows by one per call
        pos = torch.arange(grow["len"], grow["len"] + blk, device=device).unsqueeze(0)
        dec.target.forward_features(block, need_logits=True, past_key_values=cache, use_cache=True, position_ids=pos)
        grow["len"] += 1
        crop_dynamic_cache(cache, grow["len"])

    cases = {
        "plain decode step (1 token), same KV length": plain,
        "plain decode step, KV length +1 per call": plain_growing,
        f"verify {blk} tokens, KV length +1 per call": verify_growing,
        f"verify {blk} tokens, feature hooks": verify_hooks,
        f"verify {blk} tokens, no hooks": verify_plain,
        "draft block forward, prompt as new context": draft_block,
        "draft block forward, 1 new context position": draft_step,
    }
    rows = {}
    for name, fn in cases.items():
        crop_dynamic_cache(cache, plen)  # every case starts from the prompt's cache
        grow["len"] = plen
        rows[name] = timed(fn, device, args.reps)
    spec = rows[f"verify {blk} tokens, feature hooks"] + rows["draft block forward, 1 new context position"]
    ratio = spec / rows["plain decode step (1 token), same KV length"]

    # The whole loops on the same prompt: what a step costs beyond its two forwards (bookkeeping, syncs).
    for _ in range(2):  # the second pass is the one kept (the first warms every shape)
        s_out = dec.generate(ids, max_new_tokens=args.new_tokens)
        a_out = autoregressive_generate(target, ids, max_new_tokens=args.new_tokens)
    spec_step = 1000 * s_out.decode_time_s / max(s_out.num_target_forwards, 1)
    ar_step = 1000 * a_out.decode_time_s / max(a_out.num_target_forwards, 1)
    rows[f"generate: plain decoding, ms per step ({a_out.num_target_forwards} steps)"] = ar_step
    rows[f"generate: speculative, ms per step ({s_out.num_target_forwards} steps, "
         f"tau {s_out.mean_acceptance_length:.2f})"] = spec_step
    rows["generate: speculative step minus (verify + draft)"] = spec_step - spec
    print(f"{'part':60s} {'ms':>8s}")
    for k, v in rows.items():
        print(f"{k:60s} {v:8.2f}")
    print(f"{'speculative step (verify + draft) / plain step':60s} {ratio:8.2f}   (break-even tau, forwards only)")
    print(f"{'generate: speculative step / plain step':60s} {spec_step / ar_step:8.2f}   (break-even tau, whole loop)")
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; prompt {plen} tokens; "
          f"target {type(target).__name__} {target.config.num_hidden_layers} layers; draft {len(draft.layers)} layers")
    if args.json:
        Path(args.json).write_text(json.dumps({"ms": rows, "break_even_tau": ratio, "block_size": blk,
                                               "loop_break_even_tau": spec_step / ar_step,
                                               "prompt_tokens": plen, "device": str(device)}, indent=2))
    if args.append:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_rows import append_rows, provenance

        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        append_rows(args.append, [{**provenance(f"{name} (torch {torch.__version__})"), "kind": "spec step cost",
                                   "target": args.target, "draft": args.draft, "dtype": args.dtype, "ms": rows,
                                   "break_even_tau": ratio, "loop_break_even_tau": spec_step / ar_step,
                                   "block_size": blk, "prompt_tokens": plen}])


if __name__ == "__main__":
    main()
