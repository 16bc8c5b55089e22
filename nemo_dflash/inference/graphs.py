"""Decode modes and CUDA-graph capture of a fixed-shape step.

"eager": HF's forward with a DynamicCache, every kernel launched from Python. On a GPU a
small-batch decode step is then bound by kernel launches, not by the GPU (31 ms per token for
an 8B model whose weights read in ~3.4 ms), so its speedups differ from a serving engine's.
"graphs": a static KV cache and fixed shapes, each decode step captured once as a CUDA graph
(`torch.cuda.CUDAGraph`) and replayed, which is what vLLM/SGLang do for small batches.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Union

import torch

logger = logging.getLogger(__name__)

DECODE_MODES = ("eager", "graphs")


def check_decode_mode(decode: str, device: Union[str, torch.device, None]) -> None:
    """Raise a one-line ValueError naming the fix if `decode` cannot run on `device`.

    Cheap: meant to run before any model is loaded.
    """
    if decode not in DECODE_MODES:
        raise ValueError(f"Unknown decode mode {decode!r}: use one of {', '.join(DECODE_MODES)}.")
    if decode == "graphs":
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type != "cuda":
            raise ValueError(
                f"decode='graphs' needs a CUDA device (CUDA graphs), got {dev.type!r}: use decode='eager' "
                "(--decode eager), or run on a GPU."
            )
        if not torch.cuda.is_available():
            raise ValueError("decode='graphs' needs CUDA but torch sees no GPU: use decode='eager' (--decode eager).")


class CapturedStep:
    """A zero-argument step captured as one CUDA graph.

    `fn` must read and write only tensors whose addresses stay fixed (static buffers, caches,
    parameters) and must not sync with the host. It is run `warmup` times on a side stream
    (kernel selection, lazy allocations), then captured; `replay()` re-runs the recorded kernels
    and returns what `fn` returned at capture, whose memory the replay overwrites.
    """

    def __init__(self, fn: Callable[[], Any], device: torch.device, warmup: int = 2) -> None:
        self.fn = fn
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fn()

    def replay(self) -> Any:
        self.graph.replay()
        return self.outputs


class EagerStep:
    """The same interface without capture: the static path run eagerly (CPU, tests)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def replay(self) -> Any:
        return self.fn()


__all__ = ["DECODE_MODES", "CapturedStep", "EagerStep", "check_decode_mode"]
