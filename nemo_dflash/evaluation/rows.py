"""The measurement files' rows (docs/bench/*.json): one JSON list of rows per measured thing.

Every row is {"date", "commit", "device", "command", ...figures} (`provenance`); a tool appends its rows, so the
last row is the current figure and older rows stay as they were measured. The file is replaced atomically (temp
file, then os.replace): a failed run never leaves half a file or loses old rows. A file whose rows are keyed
(drafter_summary.json: one row per draft and protocol) is written with `upsert_rows`: a second measurement of the
same thing updates its row instead of adding a duplicate. The benchmarks (benchmarks/) write their rows with these.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

logger = logging.getLogger("nemo_dflash.rows")

REPO = Path(__file__).resolve().parent.parent.parent  # the checkout holding nemo_dflash/ (and benchmarks/)


def git_commit(repo: Path = REPO) -> Optional[str]:
    """Short hash of the checkout that ran, with '+dirty' when tracked files differ from it. A tree copied to
    another machine names its commit in a `.commit` file, which wins: the copy's own git state (absent, or
    the state the copy was made from) does not know the commit the tree holds."""
    marker = repo / ".commit"
    if marker.is_file():
        return marker.read_text().strip() + " (copied tree)"
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
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
        logger.error("%s is not a list of rows: give another path, or convert it to rows first", path)
        raise SystemExit(2)
    return rows


def _check_heads(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        missing = [k for k in ("date", "commit", "device", "command") if k not in r]
        if missing:
            raise ValueError(f"row without {missing}")


def write_rows(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Replace `path` with `rows`, atomically (temp file, then os.replace); returns `rows`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(rows, indent=1, default=str) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return rows


def append_rows(path: Path, rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Append `rows` to the list in `path`; returns the whole list as written."""
    new = list(rows)
    _check_heads(new)
    return write_rows(path, read_rows(Path(path)) + new)


HEAD_KEYS = ("date", "commit", "device", "command")


def fold_rows(rows: Iterable[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> list[dict[str, Any]]:
    """One row per key: a later row of a key already seen is merged into it (its measured values win, a value it
    left null keeps the earlier one) and the merged row takes the later row's place, so dates still never go back.
    The earlier rows' provenance is kept under `merged_rows`; a later row that only repeats the earlier one is
    dropped. Rows whose key is None are never merged."""
    out: list[Optional[dict[str, Any]]] = []
    at: dict[Any, int] = {}
    for row in rows:
        k = key(row)
        if k is not None and k in at:
            old = out[at[k]]
            if all(old.get(f) == v for f, v in row.items() if v is not None):
                continue  # it repeats the earlier row: nothing to merge, the earlier row stays where it is
            out[at[k]] = None
            earlier = [*old.get("merged_rows", []), {h: old.get(h) for h in HEAD_KEYS}]
            row = {**{f: v for f, v in old.items() if f != "merged_rows"},
                   **{f: v for f, v in row.items() if v is not None}, "merged_rows": earlier}
        if k is not None:
            at[k] = len(out)
        out.append(row)
    return [r for r in out if r is not None]


def same_row(row: dict[str, Any]) -> str:
    """The key under which two rows are one: every key and value (a row repeated exactly folds into one)."""
    return json.dumps(row, sort_keys=True, default=str)


def upsert_rows(path: Path, rows: Iterable[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> list[dict[str, Any]]:
    """Append `rows` to `path`, a row of a key already there merged into that row (`fold_rows`): a second
    measurement of one thing updates its row instead of adding a duplicate."""
    new = list(rows)
    _check_heads(new)
    return write_rows(path, fold_rows(read_rows(Path(path)) + new, key))



def throughput_row(args: Any, device_name: str, r: dict[str, Any], *, world: int, packed: bool, compiled: bool,
                   case: str) -> dict[str, Any]:
    """One row of docs/bench/train_throughput.json from one measured case `r` of benchmarks/train_throughput.py:
    tokens/s per GPU (`world` beside it), whatever of the case's settings it recorded."""
    row = provenance(device_name)
    if args.commit:
        row["commit"] = args.commit
    row.update({"shape": args.shape, "case": case, "world": world, "variant": getattr(args, "draft_kind", "dflash"),
                "data": "real" if getattr(args, "data", None) else "synthetic", "packed": packed,
                "compiled": compiled, "anchors": r["anchors"], "seq": r["seq"], "step_ms": round(r["step_ms"], 2),
                "tokens_per_s": round(r["tokens_s"] / world, 1), "tokens_per_s_note": "per GPU",
                "mfu": round(r["mfu"], 4), "peak_gb": round(r["peak_gb"], 2), "tflops": round(r["tflops"], 1)})
    if getattr(args, "variant_options", ""):
        row["variant_options"] = args.variant_options
    for k in ("backend", "fused_ce", "loss_impl", "packed_attention", "mbs", "accum", "overlap", "fsdp2",
              "cpu_threads"):
        if r.get(k) is not None:
            row[k] = round(r[k], 2) if isinstance(r[k], float) else r[k]
    return row
