"""What every prompt source shares: the filter a prompt passes (not empty, not too short or long, not a
duplicate), the count a source logs (a source the filters left empty is refused, naming it), and the writer of a
prompt file (OpenAI-layout JSONL that `regenerate --data NAME=FILE` reads like any chat file)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Optional

from nemo_dflash.data.sources import Conversation, DataError
from nemo_dflash.files import write_jsonl_atomic

logger = logging.getLogger("nemo_dflash.data.prompts")

MIN_CHARS = 8  # a prompt shorter than this (stripped) is dropped
MAX_CHARS = 8000  # ... and one longer than this


def keep_prompt(text: str, seen: set[str], *, min_chars: int = MIN_CHARS, max_chars: int = MAX_CHARS) -> Optional[str]:
    """The reason ``text`` is dropped ("empty", "too_short", "too_long", "duplicate"), or None;
    a kept text is added to ``seen`` (compared stripped and case-folded)."""
    stripped = text.strip()
    if not stripped:
        return "empty"
    if len(stripped) < min_chars:
        return "too_short"
    if len(stripped) > max_chars:
        return "too_long"
    key = " ".join(stripped.casefold().split())
    if key in seen:
        return "duplicate"
    seen.add(key)
    return None


def _reasons(dropped: dict[Any, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(dropped.items())) or "none"


def _log_dropped(name: str, kept: int, dropped: dict[str, int]) -> None:
    """Log a source's count; a source the filters left empty is a DataError naming it and why."""
    if not kept:
        raise DataError(f"--data {name}: no prompts left after the filters (dropped: {_reasons(dropped)}); "
                        "remove the source or give it other input")
    logger.info("%s: %d prompts (dropped: %s)", name, kept, _reasons(dropped))


def write_prompts(path: str, conversations: Iterable[Conversation]) -> int:
    """Write ``conversations`` as OpenAI-layout JSONL (``{"messages", "id"}``), atomically; the count."""
    return write_jsonl_atomic(path, ({"messages": c.messages, "id": c.location} for c in conversations))
