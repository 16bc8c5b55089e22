"""Regeneration throughput: the pipeline's slot engine against plain batched ``model.generate``.

    python benchmarks/regen_throughput.py --target pkg:smollm2 --prompts sharegpt --num-prompts 4096 \
        --max-new-tokens 1024 --batch-size 1024 --json OUT.json
    python benchmarks/regen_throughput.py --random-shape smollm2 --num-prompts 2048   # no weights needed

    python benchmarks/regen_throughput.py --target SmolLM2.gguf --prompts sharegpt_all.jsonl --turns all \
        --num-prompts 4096 --max-new-tokens 1024 --max-prompt-tokens 1536 --batch-size 1024 --stop-loops \
        --temperature 0.2 --top-p 0.9 --modes slots,slots_full,generate

Both sides answer the same prompts (ShareGPT first user turns through the target's chat
template, or random ids with --random-shape) with the same settings and stopping on; tokens/s
counts generated tokens (stop tokens included) over wall time, the model load excluded. Modes:
``slots`` (nemo_dflash.data.generation.SlotEngine, what `regenerate --engine slots` runs), ``generate``
(model.generate on left-padded batches of --batch-size, prompts sorted by length, what
`--engine generate` runs), ``hf_cb`` (transformers' continuous batching, ``generate_batch``).

``--turns all`` (needs --target) runs whole conversations: the first --num-prompts conversations
of --prompts, every user turn answered with the target's own earlier answers in the history,
through ``regenerate_conversations`` itself (templating and tokenising included, as the pipeline
runs). ``slots`` keeps a conversation in its slot between turns and prefills only each turn's new
tokens; ``slots_full`` is the same engine prefilling every turn's whole history (the behaviour
before); ``generate`` is ``--engine generate``. The ``prefill/gen`` column is the prompt tokens
run through a prefill per generated token (``reused``: prompt tokens found in the slot instead).
Prints a table; --json writes the rows.
"""

from __future__ import annotations

import argparse
import gc
import collections
import dataclasses
import json
from pathlib import Path
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402


def smollm2_shape(device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval()


def load_prompts(args, tokenizer) -> list[list[int]]:
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        lens = torch.randint(16, min(400, args.max_prompt_tokens) + 1, (args.num_prompts,), generator=g)
        return [torch.randint(3, 49152, (int(n),), generator=g).tolist() for n in lens]
    from nemo_dflash.data import SHAREGPT_FILE, read_conversations
    from nemo_dflash.target.loading import package_file
    from nemo_dflash.data.regenerate import prompt_problem, special_token_strings, split_prompt

    path = str(package_file(*SHAREGPT_FILE)) if args.prompts == "sharegpt" else args.prompts
    specials = special_token_strings(tokenizer)
    prompts = []
    for conv in read_conversations(path):
        system, users = split_prompt(conv.messages, "first")
        if not users:
            continue
        ids, problem = prompt_problem(tokenizer, system + [{"role": "user", "content": users[0]}],
                                      max_prompt_tokens=args.max_prompt_tokens, specials=specials)
        if problem is None:
            prompts.append(ids)
        if len(prompts) >= args.num_prompts:
            break
    return prompts


def load_conversations(args) -> list:
    """The first --num-prompts conversations of --prompts that have a user turn (--turns all)."""
    from nemo_dflash.data import SHAREGPT_FILE, read_conversations
    from nemo_dflash.target.loading import package_file
    from nemo_dflash.data.regenerate import split_prompt

    path = str(package_file(*SHAREGPT_FILE)) if args.prompts == "sharegpt" else args.prompts
    convs = []
    for conv in read_conversations(path):
        if split_prompt(conv.messages, "all")[1]:
            convs.append(conv)
        if len(convs) >= args.num_prompts > 0:
            break
    return convs


def run_conversations(model, tokenizer, convs, args, engine: str, reuse: bool = True) -> dict:
    """Every turn of ``convs`` through regenerate_conversations (what `regenerate --turns all` runs)."""
    from nemo_dflash.data.regenerate import RegenStats, regenerate_conversations

    def run(sample: list) -> tuple[RegenStats, float]:
        stats = RegenStats()
        _sync()
        t0 = time.perf_counter()
        for _ in regenerate_conversations(
            model, tokenizer, sample, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_p=args.top_p, batch_size=args.batch_size, turns="all", seed=0,
            max_prompt_tokens=args.max_prompt_tokens, engine=engine, loops="cut" if args.stop_loops else "keep",
            after_cut=args.after_cut, max_prefill_tokens=args.max_prefill_tokens, reuse_slots=reuse, stats=stats,
            prepare_ahead=args.prepare_ahead, schedule=args.schedule, engine_config=args.engine_config,
        ):
            pass
        _sync()
        return stats, time.perf_counter() - t0

    run(convs[: min(len(convs), 64)])  # compile / warm up
    gc.collect()  # the warm-up engine's KV cache goes back before the timed run allocates its own
    stats, dt = run(convs)
    prefill = stats.prefill_tokens if engine == "slots" else stats.prompt_tokens
    return {"tokens": stats.generated_tokens, "seconds": dt, "prefill_tokens": prefill,
            "reused_tokens": stats.reused_tokens, "turns": stats.answers, "conversations": stats.written,
            "finish": {"turns": stats.answers, "written": stats.written, "loops": stats.looping_before,
                       "capped": stats.capped_before, "prefix_mismatch": stats.prefix_mismatch,
                       "shortened": dict(stats.shortened),
                       "phase_seconds": {k: round(v, 1) for k, v in sorted(stats.phase_seconds.items())},
                       "gpu_seconds": {k: round(v, 1) for k, v in sorted(stats.gpu_seconds.items())},
                       "prefill_calls": dict(stats.prefill_calls)}}


def run_slots(model, prompts, args, stop_ids) -> dict:
    from nemo_dflash.data.loops import LoopDetector
    from nemo_dflash.data.generation import Request, SlotEngine

    engine = SlotEngine(model, num_slots=args.batch_size, max_prompt_tokens=args.max_prompt_tokens,
                        max_new_tokens=args.max_new_tokens, stop_ids=stop_ids, temperature=args.temperature,
                        top_p=args.top_p, seed=0, max_prefill_tokens=args.max_prefill_tokens,
                        loop_detector=LoopDetector() if args.stop_loops else None, stop_on_loop=args.stop_loops,
                        config=args.engine_config)
    warm = collections.deque(Request(i, p) for i, p in enumerate(prompts[: min(len(prompts), 64)]))
    for _ in engine.generate(warm):  # compile / warm up
        pass
    engine.generated_tokens = engine.steps = 0
    engine.seconds.clear()
    engine.gpu.read()
    engine.gpu.seconds.clear()
    pending = collections.deque(Request(i, p) for i, p in enumerate(prompts))
    finish = collections.Counter()
    _sync()
    t0 = time.perf_counter()
    for c in engine.generate(pending):
        finish[c.finish] += 1
    _sync()
    dt = time.perf_counter() - t0
    split = {k: round(v, 2) for k, v in engine.seconds.items()}
    engine.gpu.read()
    split.update({f"gpu_{k}": round(v, 2) for k, v in engine.gpu.seconds.items()})
    return {"tokens": engine.generated_tokens, "seconds": dt, "steps": engine.steps, "phase_seconds": split,
            "prefill_tokens": engine.prefill_tokens, "reused_tokens": engine.reused_tokens,
            "finish": dict(finish, steps=engine.steps, **split)}


def run_step(model, prompts, args, stop_ids) -> dict:
    """Where a decode step's time goes, with every slot filled (a full batch, mid-answer)."""
    from nemo_dflash.data.generation import Request, SlotEngine
    from nemo_dflash.sampling import keyed_sample_candidates

    engine = SlotEngine(model, num_slots=args.batch_size, max_prompt_tokens=args.max_prompt_tokens,
                        max_new_tokens=args.max_new_tokens, stop_ids=stop_ids, temperature=args.temperature,
                        top_p=args.top_p, seed=0, max_prefill_tokens=args.max_prefill_tokens, cuda_graph=False,
                        config=args.engine_config)
    S = args.batch_size
    engine._start_state()
    reqs = [Request(i, prompts[i % len(prompts)]) for i in range(S)]
    chunk = max(1, args.max_prefill_tokens // args.max_prompt_tokens)
    for k in range(0, S, chunk):
        engine._prefill(list(range(k, min(S, k + chunk))), reqs[k: k + chunk])
    engine._active.fill_(1)
    engine._answer_pos.fill_(5)
    keys, pos = engine._keys, engine._answer_pos

    def timed(fn, n=20) -> float:
        fn()
        _sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        _sync()
        return (time.perf_counter() - t0) / n * 1e3

    out = {"eager_forward_ms": timed(lambda: engine._decode_logits())}
    logits = engine._decode_logits()
    out["eager_step_ms"] = timed(lambda: engine._step())
    if engine.decode_compile:
        out["compiled_step_ms"] = timed(lambda: engine._step_fn())
    for k in (16, 64, 256):
        out[f"sample_ms_k{k}"] = timed(lambda: keyed_sample_candidates(
            logits, keys, pos, seed=0, temperature=args.temperature, top_p=args.top_p, candidates=k))
    out["argmax_ms"] = timed(lambda: logits.argmax(-1))
    if torch.cuda.is_available():
        engine.cuda_graph = True
        engine._capture()
        out["graph_step_ms"] = timed(lambda: engine._graph.replay())
        out["graph_decode_ms"] = timed(lambda: (engine._launch(), engine._collect()))
        if engine.decode_compile:  # the same graph of the eager step, for the A/B in one process
            engine._graph = None
            engine._uncompile()
            engine._capture()
            out["graph_step_eager_ms"] = timed(lambda: engine._graph.replay())
    out["mean_fill"] = float(engine.cache.lengths.float().mean())
    return {"tokens": 0, "seconds": 1e-9, "finish": {k: round(v, 3) for k, v in out.items()}}


def run_generate(model, prompts, args, stop_ids, pad_id) -> dict:
    from nemo_dflash.data.regenerate import _generation_kwargs, generate_batch

    kwargs = _generation_kwargs(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_p=args.top_p, stop_ids=stop_ids, pad_id=pad_id)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # less padding
    generate_batch(model, [prompts[i] for i in order[:8]], pad_id=pad_id, stop_ids=stop_ids,
                   **{**kwargs, "max_new_tokens": 8})
    tokens, finish = 0, collections.Counter()
    _sync()
    t0 = time.perf_counter()
    for k in range(0, len(order), args.batch_size):
        batch = [prompts[i] for i in order[k: k + args.batch_size]]
        for _, reason, n in generate_batch(model, batch, pad_id=pad_id, stop_ids=stop_ids, **kwargs):
            tokens += n
            finish[reason] += 1
    _sync()
    return {"tokens": tokens, "seconds": time.perf_counter() - t0, "prefill_tokens": sum(map(len, prompts)),
            "finish": dict(finish)}


def run_hf_cb(model, prompts, args, stop_ids, pad_id) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gc = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad_id,
                          do_sample=args.temperature > 0, temperature=args.temperature or None,
                          top_p=args.top_p if args.temperature > 0 else None, top_k=0 if args.temperature > 0 else None)
    cb = ContinuousBatchingConfig(max_requests_per_batch=args.batch_size, seed=0)
    _sync()
    t0 = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb)
    _sync()
    dt = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return {"tokens": tokens, "seconds": dt, "finish": {"done": len(out)}}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="pkg:smollm2, a .gguf or an HF dir (real weights, real stops)")
    p.add_argument("--random-shape", choices=("smollm2",), default=None, help="random weights instead of --target")
    p.add_argument("--prompts", default="sharegpt", help="sharegpt or a chat file (with --target)")
    p.add_argument("--turns", choices=("first", "all"), default="first",
                   help="first: first user turns as independent prompts; all: whole conversations, every turn "
                        "(--num-prompts conversations; modes slots, slots_full, generate)")
    p.add_argument("--after-cut", choices=("end", "continue"), default="end",
                   help="--turns all: a cut or capped answer ends its conversation, or the next turn follows it")
    p.add_argument("--num-prompts", type=int, default=2048, help="0: every conversation (--turns all)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--max-prefill-tokens", type=int, default=65536)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--stop-loops", action="store_true", help="slots: stop looping answers early (regenerate's default)")
    p.add_argument("--modes", default="slots,generate", help="comma list of slots, generate, hf_cb, step (the "
                   "parts of one decode step)")
    g = p.add_argument_group("engine settings (nemo_dflash.data.generation.EngineConfig; default: the device's)")
    g.add_argument("--refill-fraction", type=int, default=None, help="refill once 1/N of the slots are idle")
    g.add_argument("--attention-group-cost", type=float, default=None,
                   help="packed prefills: the fixed cost of an attention group in (query, key) pairs")
    g.add_argument("--decode-window", type=int, default=None, help="decode steps per host round trip")
    g.add_argument("--prefill-attention", choices=("groups", "varlen"), default=None,
                   help="packed prefills: attention by right-padded groups or one varlen flash call per layer")
    g.add_argument("--decode-compile", choices=("on", "off"), default=None,
                   help="the decode step through torch.compile before capture")
    p.add_argument("--schedule", choices=("most_turns_first", "given"), default="most_turns_first",
                   help="--turns all: the order conversations start in (regenerate_conversations(schedule=))")
    p.add_argument("--prepare-ahead", type=int, default=64,
                   help="--turns all: first turns templated and tokenised this many conversations ahead on a "
                        "background thread (regenerate_conversations(prepare_ahead=), as `regenerate` does; 0: inline)")
    p.add_argument("--json", default=None)
    p.add_argument("--append", default=None, type=Path,
                   help="also append the rows to this JSON list of rows (e.g. docs/bench/regen_summary.json)")
    args = p.parse_args()
    from nemo_dflash.data.generation import EngineConfig

    on_off = {"on": True, "off": False, None: None}
    args.engine_config = EngineConfig(
        decode_window=args.decode_window, decode_compile=on_off[args.decode_compile],
        prefill_attention=args.prefill_attention,
        attention_group_cost=args.attention_group_cost, refill_fraction=args.refill_fraction)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.random_shape:
        model, tokenizer = smollm2_shape(device, dtype), None
        stop_ids, pad_id = [2], 2
    else:
        from nemo_dflash.target.loading import load_target
        from nemo_dflash.data.regenerate import _pad_id, stop_token_ids

        model, tokenizer = load_target(args.target or "pkg:smollm2", dtype="bf16" if device == "cuda" else "fp32",
                                       device=device)
        stop_ids = stop_token_ids(model, tokenizer)
        pad_id = _pad_id(tokenizer, stop_ids)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    if args.turns == "all":
        if tokenizer is None:
            p.error("--turns all needs --target (a chat template to build the later turns)")
        convs = load_conversations(args)
        print(f"# {len(convs)} conversations, every turn, <= {args.max_new_tokens} new, T={args.temperature} "
              f"top_p={args.top_p}, batch {args.batch_size}, loops {'cut' if args.stop_loops else 'kept'}, "
              f"after a cut: {args.after_cut}, {name}", flush=True)
    else:
        prompts = load_prompts(args, tokenizer)
        prompt_tokens = sum(len(x) for x in prompts)
        print(f"# {len(prompts)} prompts ({prompt_tokens / len(prompts):.0f} tokens avg), <= {args.max_new_tokens} "
              f"new, T={args.temperature} top_p={args.top_p}, batch {args.batch_size}, {name}", flush=True)
    rows = []
    print(f"{'mode':<10} {'new tokens':>11} {'seconds':>8} {'tokens/s':>10} {'prefill/gen':>11} {'reused':>10}  finish",
          flush=True)
    for mode in args.modes.split(","):
        try:
            if args.turns == "all":
                if mode not in ("slots", "slots_full", "generate"):
                    raise ValueError(f"mode {mode} does not run --turns all")
                r = run_conversations(model, tokenizer, convs, args, "generate" if mode == "generate" else "slots",
                                      reuse=mode != "slots_full")
            elif mode == "slots":
                r = run_slots(model, prompts, args, stop_ids)
            elif mode == "step":
                r = run_step(model, prompts, args, stop_ids)
            elif mode == "generate":
                r = run_generate(model, prompts, args, stop_ids, pad_id)
            elif mode == "hf_cb":
                r = run_hf_cb(model, prompts, args, stop_ids, pad_id)
            else:
                raise ValueError(f"unknown mode {mode}")
        except Exception as e:  # one failing mode must not hide the others
            print(f"{mode:<10} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        r.update(mode=mode, tokens_per_s=r["tokens"] / r["seconds"], device=name, turns_mode=args.turns,
                 prompts=len(convs) if args.turns == "all" else len(prompts),
                 weights="random" if args.random_shape else "real",
                 max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, temperature=args.temperature,
                 top_p=args.top_p, target=args.target or args.random_shape,
                 engine={**dataclasses.asdict(args.engine_config.resolved(device)),
                         "max_prefill_tokens": args.max_prefill_tokens, "prepare_ahead": args.prepare_ahead,
                         "schedule": args.schedule})
        rows.append(r)
        ratio = r["prefill_tokens"] / r["tokens"] if r.get("prefill_tokens") is not None and r["tokens"] else None
        r["prefill_per_generated"] = None if ratio is None else round(ratio, 3)
        print(f"{mode:<10} {r['tokens']:>11} {r['seconds']:>8.1f} {r['tokens_per_s']:>10.0f} "
              f"{'-' if ratio is None else f'{ratio:.3f}':>11} {r.get('reused_tokens', '-'):>10}  {r['finish']}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    if args.append and rows:
        from _common import append_rows, provenance

        append_rows(args.append, [{**provenance(name), "what": f"regen_throughput.py {r['mode']}",
                                   **{k: v for k, v in r.items() if k != "device"}} for r in rows])


if __name__ == "__main__":
    main()
