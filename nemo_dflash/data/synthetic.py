"""Synthetic packed batches: the loader's own packing and collation over random documents of a chosen length
spread, so a training step can be timed at a shape without a data set (benchmarks/train_throughput.py)."""

from __future__ import annotations

import torch


def make_packed_batches(n: int, rows: int, pack_length: int, seq: int, jitter: float, prompt_frac: float,
                        vocab: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`n` packed loader batches (`data.pack_length`): documents of lengths uniform in
    [(1-jitter)*seq, seq], the first `prompt_frac` of each unsupervised, planned by the loader's own
    packer (look-ahead first fit) and laid out by its collator."""
    import numpy as np

    from nemo_dflash.data.packing import PackedCollator, plan_packed_steps

    g = torch.Generator().manual_seed(seed)
    collate = PackedCollator(pad_token_id=0, rows=rows, pack_length=pack_length)
    lo = max(2, int(round((1 - jitter) * seq)))
    per_step = rows * pack_length // lo + 1
    lengths = np.asarray(torch.randint(lo, seq + 1, ((n + 2) * per_step + 256,), generator=g).tolist())  # a stream
    steps = plan_packed_steps(np.arange(len(lengths)), lengths, rows, pack_length)[:n]
    out = []
    for step in steps:
        docs = []
        for length in lengths[step].tolist():
            lm = [0] * int(length * prompt_frac) + [1] * (length - int(length * prompt_frac))
            docs.append({"input_ids": torch.randint(0, vocab - 1, (length,), generator=g).tolist(), "loss_mask": lm})
        out.append(collate(docs))
    return out
