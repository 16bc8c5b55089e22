"""The rows of a SmolLM2 drafter run directory, read from its files.

OUT_DIR is a pipeline run directory (`recipes.pipeline ... run.dir=OUT_DIR`, docs/pipeline.md): data/regen.jsonl and
data/regen_summary.json, run/summary.json (training), eval/results.json. Run directories of the older drafter script
(logs/regenerate.log, runs/main/, eval/main/) are read too.

    python benchmarks/smollm2_summaries.py OUT_DIR --device "NVIDIA H200" [--command "..."] [--commit C] \
        [--eval RESULTS.json ...] [--data OUT_DIR/data/regen.jsonl[.gz]] [--throughput regen_throughput.json ...] \
        [--regen-json docs/bench/regen_summary.json] [--drafter-json docs/bench/drafter_summary.json]

Each JSON is a list of rows {"date", "commit", "device", "command", ...figures} (benchmarks/_common.py);
this script appends to it, so its last row is the current figure. Regeneration rows: the regenerated
set (counted in the data file), the loop/cap counts and the throughput of the regeneration (from its
log), then one row per row of any `regen_throughput.py --json` file given. Drafter row: training
tokens and held-out simulated tau (the run's summary), tau per dataset and temperature, first-256 tau,
loop share and speedup (evaluate's results.json), with evaluate's protocol. Nothing is typed in: a
value the run did not produce is null. Without a JSON path the rows are printed.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import re
from pathlib import Path
from typing import Any, Optional

from _common import append_rows, provenance, read_rows


def _load(path: Path) -> Optional[dict[str, Any]]:
    return json.loads(path.read_text()) if path.is_file() else None


def _open(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _train_summary(out: Path) -> Optional[dict[str, Any]]:
    """The training run's summary.json: RUN/run/ (the pipeline's output_dir), else the older runs/main/."""
    return _load(out / "run" / "summary.json") or _load(out / "runs" / "main" / "summary.json")


def _regen_summary_row(path: Path, head: dict[str, Any]) -> dict[str, Any]:
    """The regeneration row from the pipeline's data/regen_summary.json (regenerate --summary-json)."""
    s = json.loads(next(line for line in path.read_text().splitlines() if line.strip()))
    res: dict[str, Any] = {**head, "what": "regenerate stage (the drafter run's data step)", "file": str(path),
                           "pipeline_tokens_per_s": s.get("tokens_per_s"), "world": len(s.get("ranks_detail") or []) or 1,
                           "generated_tokens": s.get("generated_tokens"), "generate_seconds": s.get("generate_seconds"),
                           "answers_generated": s.get("answers")}
    for key in ("looping_before", "looping_after", "capped_before", "capped_after", "skipped_selection", "sampling"):
        res[key] = s.get(key)
    return res


def regen_rows(out: Path, data: Optional[Path], throughput: list[Path], head: dict[str, Any]) -> list[dict[str, Any]]:
    if (out / "data" / "regen_summary.json").is_file():
        res = _regen_summary_row(out / "data" / "regen_summary.json", head)
        return _regen_rest(out, res, data, throughput, head)
    log = (out / "logs" / "regenerate.log").read_text()
    done = re.findall(r"looping answers (\d+) -> (\d+), capped (\d+) -> (\d+) of (\d+); generated (\d+) tokens in "
                      r"([\d.]+)s \(([\d.]+) tokens/s\)", log)
    selected = re.findall(r"selected (\d+) conversations to regenerate and (\d+) held out \(examined (\d+); "
                          r"skipped (\{.*?\}|none)\)", log)
    short = re.findall(r"conversations cut short: (.*)", log)
    sampling = re.findall(r"sampling: temperature ([\d.]+), top_p ([\d.]+) \((.*?)\)", log)
    res: dict[str, Any] = {**head, "what": "regenerate recipe (the drafter run's data step)",
                           "file": str(out / "logs" / "regenerate.log")}
    if done:
        lb, la, cb, ca, answers, gen, secs, rate = done[-1]
        res.update(pipeline_tokens_per_s=float(rate), generated_tokens=int(gen), generate_seconds=float(secs),
                   answers_generated=int(answers), looping_before=int(lb), looping_after=int(la),
                   capped_before=int(cb), capped_after=int(ca))
    if selected:
        n, held, examined, skipped = selected[-1]
        res.update(conversations_selected=int(n), holdout_conversations=int(held), examined=int(examined),
                   skipped_selection=ast.literal_eval(skipped) if skipped != "none" else {})
    if short:
        res["conversations_cut_short"] = {k: int(v) for k, v in (x.split("=") for x in short[-1].split(", "))}
    if sampling:
        t, p, origin = sampling[-1]
        res["sampling"] = {"temperature": float(t), "top_p": float(p), "from": origin}
    return _regen_rest(out, res, data, throughput, head)


def _regen_rest(out: Path, res: dict[str, Any], data: Optional[Path], throughput: list[Path],
                head: dict[str, Any]) -> list[dict[str, Any]]:
    if data is not None:
        conversations = turns = 0
        with _open(data) as f:
            for line in f:
                if line.strip():
                    conversations += 1
                    turns += sum(m["role"] == "assistant" for m in json.loads(line)["messages"])
        res.update(conversations=conversations, turns=turns)
    train = _train_summary(out)
    if train:
        res.update(tokens=train["data"]["tokens"], supervised_tokens=train["data"]["supervised_tokens"])
    rows = []
    for path in throughput:
        found = _load(path) or {}
        for row in found if isinstance(found, list) else found.get("rows", []):
            rows.append({**head, "what": f"regen_throughput.py {row.get('mode')}", **row, "file": str(path)})
    return rows + [res]


def merge_evals(paths: list[Path]) -> dict[str, Any]:
    """One evaluate result from several runs of the same draft (e.g. eval_speed.py's replay, sequential and
    batched phases): figures per temperature and set, the first run that has one winning. The protocol is the
    first run's, with the temperatures of all; `complete` holds when every run whose acceptance figures were
    taken covered the whole protocol (a speedup-only run on K prompts does not count); `sources` says which
    run gave what."""
    merged: dict[str, Any] = {"results": {}, "speedup": {}, "sources": []}
    complete = []
    for path in paths:
        ev = _load(path)
        if ev is None:
            raise SystemExit(f"error: no evaluate results at {path}; give a results.json that `evaluate` wrote")
        proto = ev.get("protocol") or {}
        merged.setdefault("protocol", dict(proto))
        taken = []
        for key in ("results", "speedup"):
            for t, sets in (ev.get(key) or {}).items():
                for ds, figures in sets.items():
                    if ds not in merged[key].setdefault(t, {}):
                        merged[key][t][ds] = figures
                        taken.append(f"{key} T={t} {ds}")
                        if key == "results":
                            complete.append(bool(ev.get("complete")))
                        else:
                            merged["protocol"]["speedup_decode"] = proto.get("decode")
        merged["sources"].append({"file": str(path), "method": proto.get("method"), "decode": proto.get("decode"),
                                  "complete": ev.get("complete"), "taken": taken})
    merged["complete"] = bool(complete) and all(complete)
    keys = {t for key in ("results", "speedup") for t in merged[key]}  # "0", "1", "0.2,p0.9" (evaluate's keys)
    temps = [float(k) if "," not in k else k
             for k in sorted(keys, key=lambda k: (float(k.split(",")[0]), k))]
    if "protocol" in merged:
        merged["protocol"]["temperatures"] = temps
    return merged


def drafter_row(out: Path, head: dict[str, Any], evals: Optional[list[Path]] = None) -> dict[str, Any]:
    ev = merge_evals(evals) if evals else \
        _load(out / "eval" / "results.json") or _load(out / "eval" / "main" / "results.json") or {}
    train = _train_summary(out) or {}
    protocol = dict(ev.get("protocol") or {})
    if "turns" in protocol:  # the name for it
        protocol["mtbench_turns"] = protocol["turns"]
    res: dict[str, Any] = {**head, "target": "SmolLM2-135M-Instruct", "protocol": protocol or None,
                           "complete": ev.get("complete"), "train_tokens": train.get("tokens_seen"),
                           "train_steps": train.get("steps"), "train_seconds": train.get("train_seconds"),
                           "sim_tau_heldout": train.get("eval_accept_len")}
    for t in ("0", "1"):
        for ds in ("humaneval", "mtbench"):
            r = ev.get("results", {}).get(t, {}).get(ds, {})
            s = ev.get("speedup", {}).get(t, {}).get(ds, {})
            res[f"{ds}_t{t}_answers"] = r.get("answers", s.get("answers"))
            res[f"{ds}_t{t}_tau"] = r.get("mean_acceptance_length", s.get("mean_acceptance_length"))
            res[f"{ds}_t{t}_tau_first256"] = r.get("mean_acceptance_length_first256")
            res[f"{ds}_t{t}_loop_share"] = r.get("loop_share")
            res[f"{ds}_t{t}_speedup"] = s.get("speedup")
            res[f"{ds}_t{t}_speedup_no_loop"] = s.get("speedup_no_loop")
            spread = s.get("per_prompt_speedup") or {}
            res[f"{ds}_t{t}_speedup_per_prompt"] = ({k: spread.get(k) for k in ("prompts", "min", "median", "max")}
                                                   if spread else None)
            res[f"{ds}_t{t}_plain_ms_per_token"] = s.get("ar", {}).get("time_per_token_ms")
            res[f"{ds}_t{t}_spec_ms_per_token"] = s.get("spec", {}).get("time_per_token_ms")
    speedups = [res[f"{ds}_t0_speedup"] for ds in ("humaneval", "mtbench") if res[f"{ds}_t0_speedup"] is not None]
    res["speedup_t0"] = min(speedups) if speedups else None
    if ev.get("sources"):
        res["eval_sources"] = ev["sources"]
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--device", required=True, help="the GPU the run used, e.g. 'NVIDIA H200'")
    p.add_argument("--command", default=None, help="the command that ran the measured run (default: this one)")
    p.add_argument("--commit", default=None,
                   help="the commit(s) the measured run used, when it is not this checkout's (e.g. '005dcf4 (training), "
                        "93de145 (evaluation)')")
    p.add_argument("--data", type=Path, default=None, help="the regenerated .jsonl (or .jsonl.gz); default OUT/data")
    p.add_argument("--throughput", type=Path, nargs="*", default=[], help="regen_throughput.py --json files")
    p.add_argument("--regen-json", type=Path, default=None)
    p.add_argument("--drafter-json", type=Path, default=None)
    p.add_argument("--eval", type=Path, nargs="*", default=[],
                   help="evaluate results.json files to merge (default: OUT/eval/results.json), e.g. "
                        "eval_speed.py's OUT/replay_t0, sequential_t0 and batched_t1 results")
    args = p.parse_args()
    data = args.data or (args.out / "data" / "regen.jsonl")
    throughput = args.throughput or [x for x in [args.out / "regen_throughput.json"] if x.is_file()]
    for path in (args.regen_json, args.drafter_json):
        if path is not None:
            read_rows(path)  # refuse a file that is not a list of rows before writing either
    head = provenance(args.device, args.command)
    if args.commit:
        head["commit"] = args.commit
    regen = regen_rows(args.out, data if data.is_file() else None, throughput, head)
    drafter = [drafter_row(args.out, head, args.eval)]
    for path, rows in ((args.regen_json, regen), (args.drafter_json, drafter)):
        if path is None:
            print(json.dumps(rows, indent=1))
        else:
            append_rows(path, rows)


if __name__ == "__main__":
    main()
