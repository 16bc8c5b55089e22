"""What a process does around its accelerator: the host threads it leaves torch, the memory it gives back
between phases."""

from __future__ import annotations

import gc
import logging
import os

import torch

logger = logging.getLogger(__name__)


def release_device_memory() -> None:
    """Collect dropped models and caches, then give the allocator's cached GPU memory back, so the next phase
    (another engine's cache, another process on the same GPU) finds it free. A no-op without CUDA."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def limit_host_threads(device: torch.device) -> int | None:
    """One CPU thread for torch in a process that trains on a GPU, as torchrun gives each of its ranks.

    The host's own tensor work there is small (micro-batch slices, anchor plans, packed rows), and torch's
    default of one OpenMP thread per core fans each op out over the whole host: on a 64-core H200 host the
    SmolLM2 training step took 486.8 ms at torch's default against 273.5 ms at one thread (docs/performance.md).
    Left alone on a CPU device, or when ``OMP_NUM_THREADS`` says otherwise (``--threads`` sets it). Returns
    the count set, or None."""
    if device.type != "cuda" or os.environ.get("OMP_NUM_THREADS"):
        return None
    if torch.get_num_threads() != 1:
        logger.info("torch CPU threads %d -> 1 for GPU training (set OMP_NUM_THREADS to choose)",
                    torch.get_num_threads())
        torch.set_num_threads(1)
    return 1


def free_memory_bytes(device: str) -> int | None:
    """Memory a new allocation can take on ``device`` ("cpu", "cuda", "cuda:N"), read before any model loads: the
    GPU's free memory by the driver, or the host's available memory (/proc/meminfo's MemAvailable); None when it
    cannot be read (the checks that use it then leave the bound to the allocation)."""
    if str(device).startswith("cuda"):
        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


__all__ = ["free_memory_bytes", "limit_host_threads", "release_device_memory"]
