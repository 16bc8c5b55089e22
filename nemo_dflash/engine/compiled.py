"""The package's one cache of `torch.compile`d functions.

`torch.compile(fn)` returns a new wrapper each call, and each wrapper warms up (traces, compiles,
autotunes) on its own first calls; a module that compiled a function on every use would pay that
again and again. Every module that compiles a plain function asks here, so each (function, options)
pair is compiled once per process. Bound methods and modules compiled for one object (a slot
engine's step, a target's layers) stay with that object.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

_CACHE: dict[tuple[Callable[..., Any], tuple[tuple[str, Any], ...]], Callable[..., Any]] = {}


def compiled(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """`torch.compile(fn, **options)`, made once per process for each function and options."""
    key = (fn, tuple(sorted(options.items())))
    if key not in _CACHE:
        _CACHE[key] = torch.compile(fn, **options)
    return _CACHE[key]


__all__ = ["compiled"]
