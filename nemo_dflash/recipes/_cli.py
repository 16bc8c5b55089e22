"""Shared CLI plumbing: logging that is quiet on non-zero ranks, and clean user errors."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(level: str | None = None) -> None:
    rank = int(os.environ.get("RANK", "0"))
    level = level or os.environ.get("NEMO_DFLASH_LOG", "INFO")
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO) if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def fail(msg: str, code: int = 2) -> "NoReturn":  # type: ignore[name-defined]  # noqa: F821
    sys.stderr.write(f"error: {msg}\n")
    raise SystemExit(code)


def set_threads(threads: int | None) -> None:
    """``--threads N`` of the CPU commands: torch's default (every core) can run many times slower on a
    machine whose cores are shared with another process (docs/performance.md)."""
    if threads is None:
        return
    if threads < 1:
        fail(f"--threads must be >= 1 (got {threads})")
    import torch

    torch.set_num_threads(threads)
