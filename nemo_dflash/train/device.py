"""What a process does around its accelerator: the host threads it leaves torch (on a CPU: the threads and dtype a
short probe finds fastest now), the memory it gives back between phases."""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any, Optional

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


def _probe_seconds(threads: int, dtype: "Any", reps: int = 3) -> float:
    """Best-of-`reps` time of a training-sized matmul plus 16 decode-sized ones (SmolLM2's MLP shape)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w = torch.randn(1536, 576, dtype=dtype)
        big, small = torch.randn(512, 576, dtype=dtype), torch.randn(8, 576, dtype=dtype)
        best = float("inf")
        for _ in range(reps + 1):  # the first round warms up
            t0 = time.perf_counter()
            torch.nn.functional.linear(big, w)
            for _ in range(16):
                torch.nn.functional.linear(small, w)
            best = min(best, time.perf_counter() - t0)
        return best
    finally:
        torch.set_num_threads(before)


def pick_cpu_settings(threads: Optional[int], dtype: str) -> tuple[int, str, dict[str, float]]:
    """Threads and dtype for the CPU run: the given ones, else the fastest in a ~1 s probe.

    Why a probe: with another process on one of two cores, every two-thread op waits for the
    descheduled thread (a decode step's small matmuls ran ~30x slower than on one thread), and
    bf16 matmuls are ~4x faster than fp32 on some CPUs (AVX512-BF16 EPYC) and ~2x slower on others.
    """
    all_cores = torch.get_num_threads()
    thread_options = [threads] if threads is not None else sorted({1, all_cores})
    dtype_options = [dtype] if dtype != "auto" else ["bf16", "fp32"]
    table = {(t, d): _probe_seconds(t, torch.bfloat16 if d == "bf16" else torch.float32)
             for t in thread_options for d in dtype_options}
    best_threads, best_dtype = min(table, key=table.get)
    torch.set_num_threads(best_threads)
    return best_threads, best_dtype, {f"{t} thread(s) {d}": round(s * 1e3, 2) for (t, d), s in table.items()}


def refresh_threads(cpu: dict[str, Any], phase: str, given: Optional[int]) -> None:
    """Probe the threads again before `phase` (the dtype stays: the model is loaded): other work that
    started on a core since the last probe would make two threads many times slower."""
    if not cpu or given is not None:
        return
    threads, _, probe = pick_cpu_settings(None, cpu["dtype"])
    cpu.setdefault("threads_by_phase", {})[phase] = threads
    if threads != cpu["threads"]:
        logger.info("%s: %d thread(s) now (probe, ms: %s)", phase, threads, probe)


__all__ = ["free_memory_bytes", "limit_host_threads", "pick_cpu_settings", "refresh_threads",
           "release_device_memory"]
