"""The measurement files under docs/bench/: one JSON list of rows per measured thing.

Every row is {"date", "commit", "device", "command", ...figures}; a script appends its rows, so the
last row is the current figure and older rows stay as they were measured. The file is replaced
atomically (temp file, then os.replace): a failed run never leaves half a file or loses old rows.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Optional

REPO = Path(__file__).resolve().parent.parent


def git_commit() -> Optional[str]:
    """Short hash of the checkout that ran, with '+dirty' when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        # a copied tree without .git (e.g. sent to a GPU machine) names its commit in .commit
        marker = REPO / ".commit"
        return marker.read_text().strip() + " (copied tree)" if marker.is_file() else None
    return head + ("+dirty" if dirty else "")


def this_command() -> str:
    """The command line that is running, as a user would type it (under torchrun, as torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launcher = ["torchrun", "--nproc-per-node", str(world)] if world > 1 else ["python"]
    return " ".join(shlex.quote(a) for a in [*launcher, *sys.argv])


def provenance(device: str, command: Optional[str] = None) -> dict[str, Any]:
    """The four keys every row starts with."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(), "commit": git_commit(),
            "device": device, "command": command or this_command()}


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows already in `path` ([] when it does not exist); anything but a list of rows is refused."""
    if not path.is_file():
        return []
    rows = json.loads(path.read_text())
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        print(f"{path} is not a list of rows: give another path, or convert it to rows first", file=sys.stderr)
        raise SystemExit(2)
    return rows


def append_rows(path: Path, rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Append `rows` to the list in `path`; returns the whole list as written."""
    path = Path(path)
    new = list(rows)
    for r in new:
        missing = [k for k in ("date", "commit", "device", "command") if k not in r]
        if missing:
            raise ValueError(f"row without {missing}")
    allrows = read_rows(path) + new
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(allrows, indent=1, default=str) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return allrows
