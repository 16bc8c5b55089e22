"""Regeneration's journals: what a run has written, so an interrupted run continues where it stopped.

One process appends each finished conversation to ``OUT.partial`` (its settings in ``OUT.partial.json``) and
renames the sorted result to ``OUT`` at the end. Under torchrun each rank keeps its own journal
(``OUT.rankR-of-W.*``) and rank 0 merges the finished shards into the bytes a single process writes. A journal
is continued only with the settings it was started with; every refusal is a `JournalError` naming the fix.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Sequence

from nemo_dflash.data.sources import DataError
from nemo_dflash.files import write_text_atomic

logger = logging.getLogger("nemo_dflash.regenerate")

# Settings that change which conversations are picked or what is generated: a partial output
# may only be continued with the same values.
RESUME_KEYS = ("target", "data", "num_samples", "seed", "turns", "max_prompt_tokens", "max_new_tokens",
               "temperature", "top_p", "holdout", "engine", "loops", "capped", "after_cut", "samples_per_prompt",
               "decontaminate", "backend", "model")
# Keys added later, with the value a partial output written before them was made with.
RESUME_DEFAULTS = {"after_cut": "end", "samples_per_prompt": 1, "decontaminate": "off", "backend": "local",
                   "model": None}
# Values renamed since a journal may have been written: the old value means the new one.
RESUME_RENAMED = {"engine": {"slots": "continuous"}, "backend": {"engine": "local"}}

# A rank's files: OUT.rank{R}-of-{W}.partial / .partial.json / .jsonl / .stats.json (locks excluded).
_RANK_FILE = r"\.rank(\d+)-of-(\d+)\.(?:partial|partial\.json|jsonl|stats\.json)$"


class JournalError(DataError):
    """A journal that cannot be continued (other settings, another number of ranks, foreign lines)."""


def rank_files(out: Path, rank: int, world: int) -> dict[str, Path]:
    """Where rank ``rank`` of ``world`` journals its shard: ``partial`` (written as answers end),
    ``meta`` (its settings), ``done`` (the finished shard), ``stats`` and ``lock`` (held while it runs:
    one writer per output; rank 0 holds ``out``'s own). One rank writes ``out``'s own partial files and
    ``out`` itself."""
    if world == 1:
        return {"partial": out.with_name(out.name + ".partial"), "meta": out.with_name(out.name + ".partial.json"),
                "done": out, "stats": out.with_name(out.name + ".stats.json"), "lock": out.with_name(out.name + ".lock")}
    stem = f"{out.name}.rank{rank}-of-{world}"
    return {"partial": out.with_name(stem + ".partial"), "meta": out.with_name(stem + ".partial.json"),
            "done": out.with_name(stem + ".jsonl"), "stats": out.with_name(stem + ".stats.json"),
            "lock": out.with_name((out.name if rank == 0 else stem) + ".lock")}


def check_settings(partial: Path, meta: Path, settings: dict[str, Any]) -> None:
    """Refuse to continue ``partial`` unless its ``meta`` says it was made with ``settings``."""
    hint = f"pass --overwrite to start over, or delete {partial}"
    try:
        saved = json.loads(meta.read_text())
    except (OSError, ValueError):
        raise JournalError(f"{partial} is a partial output without readable settings ({meta}); {hint}") from None
    saved = {k: saved.get(k, RESUME_DEFAULTS.get(k)) for k in RESUME_KEYS}
    for key, renamed in RESUME_RENAMED.items():
        saved[key] = renamed.get(saved[key], saved[key])
    diff = [k for k in RESUME_KEYS if saved[k] != settings.get(k)]
    if diff:
        details = ", ".join(f"{k}: {saved[k]!r} -> {settings.get(k)!r}" for k in diff)
        raise JournalError(f"{partial} was started with other settings ({details}); rerun with the same settings "
                           f"to continue it, or {hint}")


def journal_sources(path: Path, known: set[str], *, cut: bool, hint: str) -> set[str]:
    """The sources of the whole lines of journal ``path``; a torn last line (a kill mid-write) is cut
    off when ``cut`` (the journal is this process's), else skipped. A line that is not a record of
    this run (``known``), or a conversation twice, is one line naming ``hint``."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:  # removed as stale by its rank
        return set()
    keep = data.rfind(b"\n") + 1
    if keep < len(data) and cut:
        logger.warning("%s: dropping a torn last line (%d bytes)", path, len(data) - keep)
        with open(path, "r+b") as f:
            f.truncate(keep)
    done: set[str] = set()
    for lineno, line in enumerate(data[:keep].split(b"\n")[:-1], start=1):
        try:
            source = json.loads(line)["source"]
        except (ValueError, KeyError, TypeError):
            source = None
        if source not in known or source in done:
            raise JournalError(f"{path}:{lineno} is not a record of this run; {hint}")
        done.add(source)
    return done


def resume_done(partial: Path, meta: Path, settings: dict[str, Any], train: Sequence[Any]) -> set[str]:
    """Sources of the conversations ``partial`` already holds, after checking it was made with ``settings``.

    A torn last line (killed mid-write) is cut off. Conversations are written as they end, so the
    ones not in the file (in flight at the kill) are simply redone: with keyed sampling a redone
    answer is the one the interrupted run would have written.
    """
    check_settings(partial, meta, settings)
    return journal_sources(partial, {c.location for c in train}, cut=True,
                           hint=f"pass --overwrite to start over, or delete {partial}")


def ranks_done(out: Path, rank: int, world: int, settings: dict[str, Any], known: set[str]) -> set[str]:
    """Sources of the conversations every rank's journal of ``out`` holds (journals being written and
    finished ones), each checked to be made with ``settings``: what no rank of this run redoes.
    Only this rank's own torn last line is cut; another rank's is skipped (never truncated here).
    A conversation in two ranks' journals is refused: the merge could not tell which to keep."""
    hint = f"pass --overwrite to start over (the journals are {out}.rank*-of-{world}.*)"
    owner: dict[str, int] = {}
    for r in range(world):
        f = rank_files(out, r, world)
        mine: set[str] = set()
        for path in (f["done"], f["partial"]):  # a partial left beside its finished file repeats it
            if path.exists():
                check_settings(path, f["meta"], settings)
                mine |= journal_sources(path, known, cut=r == rank and path == f["partial"], hint=hint)
        for source in mine:
            if owner.setdefault(source, r) != r:
                raise JournalError(f"{source} is in the journals of ranks {owner[source]} and {r}; {hint}")
    return set(owner)


def drop_stale_partial(files: dict[str, Path]) -> None:
    """Remove this rank's journal when its finished file already holds every line of it (a kill
    between writing the finished file and removing the journal)."""
    partial, done = files["partial"], files["done"]
    if not (partial.exists() and done.exists()):
        return
    finished = set(done.read_text(encoding="utf-8").split("\n"))
    if all(line in finished for line in partial.read_text(encoding="utf-8").split("\n")):
        partial.unlink()


def journal_worlds(out: Path) -> dict[int, list[Path]]:
    """The journals of ``out`` by the number of processes that wrote them: 1 for a single process's
    ``OUT.partial``, W for the ``OUT.rankR-of-W.*`` files of a torchrun run."""
    found: dict[int, list[Path]] = {}
    single = [p for p in (out.with_name(out.name + ".partial"), out.with_name(out.name + ".partial.json"))
              if p.exists()]
    if single:
        found[1] = single
    if out.parent.is_dir():
        pattern = re.compile(re.escape(out.name) + _RANK_FILE)
        for p in sorted(out.parent.iterdir()):
            m = pattern.match(p.name)
            if m:
                found.setdefault(int(m.group(2)), []).append(p)
    return found


def check_world(out: Path, world: int, rank: int, overwrite: bool) -> None:
    """Refuse to continue journals written by another number of processes (their ranks' shares
    cannot be told apart); with ``overwrite`` rank 0 removes them instead."""
    others = {w: paths for w, paths in journal_worlds(out).items() if w != world}
    if not others:
        return
    if overwrite:
        if rank == 0:
            for paths in others.values():
                for p in paths:
                    p.unlink(missing_ok=True)
        return
    w = max(others)
    how = "one process (no torchrun)" if w == 1 else f"{w} ranks (torchrun --nproc-per-node {w})"
    now = "one process" if world == 1 else f"{world} ranks"
    raise JournalError(f"{out} has the journals of a run on {how}, not {now}: continue it on {how}, or pass "
                       "--overwrite to start over")


def _sorted_lines(paths: Sequence[Path], order: dict[str, int]) -> list[tuple[int, str]]:
    """The lines of ``paths`` (those that exist) keyed by their conversation's selection order."""
    lines: list[str] = []
    for path in paths:
        if path.exists():
            lines.extend(line for line in path.read_text(encoding="utf-8").split("\n") if line)
    return sorted((order[json.loads(line)["source"]], line) for line in lines)


def finish_output(partial: Path, out: Path, order: dict[str, int]) -> int:
    """Write ``out`` atomically from ``partial``, in selection order (so a resumed run's file is the
    uninterrupted run's); the number of conversations."""
    keyed = _sorted_lines([partial], order)
    write_text_atomic(out, (line + "\n" for _, line in keyed))
    partial.unlink()
    return len(keyed)


def finish_rank(partial: Path, done: Path, order: dict[str, int]) -> int:
    """Write this rank's finished file atomically from its journal and what an earlier run of it
    finished, in selection order, then remove the journal; the number of conversations."""
    keyed = _sorted_lines([done, partial], order)
    if len({k for k, _ in keyed}) != len(keyed):
        raise JournalError(f"{partial} repeats a conversation of {done}; pass --overwrite to start over")
    write_text_atomic(done, (line + "\n" for _, line in keyed))
    partial.unlink(missing_ok=True)
    return len(keyed)


def merge_ranks(out: Path, world: int, order: dict[str, int]) -> list[dict[str, Any]]:
    """Rank 0: write ``out`` from the ranks' finished shards, in selection order (the bytes a
    single-process run writes), then remove the rank files; the ranks' stats."""
    files = [rank_files(out, r, world) for r in range(world)]
    missing = [r for r, f in enumerate(files) if not f["done"].exists() or f["partial"].exists()]
    if missing:
        raise JournalError(f"rank(s) {missing} of {world} have not finished their share; rerun the same command to "
                           "continue them")
    keyed = _sorted_lines([f["done"] for f in files], order)
    if len({k for k, _ in keyed}) != len(keyed):
        raise JournalError(f"the rank shards of {out} hold a conversation twice; pass --overwrite to start over")
    write_text_atomic(out, (line + "\n" for _, line in keyed))
    stats = []
    for f in files:
        stats.append(json.loads(f["stats"].read_text()))
        for key in ("done", "meta", "stats"):
            f[key].unlink(missing_ok=True)
    return stats


def clear_journals(files: dict[str, Path], world: int) -> None:
    """``--overwrite``: remove this process's journal files (and, under torchrun, its finished shard)."""
    for key in ("partial", "meta", "stats") if world == 1 else ("partial", "meta", "stats", "done"):
        files[key].unlink(missing_ok=True)


def journal_outputs(files: dict[str, Path], world: int) -> list[Path]:
    """The journal files a run of ``world`` processes continues (never refused as existing)."""
    return [files[k] for k in (("partial", "meta", "stats") if world == 1 else ("partial", "meta", "stats", "done"))]


__all__ = ["JournalError", "RESUME_DEFAULTS", "RESUME_KEYS", "check_settings", "check_world", "clear_journals",
           "drop_stale_partial", "finish_output", "finish_rank", "journal_outputs", "journal_sources",
           "journal_worlds", "merge_ranks", "rank_files", "ranks_done", "resume_done"]
