"""Which SDPA kernels run attention whose shapes change call after call.

cuDNN's SDPA, which PyTorch picks first on Hopper, builds and caches an execution plan for every
new shape. Eager decoding changes the key length every step, and the slot engine's prefills
change (rows, tokens) every refill, so each of their calls can pay a plan build: on an H200,
Qwen3-8B-shape eager decoding of never-seen lengths ran at 55 ms per token against 26 ms once
the lengths had been seen (docs/performance.md), and a whole-set SmolLM2 regeneration spent 87 s
in prefills worth ~8 s of compute (docs/data.md). Flash and memory-efficient attention have no
per-shape cost. Captured CUDA graphs have fixed shapes and keep PyTorch's choice.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager

import torch

AVOID_CUDNN_ATTENTION = True  # benchmarks set False to time PyTorch's own choice


def eager_attention_backends(device: torch.device) -> ContextManager[Any]:
    """The SDPA backends for calls of ever-changing shapes on `device` (all but cuDNN on CUDA)."""
    if device.type != "cuda" or not AVOID_CUDNN_ATTENTION:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
