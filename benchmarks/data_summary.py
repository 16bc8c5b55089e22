"""One row of docs/bench/data_summary.json from a `regenerate --summary-json` file.

    python benchmarks/data_summary.py --summary runs/data/summary.json --out docs/bench/data_summary.json \
        --device "1x NVIDIA H200" --command "torchrun ... -m nemo_dflash.recipes.regenerate ..."

The row ({"date", "commit", "device", "command", "sources": [{"name", "conversations", "turns",
"supervised_tokens"}], "decontamination": {"checked", "dropped"}, "end_to_end_tokens_per_s",
"ranks", ...}) is appended to the JSON list in --out, and printed as a table: the figures come
from the run's own summary, never typed by hand.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path
from typing import Any

from bench_rows import git_commit


def row(summary: dict[str, Any], device: str, command: str) -> dict[str, Any]:
    commit = git_commit() or "unknown"
    return {
        "date": datetime.date.today().isoformat(), "commit": commit, "device": device, "command": command,
        "sources": summary["sources"], "decontamination": summary["decontamination"],
        "end_to_end_tokens_per_s": summary["end_to_end_tokens_per_s"], "ranks": summary["ranks"],
        "conversations": summary["written"], "generated_tokens": summary["generated_tokens"],
        "wall_seconds": summary["wall_seconds"], "regenerate_seconds": summary["regenerate_seconds"],
        "tokens_per_s": summary["tokens_per_s"], "samples_per_prompt": summary["samples_per_prompt"],
        "data_sources": summary["data_sources"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--summary", type=Path, required=True, help="the file regenerate --summary-json wrote")
    p.add_argument("--out", type=Path, default=Path("docs/bench/data_summary.json"))
    p.add_argument("--device", required=True, help="e.g. '1x NVIDIA H200'")
    p.add_argument("--command", required=True, help="the regenerate command that made the summary")
    args = p.parse_args()
    r = row(json.loads(args.summary.read_text()), args.device, args.command)
    rows = json.loads(args.out.read_text()) if args.out.exists() else []
    rows.append(r)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(rows, indent=1) + "\n")
    os.replace(tmp, args.out)
    print("| source | conversations | turns | supervised tokens |")
    print("|---|---|---|---|")
    for s in r["sources"]:
        print(f"| {s['name']} | {s['conversations']:,} | {s['turns']:,} | {s['supervised_tokens']:,} |")
    print(f"\ndecontamination: {r['decontamination']}; ranks {r['ranks']}; "
          f"{r['end_to_end_tokens_per_s']:,.0f} tokens/s end to end ({r['wall_seconds']:.0f} s wall)")


if __name__ == "__main__":
    main()
