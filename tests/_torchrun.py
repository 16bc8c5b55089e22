"""Launch a test's command under 2 gloo ranks on this machine (torchrun on CPU, one thread a rank)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args: list[str], script: str = "-m nemo_dflash.recipes.regenerate",
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``args`` under 2 gloo ranks on this machine (one thread each)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), *script.split(), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
