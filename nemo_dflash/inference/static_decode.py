"""Fixed-shape decoding loops (the "graphs" mode), plain and speculative.

Every decode step has the same shapes and reads its inputs from static device buffers, so each
step is captured once as a CUDA graph and replayed (`use_graphs=True`), or run eagerly with the
very same code (`use_graphs=False`: CPU, tests). At T=0 a step also does its own bookkeeping on
the device (argmax, accepted length, next block's first token, next positions), so the host
only reads back the new tokens: one small device-to-host copy per step and nothing else.

Length buckets: a step attends over the first L positions of the caches only, L the smallest
multiple of LENGTH_BUCKET covering every position it can see (pos + 1 for the plain step,
pos + B for the speculative step's draft and verify), capped at the cache length. L is a Python
int baked into each graph, so there is one captured graph per (step, L); the host tracks the
position too (it reads the accepted length every step anyway) and replays the graph of the
current bucket. Without buckets every step attended over the whole preallocated cache under a
mask: cheap for a 1-query step, not for the B-query verify and the draft's block.

Per speculative step (block size B, position p of the last verified token):
1. draft: new context features (padded to B) -> draft context cache at their positions,
   block `[last, MASK x (B-1)]` at p..p+B-1 -> B-1 proposals written into the verify input;
2. verify: the target runs the B tokens at p..p+B-1 against its StaticCache (writing their
   K/V there), its features of the B tokens go to the draft's next input, and the accepted
   length n, the next first token and p + n + 1 are computed in place.
Rejected tokens' K/V stay in both caches, hidden by the masks, until overwritten.

At T > 0 the same two steps also sample on the device (speculative sampling: accept slot k with
probability min(1, p/q), else draw from norm(max(p - q, 0)); the bonus from p), with keyed noise:
each uniform is a hash of (a per-generation key drawn from the caller's generator, a stream, the
absolute position[, the token]), so the sampled step is one graph as well and the host still reads
back only the new tokens. A draw takes one uniform through its row's cumulative sum
(`sampling.keyed_proposals`, `sampling.keyed_verify`), and the next token is drawn from the kept row's distribution alone. A
position's noise only ever decides one kept token: a later step samples only positions past the last
kept one.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn

from nemo_dflash.inference.graphs import CapturedStep, EagerStep, fused_elementwise
from nemo_dflash.inference.output import GenerationOutput, sync, truncate
from nemo_dflash.sampling import (
    NEXT_STREAM, Sampling, SamplingParams, as_sampling, filter_scores, keyed_draw, keyed_proposals, keyed_verify,
    select_tokens,
)
from nemo_dflash.inference.static_cache import (
    StaticDraftContextCache,
    TargetStaticCache,
    attn_implementation,
    causal_mask,
    check_static_target,
)

logger = logging.getLogger(__name__)

LENGTH_BUCKET = 256  # cache lengths and attention views are rounded up to this (one graph per view length)
# True: each step attends over the smallest multiple of LENGTH_BUCKET covering its positions (one
# graph per step and view length). False: one graph per step over the whole cache. Measured on an
# H200, SmolLM2 shape, 4,352-position cache (docs/performance.md): the speculative step 4.93 -> 3.19
# ms at position 256, 2.98 + 0.71 ms at 2,048, equal at 4,096; benchmarks/decode.py speed --buckets
# times both.
USE_BUCKETS = True
# True: a runner captures the graphs of all its view lengths when it is made, before any generation's
# clock starts (each capture is ~3 forwards; a 4,352-position cache has 17 lengths). False: each length
# is captured the first time a step needs it, inside the decode loop, where it would be timed.
CAPTURE_ALL_BUCKETS = True
FUSE_ELEMENTWISE = True  # captured steps fuse RMSNorm, RoPE and SiLU*up (graphs.fused_elementwise)


def cache_length_for(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """Positions a generation can write (a verify writes B past the last token), rounded up."""
    need = prompt_len + max_new_tokens + block_size
    return -(-need // LENGTH_BUCKET) * LENGTH_BUCKET


def view_length(need: int, max_len: int) -> int:
    """Attention view for a step that must see positions [0, need): rounded up to a bucket, capped."""
    if not USE_BUCKETS:
        return max_len
    return min(-(-need // LENGTH_BUCKET) * LENGTH_BUCKET, max_len)


def view_lengths(max_len: int) -> list[int]:
    """Every view length a runner of cache length `max_len` can pick."""
    if not USE_BUCKETS:
        return [max_len]
    return sorted({min(b, max_len) for b in range(LENGTH_BUCKET, max_len + LENGTH_BUCKET, LENGTH_BUCKET)})


def _bucket_key() -> int:
    """What a runner's graphs depend on besides its cache length (0 = no buckets)."""
    return LENGTH_BUCKET if USE_BUCKETS else 0


class BucketedSteps:
    """One step (EagerStep or CapturedStep) per view length, made up front or on first use."""

    def __init__(self, make: Callable[[int], Any], max_len: int, name: str, use_graphs: bool) -> None:
        self.make, self.max_len, self.name, self.use_graphs = make, max_len, name, use_graphs
        self.bucket_key = _bucket_key()
        self.steps: dict[int, Any] = {}
        if CAPTURE_ALL_BUCKETS:  # the eager path follows the same choice, so CPU tests cover both
            for n in view_lengths(max_len):
                self.steps[n] = make(n)

    def view(self, need: int) -> int:
        """The view length for a step that must see [0, need); a one-int host check that it does."""
        n = view_length(need, self.max_len)
        if not need <= n <= self.max_len:
            raise RuntimeError(f"{self.name}: attention view of {n} positions cannot hold the {need} it needs "
                               f"(cache length {self.max_len})")
        return n

    def get(self, n: int) -> Any:
        step = self.steps.get(n)
        if step is None:
            if self.use_graphs:
                logger.info("Capturing %s for view length %d (inside the decode loop)", self.name, n)
            step = self.steps[n] = self.make(n)
        return step


def _model_dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def make_step(fn: Callable[[], Any], device: torch.device, use_graphs: bool, *models: nn.Module) -> Any:
    """`fn` as a step: captured as a CUDA graph (its models' elementwise work fused), or run eagerly."""
    if not use_graphs:
        return EagerStep(fn)
    if not FUSE_ELEMENTWISE:
        return CapturedStep(fn, device)
    with fused_elementwise(*models):
        return CapturedStep(fn, device)


# ----------------------------------------------------------------------------- plain decoding


class SampledStepState:
    """What a sampled captured step reads from buffers, set per generation: each row's noise key (drawn from
    the caller's generator), 1/T, top-p and top-k."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.key = torch.zeros(rows, dtype=torch.long, device=device)
        self.inv_temp = torch.ones((), dtype=torch.float32, device=device)
        self.top_p = torch.ones((), dtype=torch.float32, device=device)
        self.top_k = torch.zeros((), dtype=torch.long, device=device)

    def start(self, sampling: SamplingParams, generator: Optional[torch.Generator]) -> None:
        gen_device = generator.device if generator is not None else torch.device("cpu")
        self.key.copy_(torch.randint(0, 2**62, self.key.shape, generator=generator, device=gen_device))
        self.inv_temp.fill_(1.0 / sampling.temperature)
        self.top_p.fill_(sampling.top_p)
        self.top_k.fill_(sampling.top_k)

    def scores(self, logits: torch.Tensor, filtered: bool) -> torch.Tensor:
        """logits / T, filtered by top-k / top-p when the step filters (`sampling.filter_scores`)."""
        scores = logits.float() * self.inv_temp
        return filter_scores(scores, self.top_p, self.top_k) if filtered else scores

    def next_tokens(self, logits: torch.Tensor, filtered: bool, positions: torch.Tensor) -> torch.Tensor:
        """A plain step's tokens [R] for logits [R, V]: each row's keyed draw for its token at `positions` [R]."""
        return keyed_draw(NEXT_STREAM, self.key, positions, torch.softmax(self.scores(logits, filtered), dim=-1))


class StaticPlainRunner:
    """One-token decoding of a target on a StaticCache, one captured graph per token. At T > 0 the step
    also draws its token, keyed by (a per-generation key, the position), as the speculative step does."""

    def __init__(self, model: nn.Module, max_len: int, greedy: bool, use_graphs: bool, filtered: bool = False) -> None:
        check_static_target(model)
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = _model_dtype(model)
        self.attn = attn_implementation(model)
        self.max_len, self.greedy, self.use_graphs = int(max_len), greedy, use_graphs
        self.filtered = filtered and not greedy  # top-p / top-k baked into the sampled step (values in buffers)
        self.kv = TargetStaticCache(model, self.max_len, self.device, self.dtype)
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros((), dtype=torch.long, device=self.device)
        self.state = None if greedy else SampledStepState(1, self.device)
        if use_graphs:
            logger.info("Capturing the target's 1-token step as CUDA graphs (cache length %d, views %s)",
                        self.max_len, view_lengths(self.max_len) if CAPTURE_ALL_BUCKETS else "on first use")
        self.steps = BucketedSteps(
            lambda n: make_step(lambda: self._step(n), self.device, use_graphs, model), self.max_len,
            "the 1-token step", use_graphs)

    def _step(self, view_len: int) -> torch.Tensor:
        """One token at self.pos, attending over the cache's first `view_len` positions."""
        q_pos = self.pos.view(1)
        self.kv.write_positions = q_pos
        self.kv.view_len = view_len
        out = self.model(
            input_ids=self.tok, position_ids=q_pos.view(1, 1), past_key_values=self.kv.cache, use_cache=True,
            attention_mask=causal_mask(q_pos, view_len, self.attn, self.dtype),
        )
        logits = out.logits[0, -1:]
        if self.greedy:  # advance on the device: next input token and position
            tok = logits.argmax(dim=-1)
        else:
            tok = self.state.next_tokens(logits, self.filtered, q_pos + 1)
        self.tok.copy_(tok.view(1, 1))
        self.pos.add_(1)
        return logits

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Eager prompt forward into the static cache; returns the last position's logits [1, V]."""
        plen = ids.shape[1]
        positions = torch.arange(plen, device=self.device)
        self.kv.write_positions = positions
        self.kv.view_len = view_len = self.steps.view(plen)
        out = self.model(
            input_ids=ids, position_ids=positions.unsqueeze(0), past_key_values=self.kv.cache, use_cache=True,
            attention_mask=causal_mask(positions, view_len, self.attn, self.dtype),
        )
        return out.logits[0, -1:]

    @torch.no_grad()
    def generate(
        self, ids: torch.Tensor, max_new_tokens: int, temperature: Sampling, stop_ids: set[int],
        generator: Optional[torch.Generator],
    ) -> GenerationOutput:
        device = self.device
        sync(device)
        t0 = time.perf_counter()
        tok, _ = select_tokens(self.prefill(ids), temperature, generator)
        output = [int(tok[0])]
        self.tok.copy_(tok.view(1, 1))
        pos = ids.shape[1]  # the host's copy of self.pos, for picking the step's view
        self.pos.fill_(pos)
        if self.state is not None:
            self.state.start(as_sampling(temperature), generator)
        sync(device)
        t1 = time.perf_counter()
        stopped = output[0] in stop_ids
        steps = 0
        while not stopped and len(output) < max_new_tokens:
            self.steps.get(self.steps.view(pos + 1)).replay()
            pos += 1
            nxt = int(self.tok)  # the step's one host sync
            output.append(nxt)
            steps += 1
            stopped = nxt in stop_ids
        sync(device)
        t2 = time.perf_counter()
        return GenerationOutput(
            output_ids=output, num_target_forwards=steps, acceptance_lengths=[1] * steps,
            decode_time_s=t2 - t1, prefill_time_s=t1 - t0, stopped=stopped,
        )


# One runner per (target, greedy), reused across calls: capture costs far more than a step.
_PLAIN_RUNNERS: "weakref.WeakKeyDictionary[nn.Module, dict[tuple[bool, bool], StaticPlainRunner]]" = (
    weakref.WeakKeyDictionary()
)


def static_autoregressive_generate(
    model: nn.Module, ids: torch.Tensor, max_new_tokens: int, temperature: Sampling, stop_ids: set[int],
    generator: Optional[torch.Generator], use_graphs: bool,
) -> GenerationOutput:
    """Plain decoding on the static path; captures (or re-captures for a longer cache) as needed."""
    s = as_sampling(temperature)
    greedy, filtered = s.greedy, not s.greedy and s.filtered
    key: tuple = (greedy, use_graphs) + ((filtered,) if filtered else ())
    need = cache_length_for(ids.shape[1], max_new_tokens, 1)
    runners = _PLAIN_RUNNERS.setdefault(model, {})
    runner = runners.get(key)
    if runner is None or runner.max_len < need or runner.steps.bucket_key != _bucket_key():
        runners.pop(key, None)  # free the old graphs and cache first
        runner = StaticPlainRunner(model, need, greedy, use_graphs, filtered)
        runners[key] = runner
    return runner.generate(ids, max_new_tokens, temperature, stop_ids, generator)


# ----------------------------------------------------------------------------- speculative decoding


class StaticSpecRunner:
    """Fixed-shape speculative decoding for one `DFlashSpeculativeDecoder` (see the module doc)."""

    filtered = False  # top-p / top-k filter the sampled step (values in buffers)
    draft_greedy = False  # the draft proposes its argmax, verified as a one-hot q

    def __init__(self, decoder: Any, max_len: int, greedy: bool, use_graphs: bool, filtered: bool = False,
                 draft_greedy: bool = False) -> None:
        model = decoder.target.model
        check_static_target(model)
        self.dec = decoder
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = _model_dtype(model)
        self.attn = attn_implementation(model)
        self.B = decoder.block_size
        self.max_len, self.greedy, self.use_graphs = int(max_len), greedy, use_graphs
        # baked into the captured steps: whether top-p / top-k filter (their values are buffers) and
        # whether the draft proposes its argmax (one-hot q) instead of a sample
        self.filtered, self.draft_greedy = filtered, draft_greedy
        self.kv = TargetStaticCache(model, self.max_len, self.device, self.dtype)
        self.dcache = StaticDraftContextCache(len(decoder.draft.layers), self.max_len)
        dev, B = self.device, self.B
        self.blk = torch.zeros(1, B, dtype=torch.long, device=dev)  # verify input [last, proposals]
        self.pos = torch.zeros((), dtype=torch.long, device=dev)  # position of blk[0, 0]
        self.ctx_start = torch.zeros((), dtype=torch.long, device=dev)  # first position of the draft's new context
        self.arange_b = torch.arange(B, device=dev)
        self.mask_ids = torch.full((B - 1,), decoder.mask_token_id, dtype=torch.long, device=dev)
        self.key_index = torch.arange(self.max_len, device=dev)
        self.block_visible = torch.ones(B, dtype=torch.bool, device=dev)
        n_feat = len(decoder.target.target_layer_ids) * model.config.hidden_size
        self.feats = torch.zeros(1, B, n_feat, dtype=self.dtype, device=dev)  # verified features, padded to B
        self.result = torch.zeros(B + 1, dtype=torch.long, device=dev)  # [n_accepted, block tokens...]
        self.state = None if greedy else SampledStepState(1, dev)  # the sampled step's key, 1/T, filters
        if not greedy:  # the draft's distributions, for the accept test
            self.q = torch.zeros(B - 1, decoder.lm_head.weight.shape[0], dtype=torch.float32, device=dev)
        self.after_draft: Optional[Callable[[], None]] = None  # test hook: overwrite proposals in self.blk
        if use_graphs:
            logger.info("Capturing the draft block and the %d-token verify as CUDA graphs (cache length %d, "
                        "views %s)", B, self.max_len,
                        view_lengths(self.max_len) if CAPTURE_ALL_BUCKETS else "on first use")
        # Each lambda looks self._draft / self._verify up when it runs (tests wrap them).
        self.draft_steps = BucketedSteps(
            lambda n: make_step(lambda: self._draft(self.feats, n), dev, use_graphs, decoder.draft),
            self.max_len, "the draft block", use_graphs) if B > 1 else None
        self.verify_steps = BucketedSteps(
            lambda n: make_step(lambda: self._verify(n), dev, use_graphs, model), self.max_len,
            f"the {B}-token verify", use_graphs)

    def view(self, pos: int) -> int:
        """The view length of the speculative step at position `pos` (its verify sees up to pos + B - 1)."""
        return self.verify_steps.view(pos + self.B)

    def steps_at(self, pos: int) -> tuple[int, Optional[Any], Any]:
        """(view length, draft step, verify step) of the step at position `pos` (host bookkeeping only)."""
        n = self.view(pos)
        return n, (self.draft_steps.get(n) if self.draft_steps is not None else None), self.verify_steps.get(n)

    @property
    def bucket_key(self) -> int:
        return self.verify_steps.bucket_key

    # -- the two captured steps

    def _draft(self, feats: torch.Tensor, view_len: int) -> torch.Tensor:
        """Draft logits [B-1, V] for the block at self.pos, given new context `feats` [1, C, n*H]
        at positions ctx_start.. (C = B padded in the captured step; the prompt at step 1),
        attending over the context cache's first `view_len` positions plus the block."""
        B, c_len = self.B, feats.shape[1]
        ctx_pos = self.ctx_start + (self.arange_b if c_len == B else torch.arange(c_len, device=self.device))
        self.dcache.write_positions = ctx_pos
        self.dcache.view_len = view_len
        position_ids = torch.cat([ctx_pos, self.pos + self.arange_b]).unsqueeze(0)
        noise = self.dec.embed_tokens(torch.cat([self.blk[0, :1], self.mask_ids]).unsqueeze(0))
        # Context slot j is visible iff j < pos (verified); block keys are all visible.
        visible = torch.cat([self.key_index[:view_len] < self.pos, self.block_visible]).view(1, 1, 1, -1)
        hidden = self.dec.draft(noise_embedding=noise, target_hidden=feats, position_ids=position_ids,
                                attention_mask=visible, cache=self.dcache)
        logits = self.dec.lm_head(hidden[0, 1:].to(self.dec.lm_head.weight.dtype))
        if self.greedy:
            self.blk[0, 1:].copy_(logits.argmax(dim=-1))
        else:
            self._propose_sampled(logits)
        return logits

    def _propose_sampled(self, logits: torch.Tensor) -> None:
        """Keyed draws from the draft's filtered softmax into the block (or its argmax, q one-hot);
        q is kept for the accept test."""
        if self.draft_greedy:
            tok = logits.argmax(dim=-1)
            self.q.zero_().scatter_(-1, tok[:, None], 1.0)
            self.blk[0, 1:].copy_(tok)
            return
        self.q.copy_(torch.softmax(self.state.scores(logits, self.filtered), dim=-1))
        self.blk[0, 1:].copy_(keyed_proposals(self.q[None], self.state.key, self.pos.view(1))[0])

    def _verify(self, view_len: int) -> torch.Tensor:
        """Target logits [B, V] of the block, attending over the cache's first `view_len`
        positions; at T=0 also accept and advance, on the device."""
        q_pos = self.pos + self.arange_b
        self.kv.write_positions = q_pos
        self.kv.view_len = view_len
        with self.dec.target.capture(stop_early=False) as captured:
            out = self.model(
                input_ids=self.blk, position_ids=q_pos.unsqueeze(0), past_key_values=self.kv.cache, use_cache=True,
                attention_mask=causal_mask(q_pos, view_len, self.attn, self.dtype),
            )
        self.feats.copy_(self.dec.target.concat(captured))
        logits = out.logits[0]
        if self.greedy:
            tgt = logits.argmax(dim=-1)  # [B]
            n_acc = (self.blk[0, 1:] == tgt[:-1]).long().cumprod(dim=0).sum()
            tokens = tgt  # accepted proposals equal the target's tokens
        else:
            n_acc, tokens = self._accept_sampled(logits)
        self.result[0].copy_(n_acc)
        self.result[1:].copy_(tokens)
        self.ctx_start.copy_(self.pos)
        self.pos.add_(n_acc + 1)
        self.blk[0, :1].copy_(tokens.gather(0, n_acc.view(1)))
        return logits

    def _accept_sampled(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative sampling on the device: (accepted count, block tokens [B]) where tokens[:n]
        are the kept proposals and tokens[n] the next token (residual draw, or the bonus from p)."""
        p = torch.softmax(self.state.scores(logits, self.filtered), dim=-1)  # [B, V]; row k judges slot k + 1
        n_acc, tokens = keyed_verify(p[None], self.q[None], self.blk[:, 1:], self.state.key, self.pos.view(1))
        return n_acc[0], tokens[0]

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Eager prompt forward: (last logits [1, V], prompt features [1, P, n*H])."""
        plen = ids.shape[1]
        positions = torch.arange(plen, device=self.device)
        self.kv.write_positions = positions
        self.kv.view_len = view_len = self.verify_steps.view(plen)
        with self.dec.target.capture(stop_early=False) as captured:
            out = self.model(
                input_ids=ids, position_ids=positions.unsqueeze(0), past_key_values=self.kv.cache, use_cache=True,
                attention_mask=causal_mask(positions, view_len, self.attn, self.dtype),
            )
        return out.logits[0, -1:], self.dec.target.concat(captured)

    # -- the loop

    @torch.no_grad()
    def generate(
        self, ids: torch.Tensor, max_new_tokens: int, temperature: Sampling, stop_ids: set[int],
        generator: Optional[torch.Generator],
    ) -> GenerationOutput:
        device, B = self.device, self.B
        sampling = as_sampling(temperature)
        sync(device)
        t0 = time.perf_counter()
        logits, prompt_feats = self.prefill(ids)
        first, _ = select_tokens(logits, sampling, generator)
        output = [int(first[0])]
        plen = ids.shape[1]
        self.blk[0, :1].copy_(first)
        self.pos.fill_(plen)
        self.ctx_start.zero_()
        sync(device)
        t1 = time.perf_counter()

        if not self.greedy:  # this generation's noise key, drawn from (and advancing) the caller's generator
            self.state.start(sampling, generator)
        stopped = output[0] in stop_ids
        accept_lens: list[int] = []
        step_one = True
        pos = plen  # the host's copy of self.pos: picks the step's view length
        while not stopped and len(output) < max_new_tokens:
            view_len, draft_step, verify_step = self.steps_at(pos)
            if B > 1:  # step 1 drafts against the whole prompt (eager); later steps replay the graph
                self._draft(prompt_feats, view_len) if step_one else draft_step.replay()
                step_one = False
            if self.after_draft is not None:
                self.after_draft()
            verify_step.replay()
            res = self.result.tolist()  # the step's one host sync
            n_acc = res[0]
            pos += n_acc + 1
            new = res[1: n_acc + 2]  # the kept proposals and the next token
            accept_lens.append(len(new))
            kept, stopped = truncate(new, stop_ids, max_new_tokens - len(output))
            output.extend(kept)
        sync(device)
        t2 = time.perf_counter()
        return GenerationOutput(
            output_ids=output, num_target_forwards=len(accept_lens), acceptance_lengths=accept_lens,
            decode_time_s=t2 - t1, prefill_time_s=t1 - t0, stopped=stopped,
        )


def static_speculative_generate(
    decoder: Any, ids: torch.Tensor, max_new_tokens: int, temperature: Sampling, stop_ids: set[int],
    generator: Optional[torch.Generator], use_graphs: bool,
) -> GenerationOutput:
    """Speculative decoding on the static path, reusing the decoder's runner when it fits."""
    s = as_sampling(temperature)
    greedy = s.greedy
    filtered, draft_greedy = (not greedy and s.filtered), (not greedy and s.draft == "greedy")
    key: tuple = (greedy, use_graphs) + ((filtered, draft_greedy) if filtered or draft_greedy else ())
    need = cache_length_for(ids.shape[1], max_new_tokens, decoder.block_size)
    runner = decoder._static_runners.get(key)
    if runner is None or runner.max_len < need or runner.bucket_key != _bucket_key():
        decoder._static_runners.pop(key, None)
        runner = StaticSpecRunner(decoder, need, greedy, use_graphs, filtered, draft_greedy)
        decoder._static_runners[key] = runner
    return runner.generate(ids, max_new_tokens, temperature, stop_ids, generator)


__all__ = [
    "BucketedSteps",
    "CAPTURE_ALL_BUCKETS",
    "LENGTH_BUCKET",
    "SampledStepState",
    "USE_BUCKETS",
    "StaticPlainRunner",
    "StaticSpecRunner",
    "cache_length_for",
    "make_step",
    "static_autoregressive_generate",
    "static_speculative_generate",
    "view_length",
    "view_lengths",
]
