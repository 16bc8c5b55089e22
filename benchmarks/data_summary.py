"""One row of docs/bench/data_summary.json from a `regenerate --summary-json` file.

    python benchmarks/data_summary.py --summary runs/data/summary.json --out docs/bench/data_summary.json \
        --device "1x NVIDIA H200" --command "torchrun ... -m nemo_dflash.recipes.regenerate ..."

The row ({"date", "commit", "device", "command", "sources": [{"name", "conversations", "turns",
"supervised_tokens", and with --report FILE (the run's data_report.json) "unique_13gram_share", "loop_cut_share",
"answer_length_percentiles", ...}], "decontamination": {"checked", "dropped"}, "tokens_per_s" and
"end_to_end_tokens_per_s" per GPU, "world", "rank_imbalance", ...}) is appended to the JSON list in --out, and printed as a table: the figures come
from the run's own summary, never typed by hand.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path
from typing import Any, Optional

from _common import git_commit


def row(summary: dict[str, Any], device: str, command: str,
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--summary", type=Path, required=True, help="the file regenerate --summary-json wrote")
    p.add_argument("--out", type=Path, default=Path("docs/bench/data_summary.json"))
    p.add_argument("--device", required=True, help="e.g. '1x NVIDIA H200'")
    p.add_argument("--command", required=True, help="the regenerate command that made the summary")
    p.add_argument("--report", type=Path, default=None,
                   help="the run's data_report.json (OUT_STEM_report/ beside the data): per-source 13-gram share, ...")
    p.add_argument("--commit", default=None, help="the commit the run carried (default: this checkout's)")
    args = p.parse_args()
    report = json.loads(args.report.read_text()) if args.report else None
    r = row(json.loads(args.summary.read_text()), args.device, args.command, report, args.commit)
    rows = json.loads(args.out.read_text()) if args.out.exists() else []
    rows.append(r)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(rows, indent=1) + "\n")
    os.replace(tmp, args.out)
    print("| source | conversations | turns | supervised tokens | unique 13-grams |")
    print("|---|---|---|---|---|")
    for s in r["sources"]:
        share = s.get("unique_13gram_share")
        print(f"| {s['name']} | {s['conversations']:,} | {s['turns']:,} | {s['supervised_tokens']:,} | "
              f"{'-' if share is None else f'{share:.3f}'} |")
    print(f"\ndecontamination: {r['decontamination']}; {r['world']} GPU(s); per GPU {r['tokens_per_s']:,.0f} tokens/s "
          f"generating, {r['end_to_end_tokens_per_s']:,.0f} end to end ({r['wall_seconds']:.0f} s wall)")


if __name__ == "__main__":
    main()
