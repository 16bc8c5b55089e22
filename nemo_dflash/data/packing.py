"""Packed rows of a fixed token budget: every step has the same shapes.

Conversations are placed whole (never split) into `rows` rows of `pack_length` tokens, first
fit in the epoch's seeded order: a conversation goes into the first row of the current step
with room for it, and the first one that fits nowhere opens the next step. The collator runs
the same first fit over the step's conversations, so the sampler's plan and the rows agree.

Each packed row carries `doc_ids` (the conversation's index within the row, -1 on the padding
at the row's end) and `position_ids` (restarting at 0 for every conversation): the target's
document-causal mask and the draft's block mask are built from them (nemo_dflash.core), so a
conversation trains exactly as it would alone.

The sampler is resumable like `ChatBatchSampler` (state: epoch, steps yielded) and every rank
computes the same global plan and takes every world_size-th step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from nemo_dflash.data.sources import DataError


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


def plan_packed_steps(order: np.ndarray, lengths: np.ndarray, rows: int, pack_length: int) -> list[np.ndarray]:
    """The epoch's steps: consecutive runs of `order` that first fit into one step's rows."""
    steps = []
    i, n = 0, len(order)
    lens = lengths[order]
    while i < n:
        # a step holds at most rows * pack_length tokens: look only that far ahead
        stop, total = i, 0
        while stop < n and total <= rows * pack_length:
            total += min(int(lens[stop]), pack_length)
            stop += 1
        _, placed = first_fit(lens[i:stop], rows, pack_length)
        placed = max(placed, 1)
        steps.append(order[i : i + placed])
        i += placed
    return steps


class PackedBatchSampler(Sampler[list[int]]):
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
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size (got rank={rank}, world_size={world_size})")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if len(self.lengths) == 0:
            raise ValueError("cannot sample batches from an empty dataset")
        self.rows = rows
        self.pack_length = pack_length
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = 0
        self._cache: tuple[int, list[np.ndarray]] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

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

    def __iter__(self) -> Iterator[list[int]]:
        return _PackedIterator(self, self.epoch)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])

    def _signature(self) -> dict[str, Any]:
        return {
            "num_samples": len(self.lengths),
            "batch_size": self.rows,
            "pack_length": self.pack_length,
            "world_size": self.world_size,
            "rank": self.rank,
            "seed": self.seed,
        }


class _PackedIterator(Iterator[list[int]]):
    """One pass over an epoch; its state is (epoch, steps yielded)."""

    def __init__(self, sampler: PackedBatchSampler, epoch: int) -> None:
        self.sampler = sampler
        self.epoch = epoch
        self.yielded = 0

    def __iter__(self) -> "_PackedIterator":
        return self

    def __next__(self) -> list[int]:
        steps = self.sampler.batches(self.epoch)
        if self.yielded >= len(steps):
            self.sampler.epoch = max(self.sampler.epoch, self.epoch + 1)
            raise StopIteration
        out = steps[self.yielded].tolist()
        self.yielded += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "yielded": self.yielded, **self.sampler._signature()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = {k: state_dict[k] for k in self.sampler._signature() if k in state_dict}
        current = {k: v for k, v in self.sampler._signature().items() if k in saved}
        if saved != current:
            raise DataError(
                f"data loader state was saved with {saved} but this run has {current}; "
                "resume with the same data, batch size, pack length and number of ranks, or start the data from scratch"
            )
        self.epoch = int(state_dict["epoch"])
        self.yielded = int(state_dict["yielded"])


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
