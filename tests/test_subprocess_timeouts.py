"""tests/_torchrun.py's timeouts: scaled by NEMO_DFLASH_TEST_TIMEOUT_SCALE, and a command past its timeout is killed
with everything it started and fails in one line naming the ranks that had not finished."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from _torchrun import SCALE_ENV, TORCHRUN, free_port, run_command, scaled, timeout_scale

# Rank 0 ends at once; rank 1 writes its pid and a line, then waits forever (a rank hung in a collective).
HANG = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} started", flush=True)
if rank == 1:
    open(sys.argv[1], "w").write(str(os.getpid()))
    print("rank 1 waiting on the others", file=sys.stderr, flush=True)
    time.sleep(3600)
"""


def _gone(pid: int, within: float = 10.0) -> bool:
    """``pid`` ended (or is a zombie) within ``within`` seconds."""
    t0 = time.time()
    while time.time() - t0 < within:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True  # dead, not yet reaped
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_the_scale_multiplies_every_timeout(monkeypatch):
    monkeypatch.delenv(SCALE_ENV, raising=False)
    assert timeout_scale() == 1 and scaled(240) == 240
    monkeypatch.setenv(SCALE_ENV, "2.5")
    assert scaled(240) == 600
    for bad in ("0", "-1", "fast"):
        monkeypatch.setenv(SCALE_ENV, bad)
        with pytest.raises(ValueError, match=SCALE_ENV):
            scaled(1)


def test_a_command_past_its_timeout_is_killed_and_named(tmp_path, monkeypatch):
    """A plain command and the child it started: both killed, the failure names the command and shows its output."""
    monkeypatch.setenv(SCALE_ENV, "0.5")
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
            "print('parent waiting', flush=True)\ntime.sleep(3600)\n")
    t0 = time.time()
    with pytest.raises(pytest.fail.Exception) as e:
        run_command([sys.executable, "-c", code], 8)
    assert time.time() - t0 < 30
    msg = str(e.value)
    head = msg.splitlines()[0]
    assert head.startswith(f"timed out after 4 s ({SCALE_ENV}=0.5): {sys.executable} -c") and "still running" in head
    assert "parent waiting" in msg
    assert _gone(int(pid_file.read_text()))  # the grandchild did not outlive the test


def test_a_hung_rank_is_named_with_each_ranks_last_lines(tmp_path):
    """2 ranks under torchrun, rank 1 hung: the failure's first line names rank 1 of 2 (rank 0 had finished), each
    rank's last lines follow, and the hung rank is killed (torchrun starts it in a session of its own)."""
    script, pid_file = tmp_path / "hang.py", tmp_path / "rank1.pid"
    script.write_text(HANG)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), str(script), str(pid_file)]
    with pytest.raises(pytest.fail.Exception) as e:
        run_command(cmd, 15, env=env)  # past rank 1's start on a busy machine (~3 s idle); the test waits all of it
    msg = str(e.value)
    head = msg.splitlines()[0]
    after = f"after {scaled(15):.0f} s ({SCALE_ENV}={timeout_scale():g})"
    assert head.startswith(f"rank(s) 1 of 2 had not finished (rank(s) 0 had) {after}: {sys.executable} -m"), msg
    assert "rank 0 started" in msg and "rank 1 waiting on the others" in msg, msg
    assert pid_file.is_file() and _gone(int(pid_file.read_text())), msg


def test_under_torchrun_the_ranks_output_still_reaches_the_caller(tmp_path):
    """The per-rank log files (--tee) keep the console output: both ranks' lines reach stdout, prefixed by rank."""
    script = tmp_path / "ok.py"
    script.write_text("import os\nprint('hello from', os.environ['RANK'])\n")
    cmd = [sys.executable, "-m", TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), str(script)]
    res = run_command(cmd, 120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert {line for line in res.stdout.splitlines() if "hello" in line} == {"[rank0]:hello from 0",
                                                                              "[rank1]:hello from 1"}
