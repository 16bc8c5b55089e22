"""Rows of `regen_throughput.py --json` runs as one table, and optionally as a block of regen_summary.json.

    python benchmarks/regen_rows.py "packed=docs/bench/session8_regen/layout/regen_all_turns_packed.json" ...
        [--summary docs/bench/regen_summary.json --key throughput_session8 --device "..." --command "..."]

Each argument is LABEL=FILE (split at the last "="; the file's first row). Prints a markdown table (tokens/s, seconds,
phase seconds, prefill forwards, the engine settings the run recorded); with --summary, writes the
rows under --key of that JSON file, so the summary's figures come from the run files, not by hand.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def load_row(label: str, path: str) -> dict[str, Any]:
    rows = json.loads(Path(path).read_text())["rows"]
    if not rows:
        return {"label": label, "file": path, "failed": True}
    r = rows[0]
    finish = r.get("finish", {})
    return {"label": label, "file": path, "new_tokens": r["tokens"], "seconds": round(r["seconds"], 1),
            "tokens_per_s": round(r["tokens_per_s"], 1), "turns": finish.get("turns"),
            "batch_size": r.get("batch_size"), "phase_seconds": finish.get("phase_seconds"),
            "prefill_calls": finish.get("prefill_calls"), "gpu_seconds": finish.get("gpu_seconds"),
            "engine": r.get("engine")}


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| run | tokens/s | s | prefill s (forwards) | decode s | caller s | host + loop s "
           "| GPU busy: decode + prefill s | GPU idle before: decode + prefill s |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("failed"):
            out.append(f"| {r['label']} | failed (no row: see its log) | | | | | | | |")
            continue
        ph, calls, gpu = r["phase_seconds"] or {}, r["prefill_calls"] or {}, r.get("gpu_seconds") or {}
        prefill = sum(v for k, v in ph.items() if k.startswith("prefill"))
        busy = f"{gpu.get('decode', 0):.1f} + {gpu.get('prefill', 0):.1f}" if gpu else "(not recorded)"
        idle = (f"{gpu.get('idle_before_decode', 0):.1f} + {gpu.get('idle_before_prefill', 0):.1f}" if gpu
                else "(not recorded)")
        out.append(f"| {r['label']} | {r['tokens_per_s']:,.0f} | {r['seconds']} "
                   f"| {prefill:.1f} ({sum(calls.values())}) | {ph.get('decode', 0):.1f} | {ph.get('caller', 0):.1f} "
                   f"| {ph.get('host', 0) + ph.get('loop_check', 0):.1f} | {busy} | {idle} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="LABEL=FILE")
    p.add_argument("--summary", type=Path, default=None)
    p.add_argument("--key", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--command", default=None)
    p.add_argument("--what", default=None)
    args = p.parse_args()
    rows = [load_row(*item.rsplit("=", 1)) for item in args.runs]
    print(table(rows))
    if args.summary is not None:
        if not args.key:
            p.error("--summary needs --key")
        summary = json.loads(args.summary.read_text())
        ok = [r for r in rows if not r.get("failed")]
        summary[args.key] = {"device": args.device, "command": args.command, "what": args.what, "rows": rows,
                             "best": max(ok, key=lambda r: r["tokens_per_s"])["label"] if ok else None}
        tmp = args.summary.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
        tmp.replace(args.summary)


if __name__ == "__main__":
    main()
