"""Forked worker pools for the CPU-bound steps of data preparation: parsing code trees, sampling GSM-Symbolic
templates, checking each conversation's first prompt. Fork, so workers inherit the caller's inputs (module state
set before the pool starts) and only small jobs travel; every caller keeps the one-process order."""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from nemo_dflash.data.config import available_cpus

MAX_WORKERS = 32  # past this the parent's merging, not the workers, bounds these steps


def default_workers(ranks_on_host: int = 1) -> int:
    """The CPUs this process may use, shared among the ``ranks_on_host`` ranks doing the same step, at most
    :data:`MAX_WORKERS`."""
    return max(1, min(MAX_WORKERS, available_cpus() // max(1, ranks_on_host)))


@contextlib.contextmanager
def fork_pool(workers: int) -> Iterator[Optional[concurrent.futures.Executor]]:
    """A pool of ``workers`` forked processes, or None for one (the caller runs the jobs in place)."""
    if workers <= 1:
        yield None
        return
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        yield pool


@dataclass(frozen=True)
class HostShare:
    """The ranks of one host preparing the same data side by side (every rank needs all of it): local rank
    ``rank`` of ``ranks`` prepares every ``ranks``-th block into ``directory`` (host-local, this job's alone),
    ``barrier`` waits for every rank of the job, then each reads every block in order. The result is the
    one-process one, in about 1/ranks of the time, where each rank used to prepare everything."""

    rank: int
    ranks: int
    directory: Path
    barrier: Callable[[], None]
