"""Speedup of speculative over plain decoding against concurrency (how many prompts decode together).

    python benchmarks/concurrency.py --target pkg:smollm2 --draft OUT/export/main --dataset mtbench \
        --prompts 16 --batches 1,4,16 --max-new-tokens 256

For each concurrency B the same prompts (the first --prompts of the set, one turn, chat template)
are decoded in batches of B twice, plainly and speculatively, at T=0:

- `--decode graphs` (the default on a GPU): `inference.batched_static`, B rows on fixed shapes, each
  step a captured CUDA graph on both sides (what a serving engine runs);
- `--decode eager` (the default on a CPU): `inference.batched_spec`, eager forwards on masked
  dynamic caches on both sides.

Tokens per second of each side, their ratio (the speedup) and the mean acceptance length tau go to
a table and, as rows, to docs/bench/concurrency.json. Only decode time is timed (prefills are
not), as `evaluate` times speedup; a first batch of each concurrency warms up (and captures) first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import append_rows, provenance  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent.parent / "docs" / "bench" / "concurrency.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="local HF dir or pkg:smollm2")
    p.add_argument("--draft", required=True, help="the draft (export, training draft dir, checkpoint or run dir)")
    p.add_argument("--dataset", default="mtbench", help="mtbench, humaneval or a chat JSONL")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--batches", default="1,4,16", help="concurrencies to time, comma separated")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--decode", default=None, choices=["eager", "graphs"],
                   help="both sides: graphs (CUDA graphs; default on GPU) or eager (default on CPU)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=str(DEFAULT_JSON), help="append the rows here")
    return p


def check(args: argparse.Namespace) -> list[int]:
    """Every user error, before any model loads."""
    if args.prompts < 1 or args.max_new_tokens < 1:
        raise ValueError("--prompts and --max-new-tokens must be >= 1")
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"--batches {args.batches!r}: give concurrencies like 1,4,16") from None
    if not batches or min(batches) < 1:
        raise ValueError(f"--batches {args.batches!r}: give concurrencies >= 1, like 1,4,16")
    if args.decode == "graphs":
        from nemo_dflash.inference.graphs import check_decode_mode
        from nemo_dflash.recipes._cli import resolve_device_dtype

        check_decode_mode("graphs", resolve_device_dtype(args.device, args.dtype)[0])
    return batches


def _timed(fn, prompts: list[list[int]], bsz: int) -> tuple[float, list[Any]]:
    """Decode `prompts` in batches of `bsz`; (decode seconds, outputs): prefills are not timed,
    as `evaluate` times speedup."""
    outs, seconds = [], 0.0
    for i in range(0, len(prompts), bsz):
        res = fn(prompts[i : i + bsz])
        seconds += res[0].decode_time_s
        outs += res
    return seconds, outs


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from nemo_dflash.data.chat_template import stop_token_ids
    from nemo_dflash.inference import batched_spec, batched_static
    from nemo_dflash.inference.eval_run import ModelSpec, load_models
    from nemo_dflash.inference.evaluate import encode_chat, load_prompt_set
    from nemo_dflash.inference.spec_decode import DFlashSpeculativeDecoder
    from nemo_dflash.recipes._cli import resolve_device_dtype

    batches = check(args)
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    name, prompt_set = load_prompt_set(args.dataset, args.prompts)
    target, tokenizer, draft = load_models(ModelSpec(args.draft, args.target, device, dtype, args.threads))
    decoder = DFlashSpeculativeDecoder(target, draft, args.block_size)
    stops = stop_token_ids(target, tokenizer)
    prompts = [encode_chat(tokenizer, p.history() + ([] if p.messages is not None else
                                                    [{"role": "user", "content": p.turns[0]}]))
               for p in prompt_set]
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=0.0, stop_token_ids=stops)
    decode = args.decode or ("graphs" if device == "cuda" else "eager")
    rows = []
    dev_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    for bsz in batches:
        if decode == "graphs":  # bsz rows on fixed shapes; a last, smaller batch keeps them (padding rows)
            def plain(ps, bsz=bsz):
                return batched_static.batched_static_autoregressive_generate(target, ps, rows=bsz, **kw)

            def spec(ps, bsz=bsz):
                return batched_static.batched_static_speculative_generate(decoder, ps, rows=bsz, **kw)
        else:
            def plain(ps):
                return batched_spec.batched_autoregressive_generate(target, ps, **kw)

            def spec(ps):
                return batched_spec.batched_speculative_generate(decoder, ps, **kw)

        longest = sorted(prompts, key=len)[-bsz:]  # the runners' caches then fit every batch (graphs)
        for fn in (plain, spec):  # warm-up: allocator, kernels, the graphs' capture
            fn(longest)
        t_plain, o_plain = _timed(plain, prompts, bsz)
        t_spec, o_spec = _timed(spec, prompts, bsz)
        tok_plain = sum(len(o.output_ids) - 1 for o in o_plain)
        tok_spec = sum(len(o.output_ids) - 1 for o in o_spec)
        steps = [a for o in o_spec for a in o.acceptance_lengths]
        same = sum(a.output_ids == b.output_ids for a, b in zip(o_plain, o_spec))
        rows.append({
            **provenance(dev_name), "dataset": name, "prompts": len(prompts), "concurrency": bsz,
            "max_new_tokens": args.max_new_tokens, "temperature": 0.0, "block_size": decoder.block_size,
            "decode": decode, "dtype": dtype, "plain_tokens_per_s": tok_plain / t_plain,
            "spec_tokens_per_s": tok_spec / t_spec, "speedup": (tok_spec / t_spec) / (tok_plain / t_plain),
            "tau": statistics.mean(steps) if steps else None, "identical_answers": same,
        })
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    r0 = rows[0]
    head = (f"{r0['dataset']}, {r0['prompts']} prompts, up to {r0['max_new_tokens']} new tokens, 1 turn, T=0, "
            f"block {r0['block_size']}, {r0['decode']} on both sides, {r0['dtype']} on {r0['device']}")
    lines = [head, f"{'concurrency':>11} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} {'tau':>6} {'same':>5}"]
    for r in rows:
        lines.append(f"{r['concurrency']:>11} {r['plain_tokens_per_s']:>12.1f} {r['spec_tokens_per_s']:>11.1f} "
                     f"{r['speedup']:>7.2f}x {r['tau'] or 0:>6.2f} {r['identical_answers']:>3}/{r['prompts']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    t = time.perf_counter()
    rows = measure(args)
    print(table(rows))
    print(f"({time.perf_counter() - t:.0f} s)")
    append_rows(Path(args.json), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
