"""Continuous-batching generation for regeneration: every batch slot stays busy until the last prompt.

A slot is one row of a static KV cache. When an answer ends (stop token, token cap, or a loop),
its slot is refilled at once with the next prompt, so finished rows never idle the batch as they
do in ``model.generate``. The model's own forward is used unchanged (embeddings, norms, RoPE,
MLP, lm_head); only its attention is swapped, through transformers' ``AttentionInterface``, for
one that writes into the slot cache and reads each slot's filled prefix: flex_attention decoding
on a GPU (it skips the unfilled KV blocks of every slot), SDPA with a length mask elsewhere.

A refill's prompts run as one packed row of their real tokens, attention grouped by length;
decode steps are queued ``EngineConfig.decode_window`` at a time, each step stopping the
slots whose answers end, so the host's bookkeeping and the caller's work overlap queued steps.

Why not transformers' own continuous batching (``generate_batch``, 5.17 on the benchmark GPUs): its
fast decode path needs flash-attn's paged kernel, which those machines do not have and cannot
download; without it, ``paged|sdpa`` packs the whole batch into one row with a dense
[all queries x all keys] mask, quadratic in the batch size. ``benchmarks/regen.py throughput``
measures both.

A conversation keeps its slot between turns: a request marked ``hold`` parks its slot when its
answer ends, and a follow-up ``Request(after=completion)`` continues in it. The slot's KV already
holds the previous prompt and the answer, so only what the new prompt adds after the longest
common prefix with those tokens is prefilled (the chat template's end of turn, the next user
turn, the generation prompt). A prefix is correct by causality whatever follows it, so a shorter
common prefix (a cut answer, a template that rewrites earlier turns) only costs prefill.

This module owns the engine: slots, requests and completions, refills, decode steps and windows,
CUDA graph capture. The slot cache and the attention swapped into the model live in
``slot_attention.py``; how a refill is split into forwards and attention groups in ``prefill_plan.py``;
keyed sampling in ``nemo_dflash.sampling``.

Sampling is keyed: the Gumbel noise of token ``v`` at answer position ``t`` of request ``key`` is
a hash of ``(seed, key, t, v)``. An answer therefore does not depend on which other requests
share its batch, on the slot it lands in, or on whether the run was interrupted and resumed.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from nemo_dflash.attention import KV_BLOCK, FilledBlocks, eager_attention_backends
from nemo_dflash.data.loops import LoopDetector
from nemo_dflash.data.prefill_plan import min_cost_attention_plan
from nemo_dflash.data.slot_attention import (
    ATTN_NAME,
    AttentionGroup,
    PackedRows,
    SlotKVCache,
    SlotPass,
    VarlenRows,
    check_kv_fits,
    free_device_bytes,
    register_slot_attention,
    slots_that_fit,
)
from nemo_dflash.sampling import keyed_sample_candidates, redo_wide_rows, sample_full

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class EngineConfig:
    """The engine's speed settings; none of them changes an answer. A field left None takes the
    device's default (:meth:`resolved`), the setting that measured fastest:

    - ``decode_window``: decode steps launched per host round trip. The host reads the step's flags
      (answers that ended, loop checks due) once per window, so its bookkeeping and the caller's work
      (the next turn's template) overlap queued GPU steps. Answers stop inside the window (the step
      deactivates an ended slot), so a window changes no output; an ended slot idles for the rest of
      its window. One H200, whole ShareGPT set: 1 -> 53.5k, 4 -> 55.9k, 8 -> 57.1k, 16 -> 54.1k tokens/s
      (1,024 slots); with the compiled step, varlen prefills and 2,048 slots 8 -> 99.5k, 12 -> 100.1k
      (one run each: within run-to-run noise). A CPU runs each step synchronously: 1 there.
    - ``decode_compile``: the decode step through torch.compile (inductor) before it is captured: an
      eager step is ~40 small kernels per layer, which inductor fuses. One H200, whole ShareGPT set: GPU
      decode time 56.7 -> 42.9 s, 73.4k -> 93.5k tokens/s; the compile takes ~40 s once per process. A
      step that fails to compile or capture runs eagerly. Off on CPU (the tests and the demo would pay it).
    - ``prefill_attention``: how a packed prefill attends: "groups" (rows split into right-padded SDPA
      batches by :func:`~nemo_dflash.data.prefill_plan.min_cost_attention_plan`) or "varlen" (one
      variable-length flash call per layer over every row; on CPU or in fp32 a per-row reference). One
      H200, whole ShareGPT set: GPU prefill time 12.5 -> 7.4 s, 73.4k -> 81.0k tokens/s. CPU: groups.
    - ``attention_group_cost``: a packed prefill's fixed cost per attention group (its ~10 extra
      kernels per layer), in (query, key) pairs; ``kv_read_queries``: a continuing row's keys read from
      its slot, counted as this many extra queries.
    - ``refill_fraction``: refill once ``num_slots // refill_fraction`` slots are idle. A prefill is one
      forward with a fixed cost: on a GPU the decode step is cheap next to it at any fill (16), on a CPU
      an idle slot costs little (2).

    Prefills always run packed: a refill's prompts as one row of their real tokens, attention per
    group of rows (on one H200, whole ShareGPT set: 55.9k tokens/s against 48.9k for right-padded
    batches, which were removed with their split plans and shared-forward switch).
    Launching the next decode window before the loop checks ran was timed slower (69.1k against 73.4k
    tokens/s) and removed too.
    """

    decode_window: Optional[int] = None
    decode_compile: Optional[bool] = None
    prefill_attention: Optional[str] = None
    attention_group_cost: Optional[float] = None
    kv_read_queries: float = 16.0
    refill_fraction: Optional[int] = None

    def __post_init__(self) -> None:
        if self.prefill_attention not in (None, "groups", "varlen"):
            raise ValueError(f"prefill_attention must be 'groups' or 'varlen' (got {self.prefill_attention!r})")
        for name in ("decode_window", "refill_fraction"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (got {value})")

    def resolved(self, device_type: str) -> "EngineConfig":
        """This configuration with every None replaced by ``device_type``'s default."""
        cpu = device_type == "cpu"
        defaults = {"decode_window": 1 if cpu else 12, "decode_compile": not cpu,
                    "prefill_attention": "groups" if cpu else "varlen",
                    "attention_group_cost": 4096.0 if cpu else 2_000_000.0,
                    "refill_fraction": 16 if device_type == "cuda" else 2}
        return replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})


def cache_width(max_prompt_tokens: int, max_new_tokens: int) -> int:
    """Tokens a slot of the KV cache holds: prompt and answer, rounded up to the KV block."""
    return KV_BLOCK * math.ceil((max_prompt_tokens + max_new_tokens) / KV_BLOCK)


AUTO_SLOTS_CAP = 2048  # `auto` slots at most (the H200's 2,048 fill its decode step)
CPU_AUTO_SLOTS = 8  # `auto` where nothing is fitted (off a GPU)


def auto_num_slots(fit: Optional[int]) -> int:
    """`--batch-size auto`: 97% of the slots that fit (`max_slots`; a margin for what the engine
    allocates before its cache), capped at AUTO_SLOTS_CAP; CPU_AUTO_SLOTS where nothing was fitted
    (off a GPU)."""
    return CPU_AUTO_SLOTS if fit is None else max(1, min(fit - fit // 32, AUTO_SLOTS_CAP))


def max_slots(model: nn.Module, max_prompt_tokens: int, max_new_tokens: int) -> Optional[int]:
    """The most answers in flight whose KV cache fits the GPU's free memory now (None off a GPU)."""
    param = next(model.parameters())
    if param.device.type != "cuda":
        return None
    width = cache_width(max_prompt_tokens, max_new_tokens)
    return slots_that_fit(SlotKVCache.slot_bytes(model.config, width, param.dtype), free_device_bytes(param.device))


def check_supported(model: nn.Module) -> None:
    """Raise ValueError (one line, naming the fix) if the slot engine cannot run ``model`` exactly."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    name = type(model).__name__
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"{name} has {sorted(kinds)} layers; the slot engine handles full attention only: "
                         "use --engine generate")
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        raise ValueError(f"{name} uses sliding-window attention; the slot engine does not: use --engine generate")
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(f"{name} does not take transformers' attention interface: use --engine generate")


# ----------------------------------------------------------------------------- the engine


@dataclass
class Request:
    """One prompt to answer. ``key`` keys the sampling noise: give each request its own.

    ``hold``: a follow-up may continue this conversation, so keep the slot (and its KV) when the
    answer ends. ``after``: the completion this request follows; if its slot is still held, the
    request continues there and only the part of ``prompt_ids`` past the common prefix with the
    slot's tokens is prefilled. ``prompt_ids`` is always the whole prompt.

    ``max_new_tokens``: this answer's token cap, 1 up to the engine's (None: the engine's). The
    cap is a per-slot tensor the decode step reads, so requests of different caps share a batch
    (and a captured step) and each answer is the one it would be alone under an engine of its cap.
    """

    key: int
    prompt_ids: list[int]
    tag: Any = None  # the caller's handle, returned with the completion
    hold: bool = False
    after: Optional["Completion"] = None
    max_new_tokens: Optional[int] = None


@dataclass
class Completion:
    """An answer: ``token_ids`` exclude the stop token and, for a loop, everything from its start."""

    request: Request
    token_ids: list[int]
    finish: str  # "stop" | "length" | "loop"
    generated: int  # tokens generated for it (stop token and cut loop included)
    loop_start: Optional[int] = None
    slot: Optional[int] = None  # the slot held for a follow-up (``Request.hold``), else None


class GpuClock:
    """GPU time of the engine's work by phase, from CUDA event pairs read once their work is done
    (never a synchronisation of its own). The host phases in ``SlotEngine.seconds`` overlap queued
    GPU work; this says how long the GPU itself was busy with each phase and how long it sat idle
    before each (``idle_before_<phase>``: from the end of the previous piece of work to the start of
    this one, i.e. the host had not yet launched it). A no-op off CUDA."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.seconds: collections.Counter = collections.Counter()
        self._open: list[tuple[str, Any, Any]] = []  # (phase, start event, end event), not yet read
        self._last_end: Any = None  # the end event of the latest piece of work

    def start(self, phase: str) -> Any:
        if not self.enabled:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if self._last_end is not None:
            self._open.append((f"idle_before_{phase}", self._last_end, event))
        return event

    def stop(self, phase: str, start: Any) -> None:
        if start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._open.append((phase, start, end))
        self._last_end = end

    def pause(self) -> None:
        """The time until the next start is not the engine's (a run ended): no gap is counted."""
        self._last_end = None

    def read(self) -> None:
        """Add the pairs whose work has finished; keep the others for later."""
        still = []
        for phase, start, end in self._open:
            if end.query():
                self.seconds[phase] += start.elapsed_time(end) / 1e3
            else:
                still.append((phase, start, end))
        self._open = still


class SlotEngine:
    """Continuous batching over a static slot cache; see the module docstring.

    ``loop_detector``, if given, fills ``Completion.loop_start`` of every answer. With
    ``stop_on_loop`` it is also checked every ``loop_check_every`` tokens of a growing answer, and
    a looping answer is stopped there and returned with ``finish="loop"``, cut at the loop's start
    (a loop runs to the token cap otherwise: stopping it early saves that compute).

    Multi-turn: a completion of a ``hold`` request keeps its slot until the generator is resumed;
    a ``Request(after=completion)`` appended to ``pending`` before that continues in the slot
    (see :class:`Request`); a held slot without a follow-up is freed then.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        num_slots: int,
        max_prompt_tokens: int,
        max_new_tokens: int,
        stop_ids: list[int],
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        loop_detector: Optional[LoopDetector] = None,
        stop_on_loop: bool = False,
        loop_check_every: int = 128,
        max_prefill_tokens: int = 65536,
        use_flex: Optional[bool] = None,
        cuda_graph: Optional[bool] = None,
        reuse_slots: bool = True,
        config: Optional[EngineConfig] = None,
    ) -> None:
        if num_slots < 1 or max_prompt_tokens < 1 or max_new_tokens < 1:
            raise ValueError("num_slots, max_prompt_tokens and max_new_tokens must be >= 1")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1 (got {temperature}, {top_p})")
        check_supported(model)
        register_slot_attention()
        self.model = model
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        param = next(model.parameters())
        self.device = param.device
        self.num_slots = num_slots
        self.max_prompt_tokens = max_prompt_tokens
        self.max_new_tokens = max_new_tokens
        width = cache_width(max_prompt_tokens, max_new_tokens)
        if self.device.type == "cuda":
            check_kv_fits(num_slots, width, SlotKVCache.slot_bytes(model.config, width, param.dtype),
                          free_device_bytes(self.device))
        self.cache = SlotKVCache(model.config, num_slots, width, self.device, param.dtype)
        self.config = (config or EngineConfig()).resolved(self.device.type)
        self.stop_ids = set(stop_ids)
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        self.loop_detector, self.loop_check_every = loop_detector, loop_check_every
        self.stop_on_loop = stop_on_loop and loop_detector is not None
        # a window shorter than the loop-check period: an answer is due at most once per window
        self.decode_window = max(1, min(self.config.decode_window,
                                        loop_check_every - 1 if loop_check_every > 1 else 1))
        self.max_prefill_tokens = max(max_prefill_tokens, max_prompt_tokens)
        self.reuse_slots = reuse_slots  # False: every request is prefilled whole (the A/B baseline)
        # Free slots that trigger a refill. A prefill is one eager forward with a fixed cost: on a GPU
        # the decode step is cheap next to it at any fill, on a CPU an idle slot costs little.
        self.min_refill = max(1, num_slots // self.config.refill_fraction)
        self.use_flex = self.device.type == "cuda" if use_flex is None else use_flex
        self.cuda_graph = (self.device.type == "cuda") if cuda_graph is None else cuda_graph
        if self.cuda_graph and self.device.type != "cuda":
            raise ValueError("cuda_graph needs a CUDA device")
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        decode_compile = self.config.decode_compile
        self.decode_compile = decode_compile  # set False when the compiled step fails and it falls back to eager
        self.prefill_attention = self.config.prefill_attention
        self._step_fn: Callable[[], None] = torch.compile(self._step, dynamic=False) if decode_compile else self._step
        self.generated_tokens = 0
        self.steps = 0
        self.prefill_tokens = 0  # tokens run through a prefill forward (padding excluded)
        self.reused_tokens = 0  # prompt tokens whose K/V a follow-up found in its slot (not prefilled)
        self.continued = 0  # follow-ups that continued in their conversation's slot
        self.prefix_short = 0  # of those, slots whose tokens were not all a prefix of the new prompt
        self.redone = 0  # decode samples redone over the whole vocabulary (a nucleus wider than the candidates)
        # wall time by phase: prefill_fresh / _continue / _mixed, decode, host (bookkeeping), loop_check, caller
        # (between yields)
        self.seconds: collections.Counter = collections.Counter()
        # GPU busy time by phase (decode windows, prefill forwards): CUDA events, CUDA only
        self.gpu = GpuClock(self.device.type == "cuda")
        self.prefills: collections.Counter = collections.Counter()  # prefill forwards by kind, as above
        if self.use_flex:
            self._setup_flex()
        logger.info("slot engine: %d slots x %d tokens, KV cache %.1f GB, attention %s%s%s", num_slots, width,
                    self.cache.nbytes / 1e9, "flex" if self.use_flex else "sdpa",
                    ", CUDA graph" if self.cuda_graph else "", ", compiled step" if decode_compile else "")

    def _setup_flex(self) -> None:
        """One mask for every decode pass (`attention.FilledBlocks`): its tensors are updated in place from the
        fills, so the pass has fixed shapes and fixed tensors (what a CUDA graph needs)."""
        text = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
        group = text.num_attention_heads // (getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        self._filled = FilledBlocks(self.num_slots, 1, self.cache.width, group, self.device)
        self.cache.flex = self._filled.flex

    # -- forwards

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def _prefill_logits(self, slots: list[int], requests: list[Request],
                        starts: Optional[list[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill ``slots`` with the prompts (from ``starts``: the K/V before it is already in the
        slot); (the logits of each prompt's last token [R, V], the requests' keys [R]). Queued on
        the GPU: nothing here waits for it."""
        dev, rows = self.device, len(requests)
        starts = [0] * rows if starts is None else starts
        with eager_attention_backends(dev):  # a new shape every prefill: no cuDNN plan builds
            last = self._packed_forward(slots, requests, starts)
        slot_t = self._index(slots)
        self.cache.lengths[slot_t] = self._index([len(r.prompt_ids) for r in requests])
        return self._logits(last), self._index([r.key for r in requests])

    def _prefill(self, slots: list[int], requests: list[Request], starts: Optional[list[int]] = None) -> torch.Tensor:
        """:meth:`_prefill_logits`, then the first answer token of each prompt, sampled exactly."""
        logits, keys = self._prefill_logits(slots, requests, starts)
        return self._sample(logits, keys, torch.zeros_like(keys))

    def _packed_forward(self, slots: list[int], requests: list[Request], starts: list[int]) -> torch.Tensor:
        """The prompts' tokens packed into one row (no padding outside attention) -> the last prompt
        token's hidden state [R, hidden]. Attention runs per group of rows: fresh rows apart from
        continuing ones, each sorted by span and split by :func:`min_cost_attention_plan`; or, with
        ``prefill_attention`` "varlen", as one :func:`varlen_attention` call over every row."""
        dev = self.device
        start = np.asarray(starts, dtype=np.int64)
        lens = np.fromiter((len(r.prompt_ids) for r in requests), dtype=np.int64, count=len(requests)) - start
        span = start + lens
        varlen = self.prefill_attention == "varlen"
        plan: list[np.ndarray] = []  # the rows of each attention group, in packed order
        if varlen:
            order = np.arange(len(requests))
        else:
            group_cost = self.config.attention_group_cost
            for fresh in (True, False):
                idx = np.flatnonzero((start == 0) == fresh)
                idx = idx[np.argsort(span[idx], kind="stable")]
                kv_read = 0.0 if fresh else self.config.kv_read_queries
                plan += [idx[i:j] for i, j in min_cost_attention_plan(lens[idx], span[idx], group_cost, kv_read)]
            order = np.concatenate(plan)
        offsets = np.concatenate([[0], np.cumsum(lens[order])])
        total = int(offsets[-1])
        ids = np.fromiter(itertools.chain.from_iterable(requests[r].prompt_ids[start[r]:] for r in order),
                          dtype=np.int64, count=total)
        row_of = np.repeat(np.arange(len(order)), lens[order])  # each packed token's place in ``order``
        pos = start[order][row_of] + np.arange(total) - offsets[:-1][row_of]
        self.prefill_tokens += total
        groups, first = [], 0
        for members in plan:
            n = len(members)
            glen, width = lens[members], int(lens[members].max())
            cols = np.arange(width)[None, :]
            gather = offsets[first:first + n, None] + np.minimum(cols, glen[:, None] - 1)  # pads repeat the last
            real = np.flatnonzero((cols < glen[:, None]).ravel())
            group = AttentionGroup(n, width, self._index(gather.ravel()), self._index(real))
            if start[members].any():
                keys = min(self.cache.width, 16 * math.ceil(int(span[members].max()) / 16))  # aligned mask rows
                at = self._index(start[members][:, None] + cols)  # [n, width] each query's position
                group.mask = (torch.arange(keys, device=dev)[None, None, :] <= at[:, :, None])[:, None]
                group.slots = self._index([slots[r] for r in members])
            groups.append(group)
            first += n
        slot_t = self._index(slots)
        slot_tok = slot_t[self._index(order[row_of])]
        pos_t = self._index(pos)
        packed = PackedRows(slot_tok, pos_t, groups)
        if varlen:  # every row's keys: its slot's positions 0..span-1
            spans = span[order]
            cu_k = np.concatenate([[0], np.cumsum(spans)])
            key_row = np.repeat(np.arange(len(order)), spans)
            kv_pos = np.arange(int(cu_k[-1])) - cu_k[:-1][key_row]
            packed.varlen = VarlenRows(
                slot_t[self._index(order[key_row])], self._index(kv_pos),
                self._index(offsets, torch.int32), self._index(cu_k, torch.int32),
                int(lens.max()), int(spans.max()))
        slot_pass = SlotPass(self.cache, decode=False, packed=packed)
        hidden = self.decoder(
            input_ids=self._index(ids)[None], position_ids=pos_t[None], use_cache=False,
            slot_pass=slot_pass,
        ).last_hidden_state[0]
        last = np.empty(len(order), dtype=np.int64)
        last[order] = offsets[1:] - 1
        return hidden[self._index(last)]

    def _decode_logits(self) -> torch.Tensor:
        """The forward of a decode pass: each slot's last token at its fill position -> logits [S, V]."""
        lengths = self.cache.lengths
        slot_pass = SlotPass(self.cache, decode=True)
        if self.use_flex:
            self._filled.set(lengths.view(-1, 1))  # each slot's query at its fill position
            slot_pass.block_mask = self._filled.mask
        else:
            visible = torch.arange(self.cache.width, device=self.device)[None, :] <= lengths[:, None]
            slot_pass.kv_mask = visible[:, None, None, :]
        hidden = self.decoder(
            input_ids=self._tokens[:, None], position_ids=lengths[:, None], use_cache=False, slot_pass=slot_pass
        ).last_hidden_state[:, 0]
        return self._logits(hidden)

    def _step(self) -> None:
        """One decode step on the engine's fixed tensors: forward, keyed sample, bookkeeping.

        Free slots run too (fixed shapes) and their results are ignored. A slot whose answer ends
        (stop token, its request's token cap: ``_cap``, a tensor, so a captured step honours every
        slot's) is deactivated here, so the steps after it in a window leave it as it is; so is a
        slot whose sample must be redone exactly (a nucleus wider than the
        candidates): ``_wide_at`` keeps its answer position and ``_wide_logits`` its logits. The
        flags are sticky until the host clears them: ``_ended``, ``_due`` (a live answer whose
        length reached a multiple of ``loop_check_every``), and ``_flags`` = [any ended, any wide,
        any due, tokens generated since the host last read it]."""
        logits = self._decode_logits()
        new, wide = self._pick(logits, self._keys, self._answer_pos)
        active = self._active.bool()
        self._generated.add_(self._active.sum())
        self._tokens.copy_(torch.where(active, new, self._tokens))
        rows = torch.arange(self.num_slots, device=self.device)
        self._out[rows, self._answer_pos.clamp(max=self.max_new_tokens)] = self._tokens
        if wide is not None:
            wide = wide & active
            self._wide_at.copy_(torch.where(wide, self._answer_pos, self._wide_at))
            self._wide_logits.copy_(torch.where(wide[:, None], logits, self._wide_logits))
        else:
            wide = torch.zeros_like(active)
        self._answer_pos.add_(self._active)
        self.cache.lengths.add_(self._active)  # free slots stay empty (they decode garbage at position 0)
        ended = active & ~wide & (torch.isin(self._tokens, self._stop_t) | (self._answer_pos >= self._cap))
        self._ended.logical_or_(ended)
        self._due.logical_or_(active & ~ended & ~wide & (self._answer_pos % self.loop_check_every == 0))
        self._active.mul_(~(ended | wide))
        self._flags = torch.stack([self._ended.any(), (self._wide_at >= 0).any(), self._due.any()]).long()
        self._flags = torch.cat([self._flags, self._generated.view(1)])

    def _capture(self) -> None:
        """Record the decode step as a CUDA graph (the small model is launch-bound without one)."""
        state = (self._tokens, self._answer_pos, self._out, self.cache.lengths, self._active, self._ended, self._due,
                 self._wide_at, self._generated)
        saved = [t.clone() for t in state]
        t0 = time.perf_counter()
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles flex (and the step), settles the allocator
                    self._step_fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._step_fn()
            self._graph = graph
            # the start-up a user waits for: ~40 s compiling on a cold inductor cache, less on a warm one;
            # counted apart from the phases, so a rate can leave it out (``capture`` in ``seconds``)
            self.seconds["capture"] += time.perf_counter() - t0
            logger.info("decode step %scaptured in %.1f s", "compiled and " if self.decode_compile else "",
                        self.seconds["capture"])
        finally:
            torch.cuda.synchronize()
            for t, v in zip(state, saved):
                t.copy_(v)  # the warm-up and capture steps advanced the state: undo

    @torch.no_grad()
    def _ensure_graph(self) -> None:
        """Capture the decode step on first use (compiling it first with ``decode_compile``)."""
        if self.cuda_graph and self._graph is None:
            try:
                self._capture()
            except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly, say so once
                self._capture_failed(e)

    def _launch(self) -> None:
        """Start one decode step for every slot (a graph replay on GPU: asynchronous)."""
        self._ensure_graph()
        if self._graph is not None:
            self._graph.replay()
            return
        try:
            self._step_fn()
        except Exception as e:  # noqa: BLE001 - the compiled step, then flex, give way to what runs here
            if self.decode_compile:
                logger.warning("the compiled decode step failed (%s: %s); decoding with the eager step",
                               type(e).__name__, str(e)[:200])
                self._uncompile()
            elif self.use_flex:
                logger.warning("flex_attention decoding failed (%s: %s); using SDPA over the whole cache width",
                               type(e).__name__, str(e)[:200])
                self.use_flex = False
            else:
                raise
            self._launch()

    def _uncompile(self) -> None:
        self.decode_compile = False
        self._step_fn = self._step

    def _capture_failed(self, error: Exception) -> None:
        """A capture failed: retry with the eager step if the step was compiled, else decode eagerly."""
        torch.cuda.synchronize()
        if self.decode_compile:
            logger.warning("CUDA graph capture of the compiled decode step failed (%s: %s); capturing the eager "
                           "step", type(error).__name__, str(error)[:200])
            self._uncompile()
            try:
                self._capture()
                return
            except Exception as e:  # noqa: BLE001
                error = e
                torch.cuda.synchronize()
        logger.warning("CUDA graph capture of the decode step failed (%s: %s); decoding eagerly",
                       type(error).__name__, str(error)[:200])
        self.cuda_graph = False

    @torch.no_grad()
    def _launch_window(self) -> None:
        """Queue ``decode_window`` decode steps (graph replays on GPU: asynchronous)."""
        self._ensure_graph()  # before the clock starts: a first compile and capture are not decode time
        start = self.gpu.start("decode")
        for _ in range(self.decode_window):
            self._launch()
        self.gpu.stop("decode", start)

    @torch.no_grad()
    def _collect(self) -> tuple[bool, bool, int]:
        """Wait for the launched steps; (any slot ended, any answer due a loop check, tokens generated),
        first redoing, exactly and eagerly, the rare samples of a nucleus wider than the candidates
        (the slot then ends, is due, or is reactivated for the next window)."""
        any_ended, any_wide, any_due, generated = self._flags.tolist()
        self.gpu.read()
        self._generated.zero_()
        rows = (self._wide_at >= 0).nonzero()[:, 0] if any_wide else None  # none left if only a cut answer's
        if rows is not None and len(rows):
            self.redone += len(rows)
            at = self._wide_at[rows]
            fixed = sample_full(self._wide_logits[rows].float() / self.temperature, self._keys[rows], at, self.seed,
                                 self.top_p)
            self._tokens[rows] = fixed
            self._out[rows, at] = fixed
            length = at + 1  # the slot stopped right after this token: its answer length
            ended = torch.isin(fixed, self._stop_t) | (length >= self._cap[rows])
            due = ~ended & (length % self.loop_check_every == 0)
            self._ended[rows] = ended
            self._due[rows] = due
            self._active[rows] = (~ended).long()
            self._wide_at[rows] = -1
            any_ended = any_ended or bool(ended.any())
            any_due = any_due or bool(due.any())
        return bool(any_ended), bool(any_due), int(generated)

    def _index(self, values: Any, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """``values`` (a list or an array) on the device; on CUDA copied from pinned memory without
        waiting for the queued steps (a pageable copy synchronises with them), so the host can
        prepare and launch a prefill while a decode window still runs."""
        t = torch.from_numpy(values).to(dtype) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _pick(self, logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor):
        """(tokens, rows to redo exactly or None): the branch-free sample a graph can hold."""
        return keyed_sample_candidates(logits, keys, positions, seed=self.seed, temperature=self.temperature,
                                       top_p=self.top_p)

    def _sample(self, logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The exact keyed sample (eager: the prefill's first tokens)."""
        out, wide = self._pick(logits, keys, positions)
        redo_wide_rows(out, wide, logits, keys, positions, seed=self.seed, temperature=self.temperature,
                       top_p=self.top_p)
        return out

    # -- the loop

    def _completion(self, request: Request, answer: list[int], stopped: bool, loop_start: Optional[int],
                    slot: Optional[int] = None) -> Completion:
        n = len(answer) + stopped
        if loop_start is not None and self.stop_on_loop:
            return Completion(request, answer[:loop_start], "loop", n, loop_start=loop_start, slot=slot)
        return Completion(request, answer, "stop" if stopped else "length", n, loop_start=loop_start, slot=slot)

    def _find_loop(self, answer: Sequence[int]) -> Optional[int]:
        return self.loop_detector.find(answer) if self.loop_detector is not None else None

    def generate(self, pending: collections.deque) -> Iterator[Completion]:
        """Answer the requests of ``pending`` (popped from the left), yielding completions as they end.

        The caller may append requests to ``pending`` while it consumes completions (the next turn
        of a conversation); the generator ends when ``pending`` is empty and every slot is free.
        """
        config = self.model.config
        saved = config._attn_implementation
        config._attn_implementation = ATTN_NAME
        try:
            yield from self._generate(pending)
        finally:
            config._attn_implementation = saved

    def _start_state(self) -> None:
        dev, S = self.device, self.num_slots
        self.gpu.pause()  # the time since an earlier run is not idle time of this one
        if getattr(self, "_tokens", None) is None:  # fixed tensors: a captured graph reads them
            self._tokens = torch.zeros(S, dtype=torch.long, device=dev)
            self._keys = torch.zeros(S, dtype=torch.long, device=dev)
            self._answer_pos = torch.zeros(S, dtype=torch.long, device=dev)
            self._active = torch.zeros(S, dtype=torch.long, device=dev)
            self._ended = torch.zeros(S, dtype=torch.bool, device=dev)
            self._due = torch.zeros(S, dtype=torch.bool, device=dev)
            self._out = torch.zeros((S, self.max_new_tokens + 1), dtype=torch.long, device=dev)
            self._cap = torch.full((S,), self.max_new_tokens, dtype=torch.long, device=dev)  # each slot's token cap
            self._stop_t = torch.tensor(sorted(self.stop_ids), dtype=torch.long, device=dev)
            self._wide_at = torch.full((S,), -1, dtype=torch.long, device=dev)  # answer position of a redo, -1: none
            self._generated = torch.zeros((), dtype=torch.long, device=dev)
            sampled = self.temperature > 0 and self.top_p < 1.0  # only then can a sample be too wide
            vocab = self.lm_head.weight.shape[0] if sampled else 1
            self._wide_logits = torch.zeros((S, vocab), dtype=torch.float32, device=dev)
        for t in (self._tokens, self._keys, self._answer_pos, self._active, self._ended, self._due, self.cache.lengths,
                  self._generated):
            t.zero_()
        self._wide_at.fill_(-1)
        self._cap.fill_(self.max_new_tokens)

    def _check(self, req: Request) -> None:
        if not 0 < len(req.prompt_ids) <= self.max_prompt_tokens:
            raise ValueError(f"request {req.key}: prompt of {len(req.prompt_ids)} tokens; the engine "
                             f"takes 1..{self.max_prompt_tokens}")
        if req.max_new_tokens is not None and not 0 < req.max_new_tokens <= self.max_new_tokens:
            raise ValueError(f"request {req.key}: max_new_tokens {req.max_new_tokens}; the engine "
                             f"takes 1..{self.max_new_tokens}")

    def _cap_of(self, req: Request) -> int:
        return self.max_new_tokens if req.max_new_tokens is None else req.max_new_tokens

    def _claim_follow_ups(self, pending: collections.deque, held: dict[int, tuple[Completion, np.ndarray]],
                          ready: list[tuple[int, Request, int]], free: list[int]) -> None:
        """Move the follow-ups of ``held`` slots from ``pending`` to ``ready`` (slot, request, tokens
        of the slot's KV to keep); free the held slots nobody follows."""
        claimed: set[int] = set()
        if self.reuse_slots and any(r.after is not None for r in pending):
            rest = []
            for req in pending:
                after = req.after
                slot = None if after is None else after.slot
                if slot is None or slot in claimed or slot not in held or held[slot][0] is not after:
                    rest.append(req)  # not a follow-up of a held slot: a fresh prefill
                    continue
                self._check(req)
                kv = held[slot][1]
                new = np.asarray(req.prompt_ids[: len(kv)], dtype=np.int64)
                differ = np.flatnonzero(new != kv[: len(new)])
                common = int(differ[0]) if len(differ) else len(new)
                self.prefix_short += common < len(kv)
                # at least the prompt's last token is run: its logits give the first answer token
                ready.append((slot, req, min(common, len(req.prompt_ids) - 1)))
                claimed.add(slot)
            if claimed:
                pending.clear()
                pending.extend(rest)
        unclaimed = [s for s in held if s not in claimed]
        if unclaimed:
            free.extend(unclaimed)
            self.cache.lengths[self._index(unclaimed)] = 0
        held.clear()

    def _chunks(self, items: list[tuple[int, Request, int]]) -> Iterator[list[tuple[int, Request, int]]]:
        """``items`` (slot, request, start) in packed prefill chunks: fresh and continuing rows
        together, sorted by the tokens to prefill, each chunk within ``max_prefill_tokens`` real tokens."""

        def todo(it: tuple[int, Request, int]) -> int:
            return len(it[1].prompt_ids) - it[2]

        chunk, tokens = [], 0
        for it in sorted(items, key=todo):
            if chunk and tokens + todo(it) > self.max_prefill_tokens:
                yield chunk
                chunk, tokens = [], 0
            chunk.append(it)
            tokens += todo(it)
        if chunk:
            yield chunk

    def _generate(self, pending: collections.deque) -> Iterator[Completion]:
        self._start_state()
        requests: dict[int, Request] = {}  # slot -> its request
        free = list(range(self.num_slots - 1, -1, -1))
        held: dict[int, tuple[Completion, np.ndarray]] = {}  # slot -> (its completion, the token ids in its KV)
        ready: list[tuple[int, Request, int]] = []  # follow-ups in their own slots, waiting for a prefill
        in_flight = False  # a window of steps launched and not yet collected
        every = self.loop_check_every
        while True:
            done: list[Completion] = []
            if held:
                self._claim_follow_ups(pending, held, ready, free)
            # Refill once enough slots are idle: a prefill is one eager forward, and refilling one
            # or two slots per step would spend more time in prefills than in decoding.
            idle = len(free) + len(ready)
            refill = idle >= self.min_refill or len(free) >= len(pending) or not requests
            if refill and (ready or (free and pending)):
                items, ready = ready, []
                self.continued += len(items)
                while free and pending:
                    self._check(pending[0])
                    items.append((free.pop(), pending.popleft(), 0))
                for chunk in self._chunks(items):
                    self._start(chunk, requests)
            if not requests:
                yield from self._handed(done)
                if not pending and not ready and not held:
                    return
                continue
            t0 = time.perf_counter()
            if not in_flight:
                self._launch_window()
            any_ended, any_due, generated = self._collect()
            in_flight = False
            self.steps += self.decode_window
            self.generated_tokens += generated
            t1 = time.perf_counter()
            self.seconds["decode"] += t1 - t0
            finished: dict[int, tuple[list[int], bool, Optional[int]]] = {}
            rows_of: dict[int, np.ndarray] = {}
            checking = 0.0
            ended = self._ended.nonzero()[:, 0].tolist() if any_ended else []
            due = self._due.nonzero()[:, 0].tolist() if any_due else []
            launching = 0.0
            if ended or due:
                slots = ended + due
                lengths = self._answer_pos[slots].tolist()
                rows = self._out[slots].cpu().numpy()
                self._ended[slots] = False
                self._due[slots] = False
                length_of = dict(zip(slots, lengths))
                row_of = dict(zip(slots, rows))
                if self.stop_on_loop and due:
                    # each answer is checked at its own lengths k, 2k, ... (within a window an answer
                    # is due at most once, and it may have gone on past its due length): the cut does
                    # not depend on the batch, and the checks (and the answers they end) spread over
                    # the steps. Checked before an end in the same window: the end came later.
                    t2 = time.perf_counter()
                    for s in due:
                        n = length_of[s] // every * every
                        if s not in requests or n < self.loop_detector.min_tokens:
                            continue
                        row = row_of[s]
                        start = self._find_loop(row[:n])
                        if start is not None:
                            finished[s] = (row[:n].tolist(), False, start)
                            rows_of[s] = row[: n - 1]
                            self.generated_tokens -= length_of[s] - n  # the window's tokens past the check
                    checking = time.perf_counter() - t2
                    self.seconds["loop_check"] += checking
                for s in ended:
                    if s in finished:
                        continue
                    n, row = length_of[s], row_of[s]
                    stopped = int(row[n - 1]) in self.stop_ids
                    answer = row[: n - 1 if stopped else n].tolist()
                    finished[s] = (answer, stopped, self._find_loop(answer))
                    rows_of[s] = row[: n - 1]  # the answer tokens whose K/V is in the slot
            if finished:
                gone = []
                for s, (answer, stopped, start) in finished.items():
                    req = requests.pop(s)
                    done.append(self._completion(req, answer, stopped, start, s if req.hold else None))
                    if req.hold:
                        held[s] = (done[-1], np.concatenate([np.asarray(req.prompt_ids, dtype=np.int64), rows_of[s]]))
                    else:
                        free.append(s)
                        gone.append(s)
                idx = self._index(list(finished))
                self._active[idx] = 0
                if gone:  # a held slot keeps its fill: decode steps write past it, never into it
                    self.cache.lengths[self._index(gone)] = 0
            if requests and not in_flight:
                # The next window runs on the GPU while the caller handles ``done`` (decoding, the next
                # turn's template, writing): slots refilled meanwhile join the window after. Answers
                # are keyed by request and position, so this changes no output. (On a CPU the steps
                # run here, synchronously: counted as decode.)
                t3 = time.perf_counter()
                self._launch_window()
                launching += time.perf_counter() - t3
                in_flight = True
            self.seconds["decode"] += launching
            self.seconds["host"] += time.perf_counter() - t1 - checking - launching
            yield from self._handed(done)

    def _handed(self, done: list[Completion]) -> Iterator[Completion]:
        """Yield ``done``, timing the caller's work on each (``seconds["caller"]``); only a step
        launched ahead keeps the GPU busy meanwhile."""
        for c in done:
            t0 = time.perf_counter()
            yield c
            self.seconds["caller"] += time.perf_counter() - t0

    def _start(self, chunk: list[tuple[int, Request, int]], requests: dict[int, Request]) -> None:
        """Prefill one chunk and start its answers, without waiting for the GPU: the first tokens
        stay there. An answer that ends at its first token is flagged ended, and a first sample whose
        nucleus is wider than the candidates is flagged for the exact redo, as a decode step does;
        the next collect handles both. (Waiting here for the first tokens would make the host wait
        for the decode window in flight too.)"""
        slots = [it[0] for it in chunk]
        t0 = time.perf_counter()
        start = self.gpu.start("prefill")
        logits, keys = self._prefill_logits(slots, [it[1] for it in chunk], [it[2] for it in chunk])
        first, wide = self._pick(logits, keys, torch.zeros_like(keys))
        idx = self._index(slots)
        self._tokens[idx] = first
        self._out[idx, 0] = first
        self._keys[idx] = keys
        self._answer_pos[idx] = 1
        caps = self._index([self._cap_of(it[1]) for it in chunk])
        self._cap[idx] = caps
        ended = torch.isin(first, self._stop_t) | (caps <= 1)
        if wide is not None:
            ended &= ~wide
            self._wide_at[idx] = torch.where(wide, 0, -1)
            self._wide_logits[idx] = logits.float()  # read only for the wide rows
        else:
            wide = torch.zeros_like(ended)
        self._ended[idx] = ended
        self._active[idx] = (~(ended | wide)).long()
        self.gpu.stop("prefill", start)
        continuing = sum(it[2] > 0 for it in chunk)
        kind = ("prefill_fresh" if not continuing else "prefill_continue" if continuing == len(chunk)
                else "prefill_mixed")
        self.seconds[kind] += time.perf_counter() - t0
        self.prefills[kind] += 1
        self.generated_tokens += len(chunk)
        self.reused_tokens += sum(it[2] for it in chunk)
        for s, req, _ in chunk:
            requests[s] = req
