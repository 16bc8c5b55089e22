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
  (`nemo_dflash.attention`); the captured steps keep PyTorch's choice.
- Every later step has the same shapes: R rows, and an attention view of the smallest multiple of
  `static_decode.LENGTH_BUCKET` positions covering every live row's furthest query. One graph per
  (step, view length), captured up front.
- A row that has finished stays in the batch (the shapes never change) with its position frozen
  (`alive`, a device buffer the host rewrites only when a row stops).
- **Continuous batching.** With fewer rows than prompts, the prompts enter the rows in order: the rows
  whose answers end at one step take the next prompts together, once `refill_rows` rows are free (1: at
  once) or no row decodes. Their prompts are prefilled in one forward into those rows (cache positions
  from 0; what a row held before stays hidden by its mask until overwritten), each one's first token
  chosen, and a speculative row's first block drafted eagerly against its whole prompt, while the other
  rows go on. A prompt's answer is the same whichever row and step it enters at (T=0), and at T > 0 its
  draws use its own key, drawn from the caller's generator when it enters.

At T=0 each row's answer and acceptance lengths are those of the eager reference decoder
(`spec_decode`; in exact arithmetic, tested in fp32 on CPU, where the same code runs eagerly). At T > 0
the captured steps also sample (speculative sampling: accept slot k with probability min(1, p/q), else
draw from norm(max(p - q, 0)); the bonus from p) with keyed noise (`sampling.keyed_proposals`,
`sampling.keyed_verify`): every row has its own key, drawn from the caller's generator after the first
tokens, and each uniform is a hash of (key, position[, token]), so a row's draws do not depend on the
other rows, a step is still one replay and one read-back, and the eager and captured steps give the same
answers. A position's noise only ever decides one kept token: a later step samples only positions past
the last kept one. On a GPU that sampling math (softmaxes over the vocabulary, hashes, the draws' scans) runs
compiled, a few fused kernels instead of ~40 (`static_decode.FUSE_SAMPLING`), eager and captured steps alike.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn
from torch.profiler import record_function

from nemo_dflash.attention import eager_attention_backends
from nemo_dflash.inference.output import DEFAULT_MAX_NEW_TOKENS, GenerationOutput, stop_set, sync, truncate
from nemo_dflash.sampling import Sampling, SamplingParams, as_sampling, select_tokens
from nemo_dflash.inference.static_cache import (
    FilledBlocks, StaticDraftContextCache, TargetStaticCache, attn_implementation, check_static_target,
    engine_attention, filled_blocks_on, query_groups, visible_to_mask,
)
from nemo_dflash.inference.static_decode import (
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


# What a caller may do when an answer ends: (prompt index, its output) -> a follow-up prompt (the next turn of
# its conversation, say), decoded as one more prompt, or None.
OnDone = Callable[[int, GenerationOutput], Optional[Sequence[int]]]


def _output(tokens: list[int], accepted: list[int], stop_ids: set[int], prefill_s: float,
            decode_s: float) -> GenerationOutput:
    """One prompt's answer (`accepted`: the tokens each of its steps kept)."""
    return GenerationOutput(output_ids=list(tokens), num_target_forwards=len(accepted),
                            acceptance_lengths=list(accepted), decode_time_s=decode_s, prefill_time_s=prefill_s,
                            stopped=tokens[-1] in stop_ids)


class _Schedule:
    """The prompts (a caller's follow-ups appended as answers end), each one's tokens so far, and which prompt
    each row holds: the first `rows` prompts start in rows 0..; later prompts enter rows as the rows' answers
    end, in order (continuous batching)."""

    def __init__(self, prompts: Sequence[Sequence[int]], rows: int, on_done: Optional[OnDone], max_len: int,
                 room: int) -> None:
        self.prompts = [list(p) for p in prompts]
        self.outputs: list[list[int]] = [[] for _ in self.prompts]
        self.accept: list[list[int]] = [[] for _ in self.prompts]
        start = min(len(self.prompts), rows)
        self.held: list[Optional[int]] = list(range(start)) + [None] * (rows - start)
        self.next, self.on_done, self.max_len, self.room = start, on_done, max_len, room

    def take(self, row: int) -> Optional[int]:
        """The next prompt for `row`, whose answer just ended, or None when every prompt has started."""
        i = None
        if self.next < len(self.prompts):
            i, self.next = self.next, self.next + 1
        self.held[row] = i
        return i

    def done(self, i: int, out: GenerationOutput) -> None:
        """Prompt i's answer ended: the caller's follow-up, if any, joins the queue."""
        follow = self.on_done(i, out) if self.on_done is not None else None
        if follow is None:
            return
        if not 0 < len(follow) <= self.max_len - self.room:
            raise ValueError(f"a follow-up prompt of {len(follow)} tokens does not fit the rows' cache of "
                             f"{self.max_len} positions: pass max_prompt_tokens >= {len(follow)}")
        self.prompts.append(list(follow))
        self.outputs.append([])
        self.accept.append([])


# Entering prompts are prefilled together, right-padded, up to this many padded tokens a forward: the forward's
# logits [tokens, V] then take no more memory than one prompt of this length's did when each row had its own.
PREFILL_TOKENS = 2048
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
    and live flags on the device, and the eager prefill."""

    def __init__(self, model: nn.Module, rows: int, max_len: int, use_graphs: bool) -> None:
        check_static_target(model)
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.attn = attn_implementation(model)
        self.rows, self.max_len, self.use_graphs = int(rows), int(max_len), use_graphs
        self.kv = TargetStaticCache(model, self.max_len, self.device, self.dtype, batch=self.rows)
        self.key_index = torch.arange(self.max_len, device=self.device)
        self.pos = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        self.alive = torch.ones(self.rows, dtype=torch.long, device=self.device)  # 1: still decoding
        self.sampling: Optional[SamplingParams] = None  # the call's setting (T > 0), set by `generate`
        self.filled_blocks = filled_blocks_on(self.device)  # the captured target steps read filled KV blocks only

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

    def prefill_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], view_len: int) -> torch.Tensor:
        """Prompts of any lengths into those rows of the cache, in one eager forward, right-padded (a pad's K/V
        sits past its row's position, hidden by the row's mask until a step overwrites it); the logits [k, V]
        at each prompt's last token."""
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        width = max(len(p) for p in prompts)
        ids = torch.tensor([list(p) + [p[-1]] * (width - len(p)) for p in prompts], device=self.device)
        positions = torch.arange(width, device=self.device)
        self.kv.write_positions, self.kv.view_len = positions, view_len
        self.kv.rows = torch.tensor(rows, device=self.device)
        try:  # an eager forward of a new shape: attention kernels without cuDNN's per-shape plans
            with engine_attention(self.model), eager_attention_backends(self.device):
                out = self.model(input_ids=ids, position_ids=positions.unsqueeze(0), past_key_values=self.kv.cache,
                                 use_cache=True, attention_mask=self.causal(positions.unsqueeze(0), view_len))
        finally:
            self.kv.rows = None
        return out.logits[torch.arange(len(prompts), device=self.device), lengths - 1]

    def _prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]],
                 keep: Optional[Callable[[list[int]], None]] = None) -> torch.Tensor:
        """Prompts into `rows` (prompt j into rows[j]) in the forwards `prefill_batches` plans, each attending
        over its longest prompt's bucket; `keep(its rows)` runs after each forward (the speculative runner keeps
        its features there). The last logits [k, V], in the prompts' order."""
        last: list[torch.Tensor] = [None] * len(prompts)  # type: ignore[list-item]
        for batch in prefill_batches([len(p) for p in prompts]):
            batch_rows = [rows[i] for i in batch]
            logits = self.prefill_rows(batch_rows, [prompts[i] for i in batch],
                                       view_length(max(len(prompts[i]) for i in batch), self.max_len))
            if keep is not None:
                keep(batch_rows)
            for j, i in enumerate(batch):
                last[i] = logits[j]
        return torch.stack(last)

    def set_alive(self, stopped: list[bool]) -> None:
        self.alive.copy_(torch.tensor([0 if s else 1 for s in stopped], device=self.device))

    def enter(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], last: torch.Tensor,
              generator: Optional[torch.Generator]) -> list[int]:
        """Prompts entering `rows` mid-run, their prompts prefilled: each one's first token from its prefill's
        last logits (`last` [k, V]), then its noise key (T > 0) drawn from the generator, prompt by prompt; the
        rows' positions set. Returns the first tokens."""
        toks = []
        for j, row in enumerate(rows):
            toks.append(int(select_tokens(last[j : j + 1], self.sampling or 0.0, generator)[0][0]))
            if self.state is not None:  # the runner's sampled-step buffers (None at T=0)
                gen_device = generator.device if generator is not None else torch.device("cpu")
                self.state.key[row] = int(torch.randint(0, 2**62, (1,), generator=generator, device=gen_device)[0])
        self.pos[torch.tensor(rows, device=self.device)] = torch.tensor([len(p) for p in prompts], device=self.device)
        return toks

    # ---- what each runner supplies to the one loop below
    one_token_steps: bool  # a step's tokens are one forward each (plain), or one verify's (speculative)
    sampled: bool
    state: Optional[SampledStepState]

    def _room(self, max_new_tokens: int) -> int:
        """Cache positions a row needs past its prompt."""
        raise NotImplementedError

    def _start(self, prompts: Sequence[Sequence[int]], host_pos: list[int],
               generator: Optional[torch.Generator]) -> list[int]:
        """The first rows' prompts (one a row; rows past them copy the first) prefilled, each row's first token
        chosen and returned, the rows' positions set to `host_pos`."""
        raise NotImplementedError

    def _enter_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]],
                    generator: Optional[torch.Generator]) -> tuple[list[int], list[Any]]:
        """Prompts entering `rows` mid-run, prefilled together: (their first tokens, what the next step needs of
        each or None)."""
        raise NotImplementedError

    def _decode_step(self, need: int, fresh: dict[int, Any]) -> list[list[int]]:
        """One step of every row, its live rows' queries reaching position `need`; `fresh` holds what rows
        entered since the last step left (`_enter_rows`' second value). Returns each row's new tokens."""
        raise NotImplementedError

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: set[int],
                 sampling: Optional[SamplingParams] = None, generator: Optional[torch.Generator] = None,
                 on_done: Optional[OnDone] = None, refill_rows: int = 1) -> list[GenerationOutput]:
        """Every prompt's answer (then the follow-ups' that `on_done` returned, in the order they came); with
        fewer rows than prompts, prompts enter rows as answers end: the rows freed by one step enter together
        (one prefill), once `refill_rows` rows are free or no row decodes. `prefill_time_s` is the first rows'
        prefill, `decode_time_s` the loop's (later prefills included). The one host loop of both runners:
        a step, one read-back, then each live row's new tokens kept up to a stop token or the cap."""
        if self.sampled != (sampling is not None and not sampling.greedy):
            raise ValueError("this runner's captured steps are for " + ("T > 0" if self.sampled else "T=0"))
        if refill_rows < 1:
            raise ValueError(f"refill_rows must be >= 1, got {refill_rows}")
        self.sampling = sampling if self.sampled else None
        R = self.rows
        sched = _Schedule(prompts, R, on_done, self.max_len, self._room(max_new_tokens))
        prompts, outputs, accept, m = sched.prompts, sched.outputs, sched.accept, sched.next
        sync(self.device)
        t0 = time.perf_counter()
        host_pos = [len(p) for p in prompts[:m]] + [len(prompts[0])] * (R - m)  # rows past the prompts: unread
        with record_function("engine.start"):  # named ranges: where a profiled run's time goes (regen.py)
            firsts = self._start(prompts[:m], host_pos, generator)
        for i in range(m):
            outputs[i].append(firsts[i])
        stopped = [True] * R
        sync(self.device)
        t1 = time.perf_counter()
        fresh: dict[int, Any] = {}  # rows whose prompt entered since the last step: what that step needs
        free: list[int] = []  # rows whose answer ended, waiting for a prompt

        def ended(row: int) -> None:  # the answer in `row` ended: the row waits for the next prompt
            fresh.pop(row, None)
            i = sched.held[row]
            sched.held[row] = None
            sched.done(i, _output(outputs[i], accept[i], stop_ids, t1 - t0, time.perf_counter() - t1))
            free.append(row)

        def started(row: int, tok: int, need: Any) -> None:  # a prompt's first token is in `row`
            if tok in stop_ids or max_new_tokens <= 1:
                ended(row)
            else:
                stopped[row] = False
                if need is not None:
                    fresh[row] = need

        def refill() -> None:  # waiting prompts into the free rows, each batch's prefills one forward
            while free and sched.next < len(sched.prompts):
                waiting = len(sched.prompts) - sched.next
                if len(free) < min(refill_rows, waiting) and not all(stopped):
                    return
                rows = sorted(free[:waiting])
                del free[:len(rows)]
                taken = [sched.take(r) for r in rows]
                with record_function("engine.enter"):
                    toks, needs = self._enter_rows(rows, [prompts[i] for i in taken], generator)
                for r, i, tok, need in zip(rows, taken, toks, needs):
                    host_pos[r] = len(prompts[i])
                    outputs[i].append(tok)
                    started(r, tok, need)

        for r in range(m):
            started(r, firsts[r], None)
        free.extend(range(m, R))
        refill()
        self.set_alive(stopped)
        while not all(stopped):
            with record_function("engine.step"):
                news = self._decode_step(max(p for p, s in zip(host_pos, stopped) if not s), fresh)
            fresh.clear()
            was = list(stopped)
            for r in range(R):
                if was[r]:
                    continue
                i, new = sched.held[r], news[r]
                host_pos[r] += len(new)
                kept, hit = truncate(new, stop_ids, max_new_tokens - len(outputs[i]))
                outputs[i].extend(kept)
                if self.one_token_steps:  # a plain window: one forward a kept token (the rest ran idle)
                    accept[i].extend([1] * len(kept))
                else:
                    accept[i].append(len(new))
                if hit or len(outputs[i]) >= max_new_tokens:
                    stopped[r] = True
                    ended(r)
            refill()
            if stopped != was:
                self.set_alive(stopped)
        sync(self.device)
        t2 = time.perf_counter()
        return [_output(o, a, stop_ids, t1 - t0, t2 - t1) for o, a in zip(outputs, accept)]


class BatchedStaticPlainRunner(_Rows):
    """R rows of one-token decoding, one captured graph per view length; at T > 0 each step draws every row's
    token with keyed noise (a key per row, `SampledStepState.next_tokens`). `window` steps are replayed per host
    read-back (a row's tokens past its stop or cap within a window are dropped, their K/V written past its
    answer where nothing reads them); prompts enter rows between windows."""

    one_token_steps = True

    def __init__(self, model: nn.Module, rows: int, max_len: int, use_graphs: bool, sampled: bool = False,
                 filtered: bool = False) -> None:
        super().__init__(model, rows, max_len, use_graphs)
        self.sampled, self.filtered = sampled, sampled and filtered
        self.state = SampledStepState(self.rows, self.device) if sampled else None
        self.tok = torch.zeros(self.rows, 1, dtype=torch.long, device=self.device)
        self.window = 1  # steps a host read-back (set per call by `batched_static_autoregressive_generate`)
        self.outs = torch.zeros(WINDOW_MAX, self.rows, dtype=torch.long, device=self.device)  # a window's tokens
        self.out_i = torch.zeros((), dtype=torch.long, device=self.device)  # the next step's row in `outs`
        self.filled = self.filled_mask(1)
        self.steps = BucketedSteps(lambda n: make_step(lambda: self._step(n), self.device, use_graphs, model),
                                    self.max_len, "the batched 1-token step", use_graphs,
                                    buckets=not self.filled_blocks)

    @property
    def step_key(self) -> tuple[int, bool, bool]:
        """The settings its steps were made under (`static_decode.step_key`; a runner made under others is
        rebuilt)."""
        return self.steps.step_key

    def _step(self, view_len: int) -> torch.Tensor:
        """One token a row at its position; returns the logits [R, V] (the loop reads `self.tok`)."""
        q_pos = self.pos.view(-1, 1)
        self.kv.write_positions, self.kv.view_len = q_pos, view_len
        if self.filled is not None:
            self.filled.set(q_pos)
        with engine_attention(self.model, self.filled):
            out = self.model(input_ids=self.tok, position_ids=q_pos, past_key_values=self.kv.cache, use_cache=True,
                             attention_mask=self.causal(q_pos, view_len))
        logits = out.logits[:, -1]
        if self.sampled:
            self.tok.copy_(self.state.next_tokens(logits, self.filtered, self.pos + 1).view(-1, 1))
        else:
            self.tok.copy_(logits.argmax(dim=-1, keepdim=True))
        self.outs.index_copy_(0, self.out_i.view(1), self.tok.view(1, -1))
        self.out_i.add_(1)
        self.pos.add_(self.alive)
        return logits

    def _room(self, max_new_tokens: int) -> int:
        return max_new_tokens + self.window

    def _start(self, prompts: Sequence[Sequence[int]], host_pos: list[int],
               generator: Optional[torch.Generator]) -> list[int]:
        R, m = self.rows, len(prompts)
        last = self._prefill(list(range(m)), prompts)
        last = torch.cat([last, last[:1].expand(R - m, -1)])  # rows past the prompts: a copy of the first
        firsts = select_tokens(last, self.sampling or 0.0, generator)[0].tolist()
        if self.sampled:  # each row's noise key, drawn from (and advancing) the caller's generator
            self.state.start(self.sampling, generator)
        self.tok.copy_(torch.tensor(firsts, device=self.device).view(-1, 1))
        self.pos.copy_(torch.tensor(host_pos, device=self.device))
        return firsts

    def _enter_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]],
                    generator: Optional[torch.Generator]) -> tuple[list[int], list[Any]]:
        toks = self.enter(rows, prompts, self._prefill(rows, prompts), generator)
        self.tok[torch.tensor(rows, device=self.device), 0] = torch.tensor(toks, device=self.device)
        return toks, [None] * len(rows)

    def _decode_step(self, need: int, fresh: dict[int, Any]) -> list[list[int]]:
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
                 filtered: bool = False, draft_greedy: bool = False) -> None:
        super().__init__(decoder.target.model, rows, max_len, use_graphs)
        self.dec = decoder
        self.sampled = sampled  # the captured steps sample (T > 0), or accept greedily
        # baked into the captured steps: top-p / top-k filter (values in
        # buffers), the draft proposes its argmax (one-hot q)
        self.filtered, self.draft_greedy = sampled and filtered, sampled and draft_greedy
        R, B, dev = self.rows, decoder.block_size, self.device
        self.B = B
        self.dcache = StaticDraftContextCache(len(decoder.draft.layers), self.max_len, batch=R)
        self.blk = torch.zeros(R, B, dtype=torch.long, device=dev)  # verify input: [last, proposals] a row
        self.ctx_start = torch.zeros(R, dtype=torch.long, device=dev)  # first position of each row's new context
        self.arange_b = torch.arange(B, device=dev)
        self.mask_ids = torch.full((R, B - 1), decoder.mask_token_id, dtype=torch.long, device=dev)
        self.block_visible = torch.ones(R, B, dtype=torch.bool, device=dev)
        n_feat = len(decoder.target.target_layer_ids) * self.model.config.hidden_size
        self.feats = torch.zeros(R, B, n_feat, dtype=self.dtype, device=dev)  # each row's verified features
        self.result = torch.zeros(R, B + 1, dtype=torch.long, device=dev)  # [n_accepted, block tokens...] a row
        self.state = SampledStepState(R, dev) if sampled else None  # each row's noise key, 1/T, the filters
        if sampled:  # the draft's distributions, for the accept test
            self.q = torch.zeros(R, B - 1, decoder.lm_head.weight.shape[0], dtype=torch.float32, device=dev)
        self.after_draft: Optional[Callable[[], None]] = None  # test hook: overwrite the proposals in self.blk
        self._first_blocks: Optional[tuple[list[tuple[list[int], torch.Tensor]], int]] = None
        # Each lambda looks self._draft / self._verify up when it runs (tests wrap them).
        self.draft_steps = BucketedSteps(
            lambda n: make_step(lambda: self._draft(n), dev, use_graphs, decoder.draft), self.max_len,
            "the batched draft block", use_graphs) if B > 1 else None
        self.filled = self.filled_mask(B)
        self.verify_steps = BucketedSteps(
            lambda n: make_step(lambda: self._verify(n), dev, use_graphs, self.model), self.max_len,
            f"the batched {B}-token verify", use_graphs, buckets=not self.filled_blocks)

    @property
    def step_key(self) -> tuple[int, bool, bool]:
        """The settings its steps were made under (`static_decode.step_key`; a runner made under others is
        rebuilt)."""
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
                                position_ids=position_ids, attention_mask=visible, cache=self.dcache)
        return self.dec.lm_head(hidden[:, 1:].to(self.dec.lm_head.weight.dtype))

    def _draft(self, view_len: int) -> torch.Tensor:
        """The captured draft step: every row's block from its last verify's features, its proposals
        written into the block (the argmax, or keyed draws)."""
        ctx_pos = self.ctx_start.view(-1, 1) + self.arange_b
        noise = torch.cat([self.blk[:, :1], self.mask_ids], 1)
        logits = self._draft_forward(noise, self.feats, ctx_pos, self.pos, view_len)
        self._propose(logits)
        return logits

    def _propose(self, logits: torch.Tensor, rows: slice = slice(None)) -> None:
        """Draft logits [R, B-1, V] (or those of `rows`) -> the proposals in the block: the argmax (T=0, or
        greedy proposals with a one-hot q), else one keyed draw per slot from the filtered softmax q, kept for
        the accept test."""
        if not self.sampled or self.draft_greedy:
            tok = logits.argmax(dim=-1)
            if self.sampled:
                self.q[rows].zero_().scatter_(-1, tok.unsqueeze(-1), 1.0)
            self.blk[rows, 1:].copy_(tok)
            return
        q, proposals = self.state.proposals(logits, self.filtered, rows, self.pos[rows])
        self.q[rows].copy_(q)
        self.blk[rows, 1:].copy_(proposals)

    def _first_draft_logits(self, rows: Sequence[int], prompt_feats: torch.Tensor, view_len: int) -> torch.Tensor:
        """Step 1 of those rows (prompts prefilled together, right-padded), eagerly: their blocks' draft logits
        [k, B-1, V] against their whole prompts (`prompt_feats` [k, C, F]; a pad's context sits at or past its
        row's position, where the draft's mask hides it)."""
        k, idx = prompt_feats.shape[0], torch.tensor(rows, device=self.device)
        self.dcache.rows = idx
        try:
            noise = torch.cat([self.blk[idx, :1], self.mask_ids[:k]], 1)
            ctx_pos = torch.arange(prompt_feats.shape[1], device=self.device)
            with eager_attention_backends(self.device):  # a context of the prompt's length: a new shape
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
        with self.dec.target.capture(stop_early=False) as captured, engine_attention(self.model, self.filled):
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
        return (self.blk[:, 1:] == tgt[:, :-1]).long().cumprod(dim=1).sum(dim=1), tgt

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

    def _prefill_feats(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list]:
        """`_prefill` that also keeps the target features of each forward: (last logits [k, V], [(rows, their
        prompts' features [k', C, F])] a forward), for the rows' first draft blocks."""
        feats: list[tuple[list[int], torch.Tensor]] = []
        with self.dec.target.capture(stop_early=False) as captured:
            def keep(batch_rows: list[int]) -> None:
                feats.append((batch_rows, self.dec.target.concat(captured)))

            last = self._prefill(rows, prompts, keep)
        return last, feats

    def _start(self, prompts: Sequence[Sequence[int]], host_pos: list[int],
               generator: Optional[torch.Generator]) -> list[int]:
        R, m = self.rows, len(prompts)
        last, feats = self._prefill_feats(list(range(m)), prompts)
        last = torch.cat([last, last[:1].expand(R - m, -1)])  # rows past the prompts: a copy of the first
        firsts = select_tokens(last, self.sampling or 0.0, generator)[0].tolist()
        self.blk[:, 0].copy_(torch.tensor(firsts, device=self.device))
        if self.sampling is not None:  # each row's noise key, drawn from (and advancing) the caller's generator
            self.state.start(self.sampling, generator)
        self.pos.copy_(torch.tensor(host_pos, device=self.device))
        self.ctx_start.zero_()
        self._first_blocks = (feats, m)  # step 1 drafts these rows against their whole prompts
        return firsts

    def _enter_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]],
                    generator: Optional[torch.Generator]) -> tuple[list[int], list[Any]]:
        last, feats = self._prefill_feats(rows, prompts)
        toks = self.enter(rows, prompts, last, generator)
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

    def _decode_step(self, need: int, fresh: dict[int, Any]) -> list[list[int]]:
        view = self.target_view(need + self.B, self.verify_steps)
        if self.B > 1:
            # step 1 drafts each row against its whole prompt (eager); later steps replay the graph
            dview = self.draft_steps.view(need + self.B)
            if self._first_blocks is not None:
                feats, m = self._first_blocks
                d_logits = torch.zeros(self.rows, self.B - 1, self.dec.lm_head.weight.shape[0],
                                       dtype=self.dec.lm_head.weight.dtype, device=self.device)
                for rows, f in feats:
                    d_logits[torch.tensor(rows, device=self.device)] = self._first_draft_logits(rows, f, dview)
                d_logits[m:] = d_logits[:1]  # rows past the prompts: a copy of the first (unread)
                self._propose(d_logits)
            else:
                self.draft_steps.get(dview).replay()
            for rows, f in self._entered_forwards(fresh):  # prompts that entered mid-run: first blocks, eagerly
                d_logits = self._first_draft_logits(rows, f, dview)
                for j, r in enumerate(rows):
                    self._propose(d_logits[j : j + 1], slice(r, r + 1))
        self._first_blocks = None
        if self.after_draft is not None:
            self.after_draft()
        self.verify_steps.get(view).replay()
        res = self.result.tolist()  # the step's one host sync
        return [row[1 : row[0] + 2] for row in res]  # the kept proposals and the target's next token


# Runners are kept per (model or decoder) and (kind, rows, use_graphs), as long as their owner lives:
# capture costs far more than a step.
_RUNNERS: "weakref.WeakKeyDictionary[Any, dict[tuple[str, int, bool], Any]]" = weakref.WeakKeyDictionary()


def _runner(kind: str, owner: Any, make: Callable[[int], Any], rows: int, need: int, use_graphs: bool) -> Any:
    runners = _RUNNERS.setdefault(owner, {})
    runner = runners.get((kind, rows, use_graphs))
    if runner is None or runner.max_len < need or runner.step_key != step_key():
        runners.pop((kind, rows, use_graphs), None)  # free the old graphs and caches first
        runner = runners[(kind, rows, use_graphs)] = make(need)
    return runner


def plain_runner(target_model: nn.Module, temperature: Sampling, rows: int, need: int,
                 use_graphs: bool) -> BatchedStaticPlainRunner:
    """The target's plain runner for this kind of step (greedy, sampled, sampled and filtered) with `rows`
    rows and at least `need` cache positions: the one an earlier call made when it fits, else a new one."""
    s = as_sampling(temperature)
    filtered = not s.greedy and s.filtered
    kind = "plain" if s.greedy else f"plain sampled{'+filtered' * filtered}"
    return _runner(kind, target_model, lambda n: BatchedStaticPlainRunner(target_model, rows, n, use_graphs,
                                                                          not s.greedy, filtered),
                   rows, need, use_graphs)


def spec_runner(decoder: Any, temperature: Sampling, rows: int, need: int, use_graphs: bool) -> BatchedStaticSpecRunner:
    """The decoder's speculative runner for this kind of step (its filters and proposals are baked into the
    graphs; T, top-p and top-k are buffers), as `plain_runner`."""
    s = as_sampling(temperature)
    filtered, draft_greedy = (not s.greedy and s.filtered), (not s.greedy and s.draft == "greedy")
    kind = "spec" if s.greedy else f"spec sampled{'+filtered' * filtered}{'+greedy draft' * draft_greedy}"
    return _runner(kind, decoder, lambda n: BatchedStaticSpecRunner(decoder, rows, n, use_graphs, not s.greedy,
                                                                    filtered, draft_greedy), rows, need, use_graphs)


def drop_runners(owner: Any) -> None:
    """Free the runners (caches and captured graphs) kept for a target or a decoder."""
    _RUNNERS.pop(owner, None)


def spec_cache_length(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """Cache positions a speculative row needs: a row keeps writing a block at its frozen position after it
    stops, so one block past the cap."""
    return cache_length_for(prompt_len, max_new_tokens + block_size, block_size)


def _longest(prompts: Sequence[Sequence[int]], max_prompt_tokens: Optional[int]) -> int:
    """The longest prompt the rows' caches must hold: the prompts', or `max_prompt_tokens` for follow-ups."""
    return max(max(len(p) for p in prompts), max_prompt_tokens or 0)


def batched_static_autoregressive_generate(
    target_model: nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    temperature: Sampling = 0.0, stop_token_ids: Optional[Iterable[int]] = None, rows: Optional[int] = None,
    use_graphs: bool = True, generator: Optional[torch.Generator] = None, on_done: Optional[OnDone] = None,
    max_prompt_tokens: Optional[int] = None, refill_rows: int = 1, window: int = 1,
) -> list[GenerationOutput]:
    """Plain decoding of all prompts through `rows` fixed-shape rows (default: one per prompt; fewer:
    continuous batching), at any temperature: at T > 0 a prompt's tokens are keyed draws (a key per prompt
    from `generator`). `on_done(i, output)` may return a follow-up prompt (decoded as one more; the caches
    hold prompts up to `max_prompt_tokens`). Freed rows take new prompts once `refill_rows` are free (their
    prefills batched: more rows a refill, fewer forwards, more idle rows). `window` steps run per host read-back
    (answers unchanged; a row whose answer ends inside a window idles to its end)."""
    rows = _rows(prompts, max_new_tokens, rows)
    if not 1 <= window <= WINDOW_MAX:
        raise ValueError(f"window must be in [1, {WINDOW_MAX}], got {window}")
    s = as_sampling(temperature)
    runner = plain_runner(target_model, s, rows, cache_length_for(_longest(prompts, max_prompt_tokens),
                                                                  max_new_tokens + window - 1, 1), use_graphs)
    runner.window = window
    return runner.generate(prompts, max_new_tokens, stop_set(stop_token_ids), None if s.greedy else s, generator,
                           on_done, refill_rows)


def batched_static_speculative_generate(
    decoder: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    temperature: Sampling = 0.0, stop_token_ids: Optional[Iterable[int]] = None, rows: Optional[int] = None,
    use_graphs: bool = True, generator: Optional[torch.Generator] = None, on_done: Optional[OnDone] = None,
    max_prompt_tokens: Optional[int] = None, refill_rows: int = 1,
) -> list[GenerationOutput]:
    """Speculative decoding of all prompts through `rows` fixed-shape rows (default: one per prompt; fewer:
    continuous batching). At T=0 each answer and its acceptance lengths are the eager reference decoder's for
    that prompt; at T > 0 they are samples of the target's distribution, all drawn from one `generator`.
    `on_done`, `max_prompt_tokens` and `refill_rows` as in `batched_static_autoregressive_generate`."""
    rows = _rows(prompts, max_new_tokens, rows)
    s = as_sampling(temperature)
    need = spec_cache_length(_longest(prompts, max_prompt_tokens), max_new_tokens, decoder.block_size)
    runner = spec_runner(decoder, s, rows, need, use_graphs)
    return runner.generate(prompts, max_new_tokens, stop_set(stop_token_ids), None if s.greedy else s, generator,
                           on_done, refill_rows)


__all__ = [
    "check_batch",
    "BatchedStaticPlainRunner",
    "BatchedStaticSpecRunner",
    "batched_static_autoregressive_generate",
    "drop_runners",
    "plain_runner",
    "prefill_batches",
    "spec_cache_length",
    "spec_runner",
    "batched_static_speculative_generate",
]
