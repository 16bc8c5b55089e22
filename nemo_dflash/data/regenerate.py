"""Rewrite the assistant turns of chat data with the target model's own answers.

A DFlash draft learns to predict the *target's* next tokens, so it should train on text the
target itself generates: the answers in public chat data (ShareGPT's ChatGPT replies) follow
another model's distribution and cost acceptance length. :func:`regenerate_conversations`
keeps the user (and leading system) turns of each conversation and asks the target, through its
chat template, for every assistant turn, on the decoding engine (or `data/hf_generate.py`'s
`model.generate` fallback); the run's counters are `data/regen_stats.py`'s `RegenStats`.
"""

from __future__ import annotations

import collections
import copy
import logging
import queue
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

# The template knowledge lives in data/chat_template.py; these names stay importable from here.
from nemo_dflash.data.chat_template import (  # noqa: F401 (re-exported)
    TURNS, encode_prompt, encode_prompt_text, special_token_strings, split_prompt, stop_token_ids,
)
from nemo_dflash.data.hf_generate import (  # noqa: F401 (generate_batch, _generation_kwargs: re-exported)
    BatchedGenerateEngine, _generation_kwargs, _pad_id, generate_batch,
)
from nemo_dflash.data.loops import LoopDetector
from nemo_dflash.data.regen_stats import RegenStats
from nemo_dflash.engine.plain import Completion, PlainEngine, Request
from nemo_dflash.data.sources import Conversation
from nemo_dflash.engine.sampling import GREEDY, SamplingParams

logger = logging.getLogger(__name__)

ConversationLike = Union[Conversation, Sequence[dict[str, str]]]


LOOP_POLICIES = ("cut", "drop", "keep")
CAPPED_POLICIES = ("keep", "drop")
AFTER_CUT = ("end", "continue")
ENGINES = ("continuous", "generate")
# The order conversations start in. With every turn answered, a conversation's turns run one after
# another, so the last conversations started set a tail in which the batch empties; starting those
# with the most user turns first shortens it (a schedule model, docs/data.md: -16% steps at
# 2,048 slots, -10% at 1,024 on the ShareGPT set; a model, not a timing). Records do not change:
# an answer is keyed by its conversation, not by when it ran.
SCHEDULES = ("most_turns_first", "given")


@dataclass
class _Job:
    """One conversation being regenerated: the context built so far and the user turns still to answer."""

    index: int
    source: Optional[str]
    messages: list[dict[str, str]]
    users: list[str]
    next_user: int = 0
    finish_reason: Optional[str] = None
    prompt_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""  # the rendered prompt of ``prompt_ids`` (a later turn reuses its tokens)
    last: Optional[Completion] = None  # the answer of the turn before the one being asked
    kept: Counter = field(default_factory=Counter)  # tokens / loops / capped of the answers kept so far

    @property
    def answered(self) -> int:
        return sum(m["role"] == "assistant" for m in self.messages)

    def request_key(self) -> int:
        """The sampling key of the turn being asked: stable across runs, batches and resumes."""
        name = self.source if self.source is not None else f"#{self.index}"
        return zlib.crc32(f"{name}\x00{self.next_user}".encode()) & 0x7FFFFFFF


def prompt_problem(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    *,
    max_prompt_tokens: Optional[int] = None,
    specials: Optional[Sequence[str]] = None,
) -> tuple[list[int], Optional[str]]:
    """(prompt ids, None), or ([], the reason ``messages`` cannot be a prompt).

    User text containing a special-token string (a literal ``<|im_end|>``) would forge template
    markers, and the training data reader rejects it anyway.
    """
    ids, _, reason = prompt_problem_text(tokenizer, messages, max_prompt_tokens=max_prompt_tokens, specials=specials)
    return ids, reason


def prompt_problem_text(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    *,
    max_prompt_tokens: Optional[int] = None,
    specials: Optional[Sequence[str]] = None,
    previous: Optional[tuple[str, Sequence[int]]] = None,
) -> tuple[list[int], str, Optional[str]]:
    """:func:`prompt_problem` with the rendered text: (ids, text, None) or ([], "", the reason).
    ``previous``: the conversation's previous prompt (text, ids), whose tokens are reused
    (:func:`encode_prompt_text`)."""
    specials = special_token_strings(tokenizer) if specials is None else specials
    if any(s in m["content"] for m in messages for s in specials):
        return [], "", "special_tokens_in_prompt"
    try:
        ids, text = encode_prompt_text(tokenizer, messages, previous)
    except Exception as e:  # jinja raises anything (TemplateError, TypeError, ...)
        logger.debug("chat template failed: %s", e)
        return [], "", "template_error"
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        return [], "", "prompt_too_long"
    return ids, text, None


def _as_job(index: int, conv: ConversationLike, turns: str) -> tuple[_Job, Optional[str]]:
    """A job for ``conv`` and None, or a dummy job and the reason to skip it."""
    if isinstance(conv, Conversation):
        messages, source = conv.messages, conv.location
    else:
        messages, source = list(conv), None
    system, users = split_prompt(messages, turns)
    job = _Job(index=index, source=source, messages=system, users=users)
    return job, (None if users else "no_user_turn")


def _scheduled(conversations: Iterable[ConversationLike], schedule: str,
               turns: str) -> Iterator[tuple[int, ConversationLike]]:
    """(index, conversation) in the order they start; ``index`` stays the given position (it keys
    the sampling of a conversation without a location). ``most_turns_first`` reads every
    conversation first and sorts stably by user turns, most first (a no-op for ``turns="first"``)."""
    if schedule == "given" or turns != "all":
        return enumerate(conversations)
    indexed = list(enumerate(conversations))

    def user_turns(item: tuple[int, ConversationLike]) -> int:
        conv = item[1]
        try:
            return len(split_prompt(conv.messages if isinstance(conv, Conversation) else list(conv), turns)[1])
        except Exception:  # noqa: BLE001 - a malformed conversation fails where it starts, as without a schedule
            return 0

    return iter(sorted(indexed, key=lambda item: -user_turns(item)))


class SourceMix:
    """Interleave the conversations of several sources so that, stopped at any moment (a time cap),
    the answers written follow the sources' weights by supervised tokens.

    Why interleave rather than give each source a slice of the budget: slices run one after
    another, so each hand-over drains the engine's rows (a tail per source), and a source that
    finishes early leaves its slice unused; interleaving keeps every row busy and holds the mix at
    every moment, so any cap finds it. The next conversation to start is taken from the source
    whose estimated supervised tokens, over its weight, are the fewest: the tokens of its answers
    that ended, plus its turns in flight at its mean answer length so far (``prior_tokens`` before
    any answer of it ended). Inside a source the order is as given (the seeded shuffle), so what a
    capped run answers is a random sample of each source, not its longest conversations.
    Thread-safe: the prepare-ahead thread takes conversations while the caller's thread credits
    answers."""

    def __init__(self, weights: dict[str, float], source_of: dict[str, str], prior_tokens: float) -> None:
        if not weights or any(not w > 0 for w in weights.values()):
            raise ValueError(f"SourceMix needs positive weights, got {weights}")
        self.weights, self.source_of, self.prior = dict(weights), source_of, float(prior_tokens)
        self.tokens: Counter = Counter()  # supervised tokens of the answers that ended, by source
        self.answers: Counter = Counter()  # answers that ended, by source
        self.open_turns: Counter = Counter()  # turns of started conversations not yet answered, by source
        self._lock = threading.Lock()

    def _estimate(self, name: str) -> float:
        mean = self.tokens[name] / self.answers[name] if self.answers[name] else self.prior
        return (self.tokens[name] + self.open_turns[name] * mean) / self.weights[name]

    def order(self, conversations: Iterable[ConversationLike], turns: str) -> Iterator[tuple[int, ConversationLike]]:
        """(index, conversation) in the interleaved start order, chosen as they are taken."""
        queues: dict[str, collections.deque] = {name: collections.deque() for name in self.weights}
        for index, conv in enumerate(conversations):
            if not isinstance(conv, Conversation) or self.source_of.get(conv.location) not in queues:
                raise ValueError("SourceMix orders Conversation objects of its sources only")
            queues[self.source_of[conv.location]].append((index, conv))
        while True:
            with self._lock:
                left = [name for name in self.weights if queues[name]]
                if not left:
                    return
                name = min(left, key=self._estimate)  # ties: the first source given
                index, conv = queues[name].popleft()
                self.open_turns[name] += _user_turns(conv, turns)
            yield index, conv

    def answered(self, location: Optional[str], tokens: int) -> None:
        """An answer of ``location``'s conversation ended with ``tokens`` supervised tokens kept (0: dropped)."""
        name = self.source_of.get(location or "")
        if name is not None:
            with self._lock:
                self.tokens[name] += tokens
                self.answers[name] += 1
                self.open_turns[name] -= 1

    def closed(self, location: Optional[str], unasked: int) -> None:
        """A conversation ended (or was skipped) with ``unasked`` of its turns never asked."""
        name = self.source_of.get(location or "")
        if name is not None and unasked > 0:
            with self._lock:
                self.open_turns[name] -= unasked


def _user_turns(conv: ConversationLike, turns: str) -> int:
    try:
        return len(split_prompt(conv.messages if isinstance(conv, Conversation) else list(conv), turns)[1])
    except Exception:  # noqa: BLE001 - a malformed conversation fails where it starts
        return 0


def start_order(conversations: Iterable[ConversationLike], schedule: str, turns: str) -> list[ConversationLike]:
    """The conversations in the order :func:`regenerate_conversations` starts them under ``schedule``:
    ranks sharing one queue hand it out in this order (and run it with ``schedule="given"``), so
    the longest serial chains start first across all ranks."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return [conv for _, conv in _scheduled(conversations, schedule, turns)]


def _ask_next_turn(
    job: _Job, tokenizer: Any, *, max_prompt_tokens: Optional[int], specials: Sequence[str]
) -> Optional[str]:
    """Append ``job``'s next user turn and tokenise the prompt with ``tokenizer``; the reason it
    cannot be asked, if any (the turn is then taken back out of ``job.messages``)."""
    job.messages.append({"role": "user", "content": job.users[job.next_user]})
    previous = (job.prompt_text, job.prompt_ids) if job.prompt_text else None
    ids, text, reason = prompt_problem_text(tokenizer, job.messages, max_prompt_tokens=max_prompt_tokens,
                                            specials=specials, previous=previous)
    job.prompt_ids, job.prompt_text = ids, text
    if reason is not None:
        job.messages.pop()
    return reason


_PREPARED_END = object()  # the producer's last item: the conversations are exhausted
PREPARE_THREAD_NAME = "regen-prepare"


class _PrepareFailure:
    """An exception the producer hit, re-raised by the consumer where the inline path would raise it;
    ``counted``: it came after the conversation was taken from the source (``_as_job`` or ``ask``),
    so the inline path would have counted it in ``stats.conversations``."""

    def __init__(self, error: BaseException, counted: bool) -> None:
        self.error, self.counted = error, counted


def thread_copy(tokenizer: Any) -> Any:
    """A copy of ``tokenizer`` that another thread may encode with while this one does: a fast tokenizer's own
    Rust backend (two threads on one raise "Already borrowed"), its Python-side tables (vocabulary, merges: read,
    never written, by encoding) shared. A deep copy of a 151k-token tokenizer copies those tables too: 0.9 s
    against 0.5 s, once per regeneration. Anything without a backend is deep-copied."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        return copy.deepcopy(tokenizer)
    clone = copy.copy(tokenizer)
    clone._tokenizer = copy.deepcopy(backend)
    return clone


class _FirstTurnProducer:
    """A daemon thread that takes conversations from the source, builds their jobs and asks their
    first turn ahead of the consumer, into a queue of at most ``ahead`` items, in source order.

    It encodes with its own ``tokenizer`` (a copy: one fast tokenizer used by two threads raises
    "Already borrowed"). :meth:`stop` makes it end promptly (it never blocks on a full queue for
    longer than ``_POLL_S``) and joins it."""

    _POLL_S = 0.1

    def __init__(self, conversations: Iterable[tuple[int, ConversationLike]], *, ahead: int, turns: str, tokenizer: Any,
                 max_prompt_tokens: Optional[int], specials: Sequence[str]) -> None:
        self._conversations, self._turns, self._tokenizer = conversations, turns, tokenizer
        self._max_prompt_tokens, self._specials = max_prompt_tokens, specials
        self._queue: queue.Queue = queue.Queue(maxsize=ahead)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name=PREPARE_THREAD_NAME, daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        """Queue ``item`` unless told to stop first; whether it was queued."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=self._POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        try:
            source = iter(self._conversations)  # (index, conversation) pairs
            while not self._stop.is_set():
                try:
                    index, conv = next(source)
                except StopIteration:
                    self._put(_PREPARED_END)
                    return
                except BaseException as e:  # the source itself failed: not counted as a conversation
                    self._put(_PrepareFailure(e, counted=False))
                    return
                try:
                    job, reason = _as_job(index, conv, self._turns)
                    reason = reason or _ask_next_turn(job, self._tokenizer, max_prompt_tokens=self._max_prompt_tokens,
                                                      specials=self._specials)
                except BaseException as e:
                    self._put(_PrepareFailure(e, counted=True))
                    return
                if not self._put((index, job, reason)):
                    return
        except BaseException as e:  # anything else: the consumer must not wait forever
            self._put(_PrepareFailure(e, counted=False))

    def get(self) -> Any:
        """The next item: ``(index, job, reason)``, a :class:`_PrepareFailure` or ``_PREPARED_END``."""
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive():
                    try:
                        return self._queue.get_nowait()
                    except queue.Empty:
                        raise RuntimeError(f"the {PREPARE_THREAD_NAME} thread ended without a result") from None

    def halt(self) -> None:
        """Tell the thread to stop, without waiting for it."""
        self._stop.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Tell the thread to stop and wait for it (it finishes the conversation it is preparing)."""
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the %s thread did not stop within %.0fs (a slow conversation source?)",
                           PREPARE_THREAD_NAME, timeout)


@dataclass
class RegenSettings:
    """The keyword arguments `regenerate_conversations` and `openai_backend.regenerate_on_server` share: what each
    answer is asked for, what happens to it, and the run's hooks. One list and one set of defaults for both; the
    fields are checked when it is made, at the call, before any conversation is read."""

    max_new_tokens: int = 512
    sampling: SamplingParams = GREEDY
    batch_size: int = 8  # answers in flight (the engine's rows, a server's requests)
    turns: str = "first"
    seed: int = 0
    max_prompt_tokens: Optional[int] = None  # None: the target's context less max_new_tokens
    loops: str = "cut"
    capped: str = "keep"
    after_cut: str = "end"
    loop_detector: Optional[LoopDetector] = None
    stats: Optional[RegenStats] = None
    progress: Optional[Callable[[int, int], None]] = None
    should_stop: Optional[Callable[[], bool]] = None
    prepare_ahead: int = 0
    schedule: str = "most_turns_first"
    mix: Optional[SourceMix] = None

    def __post_init__(self) -> None:
        if self.turns not in TURNS:
            raise ValueError(f"turns must be one of {TURNS}, got {self.turns!r}")
        if self.loops not in LOOP_POLICIES or self.capped not in CAPPED_POLICIES or self.after_cut not in AFTER_CUT:
            raise ValueError(f"need loops in {LOOP_POLICIES}, capped in {CAPPED_POLICIES}, after_cut in {AFTER_CUT}")
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise ValueError("batch_size and max_new_tokens must be >= 1")
        if not isinstance(self.sampling, SamplingParams):  # its own checks ran when it was made
            raise ValueError(f"sampling must be a SamplingParams (got {self.sampling!r}): build one from the temperature")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.prepare_ahead < 0:
            raise ValueError(f"prepare_ahead must be >= 0, got {self.prepare_ahead}")
        self.stats = self.stats if self.stats is not None else RegenStats()
        self.loop_detector = self.loop_detector or LoopDetector()

    def prompt_budget(self, context: Optional[int]) -> int:
        """max_prompt_tokens, else what the target's context (4096 when unknown) leaves beside an answer."""
        if self.max_prompt_tokens is not None:
            return self.max_prompt_tokens
        return max((context or 4096) - self.max_new_tokens, 1)


def _answer_engine(model: Any, tokenizer: Any, engine: str, s: RegenSettings, max_prompt_tokens: int,
                   reuse_slots: bool) -> Any:
    """The engine the answers are decoded on: the decoding engine's rows (`continuous`), or `model.generate`
    batch after batch (`generate`)."""
    stop_ids = stop_token_ids(model, tokenizer)
    if engine == "continuous":
        return PlainEngine(
            model, rows=s.batch_size, max_prompt_tokens=max_prompt_tokens, max_new_tokens=s.max_new_tokens,
            stop_ids=stop_ids, sampling=s.sampling, seed=s.seed, loop_detector=s.loop_detector,
            stop_on_loop=s.loops != "keep", reuse_rows=reuse_slots,
        )
    return BatchedGenerateEngine(
        model, batch_size=s.batch_size, max_new_tokens=s.max_new_tokens, stop_ids=stop_ids,
        pad_id=_pad_id(tokenizer, stop_ids), sampling=s.sampling, seed=s.seed,
        loop_detector=s.loop_detector,
    )


def regenerate_conversations(
    model: Any,
    tokenizer: Any,
    conversations: Iterable[ConversationLike],
    *,
    engine: str = "continuous",
    reuse_slots: bool = True,
    **settings: Any,
) -> Iterator[dict[str, Any]]:
    """Yield ``{"messages", "finish_reason"[, "source"]}`` per conversation, as conversations end.

    ``conversations`` are :class:`Conversation` objects or plain ``[{"role", "content"}]`` lists;
    their assistant turns are replaced by the target's answers (``sampling``: greedy, or sampled with its
    temperature and top-p, keyed by ``seed``, the conversation and the turn).
    ``turns="first"`` answers the first user turn only (``[system?, user, assistant]``);
    ``turns="all"`` answers every user turn, with the target's own earlier answers as context.

    ``engine="continuous"`` keeps ``batch_size`` answers in flight in the decoding engine's rows and refills rows
    as answers end (:class:`~nemo_dflash.engine.plain.PlainEngine`); ``"generate"`` runs
    ``model.generate`` batch after batch. An answer that loops (``loop_detector``, default
    :class:`LoopDetector`) is cut at the loop's start (``loops="cut"``), dropped (``"drop"``) or kept
    (``"keep"``); an answer cut by ``max_new_tokens`` is kept (``capped="keep"``) or dropped. A
    dropped answer, an empty answer, or a next prompt over ``max_prompt_tokens`` ends the
    conversation there, and so does a cut or capped answer unless ``after_cut="continue"`` (the
    next turn then sees the cut answer in its history); if no turn survives it is skipped and counted in
    ``stats.skipped``. With the engine a conversation keeps its row between turns and a later
    turn prefills only what its prompt adds to the row's tokens (``stats.prefill_tokens`` /
    ``reused_tokens``; ``prefix_mismatch`` counts the turns whose prompt rewrote earlier tokens:
    they reuse only the common prefix; ``reuse_slots=False`` prefills every prompt whole, for
    comparison). ``progress(conversations_done, new_tokens)`` is called as answers end.
    Once ``should_stop()`` is true no new conversation or turn starts; a conversation with turns
    still to ask ends at its last answer (``stats.shortened["halted"]``), one not started is left out.

    ``prepare_ahead > 0`` takes the conversations, builds their first prompts (chat template and
    tokenisation) on a background thread (``"regen-prepare"``, with its own copy of ``tokenizer``)
    up to ``prepare_ahead`` conversations ahead, so that work overlaps the GPU's instead of running
    between decode steps; the records, their order and ``stats`` are those of ``prepare_ahead=0``
    (everything inline, on the calling thread), and an exception from ``conversations`` or a
    malformed conversation is raised here as inline. The thread may read up to ``prepare_ahead + 1``
    conversations past the last one started; it is stopped and joined when the run ends, halts or
    the generator is closed. Arguments are checked at the call.

    ``schedule`` (:data:`SCHEDULES`) is the order conversations start in: ``"most_turns_first"``
    (with ``turns="all"``; it reads every conversation before the first starts) or as given.
    ``mix`` (a :class:`SourceMix`) replaces it: the sources are interleaved by their weights in
    supervised tokens, so a run stopped by ``should_stop`` keeps the mix asked for.

"""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    run_settings = RegenSettings(**settings)
    max_prompt = run_settings.prompt_budget(getattr(model.config, "max_position_embeddings", None))
    gen = _answer_engine(model, tokenizer, engine, run_settings, max_prompt, reuse_slots)
    run = _Regeneration(gen, tokenizer, conversations, run_settings, max_prompt)
    return run.records()


class _Regeneration:
    """One `regenerate_conversations` call: the conversations waiting for a slot, and what happens to
    each answer as it ends (kept, cut or dropped; the next turn asked, or the conversation's record)."""

    def __init__(self, gen: Any, tokenizer: Any, conversations: Iterable[ConversationLike], s: RegenSettings,
                 max_prompt_tokens: int) -> None:
        self.gen, self.tokenizer, self.conversations = gen, tokenizer, conversations
        self.turns, self.schedule, self.batch_size = s.turns, s.schedule, s.batch_size
        self.max_prompt_tokens, self.prepare_ahead = max_prompt_tokens, s.prepare_ahead
        self.loops, self.drop_capped, self.after_cut = s.loops, s.capped == "drop", s.after_cut
        self.stats, self.progress, self.should_stop, self.mix = s.stats, s.progress, s.should_stop, s.mix
        self.specials = special_token_strings(tokenizer)
        self.pending: collections.deque[Request] = collections.deque()
        self.producer: Optional[_FirstTurnProducer] = None
        self.source: Optional[Iterator[tuple[int, ConversationLike]]] = None
        self.exhausted = False

    def records(self) -> Iterator[dict[str, Any]]:
        """Yield each conversation's record as it ends (the public generator)."""
        try:
            order = (self.mix.order(self.conversations, self.turns) if self.mix is not None
                     else _scheduled(self.conversations, self.schedule, self.turns))
            if self.prepare_ahead > 0:
                self.producer = _FirstTurnProducer(
                    order, ahead=self.prepare_ahead,
                    turns=self.turns, tokenizer=thread_copy(self.tokenizer),
                    max_prompt_tokens=self.max_prompt_tokens, specials=self.specials,
                )
            else:
                self.source = iter(order)
            yield from self._regenerate()
        finally:
            if self.producer is not None:
                self.producer.stop()

    def _ask(self, job: _Job) -> Optional[str]:
        """Append the next user turn and tokenise the prompt; the reason it cannot be asked, if any."""
        return _ask_next_turn(job, self.tokenizer, max_prompt_tokens=self.max_prompt_tokens, specials=self.specials)

    def _end(self, job: _Job, reason: Optional[str]) -> Optional[dict[str, Any]]:
        """The record of a finished conversation (None if no turn survived); counts why it ended."""
        stats = self.stats
        if self.mix is not None:
            self.mix.closed(job.source, len(job.users) - job.next_user)
        if reason is not None:
            (stats.shortened if job.answered else stats.skipped)[reason] += 1
        if self.progress is not None:
            self.progress(1, 0)
        if not job.answered:
            return None
        stats.written += 1
        stats.turns += job.answered
        stats.answer_tokens += job.kept["tokens"]
        stats.looping_after += job.kept["loops"]
        stats.capped_after += job.kept["capped"]
        stats.finish[job.finish_reason] += 1
        record: dict[str, Any] = {"messages": job.messages, "finish_reason": job.finish_reason}
        if job.source is not None:
            record["source"] = job.source
        return record

    def _take(self) -> Optional[tuple[_Job, Optional[str]]]:
        """The next conversation's job, its first turn asked (or the reason to skip it); None at the
        end. Counted in ``stats.conversations`` here, on the calling thread."""
        if self.producer is None:
            try:
                index, conv = next(self.source)
            except StopIteration:
                return None
            self.stats.conversations += 1
            job, reason = _as_job(index, conv, self.turns)
            return job, reason or self._ask(job)
        item = self.producer.get()
        if item is _PREPARED_END:
            return None
        if isinstance(item, _PrepareFailure):
            self.stats.conversations += item.counted
            raise item.error
        _, job, reason = item
        self.stats.conversations += 1
        return job, reason

    def _admit(self) -> None:
        """Top up ``pending`` with first turns of new conversations (2 x batch_size queued)."""
        while not self.exhausted and len(self.pending) < 2 * self.batch_size and not self.stats.halted:
            taken = self._take()
            if taken is None:
                self.exhausted = True
                return
            job, reason = taken
            if reason is not None:
                self.stats.skipped[reason] += 1
                if self.mix is not None:
                    self.mix.closed(job.source, len(job.users) - job.next_user)
                if self.progress is not None:
                    self.progress(1, 0)
                continue
            self.pending.append(self._request(job))

    @staticmethod
    def _request(job: _Job) -> Request:
        """The request of the turn just asked: its slot is held while later turns remain, and it
        continues in the slot of the conversation's previous answer."""
        return Request(job.request_key(), job.prompt_ids, tag=job, hold=job.next_user + 1 < len(job.users),
                       after=job.last)

    def _answered(self, done: Completion) -> Optional[dict[str, Any]]:
        """Apply the loop and cap policies to an answer that ended; ask the next turn, or return the
        conversation's record when it ends here."""
        stats, job = self.stats, done.request.tag
        stats.answers += 1
        stats.prompt_tokens += len(job.prompt_ids)
        looped = done.finish == "loop" or done.loop_start is not None
        stats.looping_before += looped
        capped = done.finish == "length" and not looped
        stats.capped_before += capped
        ids = done.token_ids
        if done.finish == "loop" and self.loops == "drop":
            ids = None
        elif looped and self.loops == "cut" and done.loop_start is not None:
            ids = ids[: done.loop_start]
        if capped and self.drop_capped:
            ids = None
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
        job.next_user += 1
        problem = None
        if ids is None:
            problem = "loop" if looped else "length"
        elif not text.strip():
            problem = "empty_answer"
        elif any(s in text for s in self.specials):
            problem = "special_tokens_in_answer"  # decoded pieces spelling a template marker
        if self.mix is not None:  # an answer's supervised tokens: its tokens and its end-of-turn token
            self.mix.answered(job.source, 0 if problem is not None else len(ids) + 1)
        if problem is not None:
            job.messages.pop()
            return self._end(job, problem)
        job.messages.append({"role": "assistant", "content": text})
        job.finish_reason = "loop" if looped and self.loops != "keep" else done.finish
        job.kept.update(tokens=len(ids), capped=int(capped), loops=int(looped and self.loops == "keep"))
        if job.next_user >= len(job.users):
            return self._end(job, None)
        if job.finish_reason != "stop" and self.after_cut == "end":
            return self._end(job, job.finish_reason)  # a cut answer is a poor context for the next turn
        if stats.halted:  # once halted no turn starts: the conversation ends at its last answer
            return self._end(job, "halted")
        history = job.prompt_ids + ids  # what the slot holds, as far as this answer was kept
        reason = self._ask(job)
        if reason is not None:
            return self._end(job, reason)
        stats.prefix_mismatch += job.prompt_ids[: len(history)] != history
        job.last = done
        self.pending.append(self._request(job))
        return None

    def _halt_pending(self) -> Iterator[dict[str, Any]]:
        """Empty the queue at a halt: a conversation whose next turn waited there ends at its last answer
        (its record, counted shortened by ``halted``); one not started yet is left out. Its answered turns
        are kept so a capped run keeps the work it did and every source its share (a multi-turn source
        has the most conversations in flight)."""
        waiting = list(self.pending)
        self.pending.clear()
        for req in waiting:
            job = req.tag
            if job.answered:
                job.messages.pop()  # the user turn asked, never answered
                record = self._end(job, "halted")
                if record is not None:
                    yield record

    def _regenerate(self) -> Iterator[dict[str, Any]]:
        gen, stats = self.gen, self.stats
        self._admit()
        t0 = time.perf_counter()
        generated0 = gen.generated_tokens
        prefill0, reused0 = getattr(gen, "prefill_tokens", 0), getattr(gen, "reused_tokens", 0)
        phases0 = collections.Counter(getattr(gen, "seconds", {}))
        # ``stats`` may carry an earlier call's figures (one call per thinking mode): they are added to
        before = (stats.seconds, stats.generated_tokens, stats.prefill_tokens, stats.reused_tokens)

        def count_progress() -> None:
            stats.seconds = before[0] + time.perf_counter() - t0
            stats.generated_tokens = before[1] + gen.generated_tokens - generated0
            stats.prefill_tokens = before[2] + getattr(gen, "prefill_tokens", 0) - prefill0
            stats.reused_tokens = before[3] + getattr(gen, "reused_tokens", 0) - reused0

        for done in gen.generate(self.pending):
            record = self._answered(done)
            count_progress()
            if self.progress is not None:
                self.progress(0, done.generated)
            if record is not None:
                yield record
            if not stats.halted and self.should_stop is not None and self.should_stop():
                stats.halted = True
                yield from self._halt_pending()
                if self.producer is not None:
                    self.producer.halt()  # nothing more is taken from it (joined when the run ends)
            self._admit()
        count_progress()
        stats.phase_seconds += collections.Counter(getattr(gen, "seconds", {})) - phases0
