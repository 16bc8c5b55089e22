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

from nemo_dflash.target.packed_attention import (
    ATTN_NAME as _VARLEN_ATTN, document_spans, register_document_varlen_attention,
)

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
    logits: [B, S, V] only when the target's distribution is requested that way.
    final_hidden: [B, S, H] the target's last hidden state after its final norm (distillation:
    the loss forms the logits from it chunk by chunk, never [B, S, V] at once).
    position_ids / doc_ids: [B, S] for packed rows (positions restart per document; document
    index per token, -1 on padding); None for ordinary right-padded rows.
    """

    hidden_states: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    logits: Optional[torch.Tensor] = None
    final_hidden: Optional[torch.Tensor] = None
    position_ids: Optional[torch.Tensor] = None
    doc_ids: Optional[torch.Tensor] = None


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


_FINAL_NORM_PATHS = ("model.norm", "model.language_model.norm", "language_model.model.norm", "transformer.ln_f",
                     "model.decoder.final_layer_norm", "gpt_neox.final_layer_norm")


def dense_document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] document ids -> bool [B, 1, S, S]: query q sees key k iff k <= q in the same document.

    Padding (-1) forms its own "document", so no row is empty (no NaN) and no real token sees it.
    """
    seq = doc_ids.shape[1]
    pos = torch.arange(seq, device=doc_ids.device)
    causal = pos.view(-1, 1) >= pos.view(1, -1)
    return ((doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1)) & causal).unsqueeze(1)


class _DocMaskBuffers:
    """The document ids a flex mask_mod reads, at one address per shape (see objective.block_mask._MaskBuffers)."""

    def __init__(self, bsz: int, seq: int, device: torch.device) -> None:
        self.doc = torch.zeros(bsz, seq, dtype=torch.long, device=device)
        doc = self.doc

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (doc[b, q_idx] == doc[b, kv_idx])

        self.mask_mod = mask_mod


_doc_buffers: dict[tuple, _DocMaskBuffers] = {}


def flex_document_causal_mask(doc_ids: torch.Tensor):
    """The same mask as `dense_document_causal_mask`, as a flex_attention BlockMask (GPU)."""
    from torch.nn.attention.flex_attention import create_block_mask

    bsz, seq = doc_ids.shape
    key = (bsz, seq, str(doc_ids.device))
    buf = _doc_buffers.get(key)
    if buf is None:
        if len(_doc_buffers) > 8:
            _doc_buffers.clear()
        buf = _doc_buffers[key] = _DocMaskBuffers(bsz, seq, doc_ids.device)
    buf.doc.copy_(doc_ids)
    # packed rows have one shape: the compiled builder compiles once, and never materialises [S, S]
    return create_block_mask(buf.mask_mod, B=bsz, H=None, Q_LEN=seq, KV_LEN=seq, device=doc_ids.device,
                             _compile=doc_ids.device.type == "cuda")


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

    def final_norm(self) -> Optional[nn.Module]:
        """The module whose output is the last hidden state the lm_head reads (None if not found)."""
        for path in _FINAL_NORM_PATHS:
            mod = _get_attr_path(self.model, path)
            if isinstance(mod, nn.Module):
                return mod
        return None

    def _set_attn_implementation(self, name: str) -> None:
        setter = getattr(self.model, "set_attn_implementation", None)
        if callable(setter):
            setter(name)
        else:  # pragma: no cover - older transformers
            self.model.config._attn_implementation = name

    def use_flex_attention(self) -> None:
        """Run the target's attention through flex_attention (GPU, packed rows): the document mask
        is then a BlockMask, and fully invisible 128x128 tiles (other documents) are skipped."""
        self._set_attn_implementation("flex_attention")

    def use_varlen_attention(self) -> None:
        """Run the target's attention over packed rows as one flash varlen call over their documents
        (`target.packed_attention: varlen`; the module `target.packed_attention` says why): no mask at all."""
        register_document_varlen_attention()
        self._set_attn_implementation(_VARLEN_ATTN)

    def document_mask(self, doc_ids: torch.Tensor):
        """The document-causal mask for packed rows, in the form the target's attention takes:
        a flex BlockMask for `flex_attention`, none for the varlen attention (it reads the documents'
        spans instead), a dense [B, 1, S, S] boolean mask otherwise."""
        impl = getattr(self.model.config, "_attn_implementation", None)
        if impl == _VARLEN_ATTN:
            return None
        if impl == "flex_attention":
            return flex_document_causal_mask(doc_ids)
        return dense_document_causal_mask(doc_ids)

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
        position_ids: Optional[torch.Tensor] = None,
        doc_ids: Optional[torch.Tensor] = None,
        return_final_hidden: bool = False,
    ) -> DFlashTargetBatch:
        """Run the frozen target and package the context features for the trainer module.

        `right_padded=True` (the caller checked that every row's padding is at its end) runs the
        target causally without the padding mask: no real position can see a later padded one,
        so the features at real positions are the same, and HF's mask builder is skipped
        along with its host sync (`mask.all()` on the GPU) and the masked attention kernel.
        Padded positions get different features, which the draft never uses (masked keys, no labels).

        Packed rows (`doc_ids`, `position_ids`): each document attends only to itself, causally
        (`document_mask`), with positions restarting per document, so its features equal those
        of the document run alone.

        `return_final_hidden` captures the target's final norm output (the lm_head's input) and
        stops there: distillation forms the teacher's logits from it chunk by chunk.
        """
        mask: Any = None if right_padded else attention_mask
        kwargs: dict[str, Any] = {}
        if doc_ids is not None:
            mask = self.document_mask(doc_ids)
            if getattr(self.model.config, "_attn_implementation", None) == _VARLEN_ATTN:
                kwargs["doc_spans"] = document_spans(doc_ids)
        kwargs["attention_mask"] = mask
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        norm = self.final_norm() if return_final_hidden and not return_logits else None
        final: dict[str, torch.Tensor] = {}
        handle = None
        if norm is not None:
            def hook(_module, _args, output):
                final["h"] = output[0] if isinstance(output, (tuple, list)) else output
                raise _StopForward

            handle = norm.register_forward_hook(hook)
        try:
            need_all = return_logits or (return_final_hidden and norm is None)
            if norm is not None:
                with self.capture(stop_early=False) as captured:
                    try:
                        self.model(input_ids=input_ids, use_cache=False, **kwargs)
                    except _StopForward:
                        pass
                hidden, outputs = self.concat(captured), None
            else:
                hidden, outputs = self.forward_features(input_ids, need_logits=need_all, **kwargs)
        finally:
            if handle is not None:
                handle.remove()
        logits = outputs.logits if (outputs is not None and need_all) else None
        return DFlashTargetBatch(
            hidden_states=hidden,
            input_ids=input_ids,
            attention_mask=attention_mask,
            loss_mask=loss_mask,
            logits=logits if return_logits or norm is None and return_final_hidden else None,
            final_hidden=final.get("h"),
            position_ids=position_ids,
            doc_ids=doc_ids,
        )


__all__ = ["DFlashTargetBatch", "HFDFlashTargetModel", "dense_document_causal_mask", "flex_document_causal_mask", "LayerIdsError", "build_target_layer_ids", "check_target_layer_ids",
           "find_decoder_layers"]
