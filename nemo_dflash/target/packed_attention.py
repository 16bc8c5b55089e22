"""The frozen target's attention over packed rows as one flash varlen call (`target.packed_attention: varlen`).

A packed row holds whole documents back to back; each must attend only to itself, causally. The flex path
(`HFDFlashTargetModel.use_flex_attention`) expresses that as a document-causal BlockMask. This one cuts the
rows into their documents instead (cumulative lengths over the flattened rows, `document_spans`) and runs
PyTorch's flash varlen kernel over them (`attention.varlen_attention`; off CUDA, its per-document
SDPA reference): no mask, no tile of another document read. The target is frozen, so only its forward runs.

The attention function is registered with transformers under `ATTN_NAME` and reads the spans from the
forward's `doc_spans` keyword, which the model hands to every attention call; transformers builds no mask for
an attention it has no mask function for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from nemo_dflash.engine.attention import varlen_attention

ATTN_NAME = "nemo_packed_documents"  # no "flash" in it: transformers would look for a flash kernel


@dataclass
class DocumentSpans:
    """Where each document of the flattened packed rows starts and ends."""

    cu: torch.Tensor  # int32 [documents + 1]: cumulative lengths over the B x S flattened tokens
    max_len: int  # an upper bound of a document's length (the row length: one value, so nothing recompiles)


def document_spans(doc_ids: torch.Tensor) -> DocumentSpans:
    """[B, S] document ids (padding -1 is a document of its own) -> the spans of the flattened rows. A document
    starts where the id changes or a row starts; one host sync (the number of documents)."""
    bsz, seq = doc_ids.shape
    flat = doc_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::seq] = True  # a row's first token starts a document even when the last row ended with the same id
    idx = torch.nonzero(starts).flatten()
    cu = torch.cat([idx, idx.new_tensor([flat.numel()])]).to(torch.int32)
    return DocumentSpans(cu=cu, max_len=seq)


def document_varlen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    doc_spans: Optional[DocumentSpans] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: q [B, H, S, D], k/v [B, KVH, S, D] -> ([B, S, H, D], None), each
    document of the packed rows attending causally over itself alone."""
    if doc_spans is None:
        raise RuntimeError(f"attention '{ATTN_NAME}' needs the packed rows' doc_spans (HFDFlashTargetModel.generate_batch)")
    bsz, heads, seq, dim = query.shape
    q = query.transpose(1, 2).reshape(bsz * seq, heads, dim)
    k = key.transpose(1, 2).reshape(bsz * seq, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(bsz * seq, value.shape[1], dim)
    out = varlen_attention(q, k, v, doc_spans.cu, doc_spans.cu, doc_spans.max_len, doc_spans.max_len, scaling)
    return out.view(bsz, seq, heads, dim), None


def register_document_varlen_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, document_varlen_attention)


__all__ = ["ATTN_NAME", "DocumentSpans", "document_spans", "document_varlen_attention",
           "register_document_varlen_attention"]
