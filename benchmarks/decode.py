"""Decoding speed: plain against speculative decoding, one prompt at a time and at any concurrency.

    python benchmarks/decode.py speed [--shapes smollm2_135m] [--modes graphs] [--draft EXPORT_DIR] ...
    python benchmarks/decode.py concurrency --target pkg:smollm2 --draft OUT/export/main --batches 1,4,16 ...
    python benchmarks/decode.py rows --shape smollm2_135m --rows 1,16,64,256 --view 768 --fold-gqa 0,1

`speed`: ms per token and per step of each decoding loop on random-weight target shapes (the projected
speedup at a given tau), with T=0 exactness checks; rows to docs/bench/decode_speed.json.
`concurrency`: speedup of speculative over plain decoding against the number of prompts decoded together;
rows to docs/bench/concurrency.json. `rows`: what one engine step costs against its row count (plain step,
verify, draft block), with and without the grouped-query fold; rows to docs/bench/decode_rows.json. `filter`: the
sampled steps' top-p filter, sort-free against a sort (a table; rows only with --json). Each subcommand has its own flags (`decode.py SUBCOMMAND --help`).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _common, beside this file


# ====================================================================================================
# speed  (was decode_speed.py)

DOC_SPEED = """Decode speed: plain vs speculative, eager vs graphs, on random-weight target shapes.

    python benchmarks/decode.py speed                       # Qwen3-8B and SmolLM2-135M shapes, both modes
    python benchmarks/decode.py speed --shapes smollm2_135m --modes graphs --json out.json
    python benchmarks/decode.py speed --draft EXPORT_DIR [--target HF_DIR_OR_pkg:smollm2]
    python benchmarks/decode.py speed --shapes smollm2_135m --modes graphs --exact '' \
        --new-tokens 2048 --cache-len 4352 --positions 256,1024,2048,4096 --buckets   # step cost vs cache length

Per shape and mode (one prompt at a time, bf16, random weights, a random 5-layer draft unless
--draft): the plain decoding loop's ms per token and the speculative loop's ms per step (both
`generate` calls, prefill excluded, the second of two runs), and, timed alone, the target's
B-token verify and the draft's block forward, both as the loop runs them. A random draft is
accepted ~never, so the loop's step cost is measured at tau ~1; the speedup at a given tau is
then PROJECTED as tau * plain_ms_per_token / spec_ms_per_step (acceptance does not change a
step's cost: the same B tokens are verified either way). With --target (a real target and
its --draft), the real tau and the real speedup on MT-Bench prompts are measured as well.

T=0 exactness is checked on the GPU as well: every mode's plain output against eager HF
decoding, and the speculative output with an oracle draft (proposals = the target's own
greedy continuation, so whole blocks are accepted and the caches roll back across blocks),
in fp32 where near-ties do not flip argmaxes (bf16 outputs are compared and reported too).

Cache length (graphs mode): `--cache-len N` builds the static caches with N positions (what
`evaluate --protocol paper` allocates for 2,048 new tokens: up to 4,352) instead of what the
prompt and --new-tokens need; `--positions` times the captured steps alone at those positions
(the view length each picks is reported); `--buckets` adds a row with the other attention-view setting
(`EngineOptions.use_buckets`: length-bucketed views by default, so a "graphs (whole cache)" row).
"""


import argparse
import gc
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder, autoregressive_generate, check_decode_mode  # noqa: E402
from nemo_dflash.engine import batched_static, graphs, static_decode  # noqa: E402
from nemo_dflash.engine.options import DEFAULT_OPTIONS, EngineOptions  # noqa: E402
from nemo_dflash.engine.sampling import GREEDY, SamplingParams, check_sampling  # noqa: E402
from nemo_dflash.evaluation.loop_figures import no_loop_figures  # noqa: E402
from nemo_dflash.engine.spec_decode import crop_dynamic_cache  # noqa: E402
from nemo_dflash.draft.model import DFlashContextCache  # noqa: E402

TAUS = (2.0, 4.24, 6.5)  # 4.24 / 6.5: the paper's Qwen3-8B MT-Bench / HumanEval tau (T=0)
SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
               rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})


# ----------------------------------------------------------------------------- models


def build_target(shape: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random-weight target of `shape`, made on the device directly (meta init, no HF init)."""
    from transformers import AutoConfig, LlamaConfig

    from nemo_dflash.target.loading import random_weight_model

    if shape == "qwen3_8b":
        from _common import QWEN3_8B_CONFIG

        cfg = AutoConfig.for_model(**QWEN3_8B_CONFIG)
    elif shape == "smollm2_135m":
        cfg = LlamaConfig(**SMOLLM2, architectures=["LlamaForCausalLM"])
    elif shape == "tiny":  # a smoke test of this script on CPU
        cfg = LlamaConfig(**dict(SMOLLM2, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=512),
                          architectures=["LlamaForCausalLM"])
    else:
        raise ValueError(f"unknown shape {shape!r}: use qwen3_8b, smollm2_135m or tiny")
    cfg._attn_implementation = "sdpa"  # what load_target uses
    return random_weight_model(cfg, device, dtype, seed=0).eval().requires_grad_(False)


def build_draft(target: torch.nn.Module, layers: int, block: int, dtype: torch.dtype, draft_dir: Optional[str],
                kind: str = "dflash", options: Optional[dict] = None):
    """A random draft of `kind` (dflash | dflash2: what a decoding step costs with each), or the export at
    `draft_dir`."""
    from nemo_dflash.draft.build import build_draft_for_target

    device = next(target.parameters()).device
    if draft_dir:
        from nemo_dflash.serving.export import check_draft_fits_target, load_draft

        draft = load_draft(draft_dir, device=device, dtype=dtype)
        check_draft_fits_target(draft.config, target.config)
        return draft.eval()
    mask_id = target.config.vocab_size - 1
    with torch.device(device):  # initialised where it runs (a 1B-parameter draft for the 8B shape)
        draft = build_draft_for_target(target, None, num_layers=layers, block_size=block, mask_token_id=mask_id,
                                       kind=kind, variant_options=options)
    return draft.to(dtype=dtype).eval()


# ----------------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, reps: int, setup: Callable[[], Any] = lambda: None) -> float:
    """Median ms of `fn` over `reps` synchronised repeats after 3 warm-ups; `setup` runs untimed."""
    times = []
    for i in range(reps + 3):
        setup()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= 3:
            times.append(1000 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def eager_parts(dec: DFlashSpeculativeDecoder, ids: torch.Tensor, reps: int) -> dict[str, float]:
    """The eager loop's verify (B tokens, hooks, mask, crop back) and draft block (1 new context
    position, lm_head, argmax), each alone at the prompt's KV length."""
    from transformers import DynamicCache

    device, model, blk = dec.device, dec.target.model, dec.block_size
    plen = ids.shape[1]
    cache = DynamicCache()
    with dec.target.capture(stop_early=False) as captured:
        model(input_ids=ids, past_key_values=cache, use_cache=True,
              position_ids=torch.arange(plen, device=device).unsqueeze(0))
        feats = dec.target.concat(captured)
        block = ids[:, -blk:].clone()
        one = ids[:, -1:].clone()
        q_pos = torch.arange(plen, plen + blk, device=device)

        def verify() -> None:
            out = model(input_ids=block, past_key_values=cache, use_cache=True, position_ids=q_pos.unsqueeze(0),
                        **dec._verify_mask(q_pos, plen + blk))
            dec.target.concat(captured)
            out.logits[0].argmax(-1)
            crop_dynamic_cache(cache, plen)

        def plain() -> None:
            out = model(input_ids=one, past_key_values=cache, use_cache=True, position_ids=q_pos[:1].unsqueeze(0))
            out.logits[0, -1:].argmax(-1)
            crop_dynamic_cache(cache, plen)

        verify_ms = timed(verify, device, reps)
        plain_ms = timed(plain, device, reps)
    steady = DFlashContextCache(len(dec.draft.layers))
    dec.draft_logits(one[0], plen - 1, feats[:, :-1], steady, blk)

    def draft() -> None:
        dec.draft_logits(one[0], plen, feats[:, -1:], steady, blk).argmax(-1)
        steady.crop(plen - 1)

    return {"verify_ms": verify_ms, "draft_ms": timed(draft, device, reps), "plain_step_ms": plain_ms}


def graph_parts(dec: DFlashSpeculativeDecoder, target: torch.nn.Module, plen: int, reps: int,
                positions: tuple[int, ...] = (), options: EngineOptions = DEFAULT_OPTIONS,
                sampling: SamplingParams = GREEDY) -> dict[str, Any]:
    """The captured verify and draft graphs (and the plain 1-token graph), each replayed alone at
    the prompt's position, and at each of `positions` that the caches hold (`by_position`); at T > 0 the sampled
    steps (the draft's proposals or selector walk, the keyed accept test)."""
    device = dec.device
    runner = batched_static.spec_runner(dec, sampling, 1, 0, True, options)  # the runners the generations made (one row)
    plain = batched_static.plain_runner(target, sampling, 1, 0, True, options)

    def at(pos: int) -> dict[str, Any]:
        view = runner.verify_steps.view(pos + runner.B)
        draft_step = runner.draft_steps.get(view) if runner.draft_steps is not None else None
        verify_step = runner.verify_steps.get(view)
        plain_view = plain.steps.view(pos + 1)
        plain_step = plain.steps.get(plain_view)

        def spec_setup() -> None:
            runner.pos.fill_(pos)
            runner.ctx_start.fill_(pos - 1)

        out = {"pos": pos, "view_len": view, "plain_view_len": plain_view,
               "verify_ms": timed(verify_step.replay, device, reps, spec_setup),
               "plain_step_ms": timed(plain_step.replay, device, reps, lambda: plain.pos.fill_(pos))}
        out["draft_ms"] = timed(draft_step.replay, device, reps, spec_setup) if draft_step else 0.0
        return out

    out = at(plen)
    fits = [p for p in positions if 1 <= p and p + dec.block_size <= runner.max_len and p < plain.max_len]
    if len(fits) < len(positions):
        print(f"positions {sorted(set(positions) - set(fits))} skipped: past the cache length {runner.max_len} "
              "(raise --cache-len)", flush=True)
    out["by_position"] = [at(p) for p in fits]
    out["cache_len"], out["plain_cache_len"] = runner.max_len, plain.max_len
    return out


# ----------------------------------------------------------------------------- exactness


def agree(a: list[int], b: list[int]) -> int:
    """Length of the common prefix."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def oracle_spec(dec: DFlashSpeculativeDecoder, ids: torch.Tensor, reference: list[int], n: int, mode: str):
    """Speculative decoding whose proposals are the target's own continuation `reference`."""
    device, blk = dec.device, dec.block_size
    full = torch.tensor(ids[0].tolist() + reference + [0] * (blk + 1), device=device)
    if mode == "graphs":
        dec.generate(ids, max_new_tokens=2, decode="graphs")  # build the runner, then hook it
        runner = batched_static.spec_runner(dec, GREEDY, 1, 0, True)
        offsets = torch.arange(1, blk, device=device)
        runner.after_draft = lambda: runner.blk[0, 1:].copy_(full[runner.pos[0] + offsets])
        try:
            return dec.generate(ids, max_new_tokens=n, decode="graphs")
        finally:
            runner.after_draft = None
    real = dec.draft_logits

    def forced(last, position, feats, cache, block_size):
        logits = real(last, position, feats, cache, block_size)
        return torch.zeros_like(logits).scatter_(1, full[position + 1: position + block_size].view(-1, 1), 1.0)

    dec.draft_logits = forced
    try:
        return dec.generate(ids, max_new_tokens=n)
    finally:
        del dec.draft_logits


def exactness(shape: str, modes: list[str], device: torch.device, args) -> list[dict[str, Any]]:
    """fp32 target + draft: HF's greedy generate vs each mode's plain and oracle-speculative output."""
    target = build_target(shape, device, torch.float32)
    draft = build_draft(target, args.draft_layers, args.block_size, torch.float32, None)
    dec = DFlashSpeculativeDecoder(target, draft, args.block_size)
    n = args.exact_tokens
    rows = []
    for seed in range(args.exact_seeds):
        ids = torch.randint(0, target.config.vocab_size - 1, (1, args.prompt_tokens), device=device,
                            generator=torch.Generator(device=device).manual_seed(100 + seed))
        ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
        for mode in modes:
            plain = autoregressive_generate(target, ids, max_new_tokens=n, decode=mode).output_ids
            spec = oracle_spec(dec, ids, ref, n, mode)
            rows.append({"shape": shape, "dtype": "fp32", "prompt_seed": 100 + seed, "mode": mode, "tokens": n,
                         "plain_equals_hf": plain == ref, "oracle_spec_equals_hf": spec.output_ids == ref,
                         "oracle_tau": spec.mean_acceptance_length})
            print(f"exactness {shape} fp32 seed {100 + seed} {mode:6s}: plain == HF greedy {plain == ref}, "
                  f"oracle spec == HF greedy {spec.output_ids == ref} (tau {spec.mean_acceptance_length:.2f})",
                  flush=True)
    del dec, draft, target
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows


# ----------------------------------------------------------------------------- one shape


def load_baseline(path: str):
    """A spec_decode.py from another revision (`git show REV:nemo_dflash/engine/spec_decode.py`),
    timed as an extra eager row on the same machine."""
    spec = importlib.util.spec_from_file_location("baseline_spec_decode", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


class Variant:
    """One way of decoding, timed on the same models: a mode plus the engine options it runs with."""

    def __init__(self, label: str, mode: str, dec, target, baseline=None, cudnn: bool = False,
                 unfused: bool = False, buckets: Optional[bool] = None, sampling: SamplingParams = GREEDY) -> None:
        self.label, self.mode, self.baseline, self.cudnn, self.unfused = label, mode, baseline, cudnn, unfused
        self.sampling = GREEDY if baseline else sampling  # the baseline module's rows stay greedy
        self.buckets = DEFAULT_OPTIONS.use_buckets if buckets is None else buckets
        # the runners these options make are their own (cached by options): the other variants' are not reused
        self.options = DEFAULT_OPTIONS.but(avoid_cudnn_attention=not cudnn, fuse_elementwise=not unfused,
                                           use_buckets=self.buckets)
        self.target = target
        self.dec = baseline.DFlashSpeculativeDecoder(target, dec.draft, dec.block_size) if baseline else dec

    def __enter__(self) -> "Variant":
        if self.options != DEFAULT_OPTIONS:  # one variant's graphs in memory at a time
            self._drop_graphs()
        return self

    def __exit__(self, *exc) -> None:
        if self.options != DEFAULT_OPTIONS:  # free this variant's graphs before the next one captures its own
            self._drop_graphs()

    def prebuild(self, cache_len: int) -> tuple[float, float]:
        """Graphs mode: make (capture) the T=0 runners with a `cache_len`-position cache, which the
        generations then reuse (they do whenever it holds what they need). Returns (seconds taken,
        GB of device memory they reserved: caches plus one graph pool per step and view length)."""
        if self.mode != "graphs" or self.baseline or not cache_len:
            return 0.0, 0.0
        self._drop_graphs()
        gc.collect()
        on_cuda = self.dec.device.type == "cuda"
        torch.cuda.empty_cache() if on_cuda else None
        reserved = torch.cuda.memory_reserved(self.dec.device) if on_cuda else 0
        t0 = time.perf_counter()
        batched_static.spec_runner(self.dec, self.sampling, 1, cache_len, True, self.options)
        batched_static.plain_runner(self.target, self.sampling, 1, cache_len, True, self.options)
        sync(self.dec.device)
        took = time.perf_counter() - t0
        return took, ((torch.cuda.memory_reserved(self.dec.device) - reserved) / 2**30 if on_cuda else 0.0)

    def _drop_graphs(self) -> None:
        batched_static.drop_runners(self.dec)
        batched_static.drop_runners(self.target)

    def plain(self, ids, n: int):
        if self.baseline:
            return self.baseline.autoregressive_generate(self.target, ids, max_new_tokens=n)
        return autoregressive_generate(self.target, ids, max_new_tokens=n, decode=self.mode, options=self.options,
                                       **self._sampled())

    def spec(self, ids, n: int):
        if self.baseline:
            return self.dec.generate(ids, max_new_tokens=n)
        return self.dec.generate(ids, max_new_tokens=n, decode=self.mode, options=self.options, **self._sampled())

    def _sampled(self) -> dict[str, Any]:
        """The sampling arguments of a timed call: the setting, and a generator seeded alike for every call."""
        if self.sampling.greedy:
            return {}
        return {"sampling": self.sampling, "generator": torch.Generator(device=self.dec.device).manual_seed(0)}

    def parts(self, ids, reps: int, positions: tuple[int, ...] = ()) -> dict[str, Any]:
        if self.baseline:
            return {}
        if self.mode == "graphs":
            return graph_parts(self.dec, self.target, ids.shape[1], reps, positions, self.options, self.sampling)
        with graphs.eager_attention_backends(self.dec.device, self.options.avoid_cudnn_attention):
            return eager_parts(self.dec, ids, reps)


def measure_shape(shape: str, modes: list[str], device: torch.device, args, rows: list, save: Callable[[], None]) -> None:
    dtype = torch.bfloat16
    t0 = time.perf_counter()
    target = build_target(shape, device, dtype)
    options = variant_options(args.variant_options)
    draft = build_draft(target, args.draft_layers, args.block_size, dtype, args.draft, args.draft_kind, options)
    dec = DFlashSpeculativeDecoder(target, draft, args.block_size)
    print(f"[{shape}] built in {time.perf_counter() - t0:.1f}s; draft {len(draft.layers)} layers, "
          f"block {dec.block_size}", flush=True)
    ids = torch.randint(0, target.config.vocab_size - 1, (1, args.prompt_tokens), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))
    n = args.new_tokens
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    sampling = args.sampling
    variants = [Variant(m, m, dec, target, sampling=sampling) for m in modes]
    if args.unfused and "graphs" in modes:
        variants.append(Variant("graphs (unfused)", "graphs", dec, target, unfused=True, sampling=sampling))
    if args.buckets and "graphs" in modes:  # the other view setting beside the default
        other = not DEFAULT_OPTIONS.use_buckets
        variants.append(Variant("graphs (buckets)" if other else "graphs (whole cache)", "graphs", dec, target,
                                buckets=other, sampling=sampling))
    positions = tuple(int(p) for p in args.positions.split(",") if p)
    if args.cudnn and "eager" in modes:
        variants.append(Variant("eager (cuDNN attention)", "eager", dec, target, cudnn=True, sampling=sampling))
    if args.baseline:
        variants.append(Variant("eager (baseline module)", "eager", dec, target, baseline=load_baseline(args.baseline)))
    for v in variants:
        try:
            with v:
                capture_s, capture_gb = v.prebuild(args.cache_len)
                t0 = time.perf_counter()
                for _ in range(2):  # the first run captures / warms every shape; the second is kept
                    plain = v.plain(ids, n)
                    spec = v.spec(ids, n)
                setup_s = time.perf_counter() - t0 + capture_s
                parts = v.parts(ids, args.reps, positions)
                plain_ms = 1000 * plain.decode_time_s / plain.num_target_forwards
                spec_ms = 1000 * spec.decode_time_s / spec.num_target_forwards
                row = {
                    "device": dev_name, "shape": shape, "mode": v.mode, "variant": v.label, "dtype": "bf16", "date": time.strftime("%Y-%m-%d"),
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "prompt_tokens": ids.shape[1], "new_tokens": n, "block_size": dec.block_size,
                    "draft_layers": len(draft.layers), "draft": args.draft or "random", "draft_kind": getattr(draft.config, "architectures", ["?"])[0],
                    **({"variant_options": options} if options else {}),
                    "plain_ms_per_token": plain_ms, "spec_ms_per_step": spec_ms,
                    "verify_ms": parts.get("verify_ms"), "draft_ms": parts.get("draft_ms"),
                    "plain_step_alone_ms": parts.get("plain_step_ms"),
                    "spec_steps": spec.num_target_forwards, "spec_tau_measured": spec.mean_acceptance_length,
                    "bf16_spec_output_equals_plain": spec.output_ids == plain.output_ids,
                    "bf16_spec_plain_common_prefix": agree(spec.output_ids, plain.output_ids),
                    "projected_speedup_at_tau": {str(t): t * plain_ms / spec_ms for t in TAUS},
                    "projection_note": "projection: tau * plain_ms_per_token / spec_ms_per_step, step costs "
                                       "measured with a random draft (tau ~1); not a measured speedup",
                    "setup_s": setup_s,
                }
                if not v.sampling.greedy:  # a T=0 row keeps the shape the file's rows have
                    row["sampling"] = v.sampling.record()
                if v.mode == "graphs" and not v.baseline:
                    row.update({"buckets": v.buckets, "length_bucket": static_decode.LENGTH_BUCKET,
                                "cache_len": parts.get("cache_len"), "plain_cache_len": parts.get("plain_cache_len"),
                                "view_len_at_prompt": parts.get("view_len"),
                                "step_cost_by_position": parts.get("by_position", []),
                                "prebuild_capture_s": capture_s or None, "prebuild_reserved_gb": capture_gb or None})
                if parts:
                    row["step_overhead_ms"] = spec_ms - parts["verify_ms"] - parts["draft_ms"]
                if args.interleave and not (v.unfused or v.baseline):
                    row.update(interleaved(v, target, device, args.interleave))
                rows.append(row)
                print_row(row)
                save()
        except Exception as e:  # one failing case must not lose the others
            print(f"[{shape}] {v.label}: FAILED {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                  flush=True)
            rows.append({"device": dev_name, "shape": shape, "mode": v.mode, "variant": v.label, "error": f"{type(e).__name__}: {e}"[:500]})
            save()
    if args.profile and "eager" in modes:
        with graphs.eager_attention_backends(device):
            profile_eager(dec, ids, args.profile, shape)
    del dec, draft, target, variants
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None


INTERLEAVE_LENGTHS = (53, 97, 140, 75, 210)


def interleaved(v: Variant, target, device, n: int) -> dict[str, Any]:
    """`evaluate`'s pattern: prompts of lengths not seen before, speculative and plain decoding
    alternating prompt by prompt, times summed. Its step ratio is the one `evaluate` implies."""
    spec_t = spec_steps = plain_t = plain_steps = 0.0
    for i, plen in enumerate(INTERLEAVE_LENGTHS):
        ids = torch.randint(0, target.config.vocab_size - 1, (1, plen), device=device,
                            generator=torch.Generator(device=device).manual_seed(10 + i))
        s = v.spec(ids, n)
        p = v.plain(ids, n)
        spec_t, spec_steps = spec_t + s.decode_time_s, spec_steps + s.num_target_forwards
        plain_t, plain_steps = plain_t + p.decode_time_s, plain_steps + p.num_target_forwards
    out = {"interleaved_prompt_tokens": list(INTERLEAVE_LENGTHS), "interleaved_new_tokens": n,
           "interleaved_plain_ms_per_token": 1000 * plain_t / plain_steps,
           "interleaved_spec_ms_per_step": 1000 * spec_t / spec_steps}
    out["interleaved_step_ratio"] = out["interleaved_spec_ms_per_step"] / out["interleaved_plain_ms_per_token"]
    return out


def profile_eager(dec, ids, path: str, shape: str) -> None:
    """torch.profiler over one eager speculative generation: where the host time goes."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dec.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        out = dec.generate(ids, max_new_tokens=64)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    with open(path, "a") as f:
        f.write(f"## {shape}: eager speculative generate, {out.num_target_forwards} steps\n{table}\n")
    print(f"[{shape}] profile of the eager loop appended to {path}", flush=True)


# ----------------------------------------------------------------------------- real target + draft


def measure_real(args, device: torch.device, modes: list[str]) -> list[dict[str, Any]]:
    """Real tau and real speedup: `--target` + its `--draft`, MT-Bench first turns."""
    from nemo_dflash.evaluation.protocol import encode_chat, load_mtbench
    from nemo_dflash.target.loading import load_target
    from nemo_dflash.data.regenerate import stop_token_ids

    target, tok = load_target(args.target, dtype="bf16", device=device)
    draft = build_draft(target, 0, 0, torch.bfloat16, args.draft)
    dec = DFlashSpeculativeDecoder(target, draft, args.block_size)
    stops = stop_token_ids(target, tok)
    prompts = [encode_chat(tok, [{"role": "user", "content": p.turns[0]}]) for p in load_mtbench(args.real_prompts)]
    rows = []
    for mode in modes:
        dec.generate(prompts[0], max_new_tokens=16, decode=mode)
        autoregressive_generate(target, prompts[0], max_new_tokens=16, decode=mode)
        s_t = s_tok = p_t = p_tok = 0.0
        taus = []
        for ids in prompts:
            s = dec.generate(ids, max_new_tokens=args.new_tokens, stop_token_ids=stops, decode=mode)
            p = autoregressive_generate(target, ids, max_new_tokens=args.new_tokens, stop_token_ids=stops, decode=mode)
            s_t, s_tok = s_t + s.decode_time_s, s_tok + s.num_decode_tokens
            p_t, p_tok = p_t + p.decode_time_s, p_tok + p.num_decode_tokens
            taus.append(s.mean_acceptance_length)
        row = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "shape": f"real:{args.target}", "mode": mode, "draft": args.draft, "dtype": "bf16",
               "protocol": f"MT-Bench first turns, {len(prompts)} prompts, T=0, up to {args.new_tokens} new tokens, "
                           f"block {dec.block_size}",
               "tau_measured": sum(taus) / len(taus),
               "plain_ms_per_token": 1000 * p_t / p_tok, "spec_ms_per_token": 1000 * s_t / s_tok,
               "speedup_measured": (p_t / p_tok) / (s_t / s_tok)}
        print(f"[real] {mode}: tau {row['tau_measured']:.2f}, measured speedup {row['speedup_measured']:.2f}x "
              f"({row['protocol']})", flush=True)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- output


def print_row(r: dict[str, Any]) -> None:
    def f(x):
        return "-" if x is None else f"{x:.2f}"

    proj = " ".join(f"{float(t):g}:{v:.2f}x" for t, v in r["projected_speedup_at_tau"].items())
    print(f"{r['shape']:14s} {r.get('variant', r['mode']):24s} plain {f(r['plain_ms_per_token']):>7s} ms/tok | spec step "
          f"{f(r['spec_ms_per_step']):>7s} ms = verify {f(r['verify_ms'])} + draft {f(r['draft_ms'])} + "
          f"{f(r.get('step_overhead_ms'))} | projected speedup at tau {proj} | bf16 spec==plain "
          f"{r['bf16_spec_plain_common_prefix']}/{r['new_tokens']} tokens", flush=True)
    if r.get("cache_len"):
        print(f"{'':14s} {'':24s} cache {r['cache_len']} positions, buckets {r['buckets']} "
              f"(view {r['view_len_at_prompt']} at the prompt); runners made in {r.get('prebuild_capture_s') or 0:.1f}s, "
              f"{r.get('prebuild_reserved_gb') or 0:.2f} GB", flush=True)
    for b in r.get("step_cost_by_position") or []:
        print(f"{'':14s} {'':24s} at position {b['pos']:5d} (view {b['view_len']:5d}): verify {b['verify_ms']:.2f} "
              f"+ draft {b['draft_ms']:.2f} ms, plain step {b['plain_step_ms']:.2f} ms", flush=True)
    if "interleaved_step_ratio" in r:
        print(f"{'':14s} {'':24s} interleaved new-length prompts: plain {r['interleaved_plain_ms_per_token']:.2f} "
              f"ms/tok, spec {r['interleaved_spec_ms_per_step']:.2f} ms/step, step ratio "
              f"{r['interleaved_step_ratio']:.2f} (single prompt: {r['spec_ms_per_step'] / r['plain_ms_per_token']:.2f})",
              flush=True)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'shape':14s} {'mode':24s} {'plain ms/tok':>12s} {'spec ms/step':>12s} {'verify ms':>9s} "
            f"{'draft ms':>8s} {'overhead':>8s} " + " ".join(f"{'x@tau ' + format(t, 'g'):>10s}" for t in TAUS))
    print("\n" + head)
    print("-" * len(head))
    for r in rows:
        if "projected_speedup_at_tau" not in r:
            continue

        def f(x, w):
            return f"{'-':>{w}s}" if x is None else f"{x:{w}.2f}"

        proj = " ".join(f(r["projected_speedup_at_tau"][str(t)], 10) for t in TAUS)
        print(f"{r['shape']:14s} {r.get('variant', r['mode']):24s} {f(r['plain_ms_per_token'], 12)} {f(r['spec_ms_per_step'], 12)} "
              f"{f(r['verify_ms'], 9)} {f(r['draft_ms'], 8)} {f(r.get('step_overhead_ms'), 8)} {proj}")
    print("x@tau: PROJECTED speedup = tau * plain ms/token / spec ms/step (step costs measured, tau assumed)")


def main_speed(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="decode.py speed", description=DOC_SPEED, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3_8b,smollm2_135m")
    p.add_argument("--modes", default="eager,graphs")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--draft-kind", default="dflash", choices=("dflash", "dflash2"),
                   help="the random draft's variant (dflash2: the convolutions and the selector's walk in each step)")
    p.add_argument("--variant-options", default="",
                   help='the random draft variant\'s sizes, e.g. "conv_kernel_size=0" or "selector_rank=0,'
                        'selector_top_k=0" (a part off, to time the rest)')
    p.add_argument("--draft", default=None, help="an exported draft (its architecture on the random shapes; "
                                                 "with --target, real tau and speedup)")
    p.add_argument("--target", default=None, help="a real target for --draft (HF dir or pkg:smollm2)")
    p.add_argument("--real-prompts", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--exact", default="smollm2_135m", help="shapes for the fp32 exactness check ('' to skip)")
    p.add_argument("--exact-tokens", type=int, default=96)
    p.add_argument("--exact-seeds", type=int, default=2, help="prompts for the exactness check")
    p.add_argument("--interleave", type=int, default=0, help="new tokens for the evaluate-like interleaved run")
    p.add_argument("--unfused", action="store_true", help="also a graphs row without the fused norms/RoPE/SiLU (and sampling)")
    p.add_argument("--cudnn", action="store_true", help="also an eager row with cuDNN attention allowed")
    p.add_argument("--buckets", action="store_true",
                   help="also a graphs row with the other attention-view setting (EngineOptions.use_buckets: "
                        "length-bucketed views by default, the whole cache in the extra row)")
    p.add_argument("--cache-len", type=int, default=0,
                   help="graphs mode: static cache positions (default: what prompt + new tokens need, "
                        "rounded up; evaluate --protocol paper uses up to 4352)")
    p.add_argument("--positions", default="",
                   help="graphs mode: also time the captured steps alone at these positions, e.g. 256,1024,2048,4096")
    p.add_argument("--baseline", default=None, help="a spec_decode.py of another revision, timed as an extra row")
    p.add_argument("--profile", default=None, help="append a torch.profiler table of the eager loop to this file")
    p.add_argument("--json", default=None)
    p.add_argument("--append", default=str(Path(__file__).resolve().parent.parent / "docs" / "bench" / "decode_speed.json"),
                   help="append the rows (GPU runs only) to this JSON list of rows ('': do not)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the timed decodes' temperature (0: greedy); at T > 0 both loops sample with keyed noise and "
                        "the speculative step's cost includes the draft's sampled proposals (a DFlash2 draft: its "
                        "walk) and the accept test. The exactness checks stay at T=0")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling at --temperature > 0")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    try:
        check_sampling(args.temperature, args.top_p, names=("--temperature", "--top-p", "top-k"))
    except ValueError as e:
        print(f"decode.py speed: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    args.sampling = SamplingParams(args.temperature, top_p=args.top_p)
    device = torch.device(args.device)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        check_decode_mode(m, device)
    rows: list[dict[str, Any]] = []
    exact: list[dict[str, Any]] = []

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps({
                "command": "python benchmarks/decode.py " + " ".join(sys.argv[1:]),
                "torch": torch.__version__, "rows": rows, "exactness": exact}, indent=2))

    for shape in [s for s in args.exact.split(",") if s]:
        try:
            exact.extend(exactness(shape, modes, device, args))
        except Exception as e:
            print(f"exactness {shape}: FAILED {type(e).__name__}: {e}", flush=True)
            exact.append({"shape": shape, "error": f"{type(e).__name__}: {e}"[:500]})
        save()
    if args.target:
        rows.extend(measure_real(args, device, modes))
        save()
    for shape in [s for s in args.shapes.split(",") if s]:
        measure_shape(shape, modes, device, args, rows, save)
    print_table(rows)
    if args.append and device.type == "cuda" and (rows or exact):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _common import append_rows, provenance

        head = provenance(f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})")
        append_rows(Path(args.append), [{**head, "kind": "step cost", **r} for r in rows]
                    + [{**head, "kind": "exactness", **r} for r in exact])


# ====================================================================================================
# concurrency  (was concurrency.py)

DOC_CONCURRENCY = """Speedup of speculative over plain decoding against concurrency (how many prompts decode together).

    python benchmarks/decode.py concurrency --target pkg:smollm2 --draft OUT/export/main --dataset mtbench \
        --prompts 16 --batches 1,4,16 --max-new-tokens 256

For each concurrency B the same prompts (the first --prompts of the set, one turn, chat template)
are decoded in batches of B twice, plainly and speculatively, at `--temperature` (T=0 by default; at T > 0
each call draws from a generator seeded with `--seed`, so on graphs the batched loop at B=1 and the one-prompt
loop sample the same answers):

- `--decode graphs` (the default on a GPU): `engine.batched_static`, B rows on fixed shapes, each
  step a captured CUDA graph on both sides (what a serving engine runs);
- `--decode eager` (the default on a CPU): the same decoders, each step run eagerly.

Tokens per second of each side, their ratio (the speedup) and the mean acceptance length tau go to
a table and, as rows, to docs/bench/concurrency.json. Only decode time is timed (prefills are
not), as `evaluate` times speedup; a first batch of each concurrency warms up (and captures) first.
"""


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

from _common import (  # noqa: E402
    add_engine_attention_flags, append_rows, engine_attention_options, provenance, variant_options)

DEFAULT_JSON = Path(__file__).resolve().parent.parent / "docs" / "bench" / "concurrency.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="decode.py concurrency", description=DOC_CONCURRENCY, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--temperature", type=float, default=0.0, help="both sides' sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling at --temperature > 0")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed (each call reseeds it)")
    p.add_argument("--one-prompt-loop", action="store_true",
                   help="at concurrency 1, also time the one-prompt loops `evaluate`'s speedup runs "
                        "(DFlashSpeculativeDecoder.generate, autoregressive_generate) on the same prompts")
    p.add_argument("--schedule", default="batches", choices=["batches", "continuous"],
                   help="batches: the prompts in consecutive batches of the concurrency, each waiting for its "
                        "longest answer; continuous: all prompts through that many rows, a prompt entering a row "
                        "as soon as its answer ends (what a serving engine does)")
    p.add_argument("--fuse-sampling", type=int, default=1, choices=[0, 1],
                   help="1: a sampled step's softmaxes, hashes and draws run compiled on a GPU "
                        "(EngineOptions.fuse_sampling, the default); 0: op by op, for comparison")
    add_engine_attention_flags(p)
    p.add_argument("--cudnn", action="store_true",
                   help="let the engine's eager prefills and first draft blocks use cuDNN attention (per-shape plan "
                        "builds), for comparison; default: flash / memory-efficient (nemo_dflash.engine.attention)")
    p.add_argument("--json", default=str(DEFAULT_JSON), help="append the rows here")
    return p


def check(args: argparse.Namespace) -> list[int]:
    """Every user error, before any model loads."""
    if args.prompts < 1 or args.max_new_tokens < 1:
        raise ValueError("--prompts and --max-new-tokens must be >= 1")
    from nemo_dflash.engine.sampling import check_sampling

    check_sampling(args.temperature, args.top_p, names=("--temperature", "--top-p", "top-k"))
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"--batches {args.batches!r}: give concurrencies like 1,4,16") from None
    if not batches or min(batches) < 1:
        raise ValueError(f"--batches {args.batches!r}: give concurrencies >= 1, like 1,4,16")
    if args.decode == "graphs":
        from nemo_dflash.engine.graphs import check_decode_mode
        from nemo_dflash.recipes._cli import resolve_device_dtype

        check_decode_mode("graphs", resolve_device_dtype(args.device, args.dtype)[0])
    return batches


def _timed(fn, prompts: list[list[int]], bsz: int) -> tuple[float, list[Any], list[float]]:
    """Decode `prompts` in batches of `bsz`; (decode seconds, outputs, each batch's decode seconds): prefills
    are not timed, as `evaluate` times speedup."""
    outs, batch_seconds = [], []
    for i in range(0, len(prompts), bsz):
        res = fn(prompts[i : i + bsz])
        batch_seconds.append(res[0].decode_time_s)
        outs += res
    return sum(batch_seconds), outs, batch_seconds


def _batch_tokens(outs: list[Any], bsz: int, rows: Optional[int] = None) -> list[int]:
    """New tokens of each batch of `bsz` answers (the first token comes from the untimed prefill). One batch
    through fewer `rows` (continuous batching): the first tokens of the prompts that entered mid-run were made
    inside the timed loop, so they count."""
    if rows is not None and rows < bsz:
        return [sum(len(o.output_ids) for o in outs) - rows]
    return [sum(len(o.output_ids) - 1 for o in outs[i : i + bsz]) for i in range(0, len(outs), bsz)]


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from nemo_dflash.data.chat_template import stop_token_ids
    from nemo_dflash.engine import batched_static
    from nemo_dflash.evaluation.run import ModelSpec, check_draft_files, load_models
    from nemo_dflash.evaluation.protocol import encode_chat, load_prompt_set
    from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder, autoregressive_generate
    from nemo_dflash.recipes._cli import resolve_device_dtype

    batches = check(args)
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    name, prompt_set = load_prompt_set(args.dataset, args.prompts)
    draft_sha256 = check_draft_files(str(args.draft))  # the rows name the weights they timed, read from the files
    target, tokenizer, draft = load_models(ModelSpec(args.draft, args.target, device, dtype, args.threads))
    decoder = DFlashSpeculativeDecoder(target, draft, args.block_size)
    stops = stop_token_ids(target, tokenizer)
    prompts = [encode_chat(tokenizer, p.history() + ([] if p.messages is not None else
                                                    [{"role": "user", "content": p.turns[0]}]))
               for p in prompt_set]
    from nemo_dflash.engine.sampling import SamplingParams

    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    kw = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, stop_token_ids=stops)
    decode = args.decode or ("graphs" if device == "cuda" else "eager")
    from nemo_dflash.engine.options import EngineOptions

    options, attention_settings = engine_attention_options(
        args, device, EngineOptions(fuse_sampling=bool(args.fuse_sampling), avoid_cudnn_attention=not args.cudnn))
    kw["options"] = options  # every decode call below: the runners it makes are these options'
    rows = []
    dev_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    graphs = decode == "graphs"  # bsz rows on fixed shapes; a last, smaller batch keeps them (padding rows)
    continuous = args.schedule == "continuous"

    def gen() -> torch.Generator:  # every call from the same seed: the loops sample alike at B=1
        return torch.Generator(device=device).manual_seed(args.seed)

    def one_prompt_plain(ps):
        return [autoregressive_generate(target, ps[0], decode=decode, generator=gen(), **kw)]

    def one_prompt_spec(ps):
        return [decoder.generate(ps[0], decode=decode, generator=gen(), **kw)]

    cases = [(b, "batched") for b in batches] + ([(1, "one-prompt")] if args.one_prompt_loop else [])
    for bsz, loop in cases:
        def plain(ps, bsz=bsz):
            return batched_static.batched_static_autoregressive_generate(target, ps, rows=bsz, use_graphs=graphs,
                                                                         generator=gen(), **kw)

        def spec(ps, bsz=bsz):
            return batched_static.batched_static_speculative_generate(decoder, ps, rows=bsz, use_graphs=graphs,
                                                                      generator=gen(), **kw)

        if loop == "one-prompt":
            plain, spec = one_prompt_plain, one_prompt_spec
        longest = sorted(prompts, key=len)[-bsz:]  # the runners' caches then fit every batch (graphs)
        for fn in (plain, spec):  # warm-up: allocator, kernels, the graphs' capture
            fn(longest)
        per_call, rows_of = (len(prompts), bsz) if continuous and loop == "batched" else (bsz, None)
        t_plain, o_plain, b_plain = _timed(plain, prompts, per_call)
        t_spec, o_spec, b_spec = _timed(spec, prompts, per_call)
        n_plain, n_spec = _batch_tokens(o_plain, per_call, rows_of), _batch_tokens(o_spec, per_call, rows_of)
        tok_plain, tok_spec = sum(n_plain), sum(n_spec)
        steps = [a for o in o_spec for a in o.acceptance_lengths]
        same = sum(a.output_ids == b.output_ids for a, b in zip(o_plain, o_spec))
        no_loop = no_loop_figures(o_plain, o_spec, per_call, b_plain, b_spec, n_plain, n_spec, stops)
        rows.append({
            **provenance(dev_name), "draft_sha256": draft_sha256, "dataset": name, "prompts": len(prompts),
            "concurrency": bsz, "loop": loop,
            "schedule": "continuous" if rows_of else "batches", "fuse_sampling": bool(args.fuse_sampling),
            **attention_settings, "eager_cudnn": args.cudnn,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "block_size": decoder.block_size,
            "decode": decode, "dtype": dtype, "plain_tokens_per_s": tok_plain / t_plain,
            "spec_tokens_per_s": tok_spec / t_spec, "speedup": (tok_spec / t_spec) / (tok_plain / t_plain),
            "tau": statistics.mean(steps) if steps else None, "identical_answers": same, **no_loop,
            # what the speedup and its spread are recomputed from: each batch's decode seconds and new tokens
            "batches_detail": {"plain_seconds": b_plain, "plain_tokens": n_plain,
                               "spec_seconds": b_spec, "spec_tokens": n_spec},
        })
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    r0 = rows[0]
    top_p = f" top-p {r0['top_p']:g}" if r0.get("top_p", 1.0) < 1.0 else ""
    head = (f"{r0['dataset']}, {r0['prompts']} prompts, up to {r0['max_new_tokens']} new tokens, 1 turn, "
            f"T={r0['temperature']:g}{top_p}, "
            f"block {r0['block_size']}, {r0['decode']} on both sides, {r0['dtype']} on {r0['device']}")
    lines = [head, f"{'concurrency':>11} {'loop':>10} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} {'tau':>6} "
                   f"{'same':>5} {'looping':>7} {'no-loop speedup':>15} {'tau':>5}"]
    for r in rows:
        nl = f"{r['speedup_no_loop']:.2f}x ({r['batches_no_loop']})" if r.get("speedup_no_loop") else "-"
        tau_nl = f"{r['tau_no_loop']:.2f}" if r.get("tau_no_loop") else "-"
        lines.append(f"{r['concurrency']:>11} {r.get('loop', 'batched'):>10} {r['plain_tokens_per_s']:>12.1f} {r['spec_tokens_per_s']:>11.1f} "
                     f"{r['speedup']:>7.2f}x {r['tau'] or 0:>6.2f} {r['identical_answers']:>3}/{r['prompts']} "
                     f"{r.get('loop_share', 0):>7.0%} {nl:>15} {tau_nl:>5}")
    lines.append("no-loop: batches (calls) where no answer loops on either side, their count in brackets; tau over "
                 "the speculative answers that do not loop")
    return "\n".join(lines)


def main_concurrency(argv: Optional[Sequence[str]] = None) -> int:
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



# ====================================================================================================
# rows

DOC_ROWS = """The engine's steps against their row count: what one captured step of R rows costs.

    python benchmarks/decode.py rows --shape smollm2_135m --rows 1,16,64,256 --view 768 --fold-gqa 0,1
    python benchmarks/decode.py rows --shape tiny --rows 1,3 --view 256 --device cpu     # a smoke test, eager

On random weights of --shape (bf16 on a GPU, fp32 on a CPU), for each row count R and each --fold-gqa setting
(`EngineOptions.fold_gqa`: 0, HF's SDPA, which copies every K/V head per query head under a mask; 1, the query
heads folded into their K/V head's query rows): the plain 1-token step of `BatchedStaticPlainRunner` and the
speculative runner's B-token verify and draft block (a random 5-layer draft), every row at the last position a
--view-position attention view holds, the caches filled with random K/V; the median of --reps replays (CUDA
graphs on a GPU, the same step functions eagerly on a CPU). With two fold settings it also compares their plain
step's logits on the same caches (`max_abs_logit_diff`, `same_argmax`). Prints a table and appends a row a
setting to --json: {"date", "commit", "device", "command", "shape", "rows", "fold_gqa", "filled_blocks", "view", "block_size",
"plain_step_ms", "plain_tokens_per_s", "verify_ms", "draft_ms", ...}.
"""


def build_rows_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="decode.py rows", description=DOC_ROWS,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2_135m", help="qwen3_8b, smollm2_135m or tiny")
    p.add_argument("--rows", default="1,16,64,256", help="comma list of row counts")
    p.add_argument("--view", type=int, default=768, help="attention view (a multiple of 256): the rows' caches")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--fold-gqa", default="0,1", help="comma list of EngineOptions.fold_gqa settings (0, 1)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--profile-rows", type=int, default=None,
                   help="at this row count, also print the top CUDA kernels of one eager plain step (torch.profiler)")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", default=str(Path(__file__).resolve().parent.parent / "docs" / "bench" / "decode_rows.json"))
    return p


def measure_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row a (row count, fold setting); see DOC_ROWS."""
    from _common import provenance

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    graphs_on = device.type == "cuda"
    target = build_target(args.shape, device, dtype)
    decoder = DFlashSpeculativeDecoder(target, build_draft(target, 5, args.block_size, dtype, None),
                                       block_size=args.block_size)
    B, view = args.block_size, args.view
    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    out = []
    for R in [int(r) for r in args.rows.split(",")]:
        logits = {}
        for fold in [bool(int(f)) for f in args.fold_gqa.split(",")]:
            options = DEFAULT_OPTIONS.but(fold_gqa=fold)  # the runners' steps, captures included
            plain = batched_static.BatchedStaticPlainRunner(target, R, view, graphs_on, options=options)
            spec = batched_static.BatchedStaticSpecRunner(decoder, R, view, graphs_on, options=options)
            for kv in (plain.kv, spec.kv):
                g = torch.Generator(device=device).manual_seed(0)
                for layer in kv.cache.layers:
                    layer.keys.normal_(generator=g)
                    layer.values.normal_(generator=g)
            plain.tok.copy_(torch.arange(R, device=device).view(-1, 1) % 100 + 5)

            def plain_at() -> None:
                plain.pos.fill_(view - 2)

            def spec_at() -> None:
                spec.pos.fill_(view - B - 1)
                spec.ctx_start.fill_(view - B - 2)

            plain_step = plain.steps.get(plain.steps.view(view - 1))
            plain_at()
            logits[fold] = plain_step.replay().float().clone()
            row = {"shape": args.shape, "rows": R, "fold_gqa": fold,
                   "filled_blocks": plain.filled_blocks, "view": view, "block_size": B,
                   "dtype": str(dtype).replace("torch.", ""), "decode": "graphs" if graphs_on else "eager",
                   "plain_step_ms": timed(plain_step.replay, device, args.reps, plain_at)}
            row["plain_tokens_per_s"] = R / row["plain_step_ms"] * 1e3
            if R == args.profile_rows:
                from torch.profiler import ProfilerActivity, profile

                kinds = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
                with torch.no_grad(), profile(activities=kinds) as prof:
                    plain_at()
                    plain._step(plain.steps.view(view - 1))
                    sync(device)
                print(f"rows {R}, fold {int(fold)}: one eager plain step", flush=True)
                print(prof.key_averages().table(sort_by="self_cuda_time_total" if device.type == "cuda"
                                                else "self_cpu_time_total", row_limit=8, max_name_column_width=60))
            sview = spec.verify_steps.view(view - 1)
            row["verify_ms"] = timed(spec.verify_steps.get(sview).replay, device, args.reps, spec_at)
            row["draft_ms"] = timed(spec.draft_steps.get(sview).replay, device, args.reps, spec_at)
            out.append({**provenance(dev_name), **row})
            del plain, spec
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if len(logits) == 2:
            diff = (logits[True] - logits[False]).abs().max().item()
            same = (logits[True].argmax(-1) == logits[False].argmax(-1)).float().mean().item()
            for r in out[-2:]:
                r.update(max_abs_logit_diff=diff, same_argmax=same)
    return out


def rows_table(rows: list[dict[str, Any]]) -> str:
    r0 = rows[0]
    lines = [f"{r0['shape']}, view {r0['view']}, block {r0['block_size']}, {r0['dtype']}, {r0['decode']} on {r0['device']}",
             f"{'rows':>5} {'fold':>4} {'plain ms':>9} {'plain tok/s':>12} {'verify ms':>10} {'draft ms':>9} "
             f"{'|logit diff|':>12} {'same argmax':>11}"]
    for r in rows:
        diff = f"{r['max_abs_logit_diff']:.2e}" if "max_abs_logit_diff" in r else "-"
        same = f"{r['same_argmax']:.3f}" if "same_argmax" in r else "-"
        lines.append(f"{r['rows']:>5} {int(r['fold_gqa']):>4} {r['plain_step_ms']:>9.2f} {r['plain_tokens_per_s']:>12.0f} "
                     f"{r['verify_ms']:>10.2f} {r['draft_ms']:>9.2f} {diff:>12} {same:>11}")
    return "\n".join(lines)


def main_rows(argv: Optional[Sequence[str]] = None) -> int:
    args = build_rows_parser().parse_args(argv)
    try:
        row_counts = [int(r) for r in args.rows.split(",")]
        folds = [int(f) for f in args.fold_gqa.split(",")]
        if min(row_counts) < 1 or not set(folds) <= {0, 1} or args.view % 256 or args.view < args.block_size + 2:
            raise ValueError
    except ValueError:
        print("error: give --rows as counts >= 1, --fold-gqa as 0 and/or 1, --view a multiple of 256 past the block",
              file=sys.stderr)
        raise SystemExit(2)
    rows = measure_rows(args)
    print(rows_table(rows))
    append_rows(Path(args.json), rows)
    return 0


# ====================================================================================================
# filter

DOC_FILTER = """The sampled steps' top-p filter without a top-k: the sort-free threshold against the sort it replaced.

    python benchmarks/decode.py filter                        # [64, 151936] and [512, 49152] rows, on a CPU
    python benchmarks/decode.py filter --shapes 512x151936 --device cuda --compile --json OUT.json

For each --shapes ROWSxVOCAB (fp32 scores randn * --scale, top-p --top-p as a 0-d buffer, as a captured step
reads it): `sampling.filter_scores` (the bisection of `sampling.nucleus_keep`) against a sort of the whole
vocabulary and a cumulative sum (what filter_scores ran before, kept here as the baseline), the median of --reps
calls (after one warm-up), eagerly, and with --compile also compiled (torch.compile, dynamic=False: each
bisection step one fused reduction; the sort stays a library call). `differ`: tokens only one of them keeps (no
ties in random scores: the float32 cumulative sum's rounding at the boundary, on flat rows). Prints a table; with
--json appends a row a shape: {"date", "commit", "device", "command", "rows", "vocab", "top_p", "sort_ms",
"threshold_ms", "sort_compiled_ms", "threshold_compiled_ms", "differ"}.
"""


def build_filter_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="decode.py filter", description=DOC_FILTER,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="64x151936,512x49152", help="comma list of ROWSxVOCAB")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--scale", type=float, default=2.0, help="the scores' spread (randn * scale)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="also time both compiled")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="append the rows to this file (none by default)")
    return p


def sorted_top_p(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The sort-based nucleus filter `sampling.filter_scores` ran without a top-k before its threshold."""
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    probs = sorted_scores.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= top_p
    keep = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter(-1, order, ~drop)
    return scores.masked_fill(~keep, float("-inf"))


def _median_ms(fn: Callable[[], Any], reps: int, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def measure_filter(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row a shape; see DOC_FILTER."""
    from _common import provenance
    from nemo_dflash.engine.sampling import filter_scores

    device = torch.device(args.device)
    top_p = torch.tensor(args.top_p, device=device)
    rows = []
    for shape in args.shapes.split(","):
        n, v = (int(x) for x in shape.split("x"))
        scores = torch.randn(n, v, generator=torch.Generator().manual_seed(0)).mul(args.scale).to(device)
        row = {**provenance(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
               "rows": n, "vocab": v, "top_p": args.top_p}
        differ = int((torch.isinf(filter_scores(scores, top_p)) != torch.isinf(sorted_top_p(scores, top_p))).sum())
        row["sort_ms"] = _median_ms(lambda: sorted_top_p(scores, top_p), args.reps, device)
        row["threshold_ms"] = _median_ms(lambda: filter_scores(scores, top_p), args.reps, device)
        row["sort_compiled_ms"] = row["threshold_compiled_ms"] = None
        if args.compile:
            torch._dynamo.reset()
            old, new = torch.compile(sorted_top_p, dynamic=False), torch.compile(filter_scores, dynamic=False)
            row["sort_compiled_ms"] = _median_ms(lambda: old(scores, top_p), args.reps, device)
            row["threshold_compiled_ms"] = _median_ms(lambda: new(scores, top_p), args.reps, device)
        rows.append({**row, "differ": differ})
        del scores
        gc.collect()
    return rows


def filter_table(rows: list[dict[str, Any]]) -> str:
    def ms(x: Optional[float]) -> str:
        return f"{x:.1f}" if x is not None else "-"

    lines = [f"{'rows x vocab':>14} {'top-p':>6} {'sort ms':>9} {'threshold ms':>12} {'sort (compiled)':>15} "
             f"{'threshold (compiled)':>20} {'differ':>6}"]
    for r in rows:
        lines.append(f"{r['rows']:>6} x {r['vocab']:<6} {r['top_p']:>6g} {ms(r['sort_ms']):>9} "
                     f"{ms(r['threshold_ms']):>12} {ms(r['sort_compiled_ms']):>15} "
                     f"{ms(r['threshold_compiled_ms']):>20} {r['differ']:>6}")
    return "\n".join(lines)


def main_filter(argv: Optional[Sequence[str]] = None) -> int:
    args = build_filter_parser().parse_args(argv)
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        if any(len(s) != 2 or min(s) < 1 for s in shapes) or not 0 < args.top_p <= 1 or args.reps < 1:
            raise ValueError
    except ValueError:
        print("error: give --shapes as ROWSxVOCAB,..., --top-p in (0, 1] and --reps >= 1", file=sys.stderr)
        raise SystemExit(2)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure_filter(args)
    print(filter_table(rows))
    if args.json:
        append_rows(Path(args.json), rows)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    from _common import run_subcommands

    return run_subcommands("decode.py", __doc__, {"speed": (main_speed, DOC_SPEED), "concurrency": (main_concurrency, DOC_CONCURRENCY),
                                           "rows": (main_rows, DOC_ROWS),
                                           "filter": (main_filter, DOC_FILTER)}, argv)


if __name__ == "__main__":
    raise SystemExit(main())
