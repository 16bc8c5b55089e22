"""Decode modes and CUDA-graph capture of a fixed-shape step.

"eager": HF's forward with a DynamicCache, every kernel launched from Python. On a GPU a
small-batch decode step is then bound by kernel launches, not by the GPU (31 ms per token for
an 8B model whose weights read in ~3.4 ms), so its speedups differ from a serving engine's.
"graphs": a static KV cache and fixed shapes, each decode step captured once as a CUDA graph
(`torch.cuda.CUDAGraph`) and replayed, which is what vLLM/SGLang do for small batches.
"""

from __future__ import annotations

import gc
import logging
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Union

import torch
from torch import nn

from nemo_dflash.engine.compiled import compiled
from nemo_dflash.engine.attention import eager_attention_backends

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
        # torch no longer collects garbage before a capture (torch.compiler.config.force_cudagraph_gc). A runner
        # that was dropped holds its graphs in a reference cycle (its steps' closures point back at it), so a
        # cyclic collection that starts mid-capture would destroy those graphs inside this capture, which CUDA
        # refuses ("operation not permitted when stream is capturing (function reset)"): the capture fails.
        # The collector stays off until the capture ends; what it would have freed is freed after.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(self.graph):
                self.outputs = fn()
        finally:
            if collecting:
                gc.enable()

    def replay(self) -> Any:
        self.graph.replay()
        return self.outputs


# RMSNorm classes computing exactly `weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)` (HF's
# Llama-family norm and the draft's); others (e.g. Gemma's 1 + weight) are left alone.
_RMSNORM_CLASSES = {"RMSNorm", "LlamaRMSNorm", "Qwen3RMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"}
_SILU_CLASSES = {"SiLU", "SiLUActivation"}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's `apply_rotary_pos_emb` (rotate-half RoPE), cos/sin already unsqueezed."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rope_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The draft's `apply_rope`: x [B, heads, P, D], cos/sin [B, P, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def _same_rope(original: Callable[..., Any], ours: Callable[..., Any], *args: torch.Tensor) -> bool:
    """Check, on a small random case, that a model's RoPE function is the formula we fuse."""
    try:
        with torch.no_grad():
            want, got = original(*args), ours(*args)
        want = want if isinstance(want, (tuple, list)) else (want,)
        got = got if isinstance(got, (tuple, list)) else (got,)
        return all(torch.allclose(w, g, atol=1e-5, rtol=1e-5) for w, g in zip(want, got))
    except Exception:  # a different signature: not ours to fuse
        return False


@contextmanager
def fused_elementwise(*models: nn.Module) -> Iterator[dict[str, int]]:
    """While capturing: RMSNorms, RoPE and SiLU*up of `models` run as compiled (fused) kernels.

    At batch 1 a captured decode step of HF's eager code is ~60 tiny kernels per decoder layer
    (an RMSNorm alone is 7, RoPE of q and k 10), each costing ~2 us of replay even when it
    moves almost no data. Inductor fuses each of these pieces into one kernel. The patches are
    instance attributes (norms, MLPs) and module globals (the RoPE functions) set only for the
    duration: the recorded graph keeps the fused kernels, eager code (the prefill) runs the
    models' own code. A RoPE function is replaced only after a numeric check that it is the
    rotate-half formula. A module with a `fuse_for_capture(compile)` method (DFlash2's block
    convolution, ~35 tiny kernels a draft layer) swaps in its own compiled pieces the same way
    and returns their undo; `counts` then has its class name. Same arithmetic in fp32; a fused
    kernel may round the last bit differently from the eager chain of ops.
    """
    rms = compiled(_rms_norm, dynamic=False, fullgraph=True)
    silu_mul = compiled(_silu_mul, dynamic=False, fullgraph=True)

    def fuse_piece(fn: Callable[..., Any]) -> Callable[..., Any]:
        return compiled(fn, dynamic=False, fullgraph=True)

    undo: list[Callable[[], None]] = []
    counts = {"rms_norm": 0, "silu_mul": 0, "rope": 0}
    # One compile per (shape, dtype): a target and its draft have more norm shapes than dynamo's
    # default recompile limit (8) once a second model or dtype is captured.
    dynamo_cfg = torch._dynamo.config
    limit_key = "recompile_limit" if hasattr(dynamo_cfg, "recompile_limit") else "cache_size_limit"
    old_limit = getattr(dynamo_cfg, limit_key)
    setattr(dynamo_cfg, limit_key, max(old_limit, 256))
    try:
        seen_modules: set[str] = set()
        for model in models:
            for m in model.modules():
                name = type(m).__name__
                if name in _RMSNORM_CLASSES and isinstance(getattr(m, "weight", None), torch.Tensor):
                    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
                    if isinstance(eps, float):
                        m.forward = (lambda w, e: (lambda x: rms(x, w, e)))(m.weight, eps)  # type: ignore[method-assign]
                        undo.append(lambda m=m: delattr(m, "forward"))
                        counts["rms_norm"] += 1
                elif all(isinstance(getattr(m, a, None), nn.Linear) for a in ("gate_proj", "up_proj", "down_proj")) \
                        and type(getattr(m, "act_fn", None)).__name__ in _SILU_CLASSES:
                    m.forward = (lambda mm: (lambda x: mm.down_proj(silu_mul(mm.gate_proj(x), mm.up_proj(x)))))(m)  # type: ignore[method-assign]
                    undo.append(lambda m=m: delattr(m, "forward"))
                    counts["silu_mul"] += 1
                fuse = getattr(m, "fuse_for_capture", None)
                if callable(fuse):  # a module that offers compiled pieces of its own (DFlash2's block convolution)
                    undo.append(fuse(fuse_piece))
                    counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
                module_name = type(m).__module__
                if module_name in seen_modules:
                    continue
                seen_modules.add(module_name)
                module = sys.modules.get(module_name)
                undo.extend(_patch_rope(module, counts))
        yield counts
    finally:
        setattr(dynamo_cfg, limit_key, old_limit)
        for fn in reversed(undo):
            fn()


def _patch_rope(module: Any, counts: dict[str, int]) -> list[Callable[[], None]]:
    """Swap a modeling module's RoPE function for the fused one, if it computes the same."""
    undo: list[Callable[[], None]] = []
    if module is None:
        return undo
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 3, 8, generator=g)
    cos, sin = torch.randn(1, 3, 8, generator=g), torch.randn(1, 3, 8, generator=g)
    hf = getattr(module, "apply_rotary_pos_emb", None)
    if callable(hf) and _same_rope(hf, lambda q, k, c, s: _rope_qk(q, k, c.unsqueeze(1), s.unsqueeze(1)), q, k, cos, sin):
        fused = compiled(_rope_qk, dynamic=False, fullgraph=True)

        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            return fused(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))

        module.apply_rotary_pos_emb = apply_rotary_pos_emb
        undo.append(lambda: setattr(module, "apply_rotary_pos_emb", hf))
        counts["rope"] += 1
    ours = getattr(module, "apply_rope", None)
    if callable(ours) and _same_rope(ours, _rope_one, q, cos, sin):
        fused_one = compiled(_rope_one, dynamic=False, fullgraph=True)
        module.apply_rope = fused_one
        undo.append(lambda: setattr(module, "apply_rope", ours))
        counts["rope"] += 1
    return undo


class EagerStep:
    """The same interface without capture: the static path run eagerly (CPU, tests)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def replay(self) -> Any:
        return self.fn()


__all__ = [
    "DECODE_MODES",
    "CapturedStep",
    "EagerStep",
    "check_decode_mode",
    "eager_attention_backends",
    "fused_elementwise",
]
