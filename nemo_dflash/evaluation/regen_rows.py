"""Regeneration's measurement rows: docs/bench/data_summary.json's row from a `regenerate --summary-json` file, and
the scaling rows of one regenerate command run on 1, 2, 4 GPUs (the command of each GPU count, the ratios to one
GPU). benchmarks/regen.py writes them."""

from __future__ import annotations

import datetime
import shlex
import socket
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from nemo_dflash.evaluation.rows import git_commit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def regenerate_command(gpus: int, target: str, data: Sequence[str], num_samples: int, out: Path, summary: Path,
            passthrough: Sequence[str], cpu: bool, launcher_name: str = "python") -> list[str]:
    """The regenerate command of one GPU count: torchrun for several, and for one too with `launcher_name`
    "torchrun" (the same launcher and environment as the others: one thread for CPU ops, a process group)."""
    launcher = [sys.executable]
    if gpus > 1 or launcher_name == "torchrun":
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(gpus), "--master-addr", "127.0.0.1",
                     "--master-port", str(free_port())]
    regen = ["-m", "nemo_dflash.recipes.regenerate", "--target", target, *(x for d in data for x in ("--data", d)),
             "--out", str(out), "--num-samples", str(num_samples), "--summary-json", str(summary)]
    return [*launcher, *regen, *(["--device", "cpu"] if cpu else []), *passthrough]


def scaling(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each GPU count's generated and end-to-end tokens/s over one GPU's. Generation leaves out each
    run's one-time compile and capture of the decode step (start-up, which end to end keeps): on a cold
    compile cache it is tens of seconds of the first run alone, and would flatter every later one."""
    one = next(r for r in runs if r["gpus"] == 1)
    gen = "tokens_per_s_after_capture" if all("tokens_per_s_after_capture" in r for r in runs) else "tokens_per_s"
    out: dict[str, dict[str, float]] = {"generation": {}, "end_to_end": {}}
    for r in runs:
        for key, field in (("generation", gen), ("end_to_end", "end_to_end_tokens_per_s")):
            out[key][str(r["gpus"])] = round(r[field] / one[field], 3) if one[field] > 0 else None
    return out


def run_row(gpus: int, num_samples: int, cmd: Sequence[str], summary: dict[str, Any]) -> dict[str, Any]:
    """What the row keeps of one run's summary."""
    return {"gpus": gpus, "num_samples": num_samples, "command": shlex.join(cmd), "written": summary["written"],
            "generated_tokens": summary["generated_tokens"], "tokens_per_s": summary["tokens_per_s"],
            "end_to_end_tokens_per_s": summary["end_to_end_tokens_per_s"],
            **{k: summary[k] for k in ("tokens_per_s_after_capture", "capture_seconds") if k in summary},
            "regenerate_seconds": summary["regenerate_seconds"], "wall_seconds": summary["wall_seconds"],
            "rank_imbalance": summary["rank_imbalance"], "ranks_detail": summary["ranks_detail"]}


def regen_summary_row(summary: dict[str, Any], device: str, command: str,
        report: Optional[dict[str, Any]] = None, commit: Optional[str] = None) -> dict[str, Any]:
    """The row. ``tokens_per_s`` is per GPU (``world`` beside it); with the data report, each source
    gains its unique 13-gram share, loop-cut share and answer length percentiles."""
    commit = commit or git_commit() or "unknown"
    world = summary["ranks"]
    sources = summary["sources"]
    if report is not None:
        extra = {r["name"]: r for r in report["sources"]}
        keys = ("unique_13gram_share", "loop_cut_share", "answer_length_mean", "answer_length_percentiles")
        sources = [{**s, **{k: extra[s["name"]][k] for k in keys if s["name"] in extra}} for s in sources]
        sources.append({"name": "all", **{k: report["all"][k] for k in ("conversations", "turns", "supervised_tokens",
                                                                        *keys)}})
    return {
        "date": datetime.date.today().isoformat(), "commit": commit, "device": device, "command": command,
        "sources": sources, "decontamination": summary["decontamination"],
        "end_to_end_tokens_per_s": round(summary["end_to_end_tokens_per_s"] / world, 2), "world": world,
        "ranks": world, "gpus": world, "conversations": summary["written"],
        "generated_tokens": summary["generated_tokens"], "wall_seconds": summary["wall_seconds"],
        "regenerate_seconds": summary["regenerate_seconds"], "tokens_per_s": round(summary["tokens_per_s"] / world, 2),
        "tokens_per_s_note": "per GPU: all ranks' generated tokens / seconds / world",
        "rank_imbalance": summary.get("rank_imbalance"), "ranks_detail": summary.get("ranks_detail"),
        "samples_per_prompt": summary["samples_per_prompt"], "data_sources": summary["data_sources"],
        "looping_before": summary.get("looping_before"), "looping_after": summary.get("looping_after"),
    }
