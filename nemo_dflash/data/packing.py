"""Packed rows of a fixed token budget: every step has the same shapes.

Conversations are placed whole (never split) into `rows` rows of `pack_length` tokens, first
fit in the epoch's seeded order: a conversation goes into the first row of the current step
with room for it; one that fits nowhere waits for the next step while the following ones (a
bounded look-ahead window) may still fill the gaps. The collator runs the same first fit over
the step's conversations, so the sampler's plan and the rows agree.

Each packed row carries `doc_ids` (the conversation's index within the row, -1 on the padding
at the row's end) and `position_ids` (restarting at 0 for every conversation): the target's
document-causal mask and the draft's block mask are built from them (nemo_dflash.objective.block_mask), so a
conversation trains exactly as it would alone.

The sampler is resumable like `ChatBatchSampler` (state: epoch, steps yielded) and every rank
computes the same global plan and takes every world_size-th step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nemo_dflash.data.sampler import EpochSampler


def first_fit(lengths: Sequence[int], rows: int, pack_length: int) -> tuple[list[int], int]:
    """Place conversations in order into `rows` rows of `pack_length` tokens, first fit.

    Returns (the row of each placed conversation, how many were placed): placing stops at the
    first conversation that fits in no row.
    """
    fill = [0] * rows
    out: list[int] = []
    for n in lengths:
        n = min(int(n), pack_length)
        for r in range(rows):
            if fill[r] + n <= pack_length:
                fill[r] += n
                out.append(r)
                break
        else:
            break
    return out, len(out)


def plan_packed_steps(order: np.ndarray, lengths: np.ndarray, rows: int, pack_length: int,
                      lookahead: int = 256) -> list[np.ndarray]:
    """The epoch's steps, filled first fit from the next `lookahead` waiting conversations.

    A conversation that fits in no row of the current step waits for a later one (at most a
    window away), so rows are not closed by the first long conversation: fewer padding tokens.
    The plan is a pure function of (order, lengths), hence the same on every rank and on resume;
    placing a step's conversations first fit in the listed order (the collator) gives the same rows,
    because a skipped conversation changed no row.
    """
    lens = np.minimum(lengths[order], pack_length).astype(np.int64).tolist()
    held: list[int] = []  # positions in `order` skipped by earlier steps, in order
    nxt, n = 0, len(order)
    steps = []
    while held or nxt < n:
        fill = [0] * rows
        placed: list[int] = []
        still: list[int] = []
        window = held + list(range(nxt, min(n, nxt + max(1, lookahead - len(held)))))
        scanned = 0
        for w in window:
            if max(pack_length - f for f in fill) == 0:
                break
            scanned += 1
            for r in range(rows):
                if fill[r] + lens[w] <= pack_length:
                    fill[r] += lens[w]
                    placed.append(w)
                    break
            else:
                still.append(w)
        if not placed:  # cannot happen (lengths are capped at pack_length); never loop forever
            placed, still, scanned = [window[0]], [], 1
        fresh = max(0, scanned - len(held))
        held = still + [w for w in held[scanned:]] if scanned < len(held) else still
        nxt += fresh
        steps.append(order[np.asarray(placed)])
    return steps


class PackedBatchSampler(EpochSampler):
    """Yield this rank's packed steps as lists of dataset indices (in placement order)."""

    def __init__(
        self,
        lengths: Sequence[int],
        rows: int,
        pack_length: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        if rows <= 0 or pack_length <= 0:
            raise ValueError(f"rows and pack_length must be positive (got {rows}, {pack_length})")
        super().__init__(lengths, rank=rank, world_size=world_size, seed=seed)
        self.rows = rows
        self.pack_length = pack_length
        self._cache: tuple[int, list[np.ndarray]] | None = None

    def global_steps(self, epoch: int) -> list[np.ndarray]:
        """All ranks' steps of `epoch`, padded by repetition to a multiple of world_size."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        order = np.random.default_rng([self.seed, epoch, 0x9AC4]).permutation(len(self.lengths))
        steps = plan_packed_steps(order, self.lengths, self.rows, self.pack_length)
        if len(steps) % self.world_size:
            steps = steps + steps[: self.world_size - len(steps) % self.world_size]
        self._cache = (epoch, steps)
        return steps

    def batches(self, epoch: int) -> list[np.ndarray]:
        return self.global_steps(epoch)[self.rank :: self.world_size]

    def __len__(self) -> int:
        return len(self.batches(self.epoch))

    def _batch_keys(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"batch_size": self.rows, "pack_length": self.pack_length}, {}


@dataclass
class PackedCollator:
    """Conversations -> `rows` rows of `pack_length` tokens (the sampler's first fit).

    Returns input_ids, attention_mask (1 on conversation tokens), loss_mask, position_ids
    (restarting per conversation) and doc_ids (conversation index in its row, -1 on padding),
    all [rows, pack_length].
    """

    pad_token_id: int
    rows: int
    pack_length: int

    def __call__(self, batch: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        shape = (self.rows, self.pack_length)
        ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        attn = torch.zeros(shape, dtype=torch.long)
        loss = torch.zeros(shape, dtype=torch.long)
        pos = torch.zeros(shape, dtype=torch.long)
        doc = torch.full(shape, -1, dtype=torch.long)
        lengths = [min(len(b["input_ids"]), self.pack_length) for b in batch]
        where, placed = first_fit(lengths, self.rows, self.pack_length)
        if placed < len(batch):
            raise ValueError(f"{len(batch)} conversations do not fit {self.rows} rows of {self.pack_length} tokens")
        fill = [0] * self.rows
        count = [0] * self.rows
        for item, n, r in zip(batch, lengths, where):
            a = fill[r]
            ids[r, a : a + n] = torch.as_tensor(item["input_ids"][:n], dtype=torch.long)
            loss[r, a : a + n] = torch.as_tensor(item["loss_mask"][:n], dtype=torch.long)
            attn[r, a : a + n] = 1
            pos[r, a : a + n] = torch.arange(n)
            doc[r, a : a + n] = count[r]
            fill[r] += n
            count[r] += 1
        return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss, "position_ids": pos, "doc_ids": doc}


__all__ = ["PackedBatchSampler", "PackedCollator", "first_fit", "plan_packed_steps"]
