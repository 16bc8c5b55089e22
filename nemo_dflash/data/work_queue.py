"""Work shared out to torchrun ranks through the process group's key-value store.

A static shard (``items[rank::world]``) leaves ranks idle behind the longest conversations: with
every turn answered a conversation is a serial chain, and answer lengths vary. Here every rank
holds the same list and claims its next chunk with the store's atomic counter whenever its engine
has room, so each rank keeps working until the list is exhausted and no item is handed out twice.

A chunk is a cross-section of the list, not a run of it: chunk k holds items k, k + C, k + 2C, ...
(C chunks in all). A rank's first fill is large (its engine's slots and more), and the rank that
starts first would otherwise take the whole head of a longest-first list: measured on four GPUs,
one rank drew 1,376 conversations of 10.7 turns each, the others 1.5, and generated for 105 s
against 38 s. With cross-sections every fill holds its share of long and short chains, while the
longest chains still start in the first chunks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")

# The store's keys of this package, apart from torch's own and any other user of the store.
STORE_PREFIX = "nemo_dflash.regenerate/"


class CounterStore(Protocol):
    """What the queue needs of a ``torch.distributed.Store``: an atomic add that returns the new value."""

    def add(self, key: str, amount: int) -> int: ...


class SharedQueue(Generic[T]):
    """Iterate the items this rank claims from ``items`` (identical on every rank), one chunk of up to
    ``chunk`` items at a time, through the counter ``key`` of ``store``; iteration ends once every chunk
    is claimed. Chunk k is ``items[k::n_chunks]`` (the module's docstring says why).

    Claims are lazy: a chunk is claimed when the consumer asks for its first item, so a rank
    takes work only as fast as its engine admits it. ``claimed`` counts the items handed out here.
    """

    def __init__(self, store: CounterStore, key: str, items: Sequence[T], chunk: int = 1) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self._store, self._key, self._items, self._chunk = store, key, items, chunk
        self.claimed = 0

    def __iter__(self) -> Iterator[T]:
        n_chunks = -(-len(self._items) // self._chunk)
        while True:
            k = int(self._store.add(self._key, 1)) - 1
            if k >= n_chunks:
                return
            for item in self._items[k::n_chunks]:
                self.claimed += 1
                yield item


def process_group_store() -> Any:
    """The store of the default process group (torchrun's), under this package's prefix."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    return dist.PrefixStore(STORE_PREFIX, distributed_c10d._get_default_store())


def call_prefix(store: CounterStore, world: int) -> str:
    """A key prefix this call of every rank shares and no earlier call used. torchrun's store outlives a process
    group (and an elastic restart), so a counter of an earlier call in the same launch would start the queue
    past items nobody answered. Every rank adds once per call, after a barrier, so the ranks of one call read
    values in the same block of ``world``."""
    return f"call{(int(store.add('calls', 1)) - 1) // world}/"


def queue_chunk(batch_size: int) -> int:
    """Items a rank claims at once: small, so the ranks run out of work within a few conversations of
    each other, yet one store round trip serves several admissions of a large batch."""
    return max(1, min(16, batch_size // 8))


__all__ = ["CounterStore", "SharedQueue", "STORE_PREFIX", "call_prefix", "process_group_store", "queue_chunk"]
