"""Tokenise conversations with the target model's own chat template and mask non-assistant tokens.

The draft model must learn exactly what the target generates, so the loss covers, for each
assistant turn, the tokens after the assistant header up to and including the end-of-turn token
(``<|im_end|>``, ``<|eot_id|>``, ...), as the template RENDERS them (e.g. Qwen3's injected
``<think>\\n\\n</think>\\n\\n`` in the last turn is supervised, reasoning stripped from earlier
turns is not there to supervise).

This works for any template, with or without ``{% generation %}`` markers:

1. probe the template once for the assistant header (``add_generation_prompt=True`` minus
   ``False``) and the end-of-turn marker (first special token after a probe reply);
2. render the conversation to text and walk the assistant turns in order with a cursor:
   header, then the first end-of-turn marker after it, gives the supervised character span;
3. tokenise the text with offsets and mark the tokens that overlap a span.

The same template knowledge serves generation (``regenerate`` and ``evaluate`` both prompt the
target through here, so what they ask is what the draft trains on): :func:`encode_prompt` (the
conversation plus the generation prompt), :func:`special_token_strings` (text that would forge
template markers) and :func:`stop_token_ids` (what ends an answer).
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from nemo_dflash.data.sources import DataError, read_conversations

logger = logging.getLogger(__name__)

_PROBE_USER = "nemo-dflash-probe-question"
_PROBE_ASSISTANT = "nemo-dflash-probe-answer"


class ChatTemplateError(DataError):
    """The chat template cannot render a conversation, or renders it in a way we cannot mask."""


@dataclass(frozen=True)
class TokenizedConversation:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the target model generates the token
    truncated: bool = False  # the conversation was longer than max_length

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class ChatFormat:
    """The two template markers the masking needs, found by probing the template."""

    assistant_header: str  # e.g. "<|im_start|>assistant\n"
    end_of_turn: str  # e.g. "<|im_end|>"


_FORMAT_CACHE: "weakref.WeakKeyDictionary[Any, tuple[Optional[str], ChatFormat]]" = weakref.WeakKeyDictionary()


def _render(tokenizer: Any, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False,
            **template_kwargs: Any) -> str:
    try:
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
    except Exception as e:  # jinja raises anything: TemplateError, TypeError, IndexError, ...
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
    if not isinstance(text, str):
        raise ChatTemplateError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str")
    return text


def _generation_header(tokenizer: Any, context: Sequence[dict[str, str]], **template_kwargs: Any) -> Optional[str]:
    """The text the template appends for ``add_generation_prompt=True`` after ``context``."""
    with_prompt = _render(tokenizer, context, add_generation_prompt=True, **template_kwargs)
    without = _render(tokenizer, context, add_generation_prompt=False, **template_kwargs)
    if not with_prompt.startswith(without) or len(with_prompt) == len(without):
        return None
    return with_prompt[len(without) :]


def special_token_strings(tokenizer: Any) -> list[str]:
    """The tokenizer's special-token strings, longest first: user text containing one would forge
    template markers, and the end-of-turn probe wants the longest match at a position."""
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok))
    return sorted((s for s in specials if s), key=lambda s: (-len(s), s))


def detect_chat_format(tokenizer: Any) -> ChatFormat:
    """Probe ``tokenizer``'s chat template for its assistant header and end-of-turn marker (cached)."""
    template = getattr(tokenizer, "chat_template", None)
    try:
        cached = _FORMAT_CACHE.get(tokenizer)
    except TypeError:
        cached = None
    if cached is not None and cached[0] == template:
        return cached[1]
    if not template:
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
            "DFlash tokenises with the target model's own template: use the target's (instruct) tokenizer"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("a fast tokenizer (offset mapping) is needed: load it with AutoTokenizer(..., use_fast=True)")

    user = [{"role": "user", "content": _PROBE_USER}]
    header = _generation_header(tokenizer, user)
    if not header:
        raise DataError(
            "the chat template adds nothing for add_generation_prompt=True, so the assistant header "
            "cannot be found; use a chat template with a generation prompt"
        )
    text = _render(tokenizer, user + [{"role": "assistant", "content": _PROBE_ASSISTANT}])
    at = text.rfind(_PROBE_ASSISTANT)
    if at < 0:
        raise DataError("the chat template drops the assistant content; cannot build a loss mask for it")
    tail = text[at + len(_PROBE_ASSISTANT) :]
    eot = None
    best = len(tail)
    for s in special_token_strings(tokenizer):  # longest first, so ties keep the longest match
        i = tail.find(s)
        if 0 <= i < best:
            best, eot = i, s
    if eot is None or tail[:best].strip():
        # No special token right after the reply: fall back to the literal text that ends the turn.
        stripped = tail.strip()
        if not stripped:
            raise DataError(
                "the chat template has no end-of-turn marker after an assistant reply, so the end of "
                "each assistant turn cannot be found"
            )
        eot = stripped.split()[0]
    fmt = ChatFormat(assistant_header=header, end_of_turn=eot)
    logger.info("chat template: assistant header %r, end of turn %r", header, eot)
    try:
        _FORMAT_CACHE[tokenizer] = (template, fmt)
    except TypeError:
        pass
    return fmt


def _trim_to_last_assistant(messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """Drop trailing non-assistant turns: they carry no supervision and only cost context."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    return list(messages[: last + 1])


def render_with_spans(
    tokenizer: Any, messages: Sequence[dict[str, str]], fmt: Optional[ChatFormat] = None,
    reasoning: Optional[str] = None,
) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` and return the text plus the supervised ``[start, end)`` char spans.

    ``reasoning`` ("on"/"off", see :func:`reasoning_kwargs`): the thinking mode the answers were
    generated in. The template renders in that mode, and where the mode's generation prompt is
    longer than the plain header (Qwen3 "off": ``<think>\n\n</think>\n\n``, written by the
    template, never generated), that prompt is not supervised."""
    fmt = fmt or detect_chat_format(tokenizer)
    mode_kwargs = reasoning_kwargs(reasoning)
    for m in messages:
        for marker in (fmt.assistant_header, fmt.end_of_turn):
            if marker in m["content"]:
                raise ChatTemplateError(
                    f"a {m['role']} message contains the chat-template marker {marker!r}, "
                    "which makes the turn boundaries ambiguous"
                )
    text = _render(tokenizer, messages, **mode_kwargs)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = text.find(fmt.assistant_header, cursor)
        header = fmt.assistant_header
        if start < 0 and i > 0:
            # Templates whose header depends on the context: ask for this turn's header.
            header = _generation_header(tokenizer, messages[:i]) or ""
            start = text.find(header, cursor) if header else -1
        if start < 0:
            raise ChatTemplateError(f"assistant header {fmt.assistant_header!r} of turn {i} not found in the rendered text")
        if mode_kwargs:
            prompt = _generation_header(tokenizer, messages[:i], **mode_kwargs) or ""
            if len(prompt) > len(header) and text.startswith(prompt, start):
                header = prompt
        content_start = start + len(header)
        eot = text.find(fmt.end_of_turn, content_start)
        if eot < 0:
            raise ChatTemplateError(f"end-of-turn marker {fmt.end_of_turn!r} of turn {i} not found in the rendered text")
        end = eot + len(fmt.end_of_turn)
        spans.append((content_start, end))
        cursor = end
    return text, spans


def spans_to_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap a span (offsets and spans sorted by position)."""
    mask = [0] * len(offsets)
    j = 0
    for t, (ts, te) in enumerate(offsets):
        while j < len(spans) and spans[j][1] <= ts:  # this span ended before the token
            j += 1
        if j == len(spans):
            break
        s, e = spans[j]
        if (ts < e and te > s) or (ts == te and s <= ts < e):
            mask[t] = 1
    return mask


def _finish(input_ids: list[int], mask: list[int], max_length: int) -> Optional[TokenizedConversation]:
    truncated = len(input_ids) > max_length
    input_ids, mask = list(input_ids[:max_length]), mask[:max_length]
    if not any(mask):
        return None
    return TokenizedConversation(input_ids=input_ids, loss_mask=mask, truncated=truncated)


def _template_ids(tokenizer: Any, messages: Sequence[dict[str, str]], **template_kwargs: Any) -> list[int]:
    ids = tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=False, **template_kwargs)
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return list(ids)


def tokenize_conversation(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    max_length: int,
    *,
    chat_format: Optional[ChatFormat] = None,
    verify: bool = True,
) -> Optional[TokenizedConversation]:
    """Tokenise one conversation with the chat template; None if no supervised token is left.

    ``verify`` checks that the ids equal ``apply_chat_template(tokenize=True)`` (one extra
    tokenisation); a mismatch raises :class:`ChatTemplateError`.
    """
    return tokenize_conversations(tokenizer, [messages], max_length, chat_format=chat_format, verify=verify)[0]


def tokenize_conversations(
    tokenizer: Any,
    conversations: Sequence[Sequence[dict[str, str]]],
    max_length: int,
    *,
    chat_format: Optional[ChatFormat] = None,
    verify: bool | int = False,
    errors: Optional[list[Optional[ChatTemplateError]]] = None,
    reasoning: Optional[str] | Sequence[Optional[str]] = None,
) -> list[Optional[TokenizedConversation]]:
    """Batch version of :func:`tokenize_conversation` (one batched fast-tokenizer call).

    Without ``errors`` a template problem raises; with a list, it gets one entry per
    conversation (the error or None) and the failed conversations come back as None.
    ``verify`` may be an int: verify only the first that many conversations. ``reasoning``: the
    thinking mode of every conversation, or one per conversation (see :func:`render_with_spans`).
    """
    fmt = chat_format or detect_chat_format(tokenizer)
    modes = [reasoning] * len(conversations) if reasoning is None or isinstance(reasoning, str) else list(reasoning)
    n_verify = len(conversations) if verify is True else int(verify)
    results: list[Optional[TokenizedConversation]] = [None] * len(conversations)
    errs: list[Optional[ChatTemplateError]] = [None] * len(conversations)
    rendered: list[tuple[int, list[dict[str, str]], str, list[tuple[int, int]]]] = []
    for k, messages in enumerate(conversations):
        trimmed = _trim_to_last_assistant(messages)
        if not trimmed:
            continue  # no assistant turn: nothing to learn from
        try:
            text, spans = render_with_spans(tokenizer, trimmed, fmt, reasoning=modes[k])
        except ChatTemplateError as e:
            if errors is None:
                raise
            errs[k] = e
            continue
        rendered.append((k, trimmed, text, spans))
    if rendered:
        enc = tokenizer(
            [r[2] for r in rendered], add_special_tokens=False, return_offsets_mapping=True
        )
        for (k, trimmed, _, spans), ids, offsets in zip(rendered, enc["input_ids"], enc["offset_mapping"]):
            if k < n_verify:
                expected = _template_ids(tokenizer, trimmed, **reasoning_kwargs(modes[k]))
                if expected != list(ids):
                    err = ChatTemplateError(
                        "tokenising the rendered chat text does not reproduce apply_chat_template(tokenize=True) "
                        f"({len(ids)} vs {len(expected)} tokens); this tokenizer/template is not supported"
                    )
                    if errors is None:
                        raise err
                    errs[k] = err
                    continue
            results[k] = _finish(ids, spans_to_mask(offsets, spans), max_length)
    if errors is not None:
        errors[:] = errs
    return results


# ----------------------------------------------------------------------------- thinking mode

REASONING_MODES = ("on", "off")  # a chat template's thinking switch (Qwen3, Qwen3.5: `enable_thinking`)


def reasoning_kwargs(mode: Optional[str]) -> dict[str, Any]:
    """The chat-template arguments of a thinking mode; {} for None (the template's default)."""
    if mode is None:
        return {}
    if mode not in REASONING_MODES:
        raise ValueError(f"reasoning must be one of {REASONING_MODES}, got {mode!r}")
    return {"enable_thinking": mode == "on"}


def has_thinking_switch(tokenizer: Any) -> bool:
    """Whether the chat template renders the generation prompt differently with thinking on and off."""
    user = [{"role": "user", "content": _PROBE_USER}]
    try:
        on, off = (_render(tokenizer, user, True, **reasoning_kwargs(m)) for m in REASONING_MODES)
    except ChatTemplateError:
        return False
    return on != off


class ReasoningTokenizer:
    """``tokenizer`` whose chat template always renders in one thinking mode, so every caller that
    prompts the target through it (regeneration, evaluation) asks in that mode. Everything else is
    the wrapped tokenizer's."""

    def __init__(self, tokenizer: Any, mode: str) -> None:
        self._tokenizer = tokenizer
        self._kwargs = reasoning_kwargs(mode)
        self.reasoning = mode

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("_tokenizer")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __deepcopy__(self, memo: dict) -> "ReasoningTokenizer":
        import copy

        return ReasoningTokenizer(copy.deepcopy(self._tokenizer, memo), self.reasoning)

    def apply_chat_template(self, conversation: Any, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer.apply_chat_template(conversation, *args, **{**self._kwargs, **kwargs})


# ----------------------------------------------------------------------------- prompting the target

TURNS = ("first", "all")  # which user turns of a source conversation the target answers


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


def encode_prompt(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> list[int]:
    """Token ids of ``messages`` rendered by the chat template with the assistant header appended
    (``add_generation_prompt=True``): the prompt the target answers.

    Rendered to text and tokenised without adding special tokens, so a BOS the template writes is
    not doubled. Template errors propagate as jinja raised them; callers decide whether they skip.
    """
    return encode_prompt_text(tokenizer, messages)[0]


def encode_prompt_text(tokenizer: Any, messages: Sequence[dict[str, Any]],
                       previous: Optional[tuple[str, Sequence[int]]] = None) -> tuple[list[int], str]:
    """(:func:`encode_prompt`'s ids, the rendered text). ``previous``: the (text, ids) of an earlier
    prompt of the same conversation. When the new text starts with that text up to its last
    special token, only the rest is tokenised: a fast tokenizer splits its input at special
    (added) tokens and tokenises the pieces apart, so the ids equal a whole encoding, and a later
    turn costs the tokenisation of its new part instead of the whole history. Otherwise (a template
    that rewrites earlier turns, a slow tokenizer) the whole text is tokenised."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    if previous is not None and getattr(tokenizer, "is_fast", False):
        prev_text, prev_ids = previous
        special = set(getattr(tokenizer, "all_special_ids", ()))
        last = next((k for k in range(len(prev_ids) - 1, -1, -1) if prev_ids[k] in special), None)
        if last is not None:
            marker = tokenizer.convert_ids_to_tokens(int(prev_ids[last]))
            cut = prev_text.rfind(marker)
            if cut >= 0 and text.startswith(prev_text[:cut]):
                rest = tokenizer(text[cut:], add_special_tokens=False)["input_ids"]
                return list(prev_ids[:last]) + list(rest), text
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]), text


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Token ids that end an answer: the model's and tokenizer's EOS plus the template's end-of-turn.

    A base config often names ``<|endoftext|>`` as EOS while the chat template closes turns with
    ``<|im_end|>``; stopping on either avoids running every answer to ``max_new_tokens``.
    ValueError when there is none at all (answers would never stop).
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


def write_first_turns(src: str, dst: str, turns: str = "first") -> int:
    """One line per conversation of `src` (same order, so the same seeded shuffle): its system
    prompt and its first (or every) user turn, each followed by a placeholder answer: the prompts `regenerate`
    reads, without the source's answers. Conversations with no user turn are kept whole so that the pool, and
    therefore the shuffle, does not change. Returns the lines written."""
    n = 0
    with open(dst, "w", encoding="utf-8") as f:
        for conv in read_conversations(src):
            system, users = split_prompt(conv.messages, turns)
            msgs = conv.messages if not users else system + [
                m for u in users for m in ({"role": "user", "content": u},
                                           {"role": "assistant", "content": "(regenerated)"})]
            f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")
            n += 1
    return n
