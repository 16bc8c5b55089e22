"""Magpie prompts (arXiv 2406.08464): conversations the target writes itself. Its chat template up to the user
header, after a system prompt that steers the topic (:data:`MAGPIE_TOPICS`), and the user turn sampled; with several
turns the target answers and writes the next user turn. Under several ranks each generates its share
(:func:`magpie_generate`), writes it as a shard (:func:`write_magpie_shard`), and one process merges them
(:func:`magpie_merge`) and selects (:func:`magpie_select`), so the file is the one process's."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from nemo_dflash.data.prompt_text import MAX_CHARS, MIN_CHARS, _reasons, keep_prompt
from nemo_dflash.data.sources import Conversation, DataError
from nemo_dflash.files import write_jsonl_atomic

if TYPE_CHECKING:
    from nemo_dflash.engine.sampling import SamplingParams

logger = logging.getLogger("nemo_dflash.data.prompts")

# Magpie topic steering: a system prompt per topic; the target then writes a user turn on it.
MAGPIE_TOPICS: dict[str, str] = {
    "chat": "You are a helpful AI assistant. The user asks you about everyday topics, advice, writing, "
            "science, history and culture.",
    "code": "You are an expert Python programmer. The user asks you to write, explain, debug or improve "
            "Python code.",
    "math": "You are a math tutor. The user asks you to solve math word problems step by step.",
    "reading": "You are a careful reader. The user pastes a passage (an article, a story, a report or an email) "
               "and asks questions that must be answered from the passage alone.",
    "formatting": "You are a helpful AI assistant that follows formatting instructions exactly. The user asks for "
                  "content in a precise format: a numbered list, a table, JSON, a word limit, given sections or "
                  "a given style.",
    "explain_code": "You are an expert programmer and teacher. The user pastes a piece of code and asks you to "
                    "explain what it does, how it works and why.",
}
# Multi-turn Magpie: the most user turns a conversation may want, and the template's tokens around a
# turn (role header, end-of-turn) allowed for when sizing the engine's longest prompt.
MAX_MAGPIE_TURNS = 8
TURN_OVERHEAD_TOKENS = 32


MAGPIE_MARKER = "\x00MAGPIE\x00"


def magpie_prefix_text(tokenizer: Any, system: str, history: Sequence[dict[str, str]] = ()) -> str:
    """The chat template rendered up to the next user turn's content: ``system`` as the system
    message, the ``history`` (user and assistant turns), then the user header (found by rendering a
    marker as the next user turn and cutting before it)."""
    messages = [{"role": "system", "content": system}, *history, {"role": "user", "content": MAGPIE_MARKER}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    cut = text.find(MAGPIE_MARKER)
    if cut < 0:
        raise DataError("the chat template does not render the user's text verbatim; Magpie prompts need it")
    return text[:cut]


def magpie_prefix(tokenizer: Any, system: str, history: Sequence[dict[str, str]] = ()) -> list[int]:
    """Token ids of :func:`magpie_prefix_text`: what the target continues to write a user turn."""
    return tokenizer(magpie_prefix_text(tokenizer, system, history), add_special_tokens=False)["input_ids"]


def magpie_max_prompt(prefix_tokens: int, max_turns: int, max_new_tokens: int,
                      user_max_new_tokens: Optional[int] = None) -> int:
    """The longest prompt of a Magpie conversation of ``max_turns`` user turns: the prefix, then every
    earlier user turn (at most ``user_max_new_tokens`` each; None: ``max_new_tokens``) and its answer
    (at most ``max_new_tokens``), each with its template markers. A row holds this plus the larger
    of the two caps: what ``--batch-size auto`` must size the KV cache for."""
    user = max_new_tokens if user_max_new_tokens is None else user_max_new_tokens
    return prefix_tokens + (max_turns - 1) * (user + max_new_tokens + 2 * TURN_OVERHEAD_TOKENS)


def parse_turns(text: str) -> tuple[int, int]:
    """``"3"`` -> (3, 3), ``"2-6"`` -> (2, 6): user turns per Magpie conversation; DataError when
    malformed."""
    lo, _, hi = text.strip().partition("-")
    hi = hi or lo
    if not (lo.isdigit() and hi.isdigit()) or not 1 <= int(lo) <= int(hi) <= MAX_MAGPIE_TURNS:
        raise DataError(f"--turns {text!r}: give N or MIN-MAX user turns per conversation, "
                        f"1 <= MIN <= MAX <= {MAX_MAGPIE_TURNS} (e.g. 2-6)")
    return int(lo), int(hi)


@dataclass
class _MagpieConversation:
    """One Magpie conversation in flight: the messages written so far and how many user turns it wants.
    ``position`` is its place in the run's global order (:func:`magpie_plan`), which the selection
    reads conversations in whichever rank generated them."""

    topic: str
    index: int
    turns: int
    messages: list[dict[str, str]]
    ended: Optional[str] = None  # why it stopped before ``turns`` user turns
    position: int = 0

    def users(self) -> int:
        return sum(m["role"] == "user" for m in self.messages)

    def record(self) -> dict[str, Any]:
        """The conversation as a JSON object (a rank's shard line; :meth:`from_record` reads it back)."""
        return {"position": self.position, "topic": self.topic, "index": self.index, "turns": self.turns,
                "messages": self.messages, "ended": self.ended}

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> "_MagpieConversation":
        return cls(rec["topic"], rec["index"], rec["turns"], rec["messages"], rec["ended"], rec["position"])


def _turn_problem(text: str, finish: str, role: str, specials: Sequence[str]) -> Optional[str]:
    """Why a generated turn is unusable, or None. A capped answer is kept: it is context for the
    next user turn only (regenerate answers every user turn again)."""
    if finish == "loop":
        return "looping"
    if finish == "length" and role == "user":
        return "capped"
    if any(s in text for s in specials):
        return "special_tokens"  # the target wrote a role header or another template marker
    stripped = text.strip()
    if not stripped:
        return "empty"
    if role == "user" and len(stripped) < MIN_CHARS:
        return "too_short"
    if role == "user" and len(stripped) > MAX_CHARS:
        return "too_long"
    return None


def magpie_prompts(model: Any, tokenizer: Any, counts: dict[str, int], *, seed: int = 0, max_new_tokens: int = 256,
                   user_max_new_tokens: Optional[int] = None, batch_size: int = 64,
                   sampling: Optional[SamplingParams] = None, name: str = "magpie", oversample: float = 1.3,
                   turns: tuple[int, int] = (1, 1),
                   report: Optional[dict[str, dict[str, Any]]] = None) -> list[Conversation]:
    """``counts[topic]`` conversations the target writes itself per topic of :data:`MAGPIE_TOPICS`.

    The first user turn continues the chat template up to the user header after the topic's system
    prompt; each request has its own sampling key, so prompts differ by their keyed noise, and the
    end-of-turn token ends one. With ``turns=(lo, hi)`` a conversation wants a seeded number of user
    turns in that range: after a user turn the target answers it (``add_generation_prompt``), then
    writes the next user turn from the template rendered up to the next user header. The file keeps
    those answers as the context the next turn was written in; ``regenerate`` answers every user
    turn again. A later turn that fails (capped, looping, empty, a template marker) ends the
    conversation at its last good user turn (counted as ``shortened``). ``oversample`` asks for more
    conversations than ``counts`` so the first-turn filters (empty, too short or long, duplicate,
    looping, capped) still leave the count where the target is varied enough; a topic left short
    is reported (``report`` and the log), never padded from another topic.

    A user turn is capped at ``user_max_new_tokens`` tokens (None: ``max_new_tokens``) and dropped
    when it reaches the cap; an answer at ``max_new_tokens`` and kept cut (it is context only), so
    answers can stay short while user turns run long.
    """
    convs = magpie_generate(model, tokenizer, counts, seed=seed, max_new_tokens=max_new_tokens,
                            user_max_new_tokens=user_max_new_tokens, batch_size=batch_size, sampling=sampling,
                            oversample=oversample, turns=turns)
    return magpie_select(convs, counts, name=name, report=report)


def check_magpie_args(counts: dict[str, int], turns: tuple[int, int]) -> None:
    """A DataError naming the fix for unknown topics or a turn range out of bounds."""
    unknown = sorted(set(counts) - set(MAGPIE_TOPICS))
    if unknown:
        raise DataError(f"unknown Magpie topics {unknown}: use {', '.join(MAGPIE_TOPICS)}")
    lo, hi = turns
    if not 1 <= lo <= hi <= MAX_MAGPIE_TURNS:
        raise DataError(f"Magpie turns {turns}: need 1 <= min <= max <= {MAX_MAGPIE_TURNS}")


def magpie_plan(counts: dict[str, int], *, seed: int = 0, oversample: float = 1.3,
                turns: tuple[int, int] = (1, 1)) -> list[_MagpieConversation]:
    """Every conversation a run samples, in its global order (topics sorted, then index), each with its
    seeded number of wanted user turns: the same list on every rank, so ranks can split it without talking."""
    check_magpie_args(counts, turns)
    lo, hi = turns
    plan: list[_MagpieConversation] = []
    for topic, n in sorted(counts.items()):
        for k in range(int(n * oversample) + 1):
            want = random.Random(f"{seed}/{topic}/{k}").randint(lo, hi) if hi > lo else lo
            plan.append(_MagpieConversation(topic, k, want, [{"role": "system", "content": MAGPIE_TOPICS[topic]}],
                                            position=len(plan)))
    return plan


def magpie_shares(wants: Sequence[int], world: int) -> list[int]:
    """The rank generating each conversation of :func:`magpie_plan` (``wants``: their wanted user turns).
    Each in turn goes to the rank with the fewest wanted turns so far (the lowest rank on a tie): a
    conversation's turns are a serial chain, so balancing turns balances the ranks' work better than a
    count split. Deterministic: every rank computes the same shares."""
    import heapq

    if world < 1:
        raise ValueError(f"world must be >= 1 (got {world})")
    loads = [(0, r) for r in range(world)]
    out = []
    for want in wants:
        load, r = heapq.heappop(loads)
        out.append(r)
        heapq.heappush(loads, (load + want, r))
    return out


def magpie_generate(model: Any, tokenizer: Any, counts: dict[str, int], *, seed: int = 0, max_new_tokens: int = 256,
                    user_max_new_tokens: Optional[int] = None, batch_size: int = 64,
                    sampling: Optional[SamplingParams] = None, oversample: float = 1.3, turns: tuple[int, int] = (1, 1),
                    rank: int = 0,
                    world: int = 1) -> list[_MagpieConversation]:
    """The conversations of :func:`magpie_plan` that rank ``rank`` of ``world`` generates
    (:func:`magpie_shares`), in global order; every one of them, whatever its outcome (:func:`magpie_select`
    filters them over all ranks). Each request's sampling is keyed by (seed, topic, index, step), so a
    conversation comes out the same whichever rank or batch generates it. User turns are capped at
    ``user_max_new_tokens`` (None: ``max_new_tokens``), answers at ``max_new_tokens``: each request
    carries its cap, the engine's is the larger. ``sampling`` None: T=1, as Magpie samples."""
    import collections
    import zlib

    from nemo_dflash.data.chat_template import encode_prompt, special_token_strings, stop_token_ids
    from nemo_dflash.data.loops import LoopDetector
    from nemo_dflash.engine.plain import PlainEngine, Request
    from nemo_dflash.engine.sampling import SamplingParams  # noqa: F811  (at run time; the hint above is for types)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, world {world})")
    user_cap = max_new_tokens if user_max_new_tokens is None else user_max_new_tokens
    if user_cap < 1 or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens {max_new_tokens} and user_max_new_tokens {user_cap} must be >= 1")
    plan = magpie_plan(counts, seed=seed, oversample=oversample, turns=turns)
    shares = magpie_shares([c.turns for c in plan], world)
    convs = [c for c, r in zip(plan, shares) if r == rank]
    if not convs:
        return []
    hi = turns[1]
    topic_index = {topic: ti for ti, topic in enumerate(sorted(counts))}
    stop_ids = stop_token_ids(model, tokenizer)
    specials = special_token_strings(tokenizer)
    prefixes = {topic: magpie_prefix(tokenizer, MAGPIE_TOPICS[topic]) for topic in counts}
    max_prompt = magpie_max_prompt(max(len(p) for p in prefixes.values()), hi, max_new_tokens, user_cap)
    cap_of = {"user": user_cap, "assistant": max_new_tokens}  # the turn a request writes -> its token cap
    pending: collections.deque = collections.deque(
        Request(key=(seed * 7919 + topic_index[c.topic] * 1_000_003 + c.index) & 0x7FFFFFFF,
                prompt_ids=prefixes[c.topic], tag=c, hold=c.turns > 1, max_new_tokens=user_cap) for c in convs)
    engine = PlainEngine(model, rows=batch_size, max_prompt_tokens=max_prompt,
                         max_new_tokens=max(user_cap, max_new_tokens),
                         stop_ids=stop_ids, sampling=sampling or SamplingParams(1.0), seed=seed,
                         loop_detector=LoopDetector(), stop_on_loop=True)
    for done in engine.generate(pending):
        conv: _MagpieConversation = done.request.tag
        role = "user" if conv.messages[-1]["role"] != "user" else "assistant"
        text = tokenizer.decode(done.token_ids, skip_special_tokens=False)
        why = _turn_problem(text, done.finish, role, specials)
        if why is not None:
            if role == "assistant":  # the last user turn stays: regenerate answers it
                conv.ended = f"answer_{why}"
            elif conv.users() == 0:
                conv.ended = why
            else:  # drop the answer the failed user turn followed
                conv.messages.pop()
                conv.ended = f"user_{why}"
            continue
        conv.messages.append({"role": role, "content": text.strip()})
        if role == "user" and conv.users() == conv.turns:
            continue  # done: the conversation ends with a user turn
        if role == "user":
            ids = encode_prompt(tokenizer, conv.messages)
        else:
            ids = magpie_prefix(tokenizer, MAGPIE_TOPICS[conv.topic], conv.messages[1:])
        if len(ids) > max_prompt:
            conv.ended = "context_too_long"
            if role == "assistant":
                conv.messages.pop()
            continue
        step = len(conv.messages) - 1
        last = role == "assistant" and conv.users() + 1 == conv.turns
        key = zlib.crc32(f"{seed}/{conv.topic}/{conv.index}/{step}".encode()) & 0x7FFFFFFF
        nxt = "assistant" if role == "user" else "user"
        pending.append(Request(key=key, prompt_ids=ids, tag=conv, hold=not last, after=done,
                               max_new_tokens=cap_of[nxt]))
    return convs


def magpie_select(convs: Sequence[_MagpieConversation], counts: dict[str, int], *, name: str = "magpie",
                  report: Optional[dict[str, dict[str, Any]]] = None) -> list[Conversation]:
    """The first ``counts[topic]`` usable conversations of each topic among ``convs`` (every conversation of
    :func:`magpie_plan`, generated, in its global order): first turns filtered with :func:`keep_prompt`
    (duplicates across the whole run), then the per-topic cutoff; ``report`` gets each topic's row. Runs
    over all conversations on one process, so the kept set does not depend on how ranks split the work."""
    out: list[Conversation] = []
    seen: set[str] = set()
    for topic, n in sorted(counts.items()):
        row: dict[str, Any] = {"asked": n, "sampled": 0, "kept": 0, "dropped": {}, "shortened": {}, "turns": {}}
        for conv in (c for c in convs if c.topic == topic):
            row["sampled"] += 1
            if row["kept"] >= n:
                continue
            first = conv.messages[1]["content"] if len(conv.messages) > 1 else None
            why = conv.ended if first is None else keep_prompt(first, seen)
            if why is not None:
                row["dropped"][why] = row["dropped"].get(why, 0) + 1
                continue
            if conv.ended is not None:
                row["shortened"][conv.ended] = row["shortened"].get(conv.ended, 0) + 1
            users = conv.users()
            row["turns"][users] = row["turns"].get(users, 0) + 1
            row["kept"] += 1
            out.append(Conversation(conv.messages, f"{name}-{topic}:{conv.index}"))
        row["turns"] = dict(sorted(row["turns"].items()))
        row["degenerate"] = row["kept"] == 0
        if row["kept"] < n:
            logger.warning("%s topic %s: %d of %d conversations (the rest dropped: %s); not padded from other topics",
                           name, topic, row["kept"], n, _reasons(row["dropped"]))
        else:
            logger.info("%s topic %s: %d conversations, user turns %s (dropped: %s; shortened: %s)", name, topic,
                        row["kept"], row["turns"], _reasons(row["dropped"]), _reasons(row["shortened"]))
        if report is not None:
            report[topic] = row
    return out


def magpie_merge(shards: Iterable[Iterable[_MagpieConversation]], total: int) -> list[_MagpieConversation]:
    """The ranks' conversations back in their global order; a DataError when a position of the
    ``total`` planned is missing or given twice (a shard of another run or setting)."""
    merged = sorted((c for shard in shards for c in shard), key=lambda c: c.position)
    if [c.position for c in merged] != list(range(total)):
        raise DataError(f"the Magpie rank shards hold {len(merged)} conversations, not positions 0..{total - 1} "
                        "once each: rerun the same command (the shards are written again)")
    return merged


def write_magpie_shard(path: str | Path, convs: Iterable[_MagpieConversation]) -> int:
    """Write a rank's generated conversations as JSONL, atomically (read back by :func:`read_magpie_shard`)."""
    return write_jsonl_atomic(path, (c.record() for c in convs))


def read_magpie_shard(path: str | Path) -> list[_MagpieConversation]:
    with open(path, encoding="utf-8") as f:
        return [_MagpieConversation.from_record(json.loads(line)) for line in f if line.strip()]
