"""The serving engines' known limits, checked on a draft's exported config before anything is written.

A draft that breaks one of these either fails to load in the engine or, worse, loads and serves at
tau ~1 with no error. Each finding is one line that names the fix; `check_engine_limits` raises the
ones that break every engine (or the engine the user named) and returns the others as warnings.

Sources (docs/serve.md, "Pitfalls"): SGLang captures target layers up to N-2 only; ModelOpt's
DFlash notes list head_dim 160 and M-RoPE as unsupported by vLLM; the engines' attention kernels take
head dims that are multiples of 8 up to 256; their RoPE factory knows a fixed set of scaling types.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional

logger = logging.getLogger(__name__)

ENGINES = ("vllm", "sglang")

# RoPE scaling types both engines' `get_rope` build for a 1-D (text) rotary embedding.
ENGINE_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "yarn", "llama3", "longrope"})
# Head dims ModelOpt documents as rejected by vLLM's DFlash path.
VLLM_REJECTED_HEAD_DIMS = frozenset({160})
MAX_HEAD_DIM = 256


class EngineLimitError(ValueError):
    """A draft that an engine the user serves with would refuse or serve wrongly."""


@dataclass(frozen=True)
class Finding:
    engines: tuple[str, ...]  # the engines it breaks
    message: str              # one line, names the fix


def engine_findings(cfg: Mapping[str, Any], vocab: Optional[int] = None) -> list[Finding]:
    """Every known engine limit that the exported ``cfg`` (config.json dict) breaks.

    ``vocab``: rows of the target's embedding table when known (else the config's ``vocab_size``).
    """
    out: list[Finding] = []
    dflash = cfg.get("dflash_config") or {}
    n_target = int(cfg.get("num_target_layers") or 0)
    ids = [int(i) for i in dflash.get("target_layer_ids") or []]
    if n_target and ids and max(ids) > n_target - 2:
        out.append(Finding(("sglang",), (
            f"target_layer_ids {ids} go above N-2 = {n_target - 2} of a {n_target}-layer target, which SGLang cannot "
            f"capture: serve with vLLM, or retrain with draft.target_layer_ids at most {n_target - 2} "
            f"(the default build_target_layer_ids stops at N-3)")))
    rows = int(vocab if vocab is not None else cfg.get("vocab_size") or 0)
    mask = dflash.get("mask_token_id")
    if mask is not None and rows and not 0 <= int(mask) < rows:
        out.append(Finding(ENGINES, (
            f"mask_token_id {mask} is not a row of the target's embedding table [0, {rows}): the engines embed it "
            "with the target's table; set draft.mask_token_id to a reserved/unused row and retrain")))
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    if head_dim in VLLM_REJECTED_HEAD_DIMS:
        out.append(Finding(("vllm",), (
            f"head_dim {head_dim} is rejected by vLLM's DFlash draft attention: serve this draft with SGLang "
            "(the draft takes the target's head_dim)")))
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        out.append(Finding(ENGINES, (
            f"head_dim {head_dim} is not a multiple of 8 up to {MAX_HEAD_DIM}, which the engines' attention kernels "
            "need: retrain the draft with a supported head_dim")))
    rope = dict(cfg.get("rope_scaling") or {})
    rope_type = str(rope.get("rope_type", rope.get("type", "default")))
    if any(k.startswith("mrope") for k in rope) or rope_type == "mrope":
        out.append(Finding(ENGINES, (
            "the RoPE is M-RoPE (mrope_section), which makes the engines expect 3-D positions for a text-only "
            "draft: drop mrope_section/mrope_interleaved (text positions make it plain RoPE) and re-export")))
    elif rope_type not in ENGINE_ROPE_TYPES:
        out.append(Finding(ENGINES, (
            f"rope type {rope_type!r} is not one the engines' RoPE factory builds ({sorted(ENGINE_ROPE_TYPES)}): "
            "the draft would serve with another rotation; train against a target with a supported RoPE")))
    if "DFlash2DraftModel" in (cfg.get("architectures") or []):
        out.extend(_dflash2_findings(cfg, dflash, rows))
    factor = float(cfg.get("partial_rotary_factor", 1.0))
    if factor != 1.0 and int(head_dim * factor) % 2:
        out.append(Finding(ENGINES, (
            f"partial_rotary_factor {factor} of head_dim {head_dim} rotates an odd number of dims: "
            "no engine can pair them; check the target's config")))
    return out


def _dflash2_findings(cfg: Mapping[str, Any], dflash: Mapping[str, Any], rows: int) -> list[Finding]:
    """DFlash2's fields as the engines' loaders read them: each pair set together (SGLang takes an absent field
    as 0, which turns the module off while its weights are still there), the group size dividing the hidden size,
    and top-K no larger than the vocabulary."""
    out = []
    conv = [dflash.get("conv_kernel_size"), dflash.get("conv_group_size")]
    sel = [dflash.get("selector_rank"), dflash.get("selector_top_k")]
    for name, pair in (("conv_kernel_size / conv_group_size", conv), ("selector_rank / selector_top_k", sel)):
        if any(v is None for v in pair):
            out.append(Finding(ENGINES, (f"dflash_config sets only part of {name}: write both (re-export with "
                                         "`python -m nemo_dflash.recipes.export`)")))
    hidden = int(cfg.get("hidden_size") or 0)
    if conv[0] and conv[1] and hidden % int(conv[1]):
        out.append(Finding(ENGINES, (f"conv_group_size {conv[1]} does not divide hidden_size {hidden}: retrain with "
                                     "draft.dflash2.conv_group_size dividing it")))
    if sel[1] and rows and int(sel[1]) > rows:
        out.append(Finding(ENGINES, (f"selector_top_k {sel[1]} is above the vocabulary ({rows}): retrain with "
                                     "draft.dflash2.selector_top_k <= the vocabulary")))
    return out


def check_engine_limits(cfg: Mapping[str, Any], engine: str = "any", vocab: Optional[int] = None,
                        warn: bool = True) -> list[str]:
    """Raise (one line each) what breaks every engine, or the named ``engine``; return the rest
    (logged as warnings with ``warn``)."""
    if engine not in ("any", *ENGINES):
        raise EngineLimitError(f"unknown engine {engine!r}: use one of any, {', '.join(ENGINES)}")
    findings = engine_findings(cfg, vocab)
    wanted = set(ENGINES) if engine == "any" else {engine}
    fatal = [f.message for f in findings if wanted <= set(f.engines)]
    if fatal:
        raise EngineLimitError("; ".join(fatal))
    warnings = [f"{'/'.join(f.engines)}: {f.message}" for f in findings]
    for w in warnings if warn else ():
        logger.warning("%s", w)
    return warnings


__all__ = ["ENGINES", "EngineLimitError", "Finding", "check_engine_limits", "engine_findings"]
