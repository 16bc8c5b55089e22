"""Frozen-target wrapper: capture chosen decoder layers' outputs with forward hooks.

Hooks (rather than `output_hidden_states=True`) keep only the layers the draft fuses, and
let the forward stop right after the last captured layer when the target's logits are not
needed, which skips the remaining layers and the vocab projection on every training step.

Convention: the output of decoder layer i is HF's `output_hidden_states[i + 1]` (index 0 is
the embeddings). For the very last layer HF applies the final norm before reporting it; the
hook (like vLLM/SGLang) captures the raw layer output.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Attribute paths to the decoder-layer list, in the order we try them.
_LAYER_PATHS = (
    "model.layers",
    "layers",
    "model.language_model.layers",
    "language_model.model.layers",
    "language_model.layers",
    "transformer.h",
    "model.decoder.layers",
    "gpt_neox.layers",
)


@dataclass
class DFlashTargetBatch:
    """What the trainer module needs from one target forward.

    hidden_states: [B, S, n_layers * H], the captured layers concatenated along features.
    logits: [B, S, V] only when the target's distribution is requested (distillation).
    """

    hidden_states: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    logits: Optional[torch.Tensor] = None


class _StopForward(Exception):
    """Raised by the last capture hook to end the target's forward early."""


def _get_attr_path(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """Locate the decoder-layer list in the usual HF layouts."""
    for path in _LAYER_PATHS:
        layers = _get_attr_path(model, path)
        if isinstance(layers, (nn.ModuleList, list, tuple)) and len(layers) > 0:
            return layers  # type: ignore[return-value]
    raise ValueError(
        f"Could not find the decoder layers of {type(model).__name__}: tried {', '.join(_LAYER_PATHS)}. "
        "Add the attribute path to nemo_dflash.target._LAYER_PATHS."
    )


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default target layers to fuse: evenly from layer 1 to L-3 (the paper's choice).

    Qwen3-8B (L=36, n=5) -> [1, 9, 17, 25, 33]. For shallow targets where that formula
    would repeat or overflow ids, spread n distinct ids evenly over [0, L-1] instead.
    """
    L, n = int(num_target_layers), int(num_draft_layers)
    if L < 1 or n < 1:
        raise ValueError(f"num_target_layers ({L}) and num_draft_layers ({n}) must be >= 1")
    if n > L:
        raise ValueError(
            f"Cannot pick {n} distinct target layers from a {L}-layer target: "
            "use fewer draft layers or set `target_layer_ids` explicitly."
        )
    if n == 1:
        return [L // 2]
    if L > 4 and (L - 4) >= (n - 1):
        ids = [int(round(1 + i * (L - 4) / (n - 1))) for i in range(n)]
        if len(set(ids)) == n:
            return ids
    # Shallow target: spacing >= 1 over [0, L-1] with half-up rounding gives distinct ids.
    return [_round_half_up(i * (L - 1) / (n - 1)) for i in range(n)]


class LayerIdsError(ValueError):
    """Target layer ids that do not index the target's decoder layers (one line, the user's to fix)."""


def check_target_layer_ids(
    target_layer_ids: Optional[Sequence[int]], depth: Optional[int] = None, key: str = "target_layer_ids"
) -> list[int]:
    """The one check of the layers a draft fuses: non-empty, distinct, 0-based and, with ``depth``
    (the target's decoder layers), below it. Recipes (no target yet), the draft builder, the
    fit check and this wrapper all call it, so every path names the same problems."""
    ids = [int(i) for i in (target_layer_ids or [])]
    problems = []
    if not ids:
        problems.append("the list is empty")
    bad = [i for i in ids if i < 0 or (depth is not None and i >= depth)]
    if bad:
        problems.append(f"{bad} outside [0, {depth - 1}]" if depth is not None else f"{bad} negative")
    if len(set(ids)) != len(ids):
        problems.append("ids repeat")
    if problems:
        where = f" for a target with {depth} decoder layers" if depth is not None else ""
        default = f"build_target_layer_ids({depth}, num_draft_layers)" if depth is not None else "the default"
        raise LayerIdsError(
            f"Invalid {key} {ids}{where} ({'; '.join(problems)}): use distinct 0-based layer indices, "
            f"or leave them unset to use {default}."
        )
    return ids


class HFDFlashTargetModel:
    """Capture a set of decoder-layer hidden states from a frozen HF causal LM."""

    def __init__(self, model: nn.Module, target_layer_ids: Sequence[int]) -> None:
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.layers = find_decoder_layers(self.model)
        self.target_layer_ids = check_target_layer_ids(target_layer_ids, len(self.layers))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def config(self) -> Any:
        return self.model.config

    def compile_layers(self, **compile_kwargs: Any) -> None:
        """`torch.compile` the forward of each decoder layer up to the last captured one.

        A small target's eager forward is bound by Python and kernel launches (tens of small
        ops per layer). Only `layer.forward` is compiled, so the capture hooks (and the early
        stop they raise) still run eagerly around it in `nn.Module.__call__`.
        """
        for layer in list(self.layers)[: max(self.target_layer_ids) + 1]:
            layer.forward = torch.compile(layer.forward, **compile_kwargs)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        head = self.model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(self.model).__name__} has no lm_head; DFlash needs a causal-LM target.")
        return head

    @contextmanager
    def capture(self, stop_early: bool) -> Iterator[dict[int, torch.Tensor]]:
        """Hook the chosen layers for one forward; hooks are removed even if it raises."""
        captured: dict[int, torch.Tensor] = {}
        last = max(self.target_layer_ids)
        handles = []

        def make_hook(idx: int):
            def hook(_module, _args, output):
                captured[idx] = output[0] if isinstance(output, (tuple, list)) else output
                if stop_early and idx == last:
                    raise _StopForward

            return hook

        try:
            for idx in self.target_layer_ids:
                handles.append(self.layers[idx].register_forward_hook(make_hook(idx)))
            yield captured
        finally:
            for h in handles:
                h.remove()

    def concat(self, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        missing = [i for i in self.target_layer_ids if i not in captured]
        if missing:
            raise RuntimeError(f"Target forward did not reach layers {missing}")
        return torch.cat([captured[i] for i in self.target_layer_ids], dim=-1)

    @torch.no_grad()
    def forward_features(
        self, input_ids: torch.Tensor, need_logits: bool = False, **model_kwargs: Any
    ) -> tuple[torch.Tensor, Any]:
        """Run the target; return (concatenated features [B, S, n*H], model output or None).

        Without `need_logits` the forward stops after the last captured layer (no output).
        `model_kwargs` go to the model (attention_mask, past_key_values, position_ids...).
        """
        outputs = None
        with self.capture(stop_early=not need_logits) as captured:
            try:
                outputs = self.model(input_ids=input_ids, use_cache=model_kwargs.pop("use_cache", False), **model_kwargs)
            except _StopForward:
                pass
        return self.concat(captured), outputs

    @torch.no_grad()
    def generate_batch(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        return_logits: bool = False,
        right_padded: bool = False,
    ) -> DFlashTargetBatch:
        """Run the frozen target and package the context features for the trainer module.

        `right_padded=True` (the caller checked that every row's padding is at its end) runs the
        target causally without the padding mask: no real position can see a later padded one,
        so the features at real positions are the same, and HF's mask builder is skipped
        along with its host sync (`mask.all()` on the GPU) and the masked attention kernel.
        Padded positions get different features, which the draft never uses (masked keys, no labels).
        """
        hidden, outputs = self.forward_features(
            input_ids, need_logits=return_logits, attention_mask=None if right_padded else attention_mask
        )
        return DFlashTargetBatch(
            hidden_states=hidden,
            input_ids=input_ids,
            attention_mask=attention_mask,
            loss_mask=loss_mask,
            logits=outputs.logits if return_logits else None,
        )


__all__ = ["DFlashTargetBatch", "HFDFlashTargetModel", "LayerIdsError", "build_target_layer_ids", "check_target_layer_ids",
           "find_decoder_layers"]
