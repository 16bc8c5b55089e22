"""Speculative decoding of many prompts at once, each row at its own position.

The sequential decoder (`spec_decode.DFlashSpeculativeDecoder.generate`) runs one prompt; serving
engines run many, and a draft's speedup changes with their concurrency. This decoder runs the same
algorithm on B prompts in one batch: one draft forward drafts every row's block, one target forward
verifies every row's block, and each row keeps its own accepted prefix (T=0: the longest prefix equal
to the target's argmax; T>0: speculative sampling, `sampling.verify_blocks`, all rows at once).

Rows drift apart, each accepting a different number of tokens, so the caches are never cropped:
every verify appends B x block entries, and a per-row validity mask hides each row's rejected
entries and padding. Positions are explicit per row (RoPE reads them, not the cache slot), so where
an entry sits in the cache does not matter. When more than half the slots are dead, each row's live
entries are gathered to the front (`_compact`), so the attention never reads more than twice the
live entries (plus one step's block).

Eager HF forwards with a 4D mask (SDPA or eager attention, full-attention layers only).
"""

from __future__ import annotations

import time
from typing import Iterable, Optional, Sequence

import torch
from transformers import DynamicCache

from nemo_dflash.attention import eager_attention_backends
from nemo_dflash.draft.model import DFlashContextCache
from nemo_dflash.inference import recurrent_cache
from nemo_dflash.inference.output import GenerationOutput, stop_set, sync, truncate
from nemo_dflash.inference.static_cache import SUPPORTED_ATTN, attn_implementation, visible_to_mask
from nemo_dflash.sampling import Sampling, propose_tokens, select_tokens, verify_blocks

COMPACT_DEAD_SHARE = 0.5  # compact the caches once more than this share of their slots is dead


def _compact(valid: torch.Tensor, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Gather each row's live entries (valid [B, L]) to the front of every [B, H, L, D] tensor, in order."""
    bsz, length = valid.shape
    counts = valid.sum(1)
    new_len = int(counts.max())
    slot = torch.arange(length, device=valid.device)
    order = torch.argsort((~valid).long() * length + slot, dim=1)[:, :new_len]  # live first, in order
    out = []
    for t in tensors:
        idx = order.view(bsz, 1, new_len, 1).expand(bsz, t.shape[1], new_len, t.shape[3])
        out.append(t.gather(2, idx))
    return slot[:new_len].view(1, -1) < counts.view(-1, 1), out


def check_batch(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    """A one-line ValueError for inputs no batched decoder can take (eager or fixed-shape)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("batched decoding needs at least one prompt, each of at least one token")


def _check(model, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> str:
    """The attention implementation, once the inputs and the target are known to suit batching."""
    check_batch(prompts, max_new_tokens)
    impl = attn_implementation(model)
    if (impl not in SUPPORTED_ATTN or recurrent_cache.model_has_recurrent_layers(model)
            or recurrent_cache.has_windowed_layers(model)):
        raise ValueError(f"batched decoding needs a full-attention target with attention in {SUPPORTED_ATTN} "
                         f"(got '{impl}'); decode these prompts one at a time instead")
    return impl


def _prefill(model, prompts: Sequence[Sequence[int]], impl: str, dtype: torch.dtype, device: torch.device):
    """All prompts right-padded in one forward: (cache, live entries [B, L], lengths [B], last logits [B, V])."""
    bsz = len(prompts)
    plen = max(len(p) for p in prompts)
    ids = torch.tensor([list(p) + [0] * (plen - len(p)) for p in prompts], dtype=torch.long).to(device)
    lens = torch.tensor([len(p) for p in prompts]).to(device)
    ar = torch.arange(plen, device=device)
    kv_valid = ar.view(1, -1) < lens.view(-1, 1)
    visible = (ar.view(1, 1, -1) <= ar.view(1, -1, 1)) & kv_valid.view(bsz, 1, -1)
    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, position_ids=ar.view(1, -1).expand(bsz, -1),
                attention_mask=visible_to_mask(visible.unsqueeze(1), impl, dtype))
    return cache, kv_valid, lens, out.logits[torch.arange(bsz, device=device), lens - 1]


@torch.no_grad()
def batched_autoregressive_generate(
    target_model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 256,
    temperature: Sampling = 0.0,
    stop_token_ids: Optional[Iterable[int]] = None,
    generator: Optional[torch.Generator] = None,
) -> list[GenerationOutput]:
    """Plain decoding of all prompts in one batch, one token per row per forward: the baseline a
    batched speculative run is timed against (the same caches, masks and compaction)."""
    impl = _check(target_model, prompts, max_new_tokens)
    device = next(target_model.parameters()).device
    dtype = target_model.get_output_embeddings().weight.dtype
    stop_ids = stop_set(stop_token_ids)
    bsz = len(prompts)
    with eager_attention_backends(device):  # key lengths change every step (nemo_dflash.attention)
        sync(device)
        t0 = time.perf_counter()
        cache, kv_valid, lens, logits = _prefill(target_model, prompts, impl, dtype, device)
        last, _ = select_tokens(logits, temperature, generator)
        outputs = [[t] for t in last.tolist()]
        sync(device)
        t1 = time.perf_counter()
        stopped = [o[0] in stop_ids or max_new_tokens <= 1 for o in outputs]
        one = torch.ones(bsz, 1, dtype=torch.bool, device=device)
        pos = lens.clone()  # [B] the position of each row's last token (as in the speculative loop)
        alive = torch.tensor([not x for x in stopped], device=device)
        live_kv = int(lens.sum())
        while not all(stopped):
            seen = torch.cat([kv_valid, one], 1)
            out = target_model(input_ids=last.view(-1, 1), past_key_values=cache, use_cache=True,
                               position_ids=pos.view(-1, 1),
                               attention_mask=visible_to_mask(seen.view(bsz, 1, 1, -1), impl, dtype))
            kv_valid = torch.cat([kv_valid, alive.view(-1, 1)], 1)
            last, _ = select_tokens(out.logits[:, -1], temperature, generator)
            pos = pos + alive.long()
            was = list(stopped)
            for b, t in enumerate(last.tolist()):  # the step's one host sync
                if not was[b]:
                    live_kv += 1
                    outputs[b].append(t)
                    stopped[b] = t in stop_ids or len(outputs[b]) >= max_new_tokens
            if stopped != was:
                alive = torch.tensor([not x for x in stopped], device=device)
            if live_kv < (1 - COMPACT_DEAD_SHARE) * bsz * kv_valid.shape[1]:
                kv_valid = _compact_cache(kv_valid, cache)
        sync(device)
        t2 = time.perf_counter()
    return [GenerationOutput(output_ids=o, num_target_forwards=len(o) - 1, acceptance_lengths=[1] * (len(o) - 1),
                             decode_time_s=t2 - t1, prefill_time_s=t1 - t0, stopped=o[-1] in stop_ids)
            for o in outputs]


@torch.no_grad()
def batched_speculative_generate(
    decoder,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 256,
    temperature: Sampling = 0.0,
    stop_token_ids: Optional[Iterable[int]] = None,
    generator: Optional[torch.Generator] = None,
) -> list[GenerationOutput]:
    """Generate up to `max_new_tokens` after each prompt, all prompts in one batch.

    `decoder` is a `DFlashSpeculativeDecoder` (its target, draft and block size are used). Returns
    one `GenerationOutput` per prompt, in order; at T=0 each equals what `decoder.generate` returns
    for that prompt alone (in exact arithmetic), acceptance lengths included. `decode_time_s` and
    `prefill_time_s` are the batch's, shared by all rows.
    """
    model = decoder.target.model
    impl = _check(model, prompts, max_new_tokens)
    device = decoder.device
    dtype = decoder.lm_head.weight.dtype
    blk = decoder.block_size
    stop_ids = stop_set(stop_token_ids)
    bsz = len(prompts)
    causal = torch.ones(blk, blk, dtype=torch.bool, device=device).tril()
    dcache = DFlashContextCache(len(decoder.draft.layers))
    d_valid = torch.zeros(bsz, 0, dtype=torch.bool, device=device)  # live draft cache entries

    # key lengths change every step: SDPA backends without a per-shape plan (nemo_dflash.attention)
    with decoder.target.capture(stop_early=False) as captured, eager_attention_backends(device):
        sync(device)
        t0 = time.perf_counter()
        cache, kv_valid, lens, last_logits = _prefill(model, prompts, impl, dtype, device)
        pending = decoder.target.concat(captured)  # [B, C, F]: features the draft has not seen
        pend_valid = kv_valid.clone()
        pend_pos = torch.arange(pending.shape[1], device=device).view(1, -1).expand(bsz, -1)
        last, _ = select_tokens(last_logits, temperature, generator)  # [B]
        outputs = [[t] for t in last.tolist()]
        sync(device)
        t1 = time.perf_counter()
        stopped = [o[0] in stop_ids or max_new_tokens <= 1 for o in outputs]
        accept = [[] for _ in range(bsz)]
        block_ar = torch.arange(blk, device=device)
        masks = torch.full((bsz, blk - 1), decoder.mask_token_id, dtype=torch.long, device=device)
        # Per-step state stays on the device (positions, live rows); the host reads the step's tokens once
        # and keeps the live-entry counts that decide compaction.
        pos = lens.clone()  # [B] the position of each row's last token
        alive = torch.tensor([not x for x in stopped], device=device)
        live_kv = live_pending = int(lens.sum())  # live entries of the target cache; of `pending`
        live_d = 0  # live entries of the draft cache
        while not all(stopped):
            # draft every row's block: context = the verified features not yet cached, plus the cache
            if blk > 1:
                noise = decoder.embed_tokens(torch.cat([last.view(-1, 1), masks], 1))
                d_pos = torch.cat([pend_pos, pos.view(-1, 1) + block_ar], 1)
                seen = torch.cat([d_valid, pend_valid, torch.ones(bsz, blk, dtype=torch.bool, device=device)], 1)
                hidden = decoder.draft(noise_embedding=noise, target_hidden=pending, position_ids=d_pos,
                                       attention_mask=seen.view(bsz, 1, 1, -1).expand(-1, -1, blk, -1), cache=dcache)
                d_valid = torch.cat([d_valid, pend_valid], 1)
                live_d += live_pending
                d_logits = decoder.lm_head(hidden[:, 1:].to(dtype))  # [B, blk-1, V]
                d_flat, d_probs = propose_tokens(d_logits.reshape(bsz * (blk - 1), -1), temperature, generator)
                d_tokens = d_flat.view(bsz, blk - 1)
            else:
                d_tokens = torch.empty(bsz, 0, dtype=torch.long, device=device)
                d_probs = None
            # verify every row's block against the live part of its own cache
            q_pos = pos.view(-1, 1) + block_ar
            seen = torch.cat([kv_valid.view(bsz, 1, -1).expand(-1, blk, -1), causal.expand(bsz, -1, -1)], 2)
            out = model(input_ids=torch.cat([last.view(-1, 1), d_tokens], 1), past_key_values=cache, use_cache=True,
                        position_ids=q_pos, attention_mask=visible_to_mask(seen.unsqueeze(1), impl, dtype))
            feats = decoder.target.concat(captured)  # [B, blk, F]
            vocab = out.logits.shape[-1]
            probs = d_probs.view(bsz, blk - 1, vocab) if d_probs is not None else None
            n_acc_t, nxt_t = verify_blocks(d_tokens, out.logits, temperature, probs, generator)
            kept = torch.where(alive, n_acc_t + 1, 0)  # the last token and the accepted drafts, per live row
            new_valid = block_ar.view(1, -1) < kept.view(-1, 1)
            kv_valid = torch.cat([kv_valid, new_valid], 1)
            pending, pend_valid, pend_pos = feats, new_valid, q_pos
            last, pos = nxt_t, pos + kept
            host = torch.cat([n_acc_t.view(-1, 1), nxt_t.view(-1, 1), d_tokens], 1).tolist()  # the step's one host sync
            was, live_pending = list(stopped), 0
            for b, r in enumerate(host):
                if was[b]:
                    continue
                new = r[2 : 2 + r[0]] + [r[1]]  # accepted proposals, then the target's token
                accept[b].append(len(new))
                live_kv += len(new)
                live_pending += len(new)
                tokens, stopped[b] = truncate(new, stop_ids, max_new_tokens - len(outputs[b]))
                outputs[b].extend(tokens)
                stopped[b] = stopped[b] or len(outputs[b]) >= max_new_tokens
            if stopped != was:
                alive = torch.tensor([not x for x in stopped], device=device)
            if live_kv < (1 - COMPACT_DEAD_SHARE) * bsz * kv_valid.shape[1]:
                kv_valid = _compact_cache(kv_valid, cache)
            if d_valid.shape[1] and live_d < (1 - COMPACT_DEAD_SHARE) * bsz * d_valid.shape[1]:
                d_valid = _compact_draft(d_valid, dcache)
        sync(device)
        t2 = time.perf_counter()
    return [
        GenerationOutput(output_ids=outputs[b], num_target_forwards=len(accept[b]), acceptance_lengths=accept[b],
                         decode_time_s=t2 - t1, prefill_time_s=t1 - t0, stopped=bool(outputs[b][-1] in stop_ids))
        for b in range(bsz)
    ]


def _compact_cache(valid: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    slots = [(layer, name) for layer in cache.layers for name in ("keys", "values")]
    new_valid, tensors = _compact(valid, [getattr(layer, name) for layer, name in slots])
    for (layer, name), t in zip(slots, tensors):
        setattr(layer, name, t)
    return new_valid


def _compact_draft(valid: torch.Tensor, dcache: DFlashContextCache) -> torch.Tensor:
    n = len(dcache.keys)
    new_valid, tensors = _compact(valid, [*dcache.keys, *dcache.values])
    dcache.keys, dcache.values = list(tensors[:n]), list(tensors[n:])
    return new_valid


__all__ = ["batched_autoregressive_generate", "batched_speculative_generate", "check_batch"]
