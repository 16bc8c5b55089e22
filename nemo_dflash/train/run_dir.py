"""A training run's claim on its `output_dir`: one run at a time, never two runs mixed in one directory.

`claim_output_dir` runs before anything expensive loads (target, data, draft) and refuses, in one
line (`RunDirError`, exit 2 from the commands):
- an `output_dir` that another training is using: rank 0 holds an `fcntl.flock` on `<output_dir>/.lock`
  for the whole run; the kernel drops it when the process ends, however it ends, so a killed run
  leaves nothing stuck;
- a fresh start (`checkpoint.resume=none`, or `auto` with no checkpoint to resume) into a directory that
  already holds a run (its config.yaml, metrics, checkpoints, final draft), unless `overwrite`: the old
  run is then renamed aside in one step and deleted, so the directory never holds half of each run;
- an `output_dir` (or its `checkpoints/`, `final/`) that cannot be written, found now rather than at
  the first save, after the steps are spent.
Under torchrun only rank 0 checks and locks; its verdict is shared with every rank.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from nemo_dflash.files import (
    CHECKPOINTS_DIR, COMPLETE, FINAL_DIR, FileLock, LockBusyError, LockReplacedError, check_writable_dir,
)
from nemo_dflash.train.distributed import DistState, all_reduce_sum

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"
# What a training run writes into its output_dir (the metrics logger's wandb/ included): a directory
# holding only these can be replaced by `--overwrite`; one holding anything else is never cleared.
RUN_ENTRIES = frozenset({
    CHECKPOINTS_DIR, FINAL_DIR, "config.yaml", "config.yaml.tmp", "metrics.jsonl", "summary.json", "curves.png",
    "wandb", LOCK_NAME,
})
_RUN_TEMP_PREFIXES = (".tmp-", ".old-", ".write-test")  # a killed run's leftovers (final/ written aside)
# Entries whose presence means the directory holds a run (an empty checkpoints/ does not count).
_RUN_MARKERS = ("config.yaml", "metrics.jsonl", "summary.json", FINAL_DIR)


class RunDirError(ValueError):
    """The output_dir cannot be used by this run (busy, holds another run, not writable)."""


def held_run(output_dir: Path) -> list[str]:
    """The entries showing that ``output_dir`` holds a run (empty when it holds none)."""
    found = [name for name in _RUN_MARKERS if (output_dir / name).exists()]
    ckpts = output_dir / CHECKPOINTS_DIR
    if ckpts.is_dir() and any(p.name.startswith("step_") for p in ckpts.iterdir()):
        found.append(CHECKPOINTS_DIR)
    return found


def _has_checkpoint(output_dir: Path) -> bool:
    ckpts = output_dir / CHECKPOINTS_DIR
    return ckpts.is_dir() and any((p / COMPLETE).is_file() for p in ckpts.iterdir() if p.name.startswith("step_"))


def blocks_a_fresh_start(output_dir: Path, resume: str) -> list[str]:
    """The entries of the run in ``output_dir`` that a run starting afresh there (``resume`` none, or auto
    with no complete checkpoint to resume) would need ``--overwrite`` to replace (empty: none)."""
    fresh = resume == "none" or (resume == "auto" and not _has_checkpoint(output_dir))
    return held_run(output_dir) if fresh and output_dir.is_dir() else []


class RunDirLock(FileLock):
    """`FileLock` on `<output_dir>/.lock`, its refusals worded for what holds it (`RunDirError`)."""

    def __init__(self, output_dir: Path, user: str = "training", place: str = "output_dir") -> None:
        """``user``, ``place``: what holds such a lock and the flag naming the directory, for the messages
        (`evaluate` locks its --out the same way)."""
        super().__init__(Path(output_dir) / LOCK_NAME)
        self.user, self.place = user, place

    def acquire(self) -> None:
        try:
            super().acquire()
        except LockBusyError as e:
            raise RunDirError(
                f"{self.place} {self.path.parent} is in use by another {self.user} (pid {e.holder}): wait for it to "
                f"end, or choose another {self.place}"
            ) from None
        except LockReplacedError:  # renamed away between open and lock (another run's --overwrite)
            raise RunDirError(
                f"{self.place} {self.path.parent} was just replaced by another {self.user}: wait for it to end, "
                f"or choose another {self.place}"
            ) from None
        except OSError as e:
            raise RunDirError(
                f"{self.place} {self.path.parent} cannot be locked ({e.strerror or e}): choose an {self.place} on a "
                "local or lock-capable filesystem"
            ) from None


def _clear_aside(output_dir: Path, lock: RunDirLock) -> RunDirLock:
    """Replace the run in ``output_dir`` by an empty directory: rename it aside (one atomic step), make a
    new one, lock it, then delete the old. Returns the lock on the new directory."""
    foreign = sorted(p.name for p in output_dir.iterdir()
                     if p.name not in RUN_ENTRIES and not p.name.startswith(_RUN_TEMP_PREFIXES))
    if foreign:
        raise RunDirError(
            f"--overwrite refused: output_dir {output_dir} also holds files a training run does not write "
            f"({', '.join(foreign[:3])}); choose another output_dir"
        )
    aside = output_dir.parent / f".{output_dir.name}.replaced-{os.getpid()}"
    os.replace(output_dir, aside)
    output_dir.mkdir()
    new_lock = RunDirLock(output_dir)
    try:
        new_lock.acquire()
    finally:
        lock.release()
    shutil.rmtree(aside, ignore_errors=True)
    logger.warning("overwrite: replaced the run that was in %s", output_dir)
    return new_lock


def _claim_main(output_dir: Path, resume: str, overwrite: bool) -> RunDirLock:
    check_writable_dir(output_dir, "output_dir")
    output_dir.mkdir(parents=True, exist_ok=True)
    lock = RunDirLock(output_dir)
    lock.acquire()
    try:
        held = blocks_a_fresh_start(output_dir, resume)
        if held:
            if not overwrite:
                if resume == "none":
                    why, fix = "checkpoint.resume=none", "resume it (checkpoint.resume=auto), "
                else:
                    why, fix = "it holds no complete checkpoint to resume from", ""
                raise RunDirError(
                    f"output_dir {output_dir} holds another run ({', '.join(held)}) and this one would start afresh "
                    f"({why}): {fix}choose another output_dir, or pass --overwrite to replace it"
                )
            lock = _clear_aside(output_dir, lock)
        for sub in (CHECKPOINTS_DIR, FINAL_DIR):  # found now, not at the first save
            if (output_dir / sub).exists():
                check_writable_dir(output_dir / sub, f"output_dir's {sub}/")
    except BaseException:
        lock.release()
        raise
    return lock


def claim_output_dir(output_dir: str | Path, resume: str, overwrite: bool, state: DistState) -> Optional[RunDirLock]:
    """Check and lock ``output_dir`` for this run (rank 0), before any model loads; every rank raises
    `RunDirError` when rank 0 refuses. Returns rank 0's lock (None elsewhere): release it at the end."""
    if not str(output_dir).strip():
        raise RunDirError("output_dir is empty, which would write the run into the working directory: set "
                          "output_dir=PATH")
    output_dir = Path(output_dir).resolve()  # through a symlink: the run it points to is the one claimed
    lock, error = None, None
    if state.is_main:
        try:
            lock = _claim_main(output_dir, resume, overwrite)
        except (RunDirError, OSError) as e:
            error = e
    refused = all_reduce_sum(torch.tensor([1.0 if error else 0.0], device=state.device), state)
    if error is not None:
        raise error if isinstance(error, RunDirError) else RunDirError(str(error)) from None
    if float(refused[0]) > 0:
        raise RunDirError(f"rank 0 refused output_dir {output_dir} (its message says why)")
    return lock


__all__ = ["LOCK_NAME", "RUN_ENTRIES", "RunDirError", "RunDirLock", "blocks_a_fresh_start", "claim_output_dir",
           "held_run"]
