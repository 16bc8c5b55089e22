"""Block-parallel speculative decoding with a DFlash draft, one prompt at a time.

Each step the draft fills a whole block `[last token, MASK x (B-1)]` in ONE forward
(conditioned on the target's features of the verified context), the target verifies all B
tokens in ONE forward, and the longest agreeing prefix plus the target's own next token is
kept. At temperature 0 the output is, token for token, the target's greedy decoding; at
T > 0 standard speculative sampling keeps the output distributed exactly as the target's.

Cache bookkeeping (the part that is easy to get wrong):
- the target's DynamicCache is cropped back to the verified tokens after every verify, so
  the rejected draft tokens leave no trace;
- the draft's `DFlashContextCache` only ever receives the target features of *verified*
  tokens (the block K/V are never stored), so it needs no rollback;
- targets with recurrent state (Qwen3.5 / Qwen3-Next Gated-DeltaNet, Mamba hybrids) get the
  cache transformers builds for them (`DynamicCache(config=...)`), and their conv / recurrent
  states are snapshotted before each verify and re-advanced over the kept tokens after a
  partial acceptance (`recurrent_cache` says why this rollback).

Two decode modes (`decode=`): "eager" is this module's loop on HF's DynamicCache, the readable reference
every other loop is tested against; "graphs" is the engine's fixed-shape loop (`batched_static`, static
caches, CUDA graphs) with one row, what serving engines run.
The eager loop keeps its per-step host work small: the feature hooks stay registered for the
whole generation, the verify mask is built directly (not by HF's mask utilities), and at T=0
a step reads the device once (accepted length and tokens in one copy).
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Iterable, Optional

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from nemo_dflash.draft.model import DFlashContextCache, DFlashDraftModel
from nemo_dflash.engine import graphs
from nemo_dflash.engine.acceptance import greedy_accepted
from nemo_dflash.engine import recurrent_cache
from nemo_dflash.engine.graphs import check_decode_mode
from nemo_dflash.engine.options import DEFAULT_OPTIONS, EngineOptions
from nemo_dflash.engine.output import DEFAULT_MAX_NEW_TOKENS, GenerationOutput, TokenIds, stop_set, sync, truncate
from nemo_dflash.engine.static_cache import SUPPORTED_ATTN, attn_implementation, causal_mask
from nemo_dflash.engine.batched_static import (
    batched_static_autoregressive_generate, batched_static_speculative_generate,
)
from nemo_dflash.engine.sampling import (
    GREEDY, SamplingParams, propose_tokens, select_tokens, verify_block,
)
from nemo_dflash.target import HFDFlashTargetModel

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- helpers


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _as_input_ids(input_ids: TokenIds, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"Speculative decoding runs one prompt at a time; got a batch of {ids.shape[0]}.")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty 1-D token list or a [1, S] tensor, got shape {tuple(ids.shape)}")
    return ids.unsqueeze(0)


def _accepts_kwarg(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def _crop_takes_tokens_to_remove(cache: DynamicCache) -> bool:
    params = list(inspect.signature(cache.crop).parameters)
    return bool(params) and params[0] == "tokens_to_remove"


def crop_dynamic_cache(cache: DynamicCache, length: int) -> None:
    """Crop a DynamicCache to its first `length` positions.

    Plain DynamicLayers are sliced directly (a view per layer: this runs every decoding step,
    and the per-layer `crop` goes through a deprecation wrapper). Otherwise the cache's own
    `crop`: transformers >= 5 takes the number of tokens to *remove* (a negative int), older
    versions took the length to keep.
    """
    current = cache.get_seq_length()
    if length >= current:
        return
    layers = getattr(cache, "layers", None)
    if layers and all(type(layer) is DynamicLayer for layer in layers):
        for layer in layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]
    elif _crop_takes_tokens_to_remove(cache):
        cache.crop(length - current)
    else:  # pragma: no cover - transformers 4.x
        cache.crop(length)
    if cache.get_seq_length() != length:  # pragma: no cover
        raise RuntimeError(f"DynamicCache crop left {cache.get_seq_length()} positions, expected {length}")


def _new_cache(model: nn.Module, recurrent: bool) -> DynamicCache:
    """The target's cache: the one transformers builds for it where it has recurrent layers (a
    bare DynamicCache has no conv / recurrent state); a plain DynamicCache otherwise, whose
    cropping the decoder relies on (sliding layers of a config-built cache refuse to crop past
    their window)."""
    return recurrent_cache.make_target_cache(model) if recurrent else DynamicCache()


def _refuse_static_for_recurrent(decode: str, model: nn.Module, recurrent: Optional[bool] = None) -> None:
    """decode='graphs' runs on StaticCache with crop-only rollback: refuse recurrent targets in one line."""
    if decode != "graphs":
        return
    if recurrent is None:
        recurrent = recurrent_cache.model_has_recurrent_layers(model)
    if recurrent:
        raise ValueError(
            f"decode='graphs' cannot roll back the recurrent (linear-attention) state of {type(model).__name__}; "
            "use decode='eager'."
        )


def _decode_inputs(input_ids: TokenIds, stop_token_ids: Optional[Iterable[int]], max_new_tokens: int, decode: str,
                   model: nn.Module, recurrent: bool, device: torch.device) -> tuple[torch.Tensor, set[int]]:
    """What the speculative and the plain decoder refuse before any forward (no token budget, a decode mode this
    model or device cannot run, a malformed prompt), so both refuse alike; then the prompt [1, S] on `device` and
    the stop ids as a set."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    _refuse_static_for_recurrent(decode, model, recurrent)
    check_decode_mode(decode, device)
    return _as_input_ids(input_ids, device), stop_set(stop_token_ids)


# ----------------------------------------------------------------------------- decoders


class DFlashSpeculativeDecoder:
    """Speculative decoding of one prompt with a frozen HF target and a DFlash draft.

    `block_size` may be smaller than the draft was trained with (a block-16 draft works at
    8); the block includes the last verified token, so B - 1 tokens are drafted per step.
    The "graphs" mode's captured steps are kept on the decoder and reused across prompts.
    """

    def __init__(self, target_model: nn.Module, draft: DFlashDraftModel, block_size: Optional[int] = None) -> None:
        from nemo_dflash.draft.build import check_draft_fits_target

        check_draft_fits_target(draft.config, target_model.config)
        self.target = HFDFlashTargetModel(target_model, draft.target_layer_ids)
        self.draft = draft  # no dropout in the draft: its train/eval mode does not matter here
        self.block_size = int(block_size or draft.config.block_size)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.block_size > draft.config.block_size:
            logger.warning(
                "Decoding with block_size %d > the draft's trained block_size %d: acceptance past slot %d is "
                "untrained.", self.block_size, draft.config.block_size, draft.config.block_size - 1,
            )
        self.mask_token_id = int(draft.config.mask_token_id)
        self.embed_tokens = self.target.get_input_embeddings()
        self.lm_head = self.target.get_output_embeddings()
        self._prefill_kwargs = {"logits_to_keep": 1} if _accepts_kwarg(target_model, "logits_to_keep") else {}
        self._recurrent = recurrent_cache.model_has_recurrent_layers(target_model)
        # Our direct verify mask is plain causal: targets with recurrent, sliding or chunked layers
        # need HF's per-layer-type masks (a full causal mask past the window changes the output).
        self._hf_masks = self._recurrent or recurrent_cache.has_windowed_layers(target_model)

    @property
    def device(self) -> torch.device:
        return _device_of(self.target.model)

    def draft_logits(
        self,
        last_token: torch.Tensor,
        position: int,
        context_features: torch.Tensor,
        draft_cache: DFlashContextCache,
        block_size: int,
    ) -> torch.Tensor:
        """Draft one block; return the logits of slots 1..B-1, [B - 1, V].

        last_token: [1] the last verified token, at `position`. context_features: [1, C, n*H]
        target features of the verified tokens at positions position-C..position-1 (the ones
        the draft cache has not seen yet); they are appended to `draft_cache`.
        """
        return self.draft_block(last_token, position, context_features, draft_cache, block_size)[1]

    def draft_block(
        self, last_token: torch.Tensor, position: int, context_features: torch.Tensor,
        draft_cache: DFlashContextCache, block_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [B - 1, H], unary logits [B - 1, V]) of slots 1..B-1 of one drafted block (see `draft_logits`)."""
        device = last_token.device
        masks = torch.full((block_size - 1,), self.mask_token_id, dtype=torch.long, device=device)
        noise = self.embed_tokens(torch.cat([last_token.view(1), masks]).unsqueeze(0))
        c_len = context_features.shape[1]
        pos = torch.arange(position - c_len, position + block_size, device=device).unsqueeze(0)
        hidden = self.draft(noise_embedding=noise, target_hidden=context_features, position_ids=pos, cache=draft_cache,
                            block_size=block_size)[0, 1:]
        return hidden, self.draft.slot_logits(hidden, self.lm_head)

    def walk_proposals(
        self, last_token: torch.Tensor, position: int, context_features: torch.Tensor,
        draft_cache: DFlashContextCache, block_size: int, sampling: SamplingParams,
        generator: Optional[torch.Generator],
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """A selector draft's proposals (DFlash2): (tokens [B - 1], q [B - 1, V] or None at T=0). Each slot is drawn
        from the walk's q given the token drawn before it (temperature only: the target's filters act on p);
        `draft="greedy"` proposes the walk's argmax path with a one-hot q."""
        hidden, logits = self.draft_block(last_token, position, context_features, draft_cache, block_size)
        if sampling.greedy or sampling.draft == "greedy":
            tokens, _ = self.draft.propose_block(hidden[None], logits[None], last_token.view(1))
            if sampling.greedy:
                return tokens[0], None
            q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
            return tokens[0], q.scatter_(-1, tokens[0].unsqueeze(-1), 1.0)

        def draw(k: int, q: torch.Tensor) -> torch.Tensor:
            return torch.multinomial(q, 1, generator=generator).squeeze(-1)

        tokens, q = self.draft.propose_block(hidden[None], logits[None], last_token.view(1),
                                             1.0 / sampling.temperature, draw)
        return tokens[0], q[0]

    @torch.no_grad()
    def generate(
        self,
        input_ids: TokenIds,
        *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        sampling: SamplingParams = GREEDY,
        stop_token_ids: Optional[Iterable[int]] = None,
        generator: Optional[torch.Generator] = None,
        past_key_values: Optional[DynamicCache] = None,
        draft_cache: Optional[DFlashContextCache] = None,
        decode: str = "eager",
        options: EngineOptions = DEFAULT_OPTIONS,
    ) -> GenerationOutput:
        """Generate up to `max_new_tokens` after `input_ids`.

        `past_key_values` / `draft_cache` may be passed (empty) to inspect the caches afterwards
        (eager mode only). `decode`: "eager" (HF DynamicCache) or "graphs" (static cache + CUDA
        graphs, CUDA only); both give the target's greedy output at T=0. `sampling`: temperature,
        top-p, top-k and how the draft proposes. `options`: the engine's speed
        settings (answers unchanged; the eager loop reads `avoid_cudnn_attention` only).
        """
        device = self.device
        ids, stop_ids = _decode_inputs(input_ids, stop_token_ids, max_new_tokens, decode, self.target.model,
                                       self._recurrent, device)
        if decode == "graphs":
            if past_key_values is not None or draft_cache is not None:
                raise ValueError("past_key_values / draft_cache are for decode='eager'; decode='graphs' owns its caches.")
            return batched_static_speculative_generate(  # the engine's loop with one row
                self, [ids[0].tolist()], max_new_tokens=max_new_tokens, sampling=sampling,
                stop_token_ids=stop_ids, rows=1, generator=generator, options=options)[0]
        return self._generate_eager(ids, max_new_tokens, sampling, stop_ids, generator, past_key_values, draft_cache,
                                    options)

    def _verify_mask(self, q_pos: torch.Tensor, kv_len: int) -> dict:
        """The verify forward's causal mask, built directly when we know the attention's mask
        format (HF's mask utilities cost Python time every step); otherwise left to HF."""
        impl = attn_implementation(self.target.model)
        if impl not in SUPPORTED_ATTN or self._hf_masks:
            return {}
        return {"attention_mask": causal_mask(q_pos, kv_len, impl, self.lm_head.weight.dtype)}

    def _rollback_recurrent(
        self, cache: DynamicCache, snap: recurrent_cache.StateSnapshot, kept_ids: torch.Tensor, kept_pos: torch.Tensor
    ) -> None:
        """After a partial acceptance: restore the pre-verify conv / recurrent states, drop the
        whole block from the attention K/V, and re-advance the target over the kept tokens. The
        feature hooks fire again here; the caller has already taken the verify's features (the
        kept positions' features are the same, the forward being causal)."""
        recurrent_cache.restore_states(snap)
        recurrent_cache.crop_attention(cache, int(kept_pos[0]))
        self.target.model(
            input_ids=kept_ids.unsqueeze(0), past_key_values=cache, use_cache=True,
            position_ids=kept_pos.unsqueeze(0), **self._prefill_kwargs,
        )

    def _eager_proposals(self, last: torch.Tensor, position: int, pending: torch.Tensor,
                         dcache: DFlashContextCache, sampling: SamplingParams, generator: Optional[torch.Generator],
                         no_draft: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One eager step's proposals and their draft distributions: a selector draft's walk, the draft's block
        (its argmax or draws), or none at block size 1."""
        blk = self.block_size
        if blk > 1 and self.draft.has_selector:
            return self.walk_proposals(last, position, pending, dcache, blk, sampling, generator)
        if blk > 1:
            d_logits = self.draft_logits(last, position, pending, dcache, blk)
            return propose_tokens(d_logits, sampling, generator)
        return no_draft, None

    def _generate_eager(
        self,
        ids: torch.Tensor,
        max_new_tokens: int,
        sampling: SamplingParams,
        stop_ids: set[int],
        generator: Optional[torch.Generator],
        past_key_values: Optional[DynamicCache],
        draft_cache: Optional[DFlashContextCache],
        options: EngineOptions = DEFAULT_OPTIONS,
    ) -> GenerationOutput:
        device, model = self.device, self.target.model
        blk = self.block_size
        cache = past_key_values if past_key_values is not None else _new_cache(model, self._recurrent)
        recurrent = recurrent_cache.has_recurrent_state(cache)
        if self._recurrent and not recurrent:
            raise ValueError(
                "This target has recurrent (linear-attention) layers but past_key_values has no state for them; "
                "pass recurrent_cache.make_target_cache(target) or None."
            )
        dcache = draft_cache if draft_cache is not None else DFlashContextCache(len(self.draft.layers))
        no_draft = torch.empty(0, dtype=torch.long, device=device)

        # One set of feature hooks for the whole generation (not registered per forward); SDPA
        # backends without a per-shape cost (graphs.eager_attention_backends).
        with self.target.capture(stop_early=False) as captured, \
                graphs.eager_attention_backends(device, options.avoid_cudnn_attention):
            sync(device)
            t0 = time.perf_counter()
            prompt_len = ids.shape[1]
            out = model(
                input_ids=ids, past_key_values=cache, use_cache=True,
                position_ids=torch.arange(prompt_len, device=device).unsqueeze(0), **self._prefill_kwargs,
            )
            pending = self.target.concat(captured)  # features the draft has not seen: [prompt_len - C, position)
            last, _ = select_tokens(out.logits[0, -1:], sampling, generator)  # [1], on the device
            output = [int(last[0])]
            sync(device)
            t1 = time.perf_counter()

            stopped = output[0] in stop_ids
            accept_lens: list[int] = []
            while not stopped and len(output) < max_new_tokens:
                position = prompt_len + len(output) - 1  # of the last (not yet verified-into-cache) token
                d_tokens, d_probs = self._eager_proposals(last, position, pending, dcache, sampling, generator,
                                                          no_draft)
                q_pos = torch.arange(position, position + blk, device=device)
                snap = recurrent_cache.snapshot_states(cache) if recurrent else None
                block_ids = torch.cat([last, d_tokens])
                out = model(
                    input_ids=block_ids.unsqueeze(0), past_key_values=cache, use_cache=True,
                    position_ids=q_pos.unsqueeze(0), **self._verify_mask(q_pos, position + blk),
                )
                feats = self.target.concat(captured)
                n_acc, new, last = _eager_verdict(out.logits[0], d_tokens, d_probs, sampling, generator, device)
                accept_lens.append(len(new))
                # Keep the last token and the accepted drafts (positions position..position+n_acc).
                if snap is not None:
                    if n_acc + 1 < blk:
                        self._rollback_recurrent(cache, snap, block_ids[: n_acc + 1], q_pos[: n_acc + 1])
                else:
                    crop_dynamic_cache(cache, position + n_acc + 1)
                pending = feats[:, : n_acc + 1]
                kept, stopped = truncate(new, stop_ids, max_new_tokens - len(output))
                output.extend(kept)
            sync(device)
            t2 = time.perf_counter()
        return GenerationOutput(
            output_ids=output,
            num_target_forwards=len(accept_lens),
            acceptance_lengths=accept_lens,
            decode_time_s=t2 - t1,
            prefill_time_s=t1 - t0,
            stopped=stopped,
        )


def _eager_verdict(logits: torch.Tensor, d_tokens: torch.Tensor, d_probs: Optional[torch.Tensor],
                   sampling: SamplingParams, generator: Optional[torch.Generator], device: torch.device
                   ) -> tuple[int, list[int], torch.Tensor]:
    """The target's verdict on one eager step's block (`logits` [B, V]): (proposals accepted, the tokens kept, the
    next step's first token [1]). T=0: the target's argmax (accepted proposals equal its own tokens); else
    speculative sampling."""
    if sampling.greedy:
        tgt = logits.argmax(dim=-1)  # [B]
        n_acc_t = greedy_accepted(d_tokens, tgt)
        res = torch.cat([n_acc_t.view(1), tgt]).tolist()  # the step's one host sync
        n_acc = res[0]
        return n_acc, res[1: n_acc + 2], tgt[n_acc: n_acc + 1]
    n_acc, nxt = verify_block(d_tokens, logits, sampling, d_probs, generator)
    return n_acc, d_tokens[:n_acc].tolist() + [nxt], torch.full((1,), nxt, dtype=torch.long, device=device)


@torch.no_grad()
def autoregressive_generate(
    target_model: nn.Module,
    input_ids: TokenIds,
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    sampling: SamplingParams = GREEDY,
    stop_token_ids: Optional[Iterable[int]] = None,
    generator: Optional[torch.Generator] = None,
    past_key_values: Optional[DynamicCache] = None,
    decode: str = "eager",
    options: EngineOptions = DEFAULT_OPTIONS,
) -> GenerationOutput:
    """Plain one-token-per-forward decoding with the same target: the speedup baseline (timed
    the same way, prefill excluded). `decode` and `options` as in `DFlashSpeculativeDecoder.generate`, so that
    both sides of a speedup run in the same mode."""
    device = _device_of(target_model)
    recurrent = recurrent_cache.model_has_recurrent_layers(target_model)
    ids, stop_ids = _decode_inputs(input_ids, stop_token_ids, max_new_tokens, decode, target_model, recurrent, device)
    if decode == "graphs":
        if past_key_values is not None:
            raise ValueError("past_key_values is for decode='eager'; decode='graphs' owns its cache.")
        return batched_static_autoregressive_generate(  # the engine's loop with one row
            target_model, [ids[0].tolist()], max_new_tokens=max_new_tokens, sampling=sampling,
            stop_token_ids=stop_ids, rows=1, generator=generator, options=options)[0]
    cache = past_key_values if past_key_values is not None else _new_cache(target_model, recurrent)
    extra = {"logits_to_keep": 1} if _accepts_kwarg(target_model, "logits_to_keep") else {}
    with graphs.eager_attention_backends(device, options.avoid_cudnn_attention):
        return _autoregressive_eager(target_model, ids, max_new_tokens, sampling, stop_ids, generator, cache, extra)


def _autoregressive_eager(
    target_model: nn.Module, ids: torch.Tensor, max_new_tokens: int, sampling: SamplingParams, stop_ids: set[int],
    generator: Optional[torch.Generator], cache: DynamicCache, extra: dict,
) -> GenerationOutput:
    device = ids.device
    sync(device)
    t0 = time.perf_counter()
    prompt_len = ids.shape[1]
    out = target_model(
        input_ids=ids, past_key_values=cache, use_cache=True,
        position_ids=torch.arange(prompt_len, device=device).unsqueeze(0), **extra,
    )
    tok, _ = select_tokens(out.logits[0, -1:], sampling, generator)
    output = [int(tok[0])]
    sync(device)
    t1 = time.perf_counter()
    stopped = output[0] in stop_ids
    steps = 0
    while not stopped and len(output) < max_new_tokens:
        position = prompt_len + len(output) - 1
        out = target_model(
            input_ids=tok.view(1, 1), past_key_values=cache, use_cache=True,
            position_ids=torch.arange(position, position + 1, device=device).unsqueeze(0),  # no host->device copy
        )
        tok, _ = select_tokens(out.logits[0, -1:], sampling, generator)
        output.append(int(tok[0]))  # the step's one host sync
        steps += 1
        stopped = output[-1] in stop_ids
    sync(device)
    t2 = time.perf_counter()
    return GenerationOutput(
        output_ids=output,
        num_target_forwards=steps,
        acceptance_lengths=[1] * steps,
        decode_time_s=t2 - t1,
        prefill_time_s=t1 - t0,
        stopped=stopped,
    )


def speculative_generate(
    target_model: nn.Module,
    draft: DFlashDraftModel,
    input_ids: TokenIds,
    *,
    block_size: Optional[int] = None,
    **kwargs,
) -> GenerationOutput:
    """One-shot helper around `DFlashSpeculativeDecoder(...).generate(...)` (`decode=` included;
    a new decoder per call, so "graphs" captures anew each time: keep a decoder to reuse them)."""
    return DFlashSpeculativeDecoder(target_model, draft, block_size).generate(input_ids, **kwargs)


__all__ = [
    "DFlashSpeculativeDecoder",
    "check_decode_mode",
    "GenerationOutput",
    "autoregressive_generate",
    "crop_dynamic_cache",
    "select_tokens",
    "speculative_generate",
    "verify_block",
]
