"""What every fixed-shape ("graphs") decode step shares: length buckets, the steps of one runner per view
length (captured as CUDA graphs, or run eagerly with the very same code), and the buffers a sampled step
reads. The decode loops themselves are `engine.batched_static`'s (any number of rows, one included).

Length buckets: a step attends over the first L positions of the caches only, L the smallest
multiple of LENGTH_BUCKET covering every position it can see (pos + 1 for the plain step,
pos + B for the speculative step's draft and verify), capped at the cache length. L is a Python
int baked into each graph, so there is one captured graph per (step, L); the host tracks the
position too (it reads the accepted length every step anyway) and replays the graph of the
current bucket. Without buckets every step attended over the whole preallocated cache under a
mask: cheap for a 1-query step, not for the B-query verify and the draft's block.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from torch import nn

from nemo_dflash.engine.compiled import compiled
from nemo_dflash.engine.graphs import CapturedStep, EagerStep, fused_elementwise
from nemo_dflash.engine.options import DEFAULT_OPTIONS, EngineOptions
from nemo_dflash.engine.sampling import SamplingParams, sampled_next_tokens, sampled_proposals, sampled_verify

logger = logging.getLogger(__name__)

LENGTH_BUCKET = 256  # cache lengths and attention views are rounded up to this (one graph per view length)
# Buckets (`EngineOptions.use_buckets`, on by default) against one graph per step over the whole cache, measured on
# an H200, SmolLM2 shape, 4,352-position cache (docs/performance.md): the speculative step 4.93 -> 3.19 ms at
# position 256, 2.98 + 0.71 ms at 2,048, equal at 4,096; benchmarks/decode.py speed --buckets times both.


def cache_length_for(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """Positions a generation can write (a verify writes B past the last token), rounded up."""
    need = prompt_len + max_new_tokens + block_size
    return -(-need // LENGTH_BUCKET) * LENGTH_BUCKET


def view_length(need: int, max_len: int, buckets: bool = True) -> int:
    """Attention view for a step that must see positions [0, need): rounded up to a bucket, capped (without
    `buckets`, `EngineOptions.use_buckets`: the whole cache)."""
    if not buckets:
        return max_len
    return min(-(-need // LENGTH_BUCKET) * LENGTH_BUCKET, max_len)


def view_lengths(max_len: int, buckets: bool = True) -> list[int]:
    """Every view length a runner of cache length `max_len` can pick."""
    if not buckets:
        return [max_len]
    return sorted({min(b, max_len) for b in range(LENGTH_BUCKET, max_len + LENGTH_BUCKET, LENGTH_BUCKET)})


def step_key(options: EngineOptions = DEFAULT_OPTIONS) -> tuple[int, EngineOptions]:
    """What a runner's captured steps depend on besides its cache length: the bucket (0 = no buckets) and the
    options they were made under. A cached runner made under another key is rebuilt."""
    return (LENGTH_BUCKET if options.use_buckets else 0, options)


class BucketedSteps:
    """One step (EagerStep or CapturedStep) per view length, made up front or on first use."""

    def __init__(self, make: Callable[[int], Any], max_len: int, name: str, use_graphs: bool,
                 buckets: bool = True, options: EngineOptions = DEFAULT_OPTIONS) -> None:
        self.make, self.max_len, self.name, self.use_graphs = make, max_len, name, use_graphs
        # False: one step over the whole cache (a step that reads only what it needs, or `use_buckets` off)
        self.buckets = buckets and options.use_buckets
        self.step_key = step_key(options)
        self.steps: dict[int, Any] = {}
        if options.capture_all_buckets:  # the eager path follows the same choice, so CPU tests cover both
            for n in view_lengths(max_len, self.buckets):
                self.steps[n] = make(n)

    def view(self, need: int) -> int:
        """The view length for a step that must see [0, need); a one-int host check that it does."""
        n = view_length(need, self.max_len) if self.buckets else self.max_len
        if not need <= n <= self.max_len:
            raise RuntimeError(f"{self.name}: attention view of {n} positions cannot hold the {need} it needs "
                               f"(cache length {self.max_len})")
        return n

    def get(self, n: int) -> Any:
        step = self.steps.get(n)
        if step is None:
            if self.use_graphs:
                logger.info("Capturing %s for view length %d (inside the decode loop)", self.name, n)
            step = self.steps[n] = self.make(n)
        return step


def make_step(fn: Callable[[], Any], device: torch.device, use_graphs: bool, *models: nn.Module,
              fuse: bool = True) -> Any:
    """`fn` as a step: captured as a CUDA graph (its models' elementwise work fused, `fuse`:
    `EngineOptions.fuse_elementwise`), or run eagerly."""
    if not use_graphs:
        return EagerStep(fn)
    if not fuse:
        return CapturedStep(fn, device)
    with fused_elementwise(*models):
        return CapturedStep(fn, device)


def fused_sampling_on(device: torch.device, options: EngineOptions = DEFAULT_OPTIONS) -> bool:
    """Whether a sampled step's math runs compiled on `device`: on a GPU, while `options.fuse_sampling` and
    `options.fuse_elementwise` hold."""
    return device.type == "cuda" and options.fuse_sampling and options.fuse_elementwise


class SampledStepState:
    """What a sampled captured step reads from buffers, set per generation: each row's noise key (drawn from
    the caller's generator), 1/T, top-p and top-k; and the step's sampling math, compiled on a GPU (`fused`; by
    default while `options.fuse_sampling` and `options.fuse_elementwise` hold).
    ``k_cap`` > 0: the steps rank only that many scores for the filters (`sampling.filter_scores`), so every call's
    top-k must be in [1, k_cap] (the runners are made per top-k); k_cap 0: no top-k, top-p alone, without a sort."""

    def __init__(self, rows: int, device: torch.device, fused: Optional[bool] = None, k_cap: int = 0,
                 options: EngineOptions = DEFAULT_OPTIONS) -> None:
        self.k_cap = int(k_cap)
        self.key = torch.zeros(rows, dtype=torch.long, device=device)
        self.inv_temp = torch.ones((), dtype=torch.float32, device=device)
        self.top_p = torch.ones((), dtype=torch.float32, device=device)
        self.top_k = torch.zeros((), dtype=torch.long, device=device)
        self.fused = fused_sampling_on(device, options) if fused is None else fused

    def configure(self, sampling: SamplingParams) -> None:
        """A call's setting into the buffers (each row's key is set as its prompt enters)."""
        if self.k_cap and not 0 < sampling.top_k <= self.k_cap:
            raise ValueError(f"a step made for top-k <= {self.k_cap} was given top_k={sampling.top_k}")
        if not self.k_cap and sampling.top_k:
            raise ValueError(f"a step made without top-k was given top_k={sampling.top_k}; make it with k_cap")
        self.inv_temp.fill_(1.0 / sampling.temperature)
        self.top_p.fill_(sampling.top_p)
        self.top_k.fill_(sampling.top_k)

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), compiled when fused (shapes are the runner's: R rows). A first call that fails to compile
        (before any capture: a step's warm-up calls come first) leaves this state unfused, with one warning."""
        if self.fused:
            try:
                return compiled(fn, dynamic=False)(*args)
            except Exception as e:  # noqa: BLE001 - any compiler failure: the same math, unfused
                logger.warning("sampling step %s did not compile, it runs unfused: %s", fn.__name__,
                               str(e).strip().splitlines()[0][:200])
                self.fused = False
        return fn(*args)

    def next_tokens(self, logits: torch.Tensor, filtered: bool, positions: torch.Tensor,
                    rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A plain step's tokens [R] for logits [R, V]: each row's keyed draw for its token at `positions` [R].
        Some rows only (`rows`: prompts entering, eagerly): unfused, as `proposals`."""
        if rows is not None:
            return sampled_next_tokens(logits, self.inv_temp, self.top_p, self.top_k, self.key[rows], positions,
                                       filtered, self.k_cap)
        return self._run(sampled_next_tokens, logits, self.inv_temp, self.top_p, self.top_k, self.key, positions,
                         filtered, self.k_cap)

    def proposals(self, logits: torch.Tensor, filtered: bool, rows: slice, first_pos: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, proposals) of `rows` for the draft's logits [r, K, V] (`sampling.sampled_proposals`). Some rows
        only (a prompt entering a row mid-run, eagerly): unfused, so that no new shape compiles inside the
        timed loop; the eager and the captured runs still draw alike, as both take this path."""
        args = (logits, self.inv_temp, self.top_p, self.top_k, self.key[rows], first_pos, filtered, self.k_cap)
        return self._run(sampled_proposals, *args) if rows == slice(None) else sampled_proposals(*args)

    def verify(self, logits: torch.Tensor, filtered: bool, q: torch.Tensor, proposals: torch.Tensor,
               first_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted [R], tokens [R, K + 1]) for the target's logits [R, K + 1, V] (`sampling.sampled_verify`)."""
        return self._run(sampled_verify, logits, self.inv_temp, self.top_p, self.top_k, q, proposals, self.key,
                         first_pos, filtered, self.k_cap)


__all__ = [
    "BucketedSteps",
    "LENGTH_BUCKET",
    "SampledStepState",
    "step_key",
    "cache_length_for",
    "fused_sampling_on",
    "make_step",
    "view_length",
    "view_lengths",
]
