"""Training-step throughput and MFU of nemo_dflash on one GPU (or several under torchrun).

Runs the real step (frozen target through the hook wrapper -> trainer module -> backward ->
clip -> fused AdamW) on a random-weight target of a given shape, and prints one table.

    python benchmarks/train_throughput.py --shape qwen3_8b                      # defaults of the issue
    python benchmarks/train_throughput.py --shape qwen3_8b --anchors 128,256,512 --seq 2048,3072,4096 \
        --backend flex,sdpa --compile 0,1 --json out.json
    torchrun --nproc-per-node 4 benchmarks/train_throughput.py --shape qwen3_8b --fsdp2

MFU = model FLOPs of a step / step time / the bf16 matmul rate measured in the same run
(formula in docs/performance.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nemo_dflash.core import DFlashTrainerModule  # noqa: E402
from nemo_dflash.model import DFlashConfig, DFlashDraftModel  # noqa: E402
from nemo_dflash.registry import build_target_layer_ids  # noqa: E402
from nemo_dflash.target import HFDFlashTargetModel  # noqa: E402

SHAPES = {
    "qwen3_8b": dict(num_hidden_layers=36, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3_4b": dict(num_hidden_layers=36, hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "small": dict(num_hidden_layers=12, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=64, vocab_size=151936),
}


@dataclass
class Case:
    anchors: int
    seq: int
    backend: str
    compile: bool
    fused_ce: bool = True


def measure_matmul_tflops(device, n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - t) / 1e12


def layer_linear_params(h, i, nq, nkv, hd) -> int:
    return h * nq * hd + 2 * h * nkv * hd + nq * hd * h + 3 * h * i


def step_flops(shape: dict, draft_layers: int, block: int, seq: int, anchors_pos: list[int], n_labels: int,
               last_target_layer: int) -> dict[str, float]:
    """Model FLOPs of one step (2 per multiply-add; backward = 2x forward for trained parts)."""
    h, i, nq, nkv, hd, v = (shape[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                 "num_key_value_heads", "head_dim", "vocab_size"))
    lin = layer_linear_params(h, i, nq, nkv, hd)
    n_t = last_target_layer + 1
    target = n_t * (2 * seq * lin + 2 * 2 * nq * hd * seq * (seq + 1) / 2)  # causal attention: half the scores
    q = len(anchors_pos) * block
    n_ctx = len(build_target_layer_ids(shape["num_hidden_layers"], draft_layers))
    fc = 2 * seq * n_ctx * h * h
    per_layer = 2 * q * (h * nq * hd + nq * hd * h + 3 * h * i) + 2 * (seq + q) * 2 * h * nkv * hd
    visible = sum(block * (a + block) for a in anchors_pos)  # keys each block may see
    attn = 2 * 2 * nq * hd * visible
    draft_fwd = fc + draft_layers * (per_layer + attn)
    head_fwd = 2 * n_labels * h * v
    return {"target": target, "draft": 3 * draft_fwd, "lm_head": 2 * head_fwd,
            "total": target + 3 * draft_fwd + 2 * head_fwd}


def build(shape_name: str, draft_layers: int, block: int, device, fsdp2: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = SHAPES[shape_name]
    cfg = Qwen3Config(**shape, max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    with torch.device("meta"):
        target = Qwen3ForCausalLM(cfg)
    target = target.to_empty(device=device).to(torch.bfloat16)
    with torch.no_grad():
        for p in target.parameters():
            p.normal_(0, 0.02)
    ids = build_target_layer_ids(shape["num_hidden_layers"], draft_layers)
    dcfg = DFlashConfig.from_target_config(cfg, num_hidden_layers=draft_layers, block_size=block,
                                           mask_token_id=151669, target_layer_ids=ids)
    with torch.device(device):
        draft = DFlashDraftModel(dcfg).float()
    wrapper = HFDFlashTargetModel(target, ids)
    if fsdp2:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in draft.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(draft, mp_policy=mp)
    return shape, target, wrapper, draft


def run_case(shape, wrapper, draft, case: Case, steps: int, warmup: int, device, ddp_world: int, fsdp2: bool,
             breakdown: bool = True):
    block = draft.config.block_size
    for layer in draft.layers:
        layer._compiled_call_impl = None  # reset any previous compile
    if case.compile:
        for layer in draft.layers:
            layer.compile()
    module = DFlashTrainerModule(draft, wrapper.get_input_embeddings(), wrapper.get_output_embeddings(),
                                 num_anchors=case.anchors, loss_decay_gamma=7.0, attn_backend=case.backend,
                                 fused_ce=case.fused_ce)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151000, (1, case.seq), generator=g).to(device)
    attn = torch.ones_like(ids)
    lm = torch.ones_like(ids)
    lm[:, : case.seq // 10] = 0  # a prompt
    times, t_target, t_draft = [], [], []
    torch.cuda.reset_peak_memory_stats(device)
    out = None
    for it in range(warmup + steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        batch = wrapper.generate_batch(ids, attn, lm)
        if breakdown:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = module(batch, row_seeds=[it])
        (out.loss_sum / out.weight_sum.clamp(min=1)).backward()
        if breakdown:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if it >= warmup:
            times.append(time.perf_counter() - t)
            t_target.append(t1 - t)
            t_draft.append(t2 - t1)
    n_valid = int(out.num_blocks)
    anchors_pos = sorted(torch.randperm(case.seq - case.seq // 10 - block, generator=g)[: min(case.anchors, n_valid)]
                         .add(case.seq // 10).tolist())
    flops = step_flops(shape, draft.config.num_hidden_layers, block, case.seq, anchors_pos, int(out.num_labels),
                       max(wrapper.target_layer_ids))
    med = statistics.median(times)
    del opt
    return {
        "anchors": case.anchors, "seq": case.seq, "backend": case.backend, "compile": case.compile,
        "fused_ce": case.fused_ce, "step_ms": med * 1e3, "tokens_s": case.seq / med, "samples_s": 1 / med,
        "peak_gb": torch.cuda.max_memory_allocated(device) / 2**30, "tflops": flops["total"] / med / 1e12,
        "flops": flops, "loss": float(out.loss.detach()),
        "target_ms": statistics.median(t_target) * 1e3, "draft_fwd_bwd_ms": statistics.median(t_draft) * 1e3,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3_8b", choices=sorted(SHAPES))
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--anchors", default="512")
    p.add_argument("--seq", default="3072")
    p.add_argument("--backend", default="flex")
    p.add_argument("--compile", default="0")
    p.add_argument("--fused-ce", default="1", help="1: lm_head gradient formed in forward; 0: checkpointed chunks")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--fsdp2", action="store_true", help="shard the draft with FSDP2 (run under torchrun)")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    if world > 1:
        torch.distributed.init_process_group("nccl", device_id=device)
    peak = measure_matmul_tflops(device)
    shape, target, wrapper, draft = build(args.shape, args.draft_layers, args.block, device, args.fsdp2)
    cases = [Case(int(a), int(s), b, bool(int(c)), bool(int(f)))
             for a in args.anchors.split(",") for s in args.seq.split(",")
             for b in args.backend.split(",") for c in args.compile.split(",") for f in args.fused_ce.split(",")]
    rows = []
    for case in cases:
        try:
            r = run_case(shape, wrapper, draft, case, args.steps, args.warmup, device, world, args.fsdp2)
        except torch.OutOfMemoryError:
            r = {"anchors": case.anchors, "seq": case.seq, "backend": case.backend, "compile": case.compile,
                 "fused_ce": case.fused_ce, "error": "OOM"}
        gc.collect()
        torch.cuda.empty_cache()
        r["mfu"] = r["tflops"] / peak if "tflops" in r else None
        rows.append(r)
        if rank == 0:
            print(json.dumps({k: v for k, v in r.items() if k != "flops"}), flush=True)
    if rank == 0:
        name = torch.cuda.get_device_name(device)
        print(f"\n{name} x{world}, {args.shape}, draft {args.draft_layers} layers, block {args.block}; "
              f"measured bf16 matmul {peak:.0f} TFLOP/s")
        hdr = f"{'anchors':>7} {'seq':>5} {'backend':>7} {'compile':>7} {'fusedCE':>7} {'step ms':>8} {'tok/s/GPU':>10} " \
              f"{'peak GB':>8} {'TFLOP/s':>8} {'MFU':>6} {'target':>7} {'draft':>7}"
        print(hdr)
        print("-" * len(hdr))
        for r in rows:
            if "error" in r:
                print(f"{r['anchors']:>7} {r['seq']:>5} {r['backend']:>7} {str(r['compile']):>7} "
                      f"{str(r['fused_ce']):>7} {r['error']:>8}")
                continue
            print(f"{r['anchors']:>7} {r['seq']:>5} {r['backend']:>7} {str(r['compile']):>7} "
                  f"{str(r['fused_ce']):>7} {r['step_ms']:>8.1f} "
                  f"{r['tokens_s']:>10.0f} {r['peak_gb']:>8.1f} {r['tflops']:>8.1f} {r['mfu']:>6.1%} "
                  f"{r['target_ms']:>7.1f} {r['draft_fwd_bwd_ms']:>7.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": name, "world": world, "shape": args.shape, "matmul_tflops": peak, "rows": rows}, f,
                          indent=2)
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
