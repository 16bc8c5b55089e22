"""Rewrite the assistant turns of chat data with the target model's own answers.

A DFlash draft learns to predict the *target's* next tokens, so it should train on text the
target itself generates: the answers in public chat data (ShareGPT's ChatGPT replies) follow
another model's distribution and cost acceptance length. :func:`regenerate_conversations`
keeps the user (and leading system) turns of each conversation and asks the target, through its
chat template, for every assistant turn.

Batched generation left-pads the prompts (decoder-only models continue from the last position)
and sorts them by length inside a window to cut padding; results come back in input order.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from nemo_dflash.data.sources import Conversation

logger = logging.getLogger(__name__)

TURNS = ("first", "all")

ConversationLike = Union[Conversation, Sequence[dict[str, str]]]


@dataclass
class RegenStats:
    """Counters of one regeneration run; ``skipped`` maps a reason to a number of conversations."""

    conversations: int = 0  # conversations given to regenerate_conversations
    written: int = 0  # conversations yielded (at least one regenerated turn)
    turns: int = 0  # assistant turns generated and kept
    prompt_tokens: int = 0  # prompt tokens of the generate calls (padding excluded)
    generated_tokens: int = 0  # new tokens, stop token included, dropped answers included
    finish: Counter = field(default_factory=Counter)  # per written conversation: "stop" / "length"
    skipped: Counter = field(default_factory=Counter)  # no conversation written, by reason
    shortened: Counter = field(default_factory=Counter)  # --turns all: later turns dropped, by reason
    seconds: float = 0.0  # time spent in generate
    halted: bool = False  # should_stop() ended the run early: later conversations were not generated

    def summary(self) -> str:
        rate = self.generated_tokens / self.seconds if self.seconds else 0.0
        skipped = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "none"
        text = (
            f"written {self.written} conversations ({self.turns} assistant turns; finish: "
            f"stop={self.finish['stop']}, length={self.finish['length']}); skipped {sum(self.skipped.values())} "
            f"({skipped}); generated {self.generated_tokens} tokens in {self.seconds:.1f}s ({rate:.1f} tokens/s)"
        )
        if self.shortened:
            text += "; conversations cut short: " + ", ".join(f"{k}={v}" for k, v in sorted(self.shortened.items()))
        return text


@dataclass
class _Job:
    """One conversation being regenerated: the context built so far and the user turns still to answer."""

    source: Optional[str]
    messages: list[dict[str, str]]
    users: list[str]
    next_user: int = 0
    finish_reason: Optional[str] = None
    done: bool = False
    prompt_ids: list[int] = field(default_factory=list)

    @property
    def answered(self) -> int:
        return sum(m["role"] == "assistant" for m in self.messages)


def split_prompt(messages: Sequence[dict[str, str]], turns: str = "first") -> tuple[list[dict[str, str]], list[str]]:
    """(leading system message if any, user turns to answer) of a conversation.

    The source's assistant turns are discarded, and so are system messages after the first turn
    and empty user turns. ``turns="first"`` keeps only the first user turn.
    """
    if turns not in TURNS:
        raise ValueError(f"turns must be one of {TURNS}, got {turns!r}")
    system = [dict(messages[0])] if messages and messages[0]["role"] == "system" else []
    users = [m["content"] for m in messages if m["role"] == "user" and m["content"].strip()]
    return system, users[:1] if turns == "first" else users


def special_token_strings(tokenizer: Any) -> list[str]:
    """The tokenizer's special-token strings: user text containing one would forge template markers."""
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok))
    return sorted(s for s in specials if s)


def encode_prompt(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered by the chat template with the assistant header appended.

    Rendered to text and tokenised without adding special tokens, so a BOS the template writes is
    not doubled.
    """
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


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
    specials = special_token_strings(tokenizer) if specials is None else specials
    if any(s in m["content"] for m in messages for s in specials):
        return [], "special_tokens_in_prompt"
    try:
        ids = encode_prompt(tokenizer, messages)
    except Exception as e:  # jinja raises anything (TemplateError, TypeError, ...)
        logger.debug("chat template failed: %s", e)
        return [], "template_error"
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        return [], "prompt_too_long"
    return ids, None


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Token ids that end an answer: the model's and tokenizer's EOS plus the template's end-of-turn.

    A base config often names ``<|endoftext|>`` as EOS while the chat template closes turns with
    ``<|im_end|>``; stopping on either avoids running every answer to ``max_new_tokens``.
    """
    ids: list[int] = []

    def add(value: Any) -> None:
        if value is None:
            return
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v >= 0 and v not in ids:
                ids.append(v)

    add(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    try:
        from nemo_dflash.data.chat_template import detect_chat_format

        eot = detect_chat_format(tokenizer).end_of_turn
        eot_id = tokenizer.convert_tokens_to_ids(eot)
        if eot_id is not None and eot_id != getattr(tokenizer, "unk_token_id", None):
            add(eot_id)
    except Exception as e:  # a template we cannot probe: EOS alone still stops generation
        logger.debug("could not probe the end-of-turn token: %s", e)
    if not ids:
        raise ValueError(
            "neither the model's generation_config nor the tokenizer defines an EOS token, so answers would "
            "never stop; use the target's instruct tokenizer (with eos_token set)"
        )
    return ids


def _pad_id(tokenizer: Any, stop_ids: Sequence[int]) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if pad is not None else stop_ids[0]


def _generation_kwargs(
    *, max_new_tokens: int, temperature: float, top_p: float, stop_ids: list[int], pad_id: int
) -> dict[str, Any]:
    """Explicit settings, so defaults in the checkpoint's generation_config (top_k=20, a repetition
    penalty, ...) do not silently reshape the distribution the draft is trained on."""
    kwargs: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad_id, num_beams=1,
        repetition_penalty=1.0, min_new_tokens=0,
    )
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    else:
        kwargs.update(do_sample=False)
    return kwargs


@torch.inference_mode()
def generate_batch(
    model: Any, prompts: Sequence[Sequence[int]], *, pad_id: int, stop_ids: Sequence[int], **gen_kwargs: Any
) -> list[tuple[list[int], str, int]]:
    """Generate for left-padded ``prompts``; per prompt (answer ids without the stop token,
    finish reason ``"stop"``/``"length"``, number of generated tokens including the stop token)."""
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        attention_mask[i, width - len(p):] = 1
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **gen_kwargs)
    stops = set(stop_ids)
    results = []
    for row in out[:, width:].tolist():
        end = next((k for k, t in enumerate(row) if t in stops), None)
        if end is None:
            results.append((row, "length", len(row)))
        else:  # rows that stopped early are padded after the stop token
            results.append((row[:end], "stop", end + 1))
    return results


def _batches(
    jobs: list[_Job], batch_size: int, max_batch_tokens: Optional[int], max_new_tokens: int
) -> Iterator[list[_Job]]:
    """Cut length-sorted (longest first) jobs into batches of at most ``batch_size`` rows and, if
    set, ``max_batch_tokens`` padded tokens: one very long prompt then runs alone instead of
    padding ``batch_size - 1`` short ones to its length."""
    batch: list[_Job] = []
    for job in jobs:
        if batch and (
            len(batch) >= batch_size
            or (max_batch_tokens and (len(batch) + 1) * (len(batch[0].prompt_ids) + max_new_tokens) > max_batch_tokens)
        ):
            yield batch
            batch = []
        batch.append(job)
    if batch:
        yield batch


def _as_job(conv: ConversationLike, turns: str) -> tuple[_Job, Optional[str]]:
    """A job for ``conv`` and None, or a dummy job and the reason to skip it."""
    if isinstance(conv, Conversation):
        messages, source = conv.messages, conv.location
    else:
        messages, source = list(conv), None
    system, users = split_prompt(messages, turns)
    job = _Job(source=source, messages=system, users=users)
    return job, (None if users else "no_user_turn")


def regenerate_conversations(
    model: Any,
    tokenizer: Any,
    conversations: Iterable[ConversationLike],
    *,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    top_p: float = 1.0,
    batch_size: int = 8,
    turns: str = "first",
    seed: int = 0,
    max_prompt_tokens: Optional[int] = None,
    sort_window: Optional[int] = None,
    max_batch_tokens: Optional[int] = None,
    stats: Optional[RegenStats] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    should_stop: Optional[Callable[[], bool]] = None,
) -> Iterator[dict[str, Any]]:
    """Yield ``{"messages", "finish_reason"[, "source"]}`` per conversation, in input order.

    ``conversations`` are :class:`Conversation` objects or plain ``[{"role", "content"}]`` lists;
    their assistant turns are replaced by the target's answers (greedy for ``temperature=0``).
    ``turns="first"`` answers the first user turn only (``[system?, user, assistant]``);
    ``turns="all"`` answers every user turn, feeding the regenerated answers back as context.
    A conversation stops at an answer cut by ``max_new_tokens`` (``finish_reason="length"``), an
    empty answer (dropped) or a prompt over ``max_prompt_tokens``; if no turn survives it is skipped
    and counted in ``stats.skipped``. ``sort_window`` (default ``16 * batch_size``) conversations
    are regenerated together, sorted by prompt length, in batches of ``batch_size`` rows and at
    most ``max_batch_tokens`` (rows x (longest prompt + max_new_tokens));
    ``progress(conversations_done, new_tokens)`` is called after each batch. Sampling seeds torch's
    global RNG with ``seed``. Arguments are checked at the call, before iteration starts.
    """
    if turns not in TURNS:
        raise ValueError(f"turns must be one of {TURNS}, got {turns!r}")
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError("batch_size and max_new_tokens must be >= 1")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1 (got {temperature}, {top_p})")
    stats = stats if stats is not None else RegenStats()
    stop_ids = stop_token_ids(model, tokenizer)
    pad_id = _pad_id(tokenizer, stop_ids)
    gen_kwargs = _generation_kwargs(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, stop_ids=stop_ids, pad_id=pad_id
    )
    specials = special_token_strings(tokenizer)
    window = sort_window or 16 * batch_size

    def prepare(job: _Job) -> Optional[str]:
        """Append the next user turn and tokenise the prompt; the reason it cannot be used, if any."""
        job.messages.append({"role": "user", "content": job.users[job.next_user]})
        job.prompt_ids, reason = prompt_problem(
            tokenizer, job.messages, max_prompt_tokens=max_prompt_tokens, specials=specials
        )
        if reason is not None:
            job.messages.pop()
        return reason

    def stop(job: _Job, reason: str) -> None:
        job.done = True
        if job.answered:
            stats.shortened[reason] += 1
        else:
            stats.skipped[reason] += 1

    def run_window(jobs: list[_Job]) -> Iterator[dict[str, Any]]:
        # Once should_stop() says so no new batch starts; what is already answered is still yielded.
        while not stats.halted:
            active, dropped = [], 0
            for job in jobs:
                if job.done:
                    continue
                reason = prepare(job)
                if reason is None:
                    active.append(job)
                else:
                    stop(job, reason)
                    dropped += 1
            if dropped and progress is not None:
                progress(dropped, 0)
            if not active:
                break
            active.sort(key=lambda j: len(j.prompt_ids), reverse=True)  # longest first: OOM shows up early
            for batch in _batches(active, batch_size, max_batch_tokens, max_new_tokens):
                t0 = time.perf_counter()
                results = generate_batch(
                    model, [j.prompt_ids for j in batch], pad_id=pad_id, stop_ids=stop_ids, **gen_kwargs
                )
                stats.seconds += time.perf_counter() - t0
                new_tokens = finished = 0
                for job, (ids, reason, n_new) in zip(batch, results):
                    stats.prompt_tokens += len(job.prompt_ids)
                    new_tokens += n_new
                    text = tokenizer.decode(ids, skip_special_tokens=True)
                    job.next_user += 1
                    problem = "empty_answer" if not text.strip() else None
                    if problem is None and any(s in text for s in specials):
                        problem = "special_tokens_in_answer"  # decoded pieces spelling a template marker
                    if problem is not None:
                        job.messages.pop()
                        stop(job, problem)
                    else:
                        job.messages.append({"role": "assistant", "content": text})
                        job.finish_reason = reason
                        stats.turns += 1
                        job.done = job.next_user >= len(job.users)
                        if reason == "length" and not job.done:
                            # An answer cut by max_new_tokens is a poor context for the next turn: end there.
                            job.done = True
                            stats.shortened["length"] += 1
                    finished += job.done
                stats.generated_tokens += new_tokens
                if progress is not None:
                    progress(finished, new_tokens)
                if should_stop is not None and should_stop():
                    stats.halted = True
                    break
        for job in jobs:
            if job.answered:
                stats.written += 1
                stats.finish[job.finish_reason] += 1
                record: dict[str, Any] = {"messages": job.messages, "finish_reason": job.finish_reason}
                if job.source is not None:
                    record["source"] = job.source
                yield record

    def run() -> Iterator[dict[str, Any]]:
        if temperature > 0:
            torch.manual_seed(seed)
        pending: list[_Job] = []
        for conv in conversations:
            stats.conversations += 1
            job, reason = _as_job(conv, turns)
            if reason is not None:
                stats.skipped[reason] += 1
                if progress is not None:
                    progress(1, 0)
                continue
            pending.append(job)
            if len(pending) >= window:
                yield from run_window(pending)
                pending = []
                if stats.halted:
                    return
        if pending:
            yield from run_window(pending)

    return run()
