"""Requests in, completions out: the one host loop both batched runners (`engine/batched_static.py`) run.

- **Continuous batching.** With fewer rows than prompts, the prompts enter the rows in order: the rows
  whose answers end at one step take the next prompts together, once `refill_rows` rows are free (1: at
  once) or no row decodes. Their prompts are prefilled in one forward into those rows (cache positions
  from 0; what a row held before stays hidden by its mask until overwritten), each one's first token
  chosen, and a speculative row's first block drafted eagerly against its whole prompt, while the other
  rows go on. A prompt's answer is the same whichever row and step it enters at: at T > 0 its draws use
  its own noise key (`Request.key` with the call's seed).
- **Requests** (`serve`): prompts are taken from a queue the caller may append to while answers stream
  out; each has its own cap; a looping answer can be stopped at a loop check; a conversation's next turn
  can continue in its row, prefilling only what its prompt adds to the row's tokens (the plain runner).

The loop knows the runner only by what `batched_static._Rows` supplies: its rows, `_enter_rows`, `_decode_step`
and its counters.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import torch
from torch.profiler import record_function

from nemo_dflash.engine.output import GenerationOutput, sync, truncate
from nemo_dflash.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from nemo_dflash.engine.batched_static import _Rows

# What a caller may do when an answer ends: (prompt index, its output) -> a follow-up prompt (the next turn of
# its conversation, say), decoded as one more prompt, or None.
OnDone = Callable[[int, GenerationOutput], Optional[Sequence[int]]]


@dataclass
class Request:
    """One prompt for `serve`. `key` keys its sampling noise (with the call's seed): an answer depends on its
    prompt and key only, not on the row it lands in, the prompts beside it, or an interrupted run.

    `hold`: a follow-up may continue this conversation, so its row (and the K/V it holds) waits for it when the
    answer ends. `after`: the completion this request follows; if its row is still held, the request continues
    there and only what its prompt adds past the longest common prefix with the row's tokens is prefilled
    (a prefix's K/V is right whatever follows it). `prompt_ids` is always the whole prompt.
    `max_new_tokens`: this answer's cap, 1 up to the call's (None: the call's)."""

    key: int
    prompt_ids: list[int]
    tag: Any = None  # the caller's handle, returned with the completion
    hold: bool = False
    after: Optional["Completion"] = None
    max_new_tokens: Optional[int] = None


@dataclass
class Completion:
    """An answer. `token_ids` exclude the stop token and, for an answer stopped at a loop, everything from the
    loop's start; `output` holds every token kept (the stop token included) and the steps' acceptance lengths."""

    request: Request
    token_ids: list[int]
    finish: str  # "stop" | "length" | "loop"
    generated: int  # tokens generated for it (a stop token and a cut loop included)
    loop_start: Optional[int] = None
    row: Optional[int] = None  # the row held for a follow-up (`Request.hold`), else None
    output: Optional[GenerationOutput] = None


def noise_key(seed: int, key: int) -> int:
    """A request's 62-bit noise key from the call's seed and its own key (splitmix64's finaliser)."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(key) + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 2


def common_prefix(held: Sequence[int], prompt: Sequence[int]) -> int:
    """Tokens a follow-up can keep of a held row: the common prefix of the row's tokens and the new prompt,
    leaving at least the prompt's last token to run (its logits give the answer's first token)."""
    n = 0
    for a, b in zip(held, prompt):
        if a != b:
            break
        n += 1
    return min(n, len(prompt) - 1)


@dataclass
class _Live:
    """A row's answer in progress: its request, tokens kept so far (a stop token included), each step's
    acceptance length, its cap and the last length its loop check reached."""

    request: Request
    cap: int
    tokens: list[int]
    accepted: list[int]
    checked: int = 0


def serve_requests(runner: "_Rows", pending: "collections.deque[Request]", max_new_tokens: int, stop_ids: set[int],
                   sampling: Optional[SamplingParams] = None, seed: int = 0, loop_detector: Any = None,
                   stop_on_loop: bool = False, loop_check_every: int = 128, refill_rows: int = 1,
                   reuse_prefix: bool = True) -> Iterator[Completion]:
    """`_Rows.serve`: the call's settings checked and set on `runner`, then its loop (`_ServeCall`)."""
    if runner.sampled != (sampling is not None and not sampling.greedy):
        raise ValueError("this runner's captured steps are for " + ("T > 0" if runner.sampled else "T=0"))
    if refill_rows < 1 or loop_check_every < 1:
        raise ValueError(f"refill_rows and loop_check_every must be >= 1, got {refill_rows}, {loop_check_every}")
    runner.sampling = sampling if runner.sampled else None
    if runner.state is not None:
        runner.state.configure(sampling)
    stop_on_loop = stop_on_loop and loop_detector is not None
    call = _ServeCall(runner, pending, max_new_tokens, stop_ids, seed, loop_detector, stop_on_loop,
                      loop_check_every, refill_rows, reuse_prefix)
    yield from call.run()


class _ServeCall:
    """One `serve` call's host side: which request each row holds, the rows free or held for a follow-up, the
    rows whose prompt just entered, and the completions not yet yielded."""

    def __init__(self, runner: "_Rows", pending: "collections.deque[Request]", max_new_tokens: int,
                 stop_ids: set[int], seed: int, loop_detector: Any, stop_on_loop: bool, loop_check_every: int,
                 refill_rows: int, reuse_prefix: bool) -> None:
        self.runner, self.pending, self.max_new_tokens, self.stop_ids = runner, pending, max_new_tokens, stop_ids
        self.seed, self.loop_detector, self.stop_on_loop = seed, loop_detector, stop_on_loop
        self.loop_check_every, self.refill_rows, self.reuse_prefix = loop_check_every, refill_rows, reuse_prefix
        R, self.room = runner.rows, runner._room(max_new_tokens)
        runner._reset()
        runner.row_requests = [None] * R
        self.live: list[Optional[_Live]] = [None] * R
        self.host_pos = [0] * R
        self.free = list(range(R))  # rows waiting for a prompt
        self.held: dict[int, tuple[Completion, list[int]]] = {}  # row -> (its completion, the tokens its K/V holds)
        self.fresh: dict[int, Any] = {}  # rows whose prompt entered since the last step: what that step needs
        self.done: list[Completion] = []
        self.clock = time.perf_counter

    def check(self, req: Request) -> int:
        """The request's cap, once its prompt fits the rows' cache."""
        max_len, max_new_tokens = self.runner.max_len, self.max_new_tokens
        if not 0 < len(req.prompt_ids) <= max_len - self.room:
            raise ValueError(f"request {req.key}: a prompt of {len(req.prompt_ids)} tokens does not fit the "
                             f"rows' cache of {max_len} positions: pass max_prompt_tokens >= "
                             f"{len(req.prompt_ids)}")
        cap = max_new_tokens if req.max_new_tokens is None else int(req.max_new_tokens)
        if not 0 < cap <= max_new_tokens:
            raise ValueError(f"request {req.key}: max_new_tokens {cap}; this call takes 1..{max_new_tokens}")
        return cap

    def finish(self, row: int, n: Optional[int] = None, loop_start: Optional[int] = None) -> None:
        """The answer in `row` ended (at its first `n` tokens, a loop check's cut); the row is held for a
        follow-up or freed."""
        a = self.live[row]
        self.live[row] = None
        self.fresh.pop(row, None)
        tokens = a.tokens if n is None else a.tokens[:n]
        stopped = bool(tokens) and tokens[-1] in self.stop_ids and n is None
        answer = tokens[:-1] if stopped else tokens
        if n is None and self.loop_detector is not None:
            loop_start = self.loop_detector.find(answer)
        out = GenerationOutput(output_ids=list(tokens), num_target_forwards=len(a.accepted),
                               acceptance_lengths=list(a.accepted), stopped=stopped)
        req = a.request
        if self.stop_on_loop and loop_start is not None:
            c = Completion(req, answer[:loop_start], "loop", len(tokens), loop_start, output=out)
        else:
            c = Completion(req, answer, "stop" if stopped else "length", len(tokens), loop_start, output=out)
        if req.hold:
            c.row = row
            self.held[row] = (c, list(req.prompt_ids) + tokens[:-1])  # the last token's K/V was never written
        else:
            self.free.append(row)
        self.done.append(c)

    def claim(self) -> list[tuple[int, Request, int]]:
        """The follow-ups of held rows, taken from `pending` into their rows (row, request, tokens kept);
        a held row nobody follows is freed."""
        runner, pending, held = self.runner, self.pending, self.held
        ready, claimed = [], set()
        if held and any(r.after is not None for r in pending):
            rest = []
            for req in pending:
                row = None if req.after is None else req.after.row
                if row is None or row in claimed or row not in held or held[row][0] is not req.after:
                    rest.append(req)
                    continue
                reuse = runner.reuses_prefix and self.reuse_prefix
                start = runner._reusable(held[row][1], req.prompt_ids) if reuse else 0
                runner.prefix_short += start < len(held[row][1])
                ready.append((row, req, start))
                claimed.add(row)
            pending.clear()
            pending.extend(rest)
        self.free.extend(r for r in held if r not in claimed)
        held.clear()
        return ready

    def refill(self) -> None:
        """Prompts into the rows free now: the held rows' follow-ups, then the queue's next prompts (once
        `refill_rows` rows are free, or no row decodes), prefilled together."""
        runner, pending, free = self.runner, self.pending, self.free
        entering = self.claim()
        runner.continued += len(entering)
        stopped = all(a is None for a in self.live)
        if pending and free and (len(free) >= min(self.refill_rows, len(pending)) or stopped):
            for row in sorted(free[: len(pending)]):
                entering.append((row, pending.popleft(), 0))
            taken = {row for row, _, _ in entering}
            free[:] = [r for r in free if r not in taken]
        if not entering:
            return
        caps = [self.check(req) for _, req, _ in entering]
        rows = [row for row, _, _ in entering]
        for row, req, _ in entering:
            runner.row_requests[row] = req
        t = self.clock()
        with record_function("engine.enter"):
            toks, needs = runner._enter_rows(rows, [req.prompt_ids for _, req, _ in entering],
                                             [s for _, _, s in entering],
                                             [noise_key(self.seed, req.key) for _, req, _ in entering])
        runner.seconds["prefill"] += self.clock() - t
        for (row, req, start), cap, tok, need in zip(entering, caps, toks, needs):
            runner.reused_tokens += start
            runner.generated_tokens += 1
            self.host_pos[row] = len(req.prompt_ids)
            self.live[row] = _Live(req, cap, [tok], [])
            if tok in self.stop_ids or cap <= 1:
                self.finish(row)
            elif need is not None:
                self.fresh[row] = need

    def keep(self, news: list[list[int]]) -> None:
        """Each live row's new tokens of a step, kept up to a stop token or its cap (and a loop check's cut)."""
        runner, loop_check_every, loop_detector = self.runner, self.loop_check_every, self.loop_detector
        for r, a in enumerate(self.live):
            if a is None:
                continue
            new = news[r]
            self.host_pos[r] += len(new)
            kept, hit = truncate(new, self.stop_ids, a.cap - len(a.tokens))
            a.tokens.extend(kept)
            runner.generated_tokens += len(kept)
            a.accepted.extend([1] * len(kept) if runner.one_token_steps else [len(new)])
            if self.stop_on_loop:  # each answer checked at its own lengths k, 2k, ...: the cut is not the batch's
                answer = len(a.tokens) - (1 if hit else 0)
                for n in range(a.checked + loop_check_every, answer + 1, loop_check_every):
                    a.checked = n
                    start = loop_detector.find(a.tokens[:n]) if n >= loop_detector.min_tokens else None
                    if start is not None:
                        runner.generated_tokens -= len(a.tokens) - n
                        self.finish(r, n, start)
                        break
                if self.live[r] is None:
                    continue
            if hit or len(a.tokens) >= a.cap:
                self.finish(r)

    def run(self) -> Iterator[Completion]:
        """The loop: a step, one read-back, the new tokens kept; completions yielded as their answers end."""
        runner, clock, live = self.runner, self.clock, self.live
        alive_set: list[bool] = [True] * runner.rows  # the rows `alive` marks stopped (`_reset`: all)
        sync(runner.device)
        t0 = clock()
        self.refill()
        sync(runner.device)
        runner.first_prefill_s, runner.decode_start = clock() - t0, clock()  # `generate`'s times
        while True:
            if self.done:
                t = clock()
                out, self.done = self.done, []
                for c in out:
                    yield c
                runner.seconds["caller"] += clock() - t
            t, prefilled = clock(), runner.seconds["prefill"]
            self.refill()
            t += runner.seconds["prefill"] - prefilled  # host time: the refill's prefill is counted apart
            if all(a is None for a in live):
                if not self.pending and not self.held and not self.done:
                    return
                runner.seconds["host"] += clock() - t
                continue
            stopped = [a is None for a in live]
            if stopped != alive_set:
                runner.set_alive(stopped)
                alive_set = stopped
            t1 = clock()
            with record_function("engine.step"):
                news = runner._decode_step(max(p for p, s in zip(self.host_pos, stopped) if not s), self.fresh,
                                           len(self.fresh) == stopped.count(False))
            t2 = clock()
            self.fresh.clear()
            self.keep(news)
            runner.seconds["decode"] += t2 - t1
            runner.seconds["host"] += (t1 - t) + (clock() - t2)


def generate_outputs(runner: "_Rows", prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: set[int],
                     sampling: Optional[SamplingParams] = None, generator: Optional[torch.Generator] = None,
                     on_done: Optional[OnDone] = None, refill_rows: int = 1) -> list[GenerationOutput]:
    """`_Rows.generate`: every prompt's answer (then the follow-ups' that `on_done` returned, in the order they
    came), through `runner.serve`; each prompt's noise key (T > 0) drawn from `generator` in that order."""
    gen_device = generator.device if generator is not None else torch.device("cpu")

    def request(i: int, prompt: Sequence[int]) -> Request:
        key = int(torch.randint(0, 2**62, (1,), generator=generator, device=gen_device)[0]) if runner.sampled else 0
        return Request(key, list(prompt), tag=i)

    pending = collections.deque(request(i, p) for i, p in enumerate(prompts))
    outputs: list[GenerationOutput] = [None] * len(pending)  # type: ignore[list-item]
    for c in runner.serve(pending, max_new_tokens, stop_ids, sampling, 0, refill_rows=refill_rows):
        outputs[c.request.tag] = c.output
        c.output.prefill_time_s = runner.first_prefill_s
        c.output.decode_time_s = time.perf_counter() - runner.decode_start
        follow = on_done(c.request.tag, c.output) if on_done is not None else None
        if follow is not None:
            pending.append(request(len(outputs), follow))
            outputs.append(None)  # type: ignore[arg-type]
    sync(runner.device)
    decode_s = time.perf_counter() - runner.decode_start
    for out in outputs:
        out.prefill_time_s, out.decode_time_s = runner.first_prefill_s, decode_s
    return outputs
