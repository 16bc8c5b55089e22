"""Held-out simulated acceptance length by position in the answer (why it exceeds real decoding).

    python benchmarks/sim_tau_by_position.py --target pkg:smollm2 --draft OUT/export/main \
        --data OUT/data/regen.jsonl [--holdout-fraction 0.02 --conversations 30 --bin 128]

Rebuilds the trainer's held-out split of `--data` (same seed and fraction as the recipe), then
measures the trainer's own acceptance metric separately for anchors in answer positions
[0, bin), [bin, 2*bin), ...: every anchor of each bin, one conversation at a time. The
recipe's metric averages over all anchors, so long answers (and their repetitive tails)
dominate it; real decoding of a 128-token answer only sees the first bin.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from nemo_dflash.core import DFlashTrainerModule
from nemo_dflash.data.config import DataConfig, DataSourceConfig
from nemo_dflash.data.dataset import build_datasets
from nemo_dflash.export import load_draft
from nemo_dflash.target.loading import load_target
from nemo_dflash.target import HFDFlashTargetModel


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--holdout-fraction", type=float, default=0.02)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--conversations", type=int, default=30)
    p.add_argument("--bin", type=int, default=128)
    p.add_argument("--dtype", default="bf16")
    args = p.parse_args()
    target, tok = load_target(args.target, dtype=args.dtype)
    draft = load_draft(args.draft, dtype=args.dtype)
    wrapper = HFDFlashTargetModel(target, draft.target_layer_ids)
    cfg = DataConfig(sources=[DataSourceConfig(path=args.data)], max_length=args.max_length,
                     holdout_fraction=args.holdout_fraction)
    _, holdout = build_datasets(cfg, tok)
    if holdout is None:
        raise SystemExit("no held-out split: pass --holdout-fraction > 0")
    blk = draft.config.block_size
    module = DFlashTrainerModule(draft, wrapper.get_input_embeddings(), wrapper.get_output_embeddings(),
                                 num_anchors=1, attn_backend="sdpa")
    sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    total = [0.0, 0.0]
    for i in range(min(args.conversations, len(holdout))):
        item = holdout[i]
        ids, lm = item["input_ids"][None], item["loss_mask"][None]
        n = ids.shape[1]
        attn = torch.ones_like(ids)
        start = int(lm[0].nonzero()[0])
        batch = wrapper.generate_batch(ids, attn, lm)
        cand = [a for a in range(start, n - blk + 1) if lm[0, a]]
        by_bin: dict[int, list[int]] = defaultdict(list)
        for a in cand:
            by_bin[(a - start) // args.bin].append(a)
        for b, anchors in by_bin.items():
            out = module(batch, anchors=torch.tensor([anchors]), valid=torch.ones(1, len(anchors), dtype=torch.bool))
            sums[b][0] += float(out.accept_sum)
            sums[b][1] += float(out.num_blocks)
            total[0] += float(out.accept_sum)
            total[1] += float(out.num_blocks)
    print(f"{'answer tokens':>16} {'anchors':>8} {'sim. tau':>9}")
    for b in sorted(sums):
        s, k = sums[b]
        print(f"{f'{b * args.bin}-{(b + 1) * args.bin - 1}':>16} {int(k):>8} {s / max(k, 1):>9.2f}")
    print(f"{'all (as trained)':>16} {int(total[1]):>8} {total[0] / max(total[1], 1):>9.2f}")


if __name__ == "__main__":
    main()
