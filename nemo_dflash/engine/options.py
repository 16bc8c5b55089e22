"""The engine's speed settings, as one value that travels with each runner and decoder call.

None of them changes an answer (each is tested against the setting off); they change which kernels run and what
is captured. A runner's captured steps are made under one `EngineOptions`, so the options are part of the key the
runners are cached by (`batched_static._runner`): two calls with different options never share captured graphs.
The defaults are what every command runs; benchmarks build other options to time one setting against another.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs a decode, answers unchanged.

    - ``fold_gqa``: the target's SDPA attention with grouped-query heads folded into their K/V head's query rows
      (`static_cache.folded_gqa_sdpa`), not HF's copy of every K/V head per query head. On an H200, SmolLM2 shape,
      768-position view: the captured plain step 4.3 ms instead of 20.7 at 256 rows (docs/performance.md).
    - ``use_buckets``: each captured step attends over the smallest multiple of `static_decode.LENGTH_BUCKET`
      covering its positions (one graph per step and view length); False: one graph over the whole cache.
    - ``capture_all_buckets``: a runner captures every view length's graph when it is made, before any clock
      starts; False: each on first use, inside the decode loop.
    - ``fuse_elementwise``: captured steps fuse RMSNorm, RoPE and SiLU*up (`graphs.fused_elementwise`).
    - ``fuse_sampling``: on a GPU, with ``fuse_elementwise``, a sampled step's softmaxes, keyed hashes and draws run
      compiled (`sampling.sampled_*`), eager and captured steps alike.
    - ``avoid_cudnn_attention``: the eager forwards (prefills, first draft blocks, the eager loops) run SDPA without
      cuDNN, whose per-shape plan builds they would pay (`nemo_dflash.engine.attention.eager_attention_backends`).
    - ``filled_blocks``: the captured target steps attend with flex over each row's filled KV blocks only
      (`static_cache.FilledBlocks`); False: SDPA over the bucketed view; None: on a GPU, for a target whose head
      dimension compiled flex takes (`static_cache.filled_blocks_on`).
    """

    fold_gqa: bool = True
    use_buckets: bool = True
    capture_all_buckets: bool = True
    fuse_elementwise: bool = True
    fuse_sampling: bool = True
    avoid_cudnn_attention: bool = True
    filled_blocks: Optional[bool] = None

    def but(self, **changes: Any) -> "EngineOptions":
        """These options with `changes` (`dataclasses.replace`)."""
        return replace(self, **changes)


DEFAULT_OPTIONS = EngineOptions()

__all__ = ["DEFAULT_OPTIONS", "EngineOptions"]
