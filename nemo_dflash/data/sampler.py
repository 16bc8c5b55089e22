"""A seeded, distributed, resumable batch sampler with optional length grouping.

Every rank computes the same global batch order for an epoch (seeded by ``seed`` and the
epoch) and takes its own slice, so no communication is needed. Length grouping sorts windows
of the shuffled data by length before cutting batches: samples of similar length share a
batch and padding drops, while the window keeps batch composition random across epochs.

The sampler and its iterator implement ``state_dict``/``load_state_dict`` so a
``torchdata.stateful_dataloader.StatefulDataLoader`` restores the exact data position.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from nemo_dflash.data.config import BATCHING_MODES

from nemo_dflash.data.sources import DataError

logger = logging.getLogger(__name__)


class EpochSampler(Sampler[list[int]]):
    """What the padded and the packed samplers share: the rank and lengths they are built from, an epoch counter
    as their whole state, and an iterator over ``batches(epoch)`` that resumes mid-epoch (`EpochBatchIterator`)."""

    def __init__(self, lengths: Sequence[int], *, rank: int, world_size: int, seed: int) -> None:
        """The checks and fields both samplers take: this rank among ``world_size``, the samples' lengths (at
        least one), the seed of every epoch's order, and epoch 0."""
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size (got rank={rank}, world_size={world_size})")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if len(self.lengths) == 0:
            raise ValueError("cannot sample batches from an empty dataset")
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        return EpochBatchIterator(self, self.epoch)

    def _batch_keys(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The sampler's own keys of `_signature`: its batch shape, and how it orders the samples."""
        raise NotImplementedError

    def _signature(self) -> dict[str, Any]:
        """What a saved position must match to resume here (`EpochBatchIterator.load_state_dict`): the data, the
        batch shape, the ranks and the order."""
        shape, order = self._batch_keys()
        return {"num_samples": len(self.lengths), **shape, "world_size": self.world_size, "rank": self.rank,
                **order, "seed": self.seed}

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])


class ChatBatchSampler(EpochSampler):
    """Yield this rank's batches of dataset indices.

    The epoch's index permutation is padded by repetition to a multiple of
    ``batch_size * world_size`` (or cut, with ``drop_last``), so every rank gets the same number
    of full batches and the ranks' shares are disjoint apart from the repeated padding.
    Batches at the same step on different ranks come from the same length group, which keeps
    the ranks' step times balanced.

    The epoch advances by itself when an epoch is exhausted; :meth:`set_epoch` overrides it.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        batching: str = "length_grouped",
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        drop_last: bool = False,
        group_batches: int = 50,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive (got {batch_size})")
        if batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {BATCHING_MODES} (got {batching!r})")
        super().__init__(lengths, rank=rank, world_size=world_size, seed=seed)
        if drop_last and len(self.lengths) < batch_size * world_size:
            raise ValueError(
                f"drop_last with {len(self.lengths)} samples < batch_size*world_size="
                f"{batch_size * world_size} leaves no batch; lower batch_size or set drop_last=False"
            )
        self.batch_size = batch_size
        self.batching = batching
        self.drop_last = drop_last
        self.group_batches = group_batches

    def _num_samples(self) -> int:
        step = self.batch_size * self.world_size
        n = len(self.lengths)
        return (n // step) * step if self.drop_last else -(-n // step) * step

    def __len__(self) -> int:
        return self._num_samples() // (self.batch_size * self.world_size)

    def global_batches(self, epoch: int) -> np.ndarray:
        """All ranks' batches for ``epoch`` as an array ``[steps, world_size, batch_size]``."""
        rng = np.random.default_rng([self.seed, epoch])
        perm = rng.permutation(len(self.lengths))
        perm = np.resize(perm, self._num_samples())  # np.resize repeats cyclically to pad
        step = self.batch_size * self.world_size
        if self.batching == "length_grouped":
            window = step * self.group_batches
            for start in range(0, len(perm), window):
                chunk = perm[start : start + window]
                perm[start : start + window] = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
        steps = perm.reshape(-1, self.world_size, self.batch_size)
        if self.batching == "length_grouped":
            steps = steps[rng.permutation(len(steps))]  # sorted windows would otherwise go long -> short
        return steps

    def batches(self, epoch: int) -> np.ndarray:
        """This rank's batches for ``epoch``: ``[steps, batch_size]``."""
        return self.global_batches(epoch)[:, self.rank, :]

    def _batch_keys(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"batch_size": self.batch_size}, {"batching": self.batching}


class EpochBatchIterator(Iterator[list[int]]):
    """One pass over an epoch of a sampler with ``batches(epoch)``, ``epoch`` and ``_signature()``
    (the padded and the packed samplers); its state is (epoch, batches yielded)."""

    def __init__(self, sampler: Any, epoch: int) -> None:
        self.sampler = sampler
        self.epoch = epoch
        self.yielded = 0
        self._batches: np.ndarray | None = None  # computed lazily: a restore replaces the epoch first

    def __iter__(self) -> "EpochBatchIterator":
        return self

    def __next__(self) -> list[int]:
        if self._batches is None:
            self._batches = self.sampler.batches(self.epoch)
        if self.yielded >= len(self._batches):
            self.sampler.epoch = max(self.sampler.epoch, self.epoch + 1)
            raise StopIteration
        batch = self._batches[self.yielded].tolist()
        self.yielded += 1
        return batch

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
        self._batches = None
