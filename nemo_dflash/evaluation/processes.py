"""`evaluate --gpus N`: the conversations dealt over N evaluate processes (one a GPU), each journaling its share
into --out/partI, then merged into the run that started them. The processes end with their parent (killed,
SIGKILLed or on an error), so no part is left half-written by a process nobody waits for.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from nemo_dflash.evaluation.run import EvalRun, Journal

logger = logging.getLogger("nemo_dflash.evaluate")


def process_env(gpu: int, device: str) -> dict[str, str]:
    """The environment of a child process on the ``gpu``-th GPU this process sees (its CUDA_VISIBLE_DEVICES
    entry, so a job given GPUs 2,3 keeps to them); on a CPU, this process's environment."""
    import os

    env = dict(os.environ)
    if device == "cuda":
        visible = [x.strip() for x in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
        env["CUDA_VISIBLE_DEVICES"] = visible[gpu] if gpu < len(visible) else str(gpu)
    return env


def start_process(argv: Sequence[str], gpu: int, device: str, log: Path) -> "subprocess.Popen[bytes]":
    """``python -m nemo_dflash.recipes.evaluate ARGV`` in the background on the ``gpu``-th GPU this process sees
    (or on the CPU), its output in ``log``; the package importable as it is here."""
    import os
    import subprocess

    import nemo_dflash

    env = process_env(gpu, device)
    root = str(Path(nemo_dflash.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "nemo_dflash.recipes.evaluate", *argv], stdout=f,
                                stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent(os.getpid()))


def die_with_parent(parent: int) -> Optional[Callable[[], None]]:
    """What a child runs between fork and exec so that it is sent SIGTERM when its parent dies, even by SIGKILL
    (Linux's PR_SET_PDEATHSIG): no `--gpus` process outlives the evaluate that started it. A parent already gone
    by then ends the child at once. None where prctl is unavailable (the parent's own cleanup then applies)."""
    import ctypes
    import os
    import signal

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded here: nothing is loaded in the forked child
    except (OSError, AttributeError):
        return None

    def child() -> None:
        prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return child


def spread(argv: Sequence[str], run: EvalRun, gpus: int) -> EvalRun:
    """Deal the conversations over ``gpus`` processes (process i on GPU i, or on the CPU; prompt j of each set to
    process j % gpus, at every temperature, so each holds an equal share of every figure's work), each an evaluate
    of its share into --out/partI, side by side; then ``run`` (on --out, its lock held throughout, so no other
    evaluate writes there meanwhile) with their answers merged in (what is left, e.g. after a process's
    --max-minutes, this process decodes). The processes end with this one: killed, or on any error here."""
    import time

    n, options, protocol = gpus, run.opts, run.protocol
    procs: list[Any] = []
    try:
        for i in range(n):
            procs.append(start_process([*argv, "--out", str(options.out / f"part{i}"), "--gpus", "1", "--part",
                                        f"{i}/{n}"], i, options.device, options.out / f"part{i}.log"))
        logger.info("%d processes evaluate every %d-th conversation of each set at T %s: logs %s/part*.log", n, n,
                    ",".join(t.key for t in protocol.samplings), options.out)
        codes = [p.wait() for p in procs]
    finally:
        stop_processes(procs)
    failed = [(i, rc) for i, rc in enumerate(codes) if rc != 0]
    if failed:
        i, rc = failed[0]
        raise ValueError(f"evaluate process {i} of --gpus {n} exited {rc}: see {options.out / f'part{i}.log'}")
    if options.max_minutes is not None:  # what the parts left gets this process's own --max-minutes
        run.deadline = time.monotonic() + 60 * options.max_minutes
    for i in range(n):  # each part's journals, opened as the run's own (a part of another evaluation is refused)
        for journal, name in ((run.journal, "answers.jsonl"), (run.timed, "speedup.jsonl")):
            for key, row in Journal(options.out / f"part{i}" / name, journal.header, overwrite=False).rows.items():
                if key not in journal.rows:
                    journal.add(key, {k: v for k, v in row.items() if k not in ("temperature", "dataset", "id")})
    return run


def stop_processes(procs: Sequence[Any]) -> None:
    """SIGTERM every process still running, then SIGKILL what has not ended within 10 s (an error or a signal in
    the parent: no part is left running without it)."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.terminate()
    for p in live:
        try:
            p.wait(10)
        except Exception:  # subprocess.TimeoutExpired
            p.kill()
            p.wait()


__all__ = ["die_with_parent", "process_env", "spread", "start_process", "stop_processes"]
