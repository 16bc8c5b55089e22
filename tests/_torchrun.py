"""The tests' subprocesses (torchrun's gloo ranks on this machine, a recipe's command) under one timeout policy.

A timeout here is a base in seconds, sized so that a busy 2-core machine (the other pytest worker on the other core,
something else of the user's beside it) finishes well inside it, times ``NEMO_DFLASH_TEST_TIMEOUT_SCALE`` (default 1;
raise it on a slower or busier machine). Past it the whole process tree is killed (torchrun starts each rank in a
session of its own, so killing its process group alone would leave the ranks running) and the test fails in one
line naming the ranks that had not finished, with the tail of each rank's output below it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCALE_ENV = "NEMO_DFLASH_TEST_TIMEOUT_SCALE"
TORCHRUN = "torch.distributed.run"
TAIL_LINES = 15


def timeout_scale() -> float:
    """The factor every subprocess timeout of the tests is multiplied by (``NEMO_DFLASH_TEST_TIMEOUT_SCALE``)."""
    raw = os.environ.get(SCALE_ENV, "1")
    try:
        scale = float(raw)
    except ValueError:
        raise ValueError(f"{SCALE_ENV}={raw!r}: a positive number, e.g. 2") from None
    if not scale > 0:
        raise ValueError(f"{SCALE_ENV}={raw!r}: a positive number, e.g. 2")
    return scale


def scaled(seconds: float) -> float:
    """``seconds`` times the timeout scale: what a test waits for a subprocess (or a file it writes)."""
    return seconds * timeout_scale()


def communicate_all(procs: Mapping[object, subprocess.Popen], seconds: float) -> dict[object, tuple[int, str, str]]:
    """Wait for processes started together (their imports overlap on the cores), each up to ``scaled(seconds)``:
    key -> (exit status, stdout, stderr); one past its time is killed and says so at the end of its stderr."""
    out = {}
    for key, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=scaled(seconds))
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            stderr += f"\n(timed out after {scaled(seconds):.0f} s: {SCALE_ENV} stretches the tests' timeouts)"
        out[key] = (proc.returncode, stdout, stderr)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children() -> dict[int, list[int]]:
    """parent pid -> its children's pids, read from /proc (Linux)."""
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:  # ended while we looked
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command name may hold spaces and brackets
        out.setdefault(ppid, []).append(int(d.name))
    return out


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid``, nearest first."""
    children, out, todo = _children(), [], [pid]
    while todo:
        for c in children.get(todo.pop(0), []):
            out.append(c)
            todo.append(c)
    return out


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _tail(text: str, n: int = TAIL_LINES) -> str:
    return "\n".join(f"    {line}" for line in text.rstrip().splitlines()[-n:])


def _rank_logs(log_dir: Path) -> dict[int, str]:
    """local rank -> its stdout and stderr as torchrun's --log-dir kept them (the last attempt's)."""
    out: dict[int, str] = {}
    for attempt in sorted(log_dir.glob("*/attempt_*")):
        for rank_dir in attempt.iterdir():
            if rank_dir.name.isdigit():
                text = "".join((rank_dir / f).read_text(errors="replace") for f in ("stdout.log", "stderr.log")
                               if (rank_dir / f).is_file())
                out[int(rank_dir.name)] = text
    return out


def hang_report(cmd: Sequence[str], limit: float, alive: Mapping[int, tuple[dict[str, str], str]], out: str,
                err: str, log_dir: Path | None) -> str:
    """The failure of a command that ran past ``limit``: one line naming what had not finished (ranks by RANK,
    other processes by pid), then each rank's output tail (or the command's own). ``alive``: pid -> (environment,
    command line) of each process still running at the timeout, read before they were killed."""
    ranks: dict[int, int] = {}  # rank -> the pid nearest the launcher that holds it
    world = None
    others = []
    for pid, (env, _) in alive.items():
        if "TORCHELASTIC_RUN_ID" in env and env.get("RANK", "").isdigit():  # a rank torchrun started
            ranks.setdefault(int(env["RANK"]), pid)
            world = int(env.get("WORLD_SIZE", "0")) or world
        else:
            others.append(pid)
    what = " ".join(cmd).replace("\n", "\\n")[:300]  # one line, whatever the arguments hold
    after = f"after {limit:.0f} s ({SCALE_ENV}={timeout_scale():g})"
    if ranks:
        done = sorted(set(range(world or 0)) - set(ranks))
        head = (f"rank(s) {', '.join(map(str, sorted(ranks)))} of {world or '?'} had not finished"
                + (f" (rank(s) {', '.join(map(str, done))} had)" if done else "") + f" {after}: {what}")
    elif log_dir is not None:
        head = f"torchrun had not finished {after}, no rank running (rendezvous, start-up or teardown): {what}"
    else:
        head = f"timed out {after}: {what}"
        if others:
            head += f"; still running: {', '.join(f'pid {p} ({alive[p][1][:80]})' for p in others[:3])}"
    lines = [head]
    logs = _rank_logs(log_dir) if log_dir is not None else {}
    for rank, text in sorted(logs.items()):
        lines += [f"  local rank {rank}, last lines:", _tail(text) or "    (nothing written)"]
    if not logs:
        lines += ["  stdout, last lines:", _tail(out) or "    (nothing)", "  stderr, last lines:",
                  _tail(err) or "    (nothing)"]
    else:  # torchrun's own lines (the ranks' are above), less its OMP_NUM_THREADS banner
        own = "\n".join(line for line in err.splitlines() if not line.startswith(("[rank", "****", "Setting OMP_")))
        if own.strip():
            lines += ["  torchrun's own stderr, last lines:", _tail(own, 5)]
    return "\n".join(lines)


def run_command(cmd: Sequence[str], timeout: float, *, env: Mapping[str, str] | None = None,
                cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """``cmd``, its output captured as text, given ``scaled(timeout)`` seconds. Under torchrun each rank's output
    is also kept in a file of its own (``--log-dir``, ``--tee 3``: the console lines gain a ``[rankN]:`` prefix),
    so that a timeout can name the ranks that had not finished and show what each last wrote."""
    cmd = [str(c) for c in cmd]
    limit = scaled(timeout)
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="nemo_dflash_test_logs_") as tmp:
        log_dir = None
        if TORCHRUN in cmd and not any(c.startswith(("--log-dir", "--log_dir", "--tee")) for c in cmd):
            at = cmd.index(TORCHRUN) + 1
            log_dir = Path(tmp)
            cmd[at:at] = ["--log-dir", tmp, "--tee", "3"]
            env.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]:")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            alive = {pid: (_environ(pid), _cmdline(pid)) for pid in descendants(proc.pid)}
            for pid in [*alive, proc.pid]:
                _kill(pid)
            _kill_group(proc.pid)
            out, err = proc.communicate()
            pytest.fail(hang_report(cmd, limit, alive, out, err, log_dir), pytrace=False)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def torchrun(args: list[str], script: str = "-m nemo_dflash.recipes.regenerate",
             env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``args`` under 2 gloo ranks on this machine (one thread each)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), *script.split(), *args]
    return run_command(cmd, timeout, env=env)
