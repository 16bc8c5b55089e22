"""The decoding engine's fixed-shape loops, plain and speculative, at any temperature and any number of
rows (one: what `DFlashSpeculativeDecoder.generate(decode="graphs")` and `autoregressive_generate` run);
each step a captured CUDA graph (`use_graphs`), or the same code run eagerly (on a CPU, in tests).

What a serving engine runs at concurrency R: R prompts decode together, one draft forward drafts every
row's block and one target forward verifies every row's block. Per speculative step (block size B, a row's
position p of its last verified token):
1. draft: the row's new context features (its last verify's B tokens) -> the draft's context cache at their
   positions, block `[last, MASK x (B-1)]` at p..p+B-1 -> B-1 proposals written into the verify input;
2. verify: the target runs the B tokens at p..p+B-1 against its static cache (writing their K/V there),
   its features of the B tokens go to the draft's next input, and the accepted length n, the next first
   token and p + n + 1 are computed in place, so the host reads back only the new tokens, once a step.

- One static cache per model with R rows ([R, H, L, D]), indexed by absolute position; each row
  writes at its own positions (`static_cache.write_at`), and a row's rejected entries stay where
  they were written, hidden by that row's mask (key j visible to a query at p iff j <= p; j < p for
  the draft's context), until a later step overwrites them.
- Prompts are prefilled eagerly (the prefill is not part of decode time), many in one forward
  (`prefill_batches`: shortest first, right-padded; a pad's K/V sits past its row's position, hidden by
  the row's mask until the row's own steps overwrite it), and the first draft block of each row is
  drafted eagerly against its whole prompt, as the eager reference does. These eager forwards have a new
  shape each time, so they run SDPA without cuDNN, whose per-shape plan builds they would pay
  (`nemo_dflash.engine.attention`); the captured steps keep PyTorch's choice.
- Every later step has the same shapes: R rows, and an attention view of the smallest multiple of
  `static_decode.LENGTH_BUCKET` positions covering every live row's furthest query. One graph per
  (step, view length), captured up front.
- A row that has finished stays in the batch (the shapes never change) with its position frozen
  (`alive`, a device buffer the host rewrites only when a row stops).
- **Continuous batching** and **requests** (`serve`): `engine/serve_loop.py`, the one host loop of both runners.

At T=0 each row's answer and acceptance lengths are those of the eager reference decoder
(`spec_decode`; in exact arithmetic, tested in fp32 on CPU, where the same code runs eagerly). At T > 0
the captured steps also sample (speculative sampling: accept slot k with probability min(1, p/q), else
draw from norm(max(p - q, 0)); the bonus from p) with keyed noise (`sampling.keyed_proposals`,
`sampling.keyed_verify`): every row has its prompt's key, and each uniform is a hash of (key, position[, token]), so a row's draws do not depend on the
other rows, a step is still one replay and one read-back, and the eager and captured steps give the same
answers. A position's noise only ever decides one kept token: a later step samples only positions past
the last kept one. On a GPU that sampling math (softmaxes over the vocabulary, hashes, the draws' scans) runs
compiled, a few fused kernels instead of ~40 (`EngineOptions.fuse_sampling`), eager and captured steps alike.

A runner is made under one `EngineOptions` (the engine's speed settings, answers unchanged) and cached by it with
its kind, rows and mode (`_runner`): a call with other options gets its own runner.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import nn

from nemo_dflash.engine.attention import eager_attention_backends
from nemo_dflash.engine.acceptance import greedy_accepted
from nemo_dflash.engine.options import DEFAULT_OPTIONS, EngineOptions
from nemo_dflash.engine.output import DEFAULT_MAX_NEW_TOKENS, GenerationOutput, stop_set
from nemo_dflash.engine.sampling import DRAFT_STREAM, GREEDY, SamplingParams, keyed_slot_draws
from nemo_dflash.engine.serve_loop import (  # noqa: F401  (noise_key: its old import path)
    Completion, OnDone, Request, common_prefix, generate_outputs, noise_key, serve_requests,
)
from nemo_dflash.engine.static_cache import (
    FilledBlocks, StaticDraftContextCache, TargetStaticCache, attn_implementation, check_static_target,
    engine_attention, filled_blocks_on, query_groups, visible_to_mask,
)
from nemo_dflash.engine.static_decode import (
    BucketedSteps, SampledStepState, step_key, cache_length_for, make_step, view_length,
)


def check_batch(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    """A one-line ValueError for inputs the batched decoders cannot take."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("batched decoding needs at least one prompt, each of at least one token")


def _rows(prompts: Sequence[Sequence[int]], max_new_tokens: int, rows: Optional[int]) -> int:
    """The batch's row count (default: one per prompt; fewer rows than prompts: continuous batching),
    once the inputs suit this decoder."""
    check_batch(prompts, max_new_tokens)
    rows = len(prompts) if rows is None else int(rows)
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    return rows


# Entering prompts are prefilled together, right-padded, up to this many padded tokens a forward (only each
# prompt's last position reaches the LM head, so a forward's memory is its activations').
PREFILL_TOKENS = 16384
WINDOW_MAX = 64  # plain steps a host read-back, at most


def prefill_batches(lengths: Sequence[int]) -> list[list[int]]:
    """The prefill's forwards for prompts of these lengths: indices, shortest first (the least padding), in
    batches whose rows x longest prompt is at most PREFILL_TOKENS (a longer prompt makes its own forward)."""
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if batches and (len(batches[-1]) + 1) * lengths[i] <= PREFILL_TOKENS:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class _Rows:
    """What both batched runners share: R rows of one target on a static cache, their positions
    and live flags on the device, the eager prefill, and the one host loop (`serve`: engine/serve_loop.py)."""

    reuses_prefix = False  # a follow-up may keep the K/V its row holds (the plain runner)

    def __init__(self, model: nn.Module, rows: int, max_len: int, use_graphs: bool,
                 options: EngineOptions = DEFAULT_OPTIONS) -> None:
        check_static_target(model)
        self.model = model
        self.options = options
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.attn = attn_implementation(model)
        self.rows, self.max_len, self.use_graphs = int(rows), int(max_len), use_graphs
        self.kv = TargetStaticCache(model, self.max_len, self.device, self.dtype, batch=self.rows)
        self.key_index = torch.arange(self.max_len, device=self.device)
        self.pos = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        self.alive = torch.ones(self.rows, dtype=torch.long, device=self.device)  # 1: still decoding
        self.sampling: Optional[SamplingParams] = None  # the call's setting (T > 0), set by `serve`
        # the captured target steps read filled KV blocks
        self.filled_blocks = filled_blocks_on(self.device, model, options.filled_blocks)
        self.row_requests: list[Optional[Request]] = [None] * self.rows  # the request each row holds (`serve`)
        # what a call did: tokens generated, prompt tokens prefilled and kept from a held row, follow-ups that
        # continued in their row (of them, rows whose tokens were not all a prefix of the new prompt), wall time
        # by phase (prefill, decode, host, caller: between yields)
        self.generated_tokens = self.prefill_tokens = self.reused_tokens = 0
        self.continued = self.prefix_short = 0
        self.seconds: collections.Counter = collections.Counter()

    def filled_mask(self, queries: int) -> Optional[FilledBlocks]:
        """The flex mask of a target step of `queries` queries a row (None: SDPA over the bucketed view)."""
        if not self.filled_blocks:
            return None
        return FilledBlocks(self.rows, queries, self.max_len, query_groups(self.model), self.device)

    def target_view(self, need: int, steps: BucketedSteps) -> int:
        """A target step's view: the whole cache when it reads filled blocks, else `steps`' bucket."""
        return self.max_len if self.filled_blocks else steps.view(need)

    def causal(self, q_pos: torch.Tensor, view_len: int) -> torch.Tensor:
        """[R, 1, Q, view] mask: key j visible to row r's query at position p iff j <= p."""
        visible = self.key_index[:view_len].view(1, 1, -1) <= q_pos.unsqueeze(-1)
        return visible_to_mask(visible.unsqueeze(1), self.attn, self.dtype)

    def prefill_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], starts: Sequence[int],
                     view_len: int) -> torch.Tensor:
        """Prompts into those rows of the cache from `starts` (the K/V before a start is the row's already), in
        one eager forward, right-padded (a pad's K/V sits past its row's position, hidden by the row's mask until
        a step overwrites it); the logits [k, V] at each prompt's last token."""
        lengths = torch.tensor([len(p) - s for p, s in zip(prompts, starts)], device=self.device)
        width = max(len(p) - s for p, s in zip(prompts, starts))
        ids = torch.tensor([list(p[s:]) + [p[-1]] * (width - len(p) + s) for p, s in zip(prompts, starts)],
                           device=self.device)
        positions = torch.tensor(starts, device=self.device).view(-1, 1) + torch.arange(width, device=self.device)
        fresh = not any(starts)  # whole prompts: attention over the forward's own K/V (`TargetStaticCache.fresh`)
        self.kv.write_positions, self.kv.view_len, self.kv.fresh = positions, view_len, fresh
        self.kv.rows = torch.tensor(rows, device=self.device)
        try:  # an eager forward of a new shape: attention kernels without cuDNN's per-shape plans
            with engine_attention(self.model, fold_gqa=self.options.fold_gqa), \
                    eager_attention_backends(self.device, self.options.avoid_cudnn_attention):
                mask = self.causal(positions, width if fresh else view_len)
                hidden = self.decoder(input_ids=ids, position_ids=positions, past_key_values=self.kv.cache,
                                      use_cache=True, attention_mask=mask).last_hidden_state
        finally:
            self.kv.rows, self.kv.fresh = None, False
        self.prefill_tokens += int(lengths.sum())
        return self.lm_head(hidden[torch.arange(len(prompts), device=self.device), lengths - 1])

    def _prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], starts: Sequence[int],
                 keep: Optional[Callable[[list[int]], None]] = None) -> torch.Tensor:
        """Prompts into `rows` (prompt j into rows[j], from starts[j]) in the forwards `prefill_batches` plans,
        each attending over its longest prompt's bucket; `keep(its rows)` runs after each forward (the
        speculative runner keeps its features there). The last logits [k, V], in the prompts' order."""
        last: list[torch.Tensor] = [None] * len(prompts)  # type: ignore[list-item]
        for batch in prefill_batches([len(p) - s for p, s in zip(prompts, starts)]):
            batch_rows = [rows[i] for i in batch]
            logits = self.prefill_rows(batch_rows, [prompts[i] for i in batch], [starts[i] for i in batch],
                                       view_length(max(len(prompts[i]) for i in batch), self.max_len,
                                                   self.options.use_buckets))
            if keep is not None:
                keep(batch_rows)
            for j, i in enumerate(batch):
                last[i] = logits[j]
        return torch.stack(last)

    def set_alive(self, stopped: list[bool]) -> None:
        self.alive.copy_(torch.tensor([0 if s else 1 for s in stopped], device=self.device))

    def enter(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], keys: Sequence[int],
              last: torch.Tensor) -> list[int]:
        """Prompts entering `rows`, prefilled: each one's first token from its prefill's last logits (`last`
        [k, V]): the argmax, or (T > 0) its keyed draw for position len(prompt), as a step draws; the rows'
        noise keys and positions set. Returns the first tokens."""
        idx = torch.tensor(rows, device=self.device)
        at = torch.tensor([len(p) for p in prompts], device=self.device)
        if self.state is not None:
            self.state.key[idx] = torch.tensor(list(keys), device=self.device)
        toks = self._pick(last, at, idx)
        self.pos[idx] = at
        return toks.tolist()

    def _pick(self, logits: torch.Tensor, positions: torch.Tensor, rows: Optional[torch.Tensor] = None
              ) -> torch.Tensor:
        """The tokens [k] of `rows` (None: every row) for their logits [k, V], each at its position [k]: the argmax,
        or (T > 0) the row's keyed draw. (Tests replace it to force answers: `row_requests` says whose they are.)"""
        if self.state is None:
            return logits.argmax(dim=-1)
        return self.state.next_tokens(logits, self.filtered, positions, rows=rows)

    def _reusable(self, held: Sequence[int], prompt: Sequence[int]) -> int:
        """Tokens of a held row a follow-up keeps (`common_prefix`)."""
        return common_prefix(held, prompt)

    # ---- what each runner supplies to the one loop below
    one_token_steps: bool  # a step's tokens are one forward each (plain), or one verify's (speculative)
    sampled: bool
    filtered: bool
    state: Optional[SampledStepState]

    def _room(self, max_new_tokens: int) -> int:
        """Cache positions a row needs past its prompt."""
        raise NotImplementedError

    def _enter_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], starts: Sequence[int],
                    keys: Sequence[int]) -> tuple[list[int], list[Any]]:
        """Prompts entering `rows` (from `starts`), prefilled together: (their first tokens, what the next
        step needs of each or None)."""
        raise NotImplementedError

    def _decode_step(self, need: int, fresh: dict[int, Any], all_fresh: bool) -> list[list[int]]:
        """One step of every row, its live rows' queries reaching position `need`; `fresh` holds what rows
        entered since the last step left (`_enter_rows`' second value; `all_fresh`: every live row entered so).
        Returns each row's new tokens."""
        raise NotImplementedError

    def _reset(self) -> None:
        """A call's start: every row free, position 0 (what a row held before stays hidden by its mask)."""
        self.pos.zero_()
        self.alive.zero_()

    @torch.no_grad()
    def serve(self, pending: "collections.deque[Request]", max_new_tokens: int, stop_ids: set[int],
              sampling: Optional[SamplingParams] = None, seed: int = 0, loop_detector: Any = None,
              stop_on_loop: bool = False, loop_check_every: int = 128, refill_rows: int = 1,
              reuse_prefix: bool = True) -> Iterator[Completion]:
        """Answer the requests of `pending` (popped from the left), yielding each completion as its answer
        ends; the caller may append requests meanwhile (a conversation's next turn). Prompts enter rows as
        answers end: the rows freed by one step enter together (one prefill), once `refill_rows` rows are free
        or no row decodes. The one host loop of both runners: a step, one read-back, then each live row's new
        tokens kept up to a stop token or its cap. `loop_detector` (`.find(tokens)` -> a loop's start or None,
        `.min_tokens`) fills each completion's `loop_start`; with `stop_on_loop` each answer is also checked at
        its own lengths k, 2k, ... (k = `loop_check_every`) and a looping one ends there, cut at the loop.
        `reuse_prefix=False`: a follow-up in its row is prefilled whole (for comparison)."""
        yield from serve_requests(self, pending, max_new_tokens, stop_ids, sampling, seed, loop_detector,
                                  stop_on_loop, loop_check_every, refill_rows, reuse_prefix)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: set[int],
                 sampling: Optional[SamplingParams] = None, generator: Optional[torch.Generator] = None,
                 on_done: Optional[OnDone] = None, refill_rows: int = 1) -> list[GenerationOutput]:
        """Every prompt's answer (then the follow-ups' that `on_done` returned, in the order they came), through
        `serve`; each prompt's noise key (T > 0) drawn from `generator` in that order. `prefill_time_s` is the
        first rows' prefill, `decode_time_s` the rest of the call (later prefills included)."""
        return generate_outputs(self, prompts, max_new_tokens, stop_ids, sampling, generator, on_done, refill_rows)


class BatchedStaticPlainRunner(_Rows):
    """R rows of one-token decoding, one captured graph per view length; at T > 0 each step draws every row's
    token with keyed noise (a key per row, `SampledStepState.next_tokens`). `window` steps are replayed per host
    read-back (a row's tokens past its stop or cap within a window are dropped, their K/V written past its
    answer where nothing reads them); prompts enter rows between windows."""

    one_token_steps = True
    reuses_prefix = True

    def __init__(self, model: nn.Module, rows: int, max_len: int, use_graphs: bool, sampled: bool = False,
                 filtered: bool = False, k_cap: int = 0, options: EngineOptions = DEFAULT_OPTIONS) -> None:
        super().__init__(model, rows, max_len, use_graphs, options)
        self.sampled, self.filtered = sampled, sampled and filtered
        self.state = (SampledStepState(self.rows, self.device, k_cap=k_cap if self.filtered else 0, options=options)
                      if sampled else None)
        self.tok = torch.zeros(self.rows, 1, dtype=torch.long, device=self.device)
        self.window = 1  # steps a host read-back (set per call by `batched_static_autoregressive_generate`)
        self.outs = torch.zeros(WINDOW_MAX, self.rows, dtype=torch.long, device=self.device)  # a window's tokens
        self.out_i = torch.zeros((), dtype=torch.long, device=self.device)  # the next step's row in `outs`
        self.filled = self.filled_mask(1)
        fuse = options.fuse_elementwise
        self.steps = BucketedSteps(
            lambda n: make_step(lambda: self._step(n), self.device, use_graphs, model, fuse=fuse), self.max_len,
            "the batched 1-token step", use_graphs, buckets=not self.filled_blocks, options=options)

    @property
    def step_key(self) -> tuple:
        """The settings its steps were made under (`static_decode.step_key`: the bucket and the options)."""
        return self.steps.step_key

    def _step(self, view_len: int) -> torch.Tensor:
        """One token a row at its position; returns the logits [R, V] (the loop reads `self.tok`)."""
        q_pos = self.pos.view(-1, 1)
        self.kv.write_positions, self.kv.view_len = q_pos, view_len
        if self.filled is not None:
            self.filled.set(q_pos)
        with engine_attention(self.model, self.filled, self.options.fold_gqa):
            out = self.model(input_ids=self.tok, position_ids=q_pos, past_key_values=self.kv.cache, use_cache=True,
                             attention_mask=self.causal(q_pos, view_len))
        logits = out.logits[:, -1]
        self.tok.copy_(self._pick(logits, self.pos + 1).view(-1, 1))
        self.outs.index_copy_(0, self.out_i.view(1), self.tok.view(1, -1))
        self.out_i.add_(1)
        self.pos.add_(self.alive)
        return logits

    def _room(self, max_new_tokens: int) -> int:
        return max_new_tokens + self.window

    def _enter_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], starts: Sequence[int],
                    keys: Sequence[int]) -> tuple[list[int], list[Any]]:
        toks = self.enter(rows, prompts, keys, self._prefill(rows, prompts, starts))
        self.tok[torch.tensor(rows, device=self.device), 0] = torch.tensor(toks, device=self.device)
        return toks, [None] * len(rows)

    def _decode_step(self, need: int, fresh: dict[int, Any], all_fresh: bool) -> list[list[int]]:
        step = self.steps.get(self.target_view(need + self.window, self.steps))
        self.out_i.zero_()
        for _ in range(self.window):
            step.replay()
        return self.outs[: self.window].t().tolist()  # the window's one host sync


class BatchedStaticSpecRunner(_Rows):
    """R rows of speculative decoding for one `DFlashSpeculativeDecoder`: per step, the draft
    block of every row and the B-token verify of every row, each one captured graph per view length."""

    one_token_steps = False

    def __init__(self, decoder: Any, rows: int, max_len: int, use_graphs: bool, sampled: bool = False,
                 filtered: bool = False, draft_greedy: bool = False, k_cap: int = 0,
                 options: EngineOptions = DEFAULT_OPTIONS) -> None:
        super().__init__(decoder.target.model, rows, max_len, use_graphs, options)
        self.dec = decoder
        self.sampled = sampled  # the captured steps sample (T > 0), or accept greedily
        # baked into the captured steps: top-p / top-k filter (values in
        # buffers), the draft proposes its argmax (one-hot q)
        self.filtered, self.draft_greedy = sampled and filtered, sampled and draft_greedy
        R, B, dev = self.rows, decoder.block_size, self.device
        self.B = B
        self.selector = bool(getattr(decoder.draft, "has_selector", False))
        self.draft_hidden: Optional[torch.Tensor] = None
        self.dcache = StaticDraftContextCache(len(decoder.draft.layers), self.max_len, batch=R)
        self.blk = torch.zeros(R, B, dtype=torch.long, device=dev)  # verify input: [last, proposals] a row
        self.ctx_start = torch.zeros(R, dtype=torch.long, device=dev)  # first position of each row's new context
        self.arange_b = torch.arange(B, device=dev)
        self.mask_ids = torch.full((R, B - 1), decoder.mask_token_id, dtype=torch.long, device=dev)
        self.block_visible = torch.ones(R, B, dtype=torch.bool, device=dev)
        n_feat = len(decoder.target.target_layer_ids) * self.model.config.hidden_size
        self.feats = torch.zeros(R, B, n_feat, dtype=self.dtype, device=dev)  # each row's verified features
        self.result = torch.zeros(R, B + 1, dtype=torch.long, device=dev)  # [n_accepted, block tokens...] a row
        # each row's noise key, 1/T, the filters
        self.state = SampledStepState(R, dev, k_cap=k_cap if self.filtered else 0, options=options) if sampled else None
        if sampled:  # the draft's distributions, for the accept test
            self.q = torch.zeros(R, B - 1, decoder.lm_head.weight.shape[0], dtype=torch.float32, device=dev)
        self.after_draft: Optional[Callable[[], None]] = None  # test hook: overwrite the proposals in self.blk
        # Each lambda looks self._draft / self._verify up when it runs (tests wrap them).
        fuse = options.fuse_elementwise
        self.draft_steps = BucketedSteps(
            lambda n: make_step(lambda: self._draft(n), dev, use_graphs, decoder.draft, fuse=fuse), self.max_len,
            "the batched draft block", use_graphs, options=options) if B > 1 else None
        self.filled = self.filled_mask(B)
        self.verify_steps = BucketedSteps(
            lambda n: make_step(lambda: self._verify(n), dev, use_graphs, self.model, fuse=fuse), self.max_len,
            f"the batched {B}-token verify", use_graphs, buckets=not self.filled_blocks, options=options)

    @property
    def step_key(self) -> tuple:
        """The settings its steps were made under (`static_decode.step_key`: the bucket and the options)."""
        return self.verify_steps.step_key

    def _draft_forward(self, noise_ids: torch.Tensor, feats: torch.Tensor, ctx_pos: torch.Tensor,
                       pos: torch.Tensor, view_len: int) -> torch.Tensor:
        """Draft logits [rows, B-1, V] for blocks at `pos` [rows], new context `feats` [rows, C, F]
        written at `ctx_pos` [rows, C] (or [C]), attending over the context cache's first `view_len`
        positions (those before each row's `pos`) plus the block."""
        rows = noise_ids.shape[0]
        self.dcache.write_positions, self.dcache.view_len = ctx_pos, view_len
        ctx = ctx_pos if ctx_pos.dim() == 2 else ctx_pos.unsqueeze(0)
        position_ids = torch.cat([ctx.expand(rows, -1), pos.view(-1, 1) + self.arange_b], 1)
        visible = torch.cat([self.key_index[:view_len].view(1, -1) < pos.view(-1, 1),
                             self.block_visible[:rows]], 1).view(rows, 1, 1, -1)
        hidden = self.dec.draft(noise_embedding=self.dec.embed_tokens(noise_ids), target_hidden=feats,
                                position_ids=position_ids, attention_mask=visible, cache=self.dcache,
                                block_size=self.B)
        # a selector draft (DFlash2) proposes from its hidden states too: kept for `_propose`
        self.draft_hidden = hidden[:, 1:] if self.selector else None
        return self.dec.draft.slot_logits(hidden[:, 1:], self.dec.lm_head)

    def _draft(self, view_len: int) -> torch.Tensor:
        """The captured draft step: every row's block from its last verify's features, its proposals
        written into the block (the argmax, or keyed draws)."""
        ctx_pos = self.ctx_start.view(-1, 1) + self.arange_b
        noise = torch.cat([self.blk[:, :1], self.mask_ids], 1)
        logits = self._draft_forward(noise, self.feats, ctx_pos, self.pos, view_len)
        self._propose(logits, hidden=self.draft_hidden)
        return logits

    def _propose(self, logits: torch.Tensor, rows: slice = slice(None), hidden: Optional[torch.Tensor] = None) -> None:
        """Draft logits [R, B-1, V] (or those of `rows`) -> the proposals in the block: the argmax (T=0, or
        greedy proposals with a one-hot q), else one keyed draw per slot from the filtered softmax q, kept for
        the accept test. A selector draft (`hidden` given) walks its candidates instead (`_walk`)."""
        if hidden is not None:
            return self._walk(logits, rows, hidden)
        if not self.sampled or self.draft_greedy:
            tok = logits.argmax(dim=-1)
            if self.sampled:
                self.q[rows].zero_().scatter_(-1, tok.unsqueeze(-1), 1.0)
            self.blk[rows, 1:].copy_(tok)
            return
        q, proposals = self.state.proposals(logits, self.filtered, rows, self.pos[rows])
        self.q[rows].copy_(q)
        self.blk[rows, 1:].copy_(proposals)

    def _walk(self, logits: torch.Tensor, rows: slice, hidden: torch.Tensor) -> None:
        """A selector draft's proposals (DFlash2): the walk's argmax path (T=0, or greedy proposals with a one-hot
        q), else slot k drawn from the walk's q given the slot before, keyed by (row key, position of slot k)."""
        anchors = self.blk[rows, 0]
        if not self.sampled or self.draft_greedy:
            tok, _ = self.dec.draft.propose_block(hidden, logits, anchors)
            if self.sampled:
                self.q[rows].zero_().scatter_(-1, tok.unsqueeze(-1), 1.0)
            self.blk[rows, 1:].copy_(tok)
            return
        # slot k's keyed uniform (row key, position of slot k), all hashed at once: the walk then draws every slot
        # given each candidate before it together (`selector_walk`), the tokens `keyed_draw` slot by slot gave
        draws = keyed_slot_draws(DRAFT_STREAM, self.state.key[rows], self.pos[rows], logits.shape[1])
        tok, q = self.dec.draft.propose_block(hidden, logits, anchors, self.state.inv_temp, draws)
        self.q[rows].copy_(q)
        self.blk[rows, 1:].copy_(tok)

    def _first_draft_logits(self, rows: Sequence[int], prompt_feats: torch.Tensor, view_len: int) -> torch.Tensor:
        """Step 1 of those rows (prompts prefilled together, right-padded), eagerly: their blocks' draft logits
        [k, B-1, V] against their whole prompts (`prompt_feats` [k, C, F]; a pad's context sits at or past its
        row's position, where the draft's mask hides it)."""
        k, idx = prompt_feats.shape[0], torch.tensor(rows, device=self.device)
        self.dcache.rows = idx
        try:
            noise = torch.cat([self.blk[idx, :1], self.mask_ids[:k]], 1)
            ctx_pos = torch.arange(prompt_feats.shape[1], device=self.device)
            # a context of the prompt's length: a new shape
            with eager_attention_backends(self.device, self.options.avoid_cudnn_attention):
                return self._draft_forward(noise, prompt_feats, ctx_pos, self.pos[idx], view_len)
        finally:
            self.dcache.rows = None

    def _verify(self, view_len: int) -> torch.Tensor:
        """The captured verify step: every row's block at its own positions; accept (greedily, or by
        keyed speculative sampling) and advance the live rows on the device. Returns the target's logits
        [R, B, V]; the loop reads `self.result`."""
        q_pos = self.pos.view(-1, 1) + self.arange_b
        self.kv.write_positions, self.kv.view_len = q_pos, view_len
        if self.filled is not None:
            self.filled.set(q_pos)
        with self.dec.target.capture(stop_early=False) as captured, \
                engine_attention(self.model, self.filled, self.options.fold_gqa):
            out = self.model(input_ids=self.blk, position_ids=q_pos, past_key_values=self.kv.cache, use_cache=True,
                             attention_mask=self.causal(q_pos, view_len))
        self.feats.copy_(self.dec.target.concat(captured))
        n_acc, tokens = self._accept(out.logits)
        self._advance(n_acc, tokens, tokens.gather(1, n_acc.view(-1, 1)).view(-1))
        return out.logits

    def _accept(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted count [R], block tokens [R, B]) for target logits [R, B, V]: tokens[:n] are the kept
        proposals and tokens[n] the next token. T=0: the target's argmax; T > 0: keyed speculative sampling
        (accept slot k with probability min(1, p/q), else a residual draw; the bonus from p)."""
        if self.sampled:
            return self.state.verify(logits, self.filtered, self.q, self.blk[:, 1:], self.pos)
        tgt = logits.argmax(dim=-1)  # [R, B]; accepted proposals equal the target's tokens
        return greedy_accepted(self.blk[:, 1:], tgt), tgt

    def _advance(self, n_acc: torch.Tensor, tokens: torch.Tensor, nxt: torch.Tensor) -> None:
        """Record a verified step ([n_accepted, tokens...] a row, the kept tokens being tokens[:n] then
        nxt) and move the live rows on."""
        self.result[:, 0].copy_(n_acc)
        self.result[:, 1:].copy_(tokens)
        self.ctx_start.copy_(self.pos)
        self.pos.add_((n_acc + 1) * self.alive)
        self.blk[:, :1].copy_(nxt.view(-1, 1))

    def _room(self, max_new_tokens: int) -> int:
        return max_new_tokens + 2 * self.B

    def _prefill_feats(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], starts: Sequence[int]
                       ) -> tuple[torch.Tensor, list]:
        """`_prefill` that also keeps the target features of each forward: (last logits [k, V], [(rows, their
        prompts' features [k', C, F])] a forward), for the rows' first draft blocks."""
        feats: list[tuple[list[int], torch.Tensor]] = []
        with self.dec.target.capture(stop_early=False) as captured:
            def keep(batch_rows: list[int]) -> None:
                feats.append((batch_rows, self.dec.target.concat(captured)))

            last = self._prefill(rows, prompts, starts, keep)
        return last, feats

    def _reset(self) -> None:
        super()._reset()
        self.ctx_start.zero_()

    def _enter_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], starts: Sequence[int],
                    keys: Sequence[int]) -> tuple[list[int], list[Any]]:
        last, feats = self._prefill_feats(rows, prompts, starts)
        toks = self.enter(rows, prompts, keys, last)
        self.blk[torch.tensor(rows, device=self.device), 0] = torch.tensor(toks, device=self.device)
        by_row = {r: (batch, f) for batch, f in feats for r in batch}  # the next step drafts each forward's rows
        return toks, [by_row[r] for r in rows]

    @staticmethod
    def _entered_forwards(fresh: dict[int, Any]) -> list[tuple[list[int], torch.Tensor]]:
        """The prefills whose rows still wait for their first block: (those rows, their features) a forward, in
        the order they ran. A row that stopped at its first token (and maybe took a later prompt) is left out."""
        out = []
        for batch, f in {id(feats): (batch, feats) for batch, feats in fresh.values()}.values():
            keep = [j for j, r in enumerate(batch) if r in fresh and fresh[r][1] is f]
            out.append(([batch[j] for j in keep], f[keep]))
        return out

    def _decode_step(self, need: int, fresh: dict[int, Any], all_fresh: bool) -> list[list[int]]:
        view = self.target_view(need + self.B, self.verify_steps)
        if self.B > 1:
            if not all_fresh:  # the rows past their first block: the captured draft step
                self.draft_steps.get(self.draft_steps.view(need + self.B)).replay()
            for rows, f in self._entered_forwards(fresh):  # prompts that just entered: first blocks, eagerly,
                d_logits = self._first_draft_logits(rows, f, self.draft_steps.view(need + self.B))  # whole prompt
                d_hidden = self.draft_hidden
                for j, r in enumerate(rows):
                    self._propose(d_logits[j : j + 1], slice(r, r + 1),
                                  d_hidden[j : j + 1] if d_hidden is not None else None)
        if self.after_draft is not None:
            self.after_draft()
        self.verify_steps.get(view).replay()
        res = self.result.tolist()  # the step's one host sync
        return [row[1 : row[0] + 2] for row in res]  # the kept proposals and the target's next token


# Runners are kept per (model or decoder) and (kind, rows, use_graphs, options), as long as their owner lives:
# capture costs far more than a step, and a runner's captured steps hold the options they were made under.
RunnerKey = tuple[str, int, bool, EngineOptions]
_RUNNERS: "weakref.WeakKeyDictionary[Any, dict[RunnerKey, Any]]" = weakref.WeakKeyDictionary()


def runner_key(kind: str, rows: int, use_graphs: bool, options: EngineOptions = DEFAULT_OPTIONS) -> RunnerKey:
    """The key a runner is cached by (`_RUNNERS[owner]`)."""
    return (kind, int(rows), bool(use_graphs), options)


def _runner(kind: str, owner: Any, make: Callable[[int], Any], rows: int, need: int, use_graphs: bool,
            options: EngineOptions) -> Any:
    runners = _RUNNERS.setdefault(owner, {})
    key = runner_key(kind, rows, use_graphs, options)
    runner = runners.get(key)
    if runner is None or runner.max_len < need or runner.step_key != step_key(options):
        runners.pop(key, None)  # free the old graphs and caches first
        runner = runners[key] = make(need)
    return runner


def plain_runner(target_model: nn.Module, sampling: SamplingParams, rows: int, need: int, use_graphs: bool,
                 options: EngineOptions = DEFAULT_OPTIONS) -> BatchedStaticPlainRunner:
    """The target's plain runner for this kind of step (greedy, sampled, sampled and filtered) with `rows`
    rows, at least `need` cache positions and these options: the one an earlier call made when it fits, else a
    new one."""
    filtered, cap = (not sampling.greedy and sampling.filtered), top_k_cap(sampling)
    kind = "plain" if sampling.greedy else f"plain sampled{'+filtered' * filtered}{f'+top{cap}' * bool(cap)}"
    return _runner(kind, target_model,
                   lambda n: BatchedStaticPlainRunner(target_model, rows, n, use_graphs, not sampling.greedy,
                                                      filtered, cap, options),
                   rows, need, use_graphs, options)


def top_k_cap(s: SamplingParams) -> int:
    """The top-k a sampled runner's filter ranks at most (`sampling.filter_scores`' k_cap): the setting's own top-k,
    so a captured step never sorts the whole vocabulary when one is set; 0 without one."""
    return s.top_k if not s.greedy and s.top_k > 0 else 0


def spec_runner(decoder: Any, sampling: SamplingParams, rows: int, need: int, use_graphs: bool,
                options: EngineOptions = DEFAULT_OPTIONS) -> BatchedStaticSpecRunner:
    """The decoder's speculative runner for this kind of step (its filters and proposals are baked into the
    graphs; T, top-p and top-k are buffers), as `plain_runner`."""
    filtered = not sampling.greedy and sampling.filtered
    draft_greedy = not sampling.greedy and sampling.draft == "greedy"
    cap = top_k_cap(sampling)
    kind = "spec" if sampling.greedy else (f"spec sampled{'+filtered' * filtered}{f'+top{cap}' * bool(cap)}"
                                           f"{'+greedy draft' * draft_greedy}")
    return _runner(kind, decoder,
                   lambda n: BatchedStaticSpecRunner(decoder, rows, n, use_graphs, not sampling.greedy, filtered,
                                                     draft_greedy, cap, options),
                   rows, need, use_graphs, options)


def drop_runners(owner: Any) -> None:
    """Free the runners (caches and captured graphs) kept for a target or a decoder."""
    _RUNNERS.pop(owner, None)


def plain_cache_length(prompt_len: int, max_new_tokens: int, window: int) -> int:
    """Cache positions a plain row needs: a row whose answer ends inside a window of steps writes to its end."""
    return cache_length_for(prompt_len, max_new_tokens + window - 1, 1)


def spec_cache_length(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """Cache positions a speculative row needs: a row keeps writing a block at its frozen position after it
    stops, so one block past the cap."""
    return cache_length_for(prompt_len, max_new_tokens + block_size, block_size)


def _longest(prompts: Sequence[Sequence[int]], max_prompt_tokens: Optional[int]) -> int:
    """The longest prompt the rows' caches must hold: the prompts', or `max_prompt_tokens` for follow-ups."""
    return max(max(len(p) for p in prompts), max_prompt_tokens or 0)


def batched_static_autoregressive_generate(
    target_model: nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    sampling: SamplingParams = GREEDY, stop_token_ids: Optional[Iterable[int]] = None, rows: Optional[int] = None,
    use_graphs: bool = True, generator: Optional[torch.Generator] = None, on_done: Optional[OnDone] = None,
    max_prompt_tokens: Optional[int] = None, refill_rows: int = 1, window: int = 1,
    options: EngineOptions = DEFAULT_OPTIONS,
) -> list[GenerationOutput]:
    """Plain decoding of all prompts through `rows` fixed-shape rows (default: one per prompt; fewer:
    continuous batching), at any temperature: at T > 0 a prompt's tokens are keyed draws (a key per prompt
    from `generator`). `on_done(i, output)` may return a follow-up prompt (decoded as one more; the caches
    hold prompts up to `max_prompt_tokens`). Freed rows take new prompts once `refill_rows` are free (their
    prefills batched: more rows a refill, fewer forwards, more idle rows). `window` steps run per host read-back
    (answers unchanged; a row whose answer ends inside a window idles to its end). `options`: the engine's speed
    settings (answers unchanged)."""
    rows = _rows(prompts, max_new_tokens, rows)
    if not 1 <= window <= WINDOW_MAX:
        raise ValueError(f"window must be in [1, {WINDOW_MAX}], got {window}")
    runner = plain_runner(target_model, sampling, rows, plain_cache_length(_longest(prompts, max_prompt_tokens),
                                                                     max_new_tokens, window), use_graphs, options)
    runner.window = window
    return runner.generate(prompts, max_new_tokens, stop_set(stop_token_ids),
                           None if sampling.greedy else sampling, generator, on_done, refill_rows)


def batched_static_speculative_generate(
    decoder: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    sampling: SamplingParams = GREEDY, stop_token_ids: Optional[Iterable[int]] = None, rows: Optional[int] = None,
    use_graphs: bool = True, generator: Optional[torch.Generator] = None, on_done: Optional[OnDone] = None,
    max_prompt_tokens: Optional[int] = None, refill_rows: int = 1, options: EngineOptions = DEFAULT_OPTIONS,
) -> list[GenerationOutput]:
    """Speculative decoding of all prompts through `rows` fixed-shape rows (default: one per prompt; fewer:
    continuous batching). At T=0 each answer and its acceptance lengths are the eager reference decoder's for
    that prompt; at T > 0 they are samples of the target's distribution, all drawn from one `generator`.
    `on_done`, `max_prompt_tokens`, `refill_rows` and `options` as in `batched_static_autoregressive_generate`."""
    rows = _rows(prompts, max_new_tokens, rows)
    need = spec_cache_length(_longest(prompts, max_prompt_tokens), max_new_tokens, decoder.block_size)
    runner = spec_runner(decoder, sampling, rows, need, use_graphs, options)
    return runner.generate(prompts, max_new_tokens, stop_set(stop_token_ids),
                           None if sampling.greedy else sampling, generator, on_done, refill_rows)


__all__ = [
    "check_batch",
    "BatchedStaticPlainRunner",
    "BatchedStaticSpecRunner",
    "batched_static_autoregressive_generate",
    "drop_runners",
    "plain_cache_length",
    "plain_runner",
    "prefill_batches",
    "runner_key",
    "spec_cache_length",
    "spec_runner",
    "batched_static_speculative_generate",
]
