"""A regeneration's run once its conversations are selected: the journals opened, the ranks' shared queue,
the answers appended to the journal as they end, and the journals finished (one process) or merged (rank 0).

The model and the tokenizer come in loaded (the command loads them); what this module adds is what makes a
run continue after a kill and make the bytes of one uninterrupted process whatever the number of ranks.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from nemo_dflash.data.journals import (
    JournalError, drop_stale_partial, finish_output, finish_rank, merge_ranks, ranks_done, resume_done,
)
from nemo_dflash.files import WriteFailed, write_error_reason, write_jsonl_atomic

logger = logging.getLogger("nemo_dflash.regenerate")


@dataclass
class RunPlan:
    """What one rank answers: ``todo`` (its conversations, or a function of the thinking mode giving its
    share of the ranks' shared queue), what an earlier run already ``done``, and the ``schedule`` left to the
    engine (``given`` when the queue fixed the order)."""

    todo: Any
    done: set[str]
    schedule: str
    queues: dict[Optional[str], Any] = field(default_factory=dict)

    def claimed(self) -> int:
        """Conversations this rank took on: its static share, or what it claimed from the queues."""
        return sum(q.claimed for q in self.queues.values()) if self.queues else len(self.todo)


def open_journals(out: Path, files: dict[str, Path], settings: dict[str, Any], train: Sequence[Any], *, rank: int,
                  world: int, overwrite: bool, group: bool) -> set[str]:
    """Start or continue the journals; the conversations already done (by any rank). One process checks its
    partial output's settings; ranks read every rank's journals (what is done is done by no one again)."""
    partial, meta = files["partial"], files["meta"]
    done: set[str] = set()
    if world == 1:
        if partial.exists():
            done = resume_done(partial, meta, settings, train)
            logger.warning("continuing %s: %d of %d conversations already done", partial, len(done), len(train))
        else:
            write_jsonl_atomic(meta, [settings])  # one JSON line: readable with json.loads
        return done
    if not overwrite:
        done = ranks_done(out, rank, world, settings, {c.location for c in train})
    if not (partial.exists() or files["done"].exists()):
        write_jsonl_atomic(meta, [settings])
    if group:
        import torch.distributed as dist

        dist.barrier()  # all journals read before any rank writes to its own
    drop_stale_partial(files)
    if done:
        logger.warning("continuing %s: %d of %d conversations already done (journals of %d ranks)", out,
                       len(done), len(train), world)
    return done


def plan_ranks(train: Sequence[Any], done: set[str], modes: Sequence[Optional[str]], *, schedule: str, turns: str,
               batch_size: int, prepare_ahead: int, mix_weights: Optional[dict[str, float]],
               dataset: dict[str, str], rank: int, world: int, group: bool) -> RunPlan:
    """This rank's work. With a process group the ranks share one queue per thinking mode, in start order
    (the longest chains first; interleaved by weight under a time cap, ``mix_weights``); a rank started alone
    takes its static shard."""
    if not group:
        todo = [c for c in train[rank::world] if c.location not in done]
        if world > 1:
            logger.warning("rank %d of %d alone (no process group): its static shard, %d conversations left",
                           rank, world, len(todo))
        return RunPlan(todo, done, schedule)
    import torch
    import torch.distributed as dist

    from nemo_dflash.data.regenerate import SourceMix, start_order
    from nemo_dflash.data.work_queue import SharedQueue, call_prefix, process_group_store, queue_block, queue_chunk

    store, chunk = process_group_store(), queue_chunk(batch_size)
    prefix = call_prefix(store, world)
    # a block of the queue is every rank's first fill (rows differ by rank with --batch-size auto): the sum
    fills = torch.tensor([2 * batch_size + prepare_ahead], dtype=torch.int64)
    dist.all_reduce(fills)
    block = queue_block(int(fills.item()), chunk)
    queues: dict[Optional[str], Any] = {}
    for mode in modes:
        left = [c for c in train if c.location not in done and getattr(c, "reasoning", None) == mode]
        if mix_weights is not None:  # a static interleave: answer lengths are not known yet
            ordered = [c for _, c in SourceMix(mix_weights, dataset, prior_tokens=1.0).order(left, turns)]
        else:
            ordered = start_order(left, schedule, turns)
        queues[mode] = SharedQueue(store, f"{prefix}next/{mode}", ordered, chunk, block, rank, world)
    logger.info("%d ranks share a queue of %d conversations (%d taken at a time, cross-sections of blocks of "
                "%d; the first block dealt, the others claimed)", world, len(train) - len(done), chunk, block * chunk)
    return RunPlan(lambda mode: queues[mode], done, "given", queues)


def append_records(records: Iterable[dict[str, Any]], partial: Path, dataset: dict[str, str],
                   on_error: Callable[[], None] = lambda: None) -> None:
    """Append each finished conversation to the journal as it ends (flushed), each tagged with its source's
    name. A server that stops answering or a full disk keeps every whole line written: `JournalError` /
    `WriteFailed` say how to continue; anything else is logged and raised. ``on_error`` runs first (the
    progress bar's close)."""
    try:
        with open(partial, "a", encoding="utf-8") as f:
            for record in records:
                record["dataset"] = dataset[record["source"]]
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        on_error()
        from nemo_dflash.data.openai_backend import ServerUnavailable

        if isinstance(e, ServerUnavailable):  # every conversation finished is in the journal
            raise JournalError(f"the server stopped answering: {e}; {partial} keeps the conversations finished: "
                               "restart the server and run the same command to continue") from e
        reason = write_error_reason(e)
        if reason is not None:  # a full disk: the whole lines written are kept, a torn last one is cut on resume
            raise WriteFailed(f"cannot write {partial} ({reason}): free space or fix the permissions, then run the "
                              "same command again to continue it") from e
        logger.error("regeneration stopped; %s keeps what was written: rerun the same command to continue it",
                     partial)
        raise


def finish_journals(out: Path, files: dict[str, Path], order: dict[str, int], mine: dict[str, Any], *, rank: int,
                    world: int, group: bool) -> tuple[Optional[list[dict[str, Any]]], list[Optional[float]]]:
    """Finish this process's journal: (every rank's stats, each rank's seconds idle at the final barrier)
    on the process that wrote ``out``; (None, idle) on the other ranks, whose finished shard rank 0 merged."""
    idle: list[Optional[float]] = [None] * world
    if world == 1:
        finish_output(files["partial"], files["done"], order)
        files["meta"].unlink(missing_ok=True)
        return [mine], [0.0]
    finish_rank(files["partial"], files["done"], order)
    write_jsonl_atomic(files["stats"], [mine])
    if group:
        import torch.distributed as dist

        waited = time.perf_counter()
        dist.barrier()  # every rank's finished file is written
        dist.all_gather_object(idle, round(time.perf_counter() - waited, 2))
        dist.destroy_process_group()
    if rank != 0:
        return None, idle
    return merge_ranks(out, world, order), idle


def progress_bar(stats: Any, total: Optional[int], rank: int) -> tuple[Any, Callable[[int, int], None]]:
    """(the progress bar on rank 0's stderr, the engine's progress callback updating it)."""
    import sys

    from tqdm import tqdm

    bar = tqdm(total=total, unit="conv", desc="regenerate", file=sys.stderr, dynamic_ncols=True,
               mininterval=0.5 if sys.stderr.isatty() else 15.0, disable=rank != 0)
    t0 = time.perf_counter()

    def progress(finished: int, new_tokens: int) -> None:
        if finished:
            bar.update(finished)
        elapsed = max(time.perf_counter() - t0, 1e-6)
        bar.set_postfix(tok_s=f"{stats.generated_tokens / elapsed:.1f}", tokens=stats.generated_tokens,
                        refresh=False)

    return bar, progress


def engine_mix(weights: Optional[dict[str, float]], dataset: dict[str, str], *, max_new_tokens: int,
               queued: bool, world: int) -> Optional[Any]:
    """Under a time cap with several sources (``weights``), the `SourceMix` that keeps the asked mix in
    supervised tokens as answers end (one process); ranks sharing a queue interleave it statically instead."""
    if weights is None:
        return None
    if queued:
        logger.warning("--max-minutes with %d ranks sharing a queue: the sources are interleaved by weight in user "
                       "turns, not in supervised tokens (answer lengths are not known when the queue is made; one "
                       "process interleaves by tokens); the achieved mix is reported", world)
        return None
    from nemo_dflash.data.regenerate import SourceMix

    logger.info("--max-minutes: the sources are interleaved by weight in supervised tokens (%s)",
                ", ".join(f"{name} {w:g}" for name, w in weights.items()))
    return SourceMix(weights, dataset, prior_tokens=max_new_tokens / 2)


def regenerate_in_modes(regenerate: Any, modes: Sequence[Optional[str]], model: Any, tokenizer: Any,
                        conversations: Union[Sequence[Any], Callable[[Optional[str]], Iterable[Any]]],
                        **kwargs: Any) -> Any:
    """``regenerate(model, tokenizer, conversations, **kwargs)`` once per thinking mode, the
    tokenizer rendering every prompt in that mode; each record gets ``"reasoning"``.
    ``conversations`` may be a function of the mode giving that mode's conversations (a rank's
    share of a queue, claimed as the engine admits them)."""
    def of_mode(mode: Optional[str]) -> Iterable[Any]:
        if callable(conversations):
            return conversations(mode)
        return [c for c in conversations if getattr(c, "reasoning", None) == mode]

    if modes == [None]:
        return regenerate(model, tokenizer, conversations(None) if callable(conversations) else conversations,
                          **kwargs)
    from nemo_dflash.data.chat_template import ReasoningTokenizer

    def run() -> Any:
        for mode in modes:
            mine = of_mode(mode)
            if isinstance(mine, list) and not mine:
                continue
            for record in regenerate(model, ReasoningTokenizer(tokenizer, mode), mine, **kwargs):
                record["reasoning"] = mode
                yield record

    return run()


__all__ = ["RunPlan", "append_records", "engine_mix", "finish_journals", "open_journals", "plan_ranks",
           "progress_bar", "regenerate_in_modes"]
