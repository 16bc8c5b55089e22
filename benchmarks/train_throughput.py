"""Training-step throughput and MFU of nemo_dflash on one GPU (or several under torchrun).

Times the trainer's own step (`nemo_dflash.train.trainer.TrainStep`: the frozen target through the hook
wrapper -> trainer module -> backward -> clip -> fused AdamW, micro-batches of variable-length rows, per-row
anchor seeds, global loss normalisation), the step `train` runs, on a random-weight target of a given shape,
and prints one table. Large targets (`--shape qwen3_8b`, a random Qwen3): one row of --seq tokens a
micro-batch by default (the paper's 512 anchors x 3072):

    python benchmarks/train_throughput.py --shape qwen3_8b                      # defaults of the issue
    python benchmarks/train_throughput.py --shape qwen3_8b --anchors 128,256,512 --seq 2048,3072,4096 \
        --backend flex,sdpa --compile 0,layers --json out.json
    torchrun --nproc-per-node 4 benchmarks/train_throughput.py --shape qwen3_8b --fsdp2

The SmolLM2-135M shape (`--shape smollm2_135m`, a random Llama with SmolLM2's dimensions and the draft
`recipes/smollm2_135m_gpu.yaml` builds), where the host-side work around the kernels decides the speed:

    python benchmarks/train_throughput.py --shape smollm2_135m --mbs 16 --anchors 256 --seq 416 \
        --compile 0 --profile 3 --json out.json
    python benchmarks/train_throughput.py --shape smollm2_135m --cases "16:256:416:layers:1 64:256:416:layers:1"
    torchrun --nproc-per-node 2 benchmarks/train_throughput.py --shape smollm2_135m \
        --cases 4:5120:416:draft:1:8192 --data REGEN.jsonl      # DDP as `train` runs it

Every knob takes a comma list; the cases are their product. Rows give tokens/s per GPU (`world` beside
it). MFU = model FLOPs of a step / step time / the bf16 matmul rate measured in the same run (formula in
docs/performance.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Optional
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import append_rows, variant_options  # noqa: E402  (benchmarks/, the script's own folder)

from nemo_dflash.data.synthetic import make_packed_batches  # noqa: E402
from nemo_dflash.evaluation.rows import throughput_row as bench_row  # noqa: E402
from nemo_dflash.train.device import limit_host_threads  # noqa: E402
from nemo_dflash.draft.registry import DRAFT_VARIANTS  # noqa: E402
from nemo_dflash.draft.registry import build_target_layer_ids  # noqa: E402
from nemo_dflash.objective.fused_loss import resolve_loss_impl  # noqa: E402
from nemo_dflash.target import HFDFlashTargetModel  # noqa: E402
from nemo_dflash.target.loading import random_weight_model  # noqa: E402

SHAPES = {
    "qwen3_8b": dict(num_hidden_layers=36, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3_4b": dict(num_hidden_layers=36, hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "small": dict(num_hidden_layers=12, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=64, vocab_size=151936),
    # SmolLM2-135M-Instruct (LlamaForCausalLM, tied embeddings)
    "smollm2_135m": dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152),
}
LLAMA_SHAPES = {"smollm2_135m": dict(mask_token_id=3, rope_theta=100000.0, max_position_embeddings=8192)}


def measure_matmul_tflops(device, n: int = 8192, iters: int = 20) -> float:
    from nemo_dflash.train.flops import matmul_tflops

    return matmul_tflops(torch.device(device), n, iters)


def step_flops(shape: dict, draft_layers: int, block: int, seq: int, anchors_pos: list[int], n_labels: int,
               last_target_layer: int) -> dict[str, float]:
    """Model FLOPs of one document's step (`nemo_dflash.train.flops`, the formula the trainer logs MFU with)."""
    from types import SimpleNamespace

    from nemo_dflash.objective.metrics import LossSums
    from nemo_dflash.train.flops import Shape, StepShapes

    shapes = StepShapes(target=Shape.of(SimpleNamespace(**shape)), target_layers_run=last_target_layer + 1,
                        draft_layers=draft_layers,
                        context_layers=len(build_target_layer_ids(shape["num_hidden_layers"], draft_layers)),
                        block=block)
    sums = LossSums(num_labels=n_labels, valid_blocks=len(anchors_pos),
                    visible_keys=sum(block * (a + block) for a in anchors_pos), context_tokens=seq,
                    context_pairs=seq * (seq + 1) / 2)
    return shapes.flops(sums)


def build_qwen3_target(shape_name: str, draft_layers: int, block: int, device, dtype=torch.bfloat16,
                       kind: str = "dflash", variant_options: Optional[dict] = None):
    """A random-weight Qwen3 target of `shape_name` (in `dtype`) and a draft of `kind` (dflash | dflash2) for it."""
    from transformers import Qwen3Config

    shape = SHAPES[shape_name]
    cfg = Qwen3Config(**shape, max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    target = random_weight_model(cfg, device, dtype)
    ids = build_target_layer_ids(shape["num_hidden_layers"], draft_layers)
    variant = DRAFT_VARIANTS[kind]
    dcfg = variant.config_cls.from_target_config(cfg, num_hidden_layers=draft_layers, block_size=block,
                                                 mask_token_id=151669, target_layer_ids=ids,
                                                 dflash_extra=dict(variant_options or {}) if kind != "dflash" else None)
    with torch.device(device):
        draft = variant.draft_cls(dcfg).float()
    target.eval().requires_grad_(False)
    wrapper = HFDFlashTargetModel(target, ids)
    return shape, target, wrapper, draft


# ----------------------------------------------------------------------------- the targets and their batches


def build_llama_target(shape_name: str, draft_layers: int, block: int, device, dtype=torch.bfloat16,
                       kind: str = "dflash", variant_options: Optional[dict] = None):
    """A random-weight Llama target of `shape_name` (in `dtype`) and the draft of `kind` the recipe builds for it."""
    from transformers import LlamaConfig

    from nemo_dflash.draft.build import build_draft_for_target

    shape, extra = SHAPES[shape_name], LLAMA_SHAPES[shape_name]
    cfg = LlamaConfig(**shape, max_position_embeddings=extra["max_position_embeddings"], tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": extra["rope_theta"]},
                      architectures=["LlamaForCausalLM"])
    cfg._attn_implementation = "sdpa"  # what load_target uses
    target = random_weight_model(cfg, device, dtype)
    target.eval().requires_grad_(False)
    draft = build_draft_for_target(target, None, num_layers=draft_layers, block_size=block,
                                   mask_token_id=extra["mask_token_id"], kind=kind,
                                   variant_options=variant_options).to(device)
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    return shape, target, wrapper, draft


def make_step_batches(n: int, rows: int, seq: int, jitter: float, prompt_frac: float, vocab: int, seed: int = 0,
                      pad_to: int = 64) -> list[dict[str, torch.Tensor]]:
    """`n` loader batches like length-grouped ones: row lengths uniform in [(1-jitter)*seq, seq],
    the first `prompt_frac` of each row unsupervised, padded to a multiple of `pad_to` (the loader's)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    width = -(-seq // pad_to) * pad_to
    for _ in range(n):
        lo = max(2, int(round((1 - jitter) * seq)))
        lengths = torch.randint(lo, seq + 1, (rows,), generator=g)
        ids = torch.randint(0, vocab - 1, (rows, width), generator=g)
        pos = torch.arange(width).unsqueeze(0)
        attn = (pos < lengths.unsqueeze(1)).long()
        lm = attn * (pos >= (lengths.float() * prompt_frac).long().unsqueeze(1)).long()
        out.append({"input_ids": ids * attn, "attention_mask": attn, "loss_mask": lm})
    return out


def make_real_packed_batches(n: int, rows: int, pack_length: int, data: str, tokenizer_path: str,
                             max_length: int = 2048) -> list[dict[str, torch.Tensor]]:
    """`n` packed loader batches of real conversations (a regenerated JSONL), tokenised by the
    training dataset itself and planned and laid out by the loader's packer and collator."""
    import numpy as np

    from nemo_dflash.data.config import DataConfig, DataSourceConfig
    from nemo_dflash.data.dataset import build_datasets, pad_token_id_of
    from nemo_dflash.data.packing import PackedCollator, plan_packed_steps
    from nemo_dflash.target.loading import load_tokenizer

    tok = load_tokenizer(tokenizer_path)
    ds, _ = build_datasets(DataConfig(sources=[DataSourceConfig(path=data)], max_length=max_length), tok)
    order = np.random.default_rng(0).permutation(len(ds))[: (n + 2) * rows * pack_length // 64]  # enough for n steps
    steps = plan_packed_steps(order, ds.lengths, rows, pack_length)[:n]
    if len(steps) < n:
        raise SystemExit(f"{data}: {len(ds)} conversations fill only {len(steps)} packed steps; ask fewer")
    collate = PackedCollator(pad_token_id=pad_token_id_of(tok), rows=rows, pack_length=pack_length)
    return [collate([ds[int(i)] for i in step]) for step in steps]


def packed_batch_flops(shape: dict, draft, wrapper, batch: dict[str, torch.Tensor], anchors: int,
                       seeds: list[int]) -> float:
    """Model FLOPs of one packed batch, counted as `batch_flops` counts them: per document, with
    the document's own length, anchors and labels (what the same documents cost unpacked)."""
    from nemo_dflash.objective.anchors import document_bounds, plan_blocks

    block = draft.config.block_size
    plan = plan_blocks(batch["input_ids"], batch["loss_mask"], batch["attention_mask"], block, anchors,
                       row_seeds=seeds, doc_ids=batch["doc_ids"], position_ids=batch["position_ids"])
    start, end = document_bounds(batch["doc_ids"])
    total = 0.0
    for r in range(batch["input_ids"].shape[0]):
        doc = batch["doc_ids"][r]
        a, v = plan.anchors[r], plan.valid[r]
        n_lab = plan.label_valid[r].sum(-1)
        for d in range(int(doc.max()) + 1):
            at = (doc == d).nonzero().squeeze(-1)
            s0 = int(at[0])
            mine = v & (doc[a] == d)
            total += step_flops(shape, draft.config.num_hidden_layers, block, at.numel(),
                                (a[mine] - s0).tolist(), int(n_lab[mine].sum()), max(wrapper.target_layer_ids))["total"]
    return total


def batch_flops(shape: dict, draft, wrapper, batch: dict[str, torch.Tensor], anchors: int, seeds: list[int]) -> float:
    """Model FLOPs of one loader batch: `step_flops` per row, with the row's own length and anchors."""
    from nemo_dflash.objective.anchors import build_labels, sample_anchors

    block = draft.config.block_size
    total = 0.0
    length = int(batch["attention_mask"].sum(1).max())
    ids, attn, lm = (batch[k][:, :length] for k in ("input_ids", "attention_mask", "loss_mask"))
    anc, valid = sample_anchors(lm, attn, block, anchors, row_seeds=seeds)
    _, label_valid = build_labels(ids, lm, attn, anc, valid, block)
    for r in range(ids.shape[0]):
        pos = anc[r][valid[r]].tolist()
        total += step_flops(shape, draft.config.num_hidden_layers, block, length, pos, int(label_valid[r].sum()),
                            max(wrapper.target_layer_ids))["total"]
    return total


def _kernel_category(name: str) -> str:
    n = name.lower()
    if n.startswith("memcpy") or n.startswith("memset"):
        return "memcpy/memset"
    if "flex" in n or ("triton" in n and ("attention" in n or "tem_fused" in n)):
        return "flex attention"
    if any(k in n for k in ("gemm", "xmma", "cutlass", "nvjet", "matmul", "sm90_", "sm80_", "wgmma")):
        return "matmul"
    if "adam" in n or "multi_tensor" in n:
        return "optimizer/foreach"
    if "triton" in n:
        return "triton (compiled fusions)"
    if any(k in n for k in ("reduce", "logsumexp", "softmax", "argmax", "norm")):
        return "reductions"
    if any(k in n for k in ("index", "scatter", "gather", "nonzero", "sort", "topk", "cat", "where", "embedding")):
        return "index/gather/scatter/cat"
    if "elementwise" in n or "vectorized" in n:
        return "elementwise"
    return "other"


def summarize_profile(prof, steps: int, wall_s: float, top: int = 20) -> dict:
    """Compact numbers from a torch.profiler run of `steps` steps (no trace leaves the machine)."""
    from collections import defaultdict

    kern, cpu = [], defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        dt = getattr(e, "device_type", None)
        if dt is not None and dt.name == "CUDA" and not getattr(e, "is_user_annotation", False):
            kern.append((e.name, e.time_range.start, e.time_range.end))
        elif e.name.startswith("cuda") or e.name in ("aten::item", "aten::_local_scalar_dense", "aten::nonzero"):
            cpu[e.name][0] += 1
            cpu[e.name][1] += e.time_range.elapsed_us()
    by_name, by_cat = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    for name, a, b in kern:
        by_name[name][0] += 1
        by_name[name][1] += b - a
        c = by_cat[_kernel_category(name)]
        c[0] += 1
        c[1] += b - a
    busy, cur_a, cur_b = 0.0, None, None  # union of kernel intervals = time the GPU did anything
    for _, a, b in sorted(kern, key=lambda t: t[1]):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                busy += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        busy += cur_b - cur_a
    ksum = sum(v[1] for v in by_name.values())
    return {
        "steps": steps,
        "wall_ms_per_step": wall_s * 1e3 / steps,
        "gpu_busy_ms_per_step": busy / 1e3 / steps,
        "kernel_sum_ms_per_step": ksum / 1e3 / steps,
        "kernels_per_step": len(kern) / steps,
        "categories": sorted(([k, v[0] / steps, v[1] / 1e3 / steps] for k, v in by_cat.items()), key=lambda r: -r[2]),
        "top_kernels": sorted(([k[:90], v[0] / steps, v[1] / 1e3 / steps] for k, v in by_name.items()),
                              key=lambda r: -r[2])[:top],
        "runtime_calls": sorted(([k, v[0] / steps, v[1] / 1e3 / steps] for k, v in cpu.items()), key=lambda r: -r[2]),
    }


def print_profile(label: str, s: dict) -> None:
    print(f"\n== profile: {label} ({s['steps']} steps) ==")
    print(f"wall {s['wall_ms_per_step']:.1f} ms/step | GPU busy (union of kernels) {s['gpu_busy_ms_per_step']:.1f} ms "
          f"({s['gpu_busy_ms_per_step'] / s['wall_ms_per_step']:.0%}) | kernel sum {s['kernel_sum_ms_per_step']:.1f} ms "
          f"| {s['kernels_per_step']:.0f} kernels/step")
    print(f"{'category':<28} {'n/step':>8} {'ms/step':>8}")
    for k, n, ms in s["categories"]:
        print(f"{k:<28} {n:>8.0f} {ms:>8.2f}")
    print(f"{'top kernels':<90} {'n/step':>7} {'ms/step':>8}")
    for k, n, ms in s["top_kernels"]:
        print(f"{k:<90} {n:>7.0f} {ms:>8.2f}")
    print(f"{'host runtime calls':<40} {'n/step':>8} {'ms/step':>8}")
    for k, n, ms in s["runtime_calls"][:10]:
        print(f"{k:<40} {n:>8.0f} {ms:>8.2f}")
    sys.stdout.flush()


@dataclass
class StepCase:
    mbs: int
    anchors: int
    seq: int
    compile: str  # "0" | "layers" (train.compile=true) | others the trainer supports
    accum: int = 1
    compile_target: bool = False  # train.compile_target
    pack_length: int = 0  # data.pack_length (0: length-grouped padded rows; mbs then counts packed rows)
    loss_impl: str = "chunked"  # loss.impl: chunked | cce | liger
    backend: str = "flex"  # loss.attn_backend on a GPU (the CPU runs sdpa)
    fused_ce: bool = True  # the lm_head gradient formed in the forward (0: checkpointed chunks)


def run_trainer_case(shape, wrapper, draft, case: StepCase, steps: int, warmup: int, device, args,
                     profile_steps: int = 0, state=None) -> dict:
    """Time `TrainStep`, the trainer's own step, on synthetic length-grouped (or packed, or real) batches.

    Under torchrun (`state.world_size` > 1) the trainer module is wrapped as `train` wraps it (DDP, or FSDP2
    with --fsdp2), each rank steps its own batches, and the row gives the world's tokens a step over the
    slowest rank's step time (`tokens_s`; `bench_row` divides by the world)."""
    from nemo_dflash.config import OptimConfig
    from nemo_dflash.objective.trainer_module import DFlashTrainerModule
    from nemo_dflash.train.distributed import DistState, wrap_draft
    from nemo_dflash.train.optim import build_optimizer
    from nemo_dflash.train.trainer import TrainStep, apply_compile, row_seeds

    for m in (draft, *draft.layers):
        m._compiled_call_impl = None  # undo a previous case's compile
    for layer in wrapper.layers:
        layer.__dict__.pop("forward", None)
    if case.compile_target:
        wrapper.compile_layers()
    cuda = device.type == "cuda"
    module = DFlashTrainerModule(draft, wrapper.get_input_embeddings(), wrapper.get_output_embeddings(),
                                 num_anchors=case.anchors, loss_decay_gamma=7.0, attn_backend=case.backend if cuda else "sdpa",
                                 fused_ce=case.fused_ce, distill_weight=args.distill_weight,
                                 loss_impl=resolve_loss_impl(case.loss_impl, device))
    module = apply_compile(module, case.compile)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    state = state or DistState(rank=0, world_size=1, local_rank=0, device=device)
    world, rank = state.world_size, state.rank
    strategy = "fsdp2" if args.fsdp2 else "ddp" if world > 1 else "none"
    bf16 = args.precision == "bf16"
    model = wrap_draft(module, strategy, state, torch.bfloat16 if cuda and bf16 else None)
    # after wrapping, as `train` does: FSDP2 swaps the draft's parameters for sharded ones
    params = [q for q in draft.parameters() if q.requires_grad]
    opt = build_optimizer(params, OptimConfig(lr=1e-4), device)
    stepper = TrainStep(wrapper, model, params, opt, state, micro_batch_size=case.mbs, seed=0, grad_clip=1.0,
                        use_bf16=bf16, return_logits=args.distill_weight > 0)
    if case.pack_length:
        if cuda and case.backend == "flex":  # target.packed_attention
            wrapper.use_varlen_attention() if args.packed_attention == "varlen" else wrapper.use_flex_attention()
        if args.data:
            batches = make_real_packed_batches(args.distinct_batches * world, case.mbs * case.accum,
                                               case.pack_length, args.data, args.tokenizer)
        else:
            batches = make_packed_batches(args.distinct_batches * world, case.mbs * case.accum, case.pack_length,
                                          case.seq, args.jitter, args.prompt_frac, shape["vocab_size"])
    else:
        wrapper.model.set_attn_implementation("sdpa")
        batches = make_step_batches(args.distinct_batches * world, case.mbs * case.accum, case.seq, args.jitter,
                                    args.prompt_frac, shape["vocab_size"])
    batches = batches[rank::world]  # every rank the same count, each its own
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t_first = time.perf_counter()
    for it in range(warmup):
        res = stepper(it, batches[it % len(batches)]).result()
    sync()
    warm_s = time.perf_counter() - t_first
    import torch._dynamo.utils as dutils

    graphs_after_warmup = int(dutils.counters["stats"]["unique_graphs"])
    # As the training loop runs: step n+1 is launched before step n's outcome is read (--overlap 1),
    # or every step is read before the next is launched (--overlap 0: the loop before that change).
    tokens, prev = [], None
    t = time.perf_counter()
    for it in range(warmup, warmup + steps):
        cur = stepper(it, batches[it % len(batches)])
        if args.overlap:
            if prev is not None:
                tokens.append(prev.result().tokens)
            prev = cur
        else:
            res = cur.result()
            tokens.append(res.tokens)
    if prev is not None:
        res = prev.result()
        tokens.append(res.tokens)
    sync()
    med = (time.perf_counter() - t) / steps  # mean step time of the pipelined loop
    tok_step = statistics.mean(tokens)
    count = packed_batch_flops if case.pack_length else batch_flops
    flops = statistics.mean(
        count(shape, draft, wrapper, batches[i % len(batches)], case.anchors,
              row_seeds(0, i, 0, case.mbs * case.accum)) for i in range(min(len(batches), 4)))
    if world > 1:  # the step's tokens are the world's already; FLOPs are summed, the slowest rank's time kept
        total = torch.tensor([flops], dtype=torch.float64, device=device)
        slowest = torch.tensor([med], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(total)
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
        flops, med = total.item(), slowest.item()
    recompiles = None
    try:
        import torch._dynamo.utils as dutils

        recompiles = int(dutils.counters["stats"]["unique_graphs"]) - graphs_after_warmup
    except Exception:  # noqa: BLE001 - a counter that moved is only informative
        pass
    row = {"mbs": case.mbs, "accum": case.accum, "anchors": case.anchors, "seq": case.seq, "compile": case.compile,
           "compile_target": case.compile_target, "pack_length": case.pack_length, "graphs_after_warmup": recompiles,
           "packed_attention": (args.packed_attention if cuda and case.backend == "flex" else "dense")
           if case.pack_length else None,
           "step_ms": med * 1e3, "tokens_step": tok_step, "tokens_s": tok_step / med,
           "block_tokens_s": world * case.mbs * case.accum * case.anchors * draft.config.block_size / med,
           "peak_gb": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0, "tflops": flops / med / 1e12,
           "warmup_s": warm_s, "loss": res.loss, "grad_norm": res.grad_norm, "cpu_threads": torch.get_num_threads(), "overlap": bool(args.overlap), "world": world,
           "loss_impl": resolve_loss_impl(case.loss_impl, device), "backend": case.backend if cuda else "sdpa",
           "fused_ce": case.fused_ce, "precision": args.precision,
           "fsdp2": bool(args.fsdp2)}
    if args.sync_debug and cuda:
        row["sync_sites"] = sync_sites(lambda s=stepper: s(warmup + steps, batches[0]).result())
        print("host syncs inside one step (torch.cuda.set_sync_debug_mode), by call site:")
        for site, n in row["sync_sites"].items():
            print(f"  {n:3d}x  {site}")
    if profile_steps:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            sync()
            t = time.perf_counter()
            for it in range(profile_steps):
                stepper(warmup + steps + it, batches[it % len(batches)])
            sync()
            wall = time.perf_counter() - t
        row["profile"] = summarize_profile(prof, profile_steps, wall)
    del opt, stepper
    return row


def sync_sites(fn) -> dict[str, int]:
    """Call sites (this repository's frames) of every operation that makes the host wait for the
    GPU while `fn` runs, counted."""
    import collections
    import traceback
    import warnings

    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing CUDA operation" not in str(message):
            return  # another warning raised inside the step
        frames = [f for f in traceback.extract_stack()[:-1]
                  if f.filename.startswith(repo) and "site-packages" not in f.filename]
        sites[" < ".join(f"{os.path.relpath(f.filename, repo)}:{f.lineno}" for f in reversed(frames[-3:]))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return dict(sites.most_common())


def _time_flex(fn, q, k, v, go, kw: dict) -> tuple[float, float, float]:
    """(first call's seconds, compile included; forward ms; forward + backward ms) of one flex_attention."""
    t0 = time.perf_counter()
    fn(q, k, v, **kw).backward(go)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    with torch.no_grad():
        _, fwd = _cuda_ms(lambda: fn(q, k, v, **kw))
    _, both = _cuda_ms(lambda: fn(q, k, v, **kw).backward(go))
    return first, fwd, both


def _cuda_ms(fn, reps: int = 10) -> tuple[float, float]:
    """(host ms per call without waiting, GPU-inclusive wall ms per call)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t) / reps
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / reps
    return host * 1e3, wall * 1e3


def probe(args, device) -> None:
    """Where one step's time goes at the recipe's shape: flex_attention variants in isolation,
    and host vs GPU time of the target forward and of the draft's forward + backward."""
    from torch.nn.attention.flex_attention import flex_attention

    from nemo_dflash.objective.block_mask import build_flex_block_mask
    from nemo_dflash.objective.trainer_module import DFlashTrainerModule
    from nemo_dflash.train.trainer import _right_padded, row_seeds

    shape, target, wrapper, draft = build_llama_target(args.shape, args.draft_layers, args.block, device)
    mbs, anchors, seq = int(args.mbs.split(",")[0]), int(args.anchors.split(",")[0]), int(args.seq.split(",")[0])
    batch = make_step_batches(1, mbs, seq, args.jitter, args.prompt_frac, shape["vocab_size"])[0]
    length = int(batch["attention_mask"].sum(1).max())
    batch = {k: v[:, :length].contiguous() for k, v in batch.items()}
    module = DFlashTrainerModule(draft, wrapper.get_input_embeddings(), wrapper.get_output_embeddings(),
                                 num_anchors=anchors, loss_decay_gamma=7.0, attn_backend="flex")
    seeds = row_seeds(0, 0, 0, mbs)
    plan = module.plan(batch["input_ids"], batch["loss_mask"], batch["attention_mask"], row_seeds=seeds)
    dev_batch = {k: v.to(device) for k, v in batch.items()}
    dplan = plan.to(device)
    blk = args.block
    host_ms, wall_ms = _cuda_ms(lambda: build_flex_block_mask(dplan.anchors, dplan.valid, dev_batch["attention_mask"], blk))
    bm = build_flex_block_mask(dplan.anchors, dplan.valid, dev_batch["attention_mask"], blk)
    n_q_tiles, n_kv_tiles = bm.kv_num_blocks.shape[-1], -(-bm.seq_lengths[1] // bm.BLOCK_SIZE[1])
    print(f"\n== probe: mbs {mbs}, anchors {anchors}, length {length}: Q {bm.seq_lengths[0]}, KV {bm.seq_lengths[1]} ==")
    print(f"block mask (eager build): host {host_ms:.1f} ms, wall {wall_ms:.1f} ms; tiles per q-tile: partial "
          f"{bm.kv_num_blocks.float().mean():.2f}, full {bm.full_kv_num_blocks.float().mean():.2f} of {n_kv_tiles} "
          f"({n_q_tiles} q-tiles); sparsity {bm.sparsity():.1f}%")
    hq, hkv, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    q_len, kv_len = bm.seq_lengths
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(mbs, hq, q_len, hd, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(mbs, hkv, kv_len, hd, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(mbs, hkv, kv_len, hd, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    go = torch.randn(mbs, hq, q_len, hd, device=device, dtype=torch.bfloat16, generator=g)

    def variant(name, compile_kw=None, kernel_options=None, gqa=True, mask=bm):
        torch._dynamo.reset()
        fn = torch.compile(flex_attention, **(compile_kw or {}))
        kk, vv = (k, v) if gqa else (k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1))
        kw = dict(block_mask=mask, enable_gqa=gqa, kernel_options=kernel_options)
        try:
            c, fwd, both = _time_flex(fn, q, kk, vv, go, kw)
            print(f"  {name:<52} fwd {fwd:7.2f} ms  fwd+bwd {both:7.2f} ms  (compile {c:5.1f} s)", flush=True)
        except Exception as e:  # one variant failing must not stop the rest
            print(f"  {name:<52} FAILED {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}", flush=True)

    print("flex_attention alone (bf16), one layer:")
    variant("default (as _flex: torch.compile(flex_attention))")
    variant("dynamic=True", {"dynamic": True})
    variant("BLOCK_M=64 BLOCK_N=64", kernel_options={"BLOCK_M": 64, "BLOCK_N": 64})
    variant("BLOCK_M=128 BLOCK_N=64 warps 8 stages 2",
            kernel_options={"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2})
    variant("BLOCK_M=64 BLOCK_N=128 warps 4 stages 3",
            kernel_options={"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3})
    variant("no GQA (k/v heads repeated)", gqa=False)
    variant("mode=max-autotune-no-cudagraphs", {"mode": "max-autotune-no-cudagraphs"})
    torch._dynamo.reset()

    # host vs GPU time of the step's parts (eager draft, as compile=0; compiled CE and flex)
    tb_fn = lambda: wrapper.generate_batch(dev_batch["input_ids"], dev_batch["attention_mask"],
                                           dev_batch["loss_mask"], right_padded=_right_padded(batch["attention_mask"]))
    with torch.no_grad():
        h, w = _cuda_ms(tb_fn)
    print(f"target forward (layers 0..{max(wrapper.target_layer_ids)}): host {h:.1f} ms, wall {w:.1f} ms")
    tb = tb_fn()
    for mode in ("0", "layers"):
        from nemo_dflash.train.trainer import apply_compile

        for m in (draft, *draft.layers):
            m._compiled_call_impl = None
        apply_compile(module, mode)

        def fb():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = module(tb, plan=dplan)
            out.loss_sum.backward()

        for _ in range(3):
            fb()
        h, w = _cuda_ms(fb, reps=5)
        print(f"draft forward+backward, compile {mode}: host {h:.1f} ms, wall {w:.1f} ms")
        draft.zero_grad(set_to_none=True)
    sys.stdout.flush()


# Backward tiles tried by `probe_flex_tiles`: (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages);
# the kernel needs N1 % M1 == 0 and M2 % N2 == 0, and each must divide the 128-token mask tile.
BWD_TILES = [(64, 128, 128, 64, 8, 3), (64, 64, 64, 64, 4, 3), (32, 64, 64, 32, 4, 3), (32, 128, 128, 32, 4, 3),
             (64, 64, 64, 64, 8, 2), (32, 64, 64, 32, 4, 2), (16, 64, 64, 16, 4, 3), (64, 128, 128, 64, 4, 2)]


def probe_flex_tiles(args, device) -> None:
    """One draft layer's flex_attention alone at the packed step's shape (the first --cases entry,
    its real block mask), forward and forward + backward, with the backward's tiles varied."""
    from torch.nn.attention.flex_attention import flex_attention

    from nemo_dflash.objective.block_mask import build_flex_block_mask
    from nemo_dflash.objective.trainer_module import DFlashTrainerModule
    from nemo_dflash.draft.model.modeling import flex_kernel_options
    from nemo_dflash.train.trainer import row_seeds

    mbs, anchors, seq, _, _, pack = args.cases.split()[0].split(":")[:6]
    mbs, anchors, seq, pack = int(mbs), int(anchors), int(seq), int(pack)
    shape, target, wrapper, draft = build_llama_target(args.shape, args.draft_layers, args.block, device)
    if args.data:
        batch = make_real_packed_batches(1, mbs, pack, args.data, args.tokenizer)[0]
    else:
        batch = make_packed_batches(1, mbs, pack, seq, args.jitter, args.prompt_frac, shape["vocab_size"])[0]
    module = DFlashTrainerModule(draft, wrapper.get_input_embeddings(), wrapper.get_output_embeddings(),
                                 num_anchors=anchors, loss_decay_gamma=7.0, attn_backend="flex")
    plan = module.plan(batch["input_ids"], batch["loss_mask"], batch["attention_mask"],
                       row_seeds=row_seeds(0, 0, 0, mbs), doc_ids=batch.get("doc_ids"),
                       position_ids=batch.get("position_ids")).to(device)
    bm = build_flex_block_mask(plan.anchors, plan.valid, batch["attention_mask"].to(device), args.block,
                               ctx_start=plan.ctx_start)
    q_len, kv_len = bm.seq_lengths
    hq, hkv, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    print(f"\n== flex probe: {mbs} packed rows of {pack}, {anchors} anchors per row: Q {q_len}, KV {kv_len}; "
          f"kv tiles per q-tile {bm.kv_num_blocks.float().mean():.2f}; sparsity {bm.sparsity():.1f}% ==")
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(mbs, hq, q_len, hd, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(mbs, hkv, kv_len, hd, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(mbs, hkv, kv_len, hd, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    go = torch.randn(mbs, hq, q_len, hd, device=device, dtype=torch.bfloat16, generator=g)
    base = flex_kernel_options(hd)
    variants = [("as the draft runs it", base, {})]
    variants += [(f"bwd M1 {m1} N1 {n1} M2 {m2} N2 {n2} warps {w} stages {st}",
                  {**(base or {}), "bwd_BLOCK_M1": m1, "bwd_BLOCK_N1": n1, "bwd_BLOCK_M2": m2, "bwd_BLOCK_N2": n2,
                   "bwd_num_warps": w, "bwd_num_stages": st}, {}) for m1, n1, m2, n2, w, st in BWD_TILES]
    variants.append(("mode=max-autotune-no-cudagraphs", None, {"mode": "max-autotune-no-cudagraphs"}))
    rows = []
    for name, opts, compile_kw in variants:
        torch._dynamo.reset()
        fn = torch.compile(flex_attention, **compile_kw)
        kw = dict(block_mask=bm, enable_gqa=hq != hkv, kernel_options=opts)
        try:
            c, fwd, both = _time_flex(fn, q, k, v, go, kw)
            rows.append({"variant": name, "kernel_options": opts, "fwd_ms": fwd, "bwd_ms": both - fwd})
            print(f"  {name:<48} fwd {fwd:6.2f} ms  bwd {both - fwd:6.2f} ms  (compile {c:5.1f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - one variant failing must not stop the rest
            print(f"  {name:<48} FAILED {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def main_trainer_step(args, device, peak: float, state=None) -> None:
    """The trainer-step cases; under torchrun (`state`) rank 0 prints and appends the world's rows."""
    world, main_rank = (state.world_size, state.is_main) if state is not None else (1, True)
    builder = build_llama_target if args.shape in LLAMA_SHAPES else build_qwen3_target
    shape, target, wrapper, draft = builder(args.shape, args.draft_layers, args.block, device,
                                            torch.bfloat16 if args.precision == "bf16" else torch.float32,
                                            args.draft_kind, variant_options(args.variant_options))
    knobs = [(b, bool(int(f))) for b in args.backend.split(",") for f in args.fused_ce.split(",")]
    if args.cases:  # explicit cases, "mbs:anchors:seq:compile:compile_target[:pack_length]" separated by spaces
        cases = [StepCase(int(x[0]), int(x[1]), int(x[2]), x[3], 1, bool(int(x[4])), int(x[5]) if len(x) > 5 else 0,
                          li, b, f)
                 for x in (c.split(":") for c in args.cases.split()) for li in args.loss_impl.split(",")
                 for b, f in knobs]
    else:
        cases = [StepCase(int(m), int(a), int(s), c, int(g), bool(int(t)), int(p), li, b, f)
                 for m in args.mbs.split(",")
                 for a in args.anchors.split(",") for s in args.seq.split(",") for c in args.compile.split(",")
                 for g in args.accum.split(",") for t in args.compile_target.split(",")
                 for p in args.pack_length.split(",") for li in args.loss_impl.split(",") for b, f in knobs]
    rows = []
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    how = "FSDP2" if args.fsdp2 else "DDP"
    title = (f"{name}{f' x{world} ({how})' if world > 1 else ''}, {args.shape}, draft {args.draft_layers} layers, "
             f"block {args.block}, TrainStep; "
             f"measured bf16 matmul {peak:.0f} TFLOP/s; rows {1 - args.jitter:.2f}-1.0 x seq, "
             f"prompt {args.prompt_frac:.0%}")
    hdr = (f"{'mbs':>4} {'acc':>3} {'anch':>5} {'seq':>5} {'pack':>5} {'compile':>7} {'tgt':>3} {'attn':>5} "
           f"{'loss':>7} {'step ms':>8} {'tok/step':>8} "
           f"{'tok/s/GPU':>9} {'blk tok/s':>10} {'peak GB':>8} {'TFLOP/s':>8} {'MFU':>6} {'warm s':>7}")

    def line(r: dict) -> str:
        head = (f"{r['mbs']:>4} {r['accum']:>3} {r['anchors']:>5} {r['seq']:>5} {r.get('pack_length', 0):>5} "
                f"{r['compile']:>7} {int(r['compile_target']):>3} {r.get('backend', 'flex'):>5} "
                f"{r.get('loss_impl', 'chunked'):>7}")
        if "error" in r:
            return f"{head} {r['error']}"
        return (f"{head} {r['step_ms']:>8.1f} {r['tokens_step']:>8.0f} {r['tokens_s'] / world:>9.0f} "
                f"{r['block_tokens_s']:>10.0f} {r['peak_gb']:>8.1f} {r['tflops']:>8.1f} {r['mfu']:>6.1%} "
                f"{r['warmup_s']:>7.1f}")

    for i, case in enumerate(cases):
        try:
            r = run_trainer_case(shape, wrapper, draft, case, args.steps, args.warmup, device, args,
                                 profile_steps=args.profile if (i == 0 or args.profile_all) else 0, state=state)
            r["mfu"] = r["tflops"] / (peak * world)
        except torch.OutOfMemoryError:
            if world > 1:
                raise  # the other ranks wait in a collective: end the run
            r = {**vars(case), "error": "OOM"}
        except Exception as e:  # one failing case must not lose the others
            if world > 1:
                raise
            import traceback

            traceback.print_exc()
            r = {**vars(case), "error": f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"}
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(r)
        if not main_rank:
            continue
        if args.verbose:
            print(json.dumps({k: v for k, v in r.items() if k != "profile"}), flush=True)
        if "profile" in r:
            print_profile(f"mbs {case.mbs} anchors {case.anchors} seq {case.seq} compile {case.compile} "
                          f"target {int(case.compile_target)}", r["profile"])
        print(f"[{i + 1}/{len(cases)}] {line(r)}", flush=True)
    if not main_rank:
        return
    print(f"\n{title}\n{hdr}\n{'-' * len(hdr)}")
    for r in rows:
        print(line(r))
    sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "shape": args.shape, "matmul_tflops": peak, "args": vars(args), "rows": rows}, f,
                      indent=2)
    if args.append and device.type == "cuda":
        append_rows(Path(args.append), [
            bench_row(args, name, r, world=world, packed=bool(r["pack_length"]),
                      compiled=r["compile"] != "0" or bool(r["compile_target"]),
                      case=f"mbs {r['mbs']} anchors {r['anchors']} seq {r['seq']}"
                      + (f" pack {r['pack_length']}" if r["pack_length"] else "")
                      + f" compile {r['compile']} target {int(r['compile_target'])}"
                      + (f" {r['backend']}" if r["backend"] != "flex" else "")
                      + ("" if r["fused_ce"] else " fused_ce 0")
                      + (" fsdp2" if r["fsdp2"] else "")
                      + (" fp32" if r["precision"] == "fp32" else "")
                      + (f" loss {r['loss_impl']}" if r["loss_impl"] != "chunked" else "")
                      + (f" distill {args.distill_weight}" if args.distill_weight else ""))
            for r in rows if "error" not in r])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3_8b", choices=sorted(SHAPES))
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--draft-kind", default="dflash", choices=sorted(DRAFT_VARIANTS),
                   help="draft.kind: dflash, or dflash2 (block convolution and candidate selector at their defaults)")
    p.add_argument("--variant-options", default="",
                   help='the variant\'s sizes, e.g. "conv_kernel_size=0" or "selector_rank=0,selector_top_k=0" (a '
                        "part off, to time the rest)")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--anchors", default="512")
    p.add_argument("--seq", default="3072")
    p.add_argument("--backend", default="flex", help="loss.attn_backend on a GPU: flex | sdpa")
    p.add_argument("--compile", default="0", help="train.compile: 0 | layers | draft | ...")
    p.add_argument("--fused-ce", default="1", help="1: lm_head gradient formed in forward; 0: checkpointed chunks")
    p.add_argument("--loss-impl", default="chunked",
                   help="loss.impl, a comma list: chunked | cce (cut-cross-entropy) | liger (liger-kernel); "
                        "a package that cannot run falls back to chunked (the row records what ran)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--fsdp2", action="store_true", help="shard the draft with FSDP2 (run under torchrun)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"),
                   help="train.precision: bf16 (a bf16 target, the step under bf16 autocast: what the GPU rows "
                        "time) or fp32 (a CPU smoke run: a core without bf16 matmuls takes minutes a bf16 step)")
    p.add_argument("--json", default=None)
    g = p.add_argument_group("trainer step")
    g.add_argument("--mbs", default="16", help="micro-batch sizes (train.micro_batch_size; default 16, 1 for the "
                   "Qwen3 shapes)")
    g.add_argument("--accum", default="1", help="micro-batches per step (train.grad_accum)")
    g.add_argument("--compile-target", default="0", help="1: compile the target's layers (train.compile_target)")
    p.add_argument("--packed-attention", default="flex", choices=("flex", "varlen"),
                   help="target.packed_attention on a GPU: the target over packed rows by a document-causal "
                        "BlockMask (flex) or one flash varlen call over the documents (varlen)")
    p.add_argument("--pack-length", default="0", help="data.pack_length: rows of this many tokens packed with "
                   "documents of --seq tokens (less --jitter); --mbs then counts packed rows and --anchors is per row")
    p.add_argument("--append", default=os.path.join(os.path.dirname(__file__), "..", "docs", "bench",
                                                     "train_throughput.json"),
                   help="append the GPU rows to this JSON list ('' : do not)")
    p.add_argument("--commit", default=None,
                   help="commit recorded in the appended rows (default: the checkout's, from git)")
    g.add_argument("--cases", default=None, help='instead of the product: "MBS:ANCHORS:SEQ:COMPILE:TARGET ..."')
    g.add_argument("--distill-weight", type=float, default=0.0,
                   help="loss.distill_weight: soft CE against the target, formed chunk by chunk from its final hidden states")
    g.add_argument("--data", default=None, help="packed rows of this regenerated JSONL's conversations (real data; "
                                                "needs --pack-length) instead of synthetic documents")
    g.add_argument("--tokenizer", default="pkg:smollm2", help="tokenizer for --data (the target's)")
    g.add_argument("--jitter", type=float, default=0.15, help="row lengths uniform in [(1-jitter)*seq, seq] "
                   "(default 0.15; 0 for the Qwen3 shapes)")
    g.add_argument("--prompt-frac", type=float, default=0.25, help="unsupervised share at the start of each row "
                   "(default 0.25; 0.1 for the Qwen3 shapes)")
    g.add_argument("--distinct-batches", type=int, default=8, help="loader batches cycled (new shapes each step)")
    g.add_argument("--profile", type=int, default=0, help="torch.profiler summary over this many steps (first case)")
    g.add_argument("--profile-all", action="store_true", help="profile every case, not only the first")
    g.add_argument("--verbose", action="store_true", help="a JSON line per case as it finishes")
    g.add_argument("--overlap", type=int, default=1, choices=(0, 1),
                   help="1: launch step n+1 before reading step n, as the training loop does; 0: read every step")
    g.add_argument("--sync-debug", action="store_true", help="list the call sites that make the host wait inside "
                   "one step (torch.cuda.set_sync_debug_mode)")
    g.add_argument("--probe", action="store_true", help="flex_attention variants and host-vs-GPU time of the parts")
    g.add_argument("--device", default="cuda:0", help="cpu: a smoke run of the same code (sdpa instead of flex)")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.shape in LLAMA_SHAPES:  # the recipe's values, not the Qwen3 defaults
        defaults = {"anchors": ("512", "256"), "seq": ("3072", "416")}
    else:  # one row of exactly --seq tokens a micro-batch, a tenth of it prompt: the paper's step
        defaults = {"mbs": ("16", "1"), "jitter": (0.15, 0.0), "prompt_frac": (0.25, 0.1)}
    for key, (parsed_default, value) in defaults.items():
        if getattr(args, key) == parsed_default:
            setattr(args, key, value)
    if args.fsdp2 and world == 1:
        p.error("--fsdp2 shards the draft over torchrun's ranks: run it under torchrun")
    if world > 1 and (args.probe or args.profile or args.sync_debug):
        p.error("--probe, --profile and --sync-debug time one GPU: run them without torchrun")
    device = torch.device(args.device)
    state = None
    if world > 1:  # one GPU a rank (gloo with --device cpu)
        from nemo_dflash.train.distributed import DistState

        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local) if device.type == "cuda" else device
        state = DistState(rank=int(os.environ.get("RANK", "0")), local_rank=local, world_size=world, device=device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    limit_host_threads(device)  # as `train` does: one CPU thread on a GPU unless OMP_NUM_THREADS says otherwise
    if state is not None:
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                             device_id=device if device.type == "cuda" else None)
    if args.probe and args.cases and len(args.cases.split()[0].split(":")) > 5:
        probe_flex_tiles(args, device)
        return
    if args.probe:
        probe(args, device)
        return
    try:
        main_trainer_step(args, device, measure_matmul_tflops(device) if device.type == "cuda" else float("nan"),
                          state)
    finally:
        if state is not None:
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
