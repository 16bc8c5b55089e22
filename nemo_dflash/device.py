"""What a process does with its accelerator between phases: give the memory it cached back."""

from __future__ import annotations

import gc

import torch


def release_device_memory() -> None:
    """Collect dropped models and caches, then give the allocator's cached GPU memory back, so the next phase
    (another engine's cache, another process on the same GPU) finds it free. A no-op without CUDA."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


__all__ = ["release_device_memory"]
