"""Model FLOPs of a training step, for the MFU the trainer logs.

Counted as 2 FLOPs per multiply-add, the backward as twice the forward for the trained draft; the frozen
target runs forward only, up to its last captured layer; the shared lm_head runs forward and backward (the
draft's gradient flows through it). A step's FLOPs follow from a few counts the loss reduces with its other
sums (`objective.metrics.LossSums`: blocks, the keys their queries see, context tokens and causal pairs), so packed and
padded batches are counted alike: what their documents would cost one by one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from nemo_dflash.objective.metrics import LossSums


@dataclass(frozen=True)
class Shape:
    """The dimensions of a decoder stack that FLOPs depend on."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> "Shape":
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(hidden=int(config.hidden_size), intermediate=int(config.intermediate_size), heads=heads,
                   kv_heads=int(getattr(config, "num_key_value_heads", None) or heads), head_dim=int(head_dim),
                   vocab=int(config.vocab_size))

    @property
    def kv_params(self) -> int:
        """k and v projections of one layer."""
        return 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def layer_linear_params(self) -> int:
        """q, k, v, o and the gated MLP of one layer."""
        h = self.hidden
        return 2 * h * self.heads * self.head_dim + self.kv_params + 3 * h * self.intermediate


@dataclass(frozen=True)
class StepShapes:
    """What a run's step FLOPs depend on beside the batch: the target (the layers it runs), the draft."""

    target: Shape
    target_layers_run: int  # up to and including the last captured layer
    draft_layers: int
    context_layers: int  # target layers fused into the draft's context
    block: int

    def flops(self, sums: LossSums) -> dict[str, float]:
        """Model FLOPs of the step whose reduced sums are `sums`: target, draft (forward + backward), lm_head."""
        t, h = self.target, self.target.hidden
        target = self.target_layers_run * (2 * sums.context_tokens * t.layer_linear_params
                                           + 2 * 2 * t.heads * t.head_dim * sums.context_pairs)
        queries = sums.valid_blocks * self.block
        fc = 2 * sums.context_tokens * self.context_layers * h * h
        # the block's queries run every projection; k and v also run over the context they attend to
        per_layer = 2 * queries * (t.layer_linear_params - t.kv_params) + 2 * (sums.context_tokens + queries) * t.kv_params
        attn = 2 * 2 * t.heads * t.head_dim * sums.visible_keys
        draft_fwd = fc + self.draft_layers * (per_layer + attn)
        head_fwd = 2 * sums.num_labels * h * t.vocab
        return {"target": target, "draft": 3 * draft_fwd, "lm_head": 2 * head_fwd,
                "total": target + 3 * draft_fwd + 2 * head_fwd}


def matmul_tflops(device: torch.device, n: int = 8192, iters: int = 20) -> float:
    """The bf16 matmul rate this GPU sustains (TFLOP/s): the denominator of MFU, measured, not the datasheet's."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


__all__ = ["Shape", "StepShapes", "matmul_tflops"]
