"""Decode modes and CUDA-graph capture of a fixed-shape step.

"eager": HF's forward with a DynamicCache, every kernel launched from Python. On a GPU a
small-batch decode step is then bound by kernel launches, not by the GPU (31 ms per token for
an 8B model whose weights read in ~3.4 ms), so its speedups differ from a serving engine's.
"graphs": a static KV cache and fixed shapes, each decode step captured once as a CUDA graph
(`torch.cuda.CUDAGraph`) and replayed, which is what vLLM/SGLang do for small batches.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import nn

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


# RMSNorm classes computing exactly `weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)` (HF's
# Llama-family norm and the draft's); others (e.g. Gemma's 1 + weight) are left alone.
_RMSNORM_CLASSES = {"RMSNorm", "LlamaRMSNorm", "Qwen3RMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"}
_compiled_rms_norm: Optional[Callable[..., torch.Tensor]] = None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


@contextmanager
def fused_rms_norms(*models: nn.Module) -> Iterator[int]:
    """While capturing: each RMSNorm of `models` runs as one compiled kernel instead of seven.

    Eager RMSNorm is 7 kernels; at batch 1 a captured 8B decode step is ~60 tiny kernels per
    layer, so the norms are over a third of the replay's kernel count. The patch is an instance
    attribute that is removed on exit: the recorded graph keeps the fused kernels, while eager
    code (the prefill) runs the models' own norms. Same arithmetic in fp32; the compiled
    reduction may round differently in the last bit.
    """
    global _compiled_rms_norm
    if _compiled_rms_norm is None:
        _compiled_rms_norm = torch.compile(_rms_norm, dynamic=False, fullgraph=True)
    fn = _compiled_rms_norm
    patched: list[nn.Module] = []
    # One compile per (shape, dtype): a target and its draft have ~6 norm shapes, more than
    # dynamo's default recompile limit (8) once a second model or dtype is captured.
    dynamo_cfg = torch._dynamo.config
    limit_key = "recompile_limit" if hasattr(dynamo_cfg, "recompile_limit") else "cache_size_limit"
    old_limit = getattr(dynamo_cfg, limit_key)
    setattr(dynamo_cfg, limit_key, max(old_limit, 256))
    try:
        for model in models:
            for m in model.modules():
                if type(m).__name__ not in _RMSNORM_CLASSES or not isinstance(getattr(m, "weight", None), torch.Tensor):
                    continue
                eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
                if not isinstance(eps, float):
                    continue
                m.forward = (lambda w, e: (lambda x: fn(x, w, e)))(m.weight, eps)  # type: ignore[method-assign]
                patched.append(m)
        yield len(patched)
    finally:
        setattr(dynamo_cfg, limit_key, old_limit)
        for m in patched:
            del m.forward


class EagerStep:
    """The same interface without capture: the static path run eagerly (CPU, tests)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def replay(self) -> Any:
        return self.fn()


__all__ = ["DECODE_MODES", "CapturedStep", "EagerStep", "check_decode_mode", "fused_rms_norms"]
