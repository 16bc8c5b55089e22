"""Drafter runs: a SmolLM2 run's summary rows, the T > 0 levers, the T > 0 acceptance ceiling, the FSDP2
scaling run of a large-target recipe, and tau against training tokens over the drafter runs.

    python benchmarks/drafter.py summaries OUT_DIR --device "NVIDIA H200" [--regen-json ...] [--drafter-json ...]
    python benchmarks/drafter.py levers {regen,train,eval,speed,chain,report} OUT [flags]
    python benchmarks/drafter.py ceiling --target pkg:smollm2 --answers EVAL_DIR/answers.jsonl --dataset humaneval
    python benchmarks/drafter.py scaling --nproc 2 --steps 200 --tokenizer TOKENIZER_DIR --out OUT_DIR
    python benchmarks/drafter.py curve docs/bench/smollm2_drafter_*_run --png docs/bench/smollm2_scaling.png
    python benchmarks/drafter.py accept --target pkg:smollm2 --draft EXPORT --dataset humaneval --temperature 1
    python benchmarks/drafter.py dedupe docs/bench/drafter_summary.json

Every training here is the trainer's own (`nemo_dflash.recipes.train` or the pipeline), timed or read from
the files it wrote. Each subcommand has its own flags (`drafter.py SUBCOMMAND --help`).
"""

from __future__ import annotations

import argparse
import ast
import copy
import gzip
import hashlib
import json
import logging
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _common, beside this file

import torch  # noqa: E402
import yaml  # noqa: E402

from _common import append_rows, fold_rows, provenance, read_rows, upsert_rows, write_qwen3_8b_config  # noqa: E402
from nemo_dflash.evaluation.protocol import encode_chat, load_prompt_set  # noqa: E402
from nemo_dflash.evaluation.ceiling import (  # noqa: E402
    CEILINGS, DRAFT_FIGURES, PER_SLOT, anchor_figures, decoder_acceptance, draft_block_logits,
)
from nemo_dflash.engine.spec_decode import crop_dynamic_cache  # noqa: E402
from nemo_dflash.recipes._cli import resolve_device_dtype  # noqa: E402
from nemo_dflash.engine.sampling import SamplingParams  # noqa: E402
from nemo_dflash.target import HFDFlashTargetModel  # noqa: E402
from nemo_dflash.target.loading import load_target  # noqa: E402
from nemo_dflash.train.metrics import epoch_gaps as heldout_gaps, read_metrics  # noqa: E402


# ====================================================================================================
# summaries  (was smollm2_summaries.py)

DOC_SUMMARIES = """The rows of a SmolLM2 drafter run directory, read from its files.

OUT_DIR is a pipeline run directory (`recipes.pipeline ... run.dir=OUT_DIR`, docs/train.md): data/regen.jsonl and
data/regen_summary.json, run/summary.json (training), eval/results.json. Run directories of the older drafter script
(logs/regenerate.log, runs/main/, eval/main/) are read too.

    python benchmarks/drafter.py summaries OUT_DIR --device "NVIDIA H200" [--command "..."] [--commit C] \
        [--eval RESULTS.json ...] [--data OUT_DIR/data/regen.jsonl[.gz]] [--throughput regen_throughput.json ...] \
        [--regen-json docs/bench/regen_summary.json] [--drafter-json docs/bench/drafter_summary.json]

Each JSON is a list of rows {"date", "commit", "device", "command", ...figures} (benchmarks/_common.py);
this script appends to it, so its last row is the current figure. The drafter rows are keyed by the draft's
weights hash and the protocol (`drafter_key`): a second summary of a draft already there (e.g. one more evaluate
run merged in) updates that row instead of adding a duplicate. Regeneration rows: the regenerated
set (counted in the data file), the loop/cap counts and the throughput of the regeneration (from its
log), then one row per row of any `regen.py throughput --json` file given. Drafter row: training
tokens and held-out simulated tau (the run's summary), tau per dataset and temperature, first-256 tau,
loop share and speedup (evaluate's results.json), with evaluate's protocol. Nothing is typed in: a
value the run did not produce is null. Without a JSON path the rows are printed.
"""


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
            rows.append({**head, "what": f"regen.py throughput {row.get('mode')}", **row, "file": str(path)})
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


def _metrics(out: Path) -> Optional[list[dict[str, Any]]]:
    """The training run's RUN/run/metrics.jsonl rows (a torn last line dropped, as a resume drops it)."""
    path = out / "run" / "metrics.jsonl"
    return read_metrics(path)[0] if path.is_file() else None


def epoch_gaps(out: Path, tail: float = 0.1) -> Optional[dict[str, Any]]:
    """`train.metrics.epoch_gaps` of the run in `out` (RUN/run/metrics.jsonl and its summary)."""
    rows = _metrics(out)
    return None if rows is None else heldout_gaps(rows, _train_summary(out) or {}, tail)


def _loss_and_data(out: Path) -> dict[str, Any]:
    """The loss and the data temperature the run trained with, from its resolved recipe and regeneration summary."""
    recipe = out / "recipe.yaml"
    loss: dict[str, Any] = {}
    if recipe.is_file():
        loss = (yaml.safe_load(recipe.read_text()) or {}).get("loss") or {}
    regen = _load(out / "data" / "regen_summary.json") or {}
    samp = regen.get("sampling") or {}
    distill, accept = loss.get("distill_weight"), loss.get("accept_weight")
    name = None if not loss else ("accept %g (%s, T=%g)" % (accept, loss.get("accept_form"), loss.get("accept_temperature"))
                                  if accept else "distill %g" % distill if distill else "hard CE")
    temp = samp.get("temperature")
    return {"loss": name, "distill_weight": distill, "accept_weight": accept,
            "data_temperature": None if temp is None else
            ("%g (top-p %g)" % (temp, samp["top_p"]) if samp.get("top_p", 1.0) < 1.0 else "%g" % temp),
            "samples_per_prompt": regen.get("samples_per_prompt")}


def draft_hashes(export: Path, recorded: set[Optional[str]]) -> dict[str, Any]:
    """The export's weights hash (the one evaluate records: names and bytes of the weights) where its weights are
    here, else the one every evaluation file recorded (when they agree); whether `recorded` (the evaluation files'
    hashes) all name it; and the weights file's own sha256 (or the one written beside it)."""
    computed = None
    if (export / "model.safetensors").exists():
        from nemo_dflash.draft.build import draft_weights_sha256

        computed = draft_weights_sha256(export)
    return {"draft_sha256": computed or (next(iter(recorded)) if len(recorded) == 1 else None),
            "eval_draft_sha256_match": (recorded == {computed}) if computed else len(recorded) == 1,
            "model_safetensors_sha256": _sha256(export / "model.safetensors")}


def drafter_row(out: Path, head: dict[str, Any], evals: Optional[list[Path]] = None) -> dict[str, Any]:
    ev = merge_evals(evals) if evals else \
        _load(out / "eval" / "results.json") or _load(out / "eval" / "main" / "results.json") or {}
    train = _train_summary(out) or {}
    protocol = dict(ev.get("protocol") or {})
    if "turns" in protocol:  # the issue's name for it
        protocol["mtbench_turns"] = protocol["turns"]
    res: dict[str, Any] = {**head, "target": "SmolLM2-135M-Instruct", "protocol": protocol or None,
                           "complete": ev.get("complete"), "train_tokens": train.get("tokens_seen"),
                           "train_steps": train.get("steps"), "train_seconds": train.get("train_seconds"),
                           "sim_tau_heldout": train.get("eval_accept_len"),
                           "sampled_tau_heldout": train.get("eval_sampled_accept_len"),
                           "heldout_gap_per_epoch": epoch_gaps(out)}
    measured = {ds for key in ("results", "speedup") for by_t in ev.get(key, {}).values() for ds in by_t}
    for t in ("0", "1"):  # the math sets' keys only where they were evaluated (evaluate --datasets math500,aime)
        for ds in ("humaneval", "mtbench", *(m for m in ("math500", "aime") if m in measured)):
            r = ev.get("results", {}).get(t, {}).get(ds, {})
            s = ev.get("speedup", {}).get(t, {}).get(ds, {})
            res[f"{ds}_t{t}_answers"] = r.get("answers", s.get("answers"))
            res[f"{ds}_t{t}_tau"] = r.get("mean_acceptance_length", s.get("mean_acceptance_length"))
            res[f"{ds}_t{t}_tau_first256"] = r.get("mean_acceptance_length_first256")
            res[f"{ds}_t{t}_tau_no_loop"] = r.get("mean_acceptance_length_no_loop")
            res[f"{ds}_t{t}_answers_no_loop"] = r.get("answers_no_loop")
            res[f"{ds}_t{t}_loop_share"] = r.get("loop_share")
            res[f"{ds}_t{t}_speedup"] = s.get("speedup")
            res[f"{ds}_t{t}_speedup_no_loop"] = s.get("speedup_no_loop")
            spread = s.get("per_prompt_speedup") or {}
            res[f"{ds}_t{t}_speedup_per_prompt"] = ({k: spread.get(k) for k in ("prompts", "min", "median", "max")}
                                                   if spread else None)
            res[f"{ds}_t{t}_plain_ms_per_token"] = s.get("ar", {}).get("time_per_token_ms")
            res[f"{ds}_t{t}_spec_ms_per_token"] = s.get("spec", {}).get("time_per_token_ms")
    # the target's recommended sampling: evaluate's key of it ("0.2,p0.9"), timed on the speedup prompts
    rkey = next((k for k in ev.get("speedup", {}) if k not in ("0", "1")), None)
    res["recommended_sampling"] = rkey
    for ds in ("humaneval", "mtbench"):
        s = ev.get("speedup", {}).get(rkey, {}).get(ds, {}) if rkey else {}
        for key, src in (("speedup", "speedup"), ("speedup_no_loop", "speedup_no_loop"),
                         ("tau", "mean_acceptance_length"), ("speedup_prompts", "num_prompts")):
            res[f"{ds}_recommended_{key}"] = s.get(src)
    speedups = [res[f"{ds}_t0_speedup"] for ds in ("humaneval", "mtbench") if res[f"{ds}_t0_speedup"] is not None]
    res["speedup_t0"] = min(speedups) if speedups else None
    res.update(_loss_and_data(out))
    files = [Path(x) for x in evals] if evals else [out / "eval" / "results.json"]
    res.update(draft_hashes(out / "export", {ev.get("draft_sha256") for ev in map(_load, files) if ev}))
    if ev.get("sources"):
        res["eval_sources"] = ev["sources"]
    return res


def train_throughput_row(out: Path, head: dict[str, Any], after_step: int = 200) -> Optional[dict[str, Any]]:
    """The training step's speed in the run itself, from RUN/run/metrics.jsonl: the median of the logged windows
    after `after_step` (windows holding an evaluation or a checkpoint are slower; the median leaves them out),
    per GPU as every row of train_throughput.json. The world size is the run's summary's, or, for runs whose
    summary predates that key, the token slots of a step over one rank's (micro-batch x packed row)."""
    summary = _train_summary(out) or {}
    rows = _metrics(out)
    config = out / "run" / "config.yaml"
    if rows is None or not config.is_file() or not summary.get("steps"):
        return None
    cfg = yaml.safe_load(config.read_text())
    mbs, pack = cfg["train"]["micro_batch_size"], cfg["data"].get("pack_length")
    windows = [r for r in rows if "tok_s" in r and r["step"] > after_step]
    if not windows or not pack:
        return None
    world = summary.get("world")
    if world is None:  # tokens over token slots is the packing efficiency (< 1): round to the rank count
        world = round(summary["tokens_seen"] / summary["steps"] / (mbs * pack * cfg["train"].get("grad_accum", 1)))

    def median(key: str) -> Optional[float]:
        vals = sorted(r[key] for r in windows if r.get(key) is not None)
        return vals[len(vals) // 2] if vals else None

    total, step_s = median("tok_s"), median("step_s")
    return {**head, "shape": "smollm2_135m",
            "case": (f"the recipe's training run: {world} GPU(s) x mbs {mbs} x {pack} packed, "
                     f"{cfg['loss']['num_anchors']} anchors, distill {cfg['loss'].get('distill_weight', 0)}, "
                     f"loss.impl {cfg['loss'].get('impl')}, {summary.get('data', {}).get('train_samples')} "
                     f"conversations; median of the {len(windows)} logged windows after step {after_step}"),
            "world": world, "data": "real", "packed": True, "compiled": bool(cfg["train"].get("compile")),
            "mbs": mbs, "anchors": cfg["loss"]["num_anchors"],
            "tokens_per_s": round(total / world, 1) if total else None, "tokens_per_s_note": "per GPU",
            "mfu": median("mfu"), "step_ms": round(step_s * 1e3, 2) if step_s else None,
            "peak_gb": median("peak_mem_gb"), "steps": summary["steps"], "file": str(out / "run" / "metrics.jsonl")}


def main_summaries(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="drafter.py summaries", description=DOC_SUMMARIES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--device", required=True, help="the GPU the run used, e.g. 'NVIDIA H200'")
    p.add_argument("--command", default=None, help="the command that ran the measured run (default: this one)")
    p.add_argument("--commit", default=None,
                   help="the commit(s) the measured run used, when it is not this checkout's (e.g. '005dcf4 (training), "
                        "93de145 (evaluation)')")
    p.add_argument("--data", type=Path, default=None, help="the regenerated .jsonl (or .jsonl.gz); default OUT/data")
    p.add_argument("--throughput", type=Path, nargs="*", default=[], help="regen.py throughput --json files")
    p.add_argument("--regen-json", type=Path, default=None)
    p.add_argument("--drafter-json", type=Path, default=None)
    p.add_argument("--train-json", type=Path, default=None,
                   help="append the run's training-throughput row (from RUN/run/metrics.jsonl) here, e.g. "
                        "docs/bench/train_throughput.json")
    p.add_argument("--no-drafter-row", action="store_true",
                   help="write the regeneration and training rows only (the drafter row waits for an evaluation)")
    p.add_argument("--eval", type=Path, nargs="*", default=[],
                   help="evaluate results.json files to merge (default: OUT/eval/results.json), e.g. "
                        "eval_speed.py's OUT/replay_t0, sequential_t0 and batched_t1 results")
    args = p.parse_args(argv)
    data = args.data or (args.out / "data" / "regen.jsonl")
    throughput = args.throughput or [x for x in [args.out / "regen_throughput.json"] if x.is_file()]
    for path in (args.regen_json, args.drafter_json, args.train_json):
        if path is not None:
            read_rows(path)  # refuse a file that is not a list of rows before writing any
    head = provenance(args.device, args.command)
    if args.commit:
        head["commit"] = args.commit
    has_regen = (args.out / "data" / "regen_summary.json").is_file() or (args.out / "logs" / "regenerate.log").is_file()
    regen = regen_rows(args.out, data if data.is_file() else None, throughput, head) if has_regen else []
    if args.regen_json is not None and not has_regen:
        raise SystemExit(f"error: --regen-json: no regeneration files under {args.out} (data/regen_summary.json or "
                         "logs/regenerate.log): give the pipeline's run directory")
    drafter = [] if args.no_drafter_row else [drafter_row(args.out, head, args.eval)]
    trained = train_throughput_row(args.out, head)
    if args.train_json is not None and trained is None:
        raise SystemExit(f"error: --train-json: no training metrics under {args.out}/run (metrics.jsonl, config.yaml, "
                         "summary.json): give the pipeline's run directory")
    for path, rows in ((args.regen_json, regen), (args.drafter_json, drafter),
                       (args.train_json, [trained] if trained else [])):
        if not rows:
            continue
        if path is None:
            print(json.dumps(rows, indent=1))
        elif path == args.drafter_json:
            upsert_rows(path, rows, drafter_key)
        else:
            append_rows(path, rows)


def drafter_key(row: dict[str, Any]) -> Optional[tuple[Any, ...]]:
    """What makes two drafter rows one measurement: the same weights (their hash) at the same protocol (name, answer
    cap, block, prompts; its temperatures may grow). A row without a weights hash is never merged."""
    if not row.get("draft_sha256"):
        return None
    protocol = row.get("protocol") or {}
    return (row["draft_sha256"], row.get("draft"), *(protocol.get(k) for k in ("name", "max_new_tokens", "block_size",
                                                                              "num_prompts")))


DOC_DEDUPE = """Rewrite a drafter_summary.json with one row per draft and protocol (`drafter_key`), the way
`summaries` writes it: a later row of a key merges into the earlier one (its values win, its nulls keep the earlier
values, `merged_rows` keeps the earlier provenance).

    python benchmarks/drafter.py dedupe docs/bench/drafter_summary.json
"""


def main_dedupe(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="drafter.py dedupe", description=DOC_DEDUPE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = read_rows(args.path)
    kept = fold_rows(rows, drafter_key)
    if len(kept) != len(rows):
        upsert_rows(args.path, [], drafter_key)
    logging.getLogger("dedupe").info("%s: %d rows -> %d", args.path, len(rows), len(kept))


# ====================================================================================================
# levers  (was sampling_levers.py)

DOC_LEVERS = r"""The T > 0 levers side by side: drafts trained at equal tokens on the same prompts, one GPU each, then
measured at T=0, at the target's recommended sampling and at T=1.

    python benchmarks/drafter.py levers regen  OUT --target pkg:smollm2 --data sharegpt --data code=P/code.jsonl
    python benchmarks/drafter.py levers train  OUT [--levers a,b,c,d] [--tokens 30e6] [--max-minutes M]
    python benchmarks/drafter.py levers eval   OUT [--levers ...]          # export + acceptance (no timing)
    python benchmarks/drafter.py levers speed  OUT [--levers ...] [--speedup-prompts 20] [--speed-max-new-tokens 512]
    python benchmarks/drafter.py levers chain  OUT --levers a,b,c,d --gpu-list 0,1,2,3 [the phases' flags]
    python benchmarks/drafter.py levers report OUT [--json docs/bench/drafter_summary.json] [--device NAME]

Levers (`LEVERS`): the data's sampling temperature, `loss.distill_weight` and `loss.accept_weight`:
  a: hard CE on answers sampled at T=0.2 / top-p 0.9 (today's recipe)   b: a + distillation (weight 1)
  b05: a + distillation (weight 0.5)   c: hard CE on answers sampled at T=1 (two answers a prompt)   d: c + b
  e: a with distillation 0.5 and the acceptance term 0.5 (`loss.accept_weight`: -log sum_x min(p_T=1, q))
  f: distillation (weight 1) on both answer sets at once (T=0.2 and T=1: three answers a prompt)
  v2i / v2s: b as a DFlash2 draft (`draft.kind=dflash2`), a true token outside the top-K injected / skipped
  v2i_dpace / v2s_dpace: the same with D-PACE position weights (`loss.position_weights=dpace`)
and, at decode time, for every draft: T=1 with the draft proposing its argmax (`--draft-proposals greedy`).

`regen` answers the prompts twice, at T=0.2 / top-p 0.9 and at T=1 (two samples a prompt), on half the GPUs
each (torchrun), with the same seed and the same time cap. `train` trains every lever on its own GPU from the
same recipe with the same step count (`--tokens` / 32,768-token steps), resuming each where it stopped (run the
same command again after `--max-minutes`). `eval` exports each draft and runs, side by side on its GPU, replay
(T=0), batched T=1 and batched T=1 with argmax proposals, at the paper's lengths (2048 new tokens, MT-Bench both
turns, HumanEval). `speed` times batch-1 speedup with CUDA graphs at T=0, the recommended settings and T=1, alone
on each GPU (tau at the recommended settings is read from those timed answers). `report` prints the table and appends one row per
lever to the drafter summary, every figure read from the files those phases wrote.
`chain` runs each lever's train, eval and speed phases one after another on its own GPU, the levers side by side,
so a GPU moves on as soon as its lever's phase ends. Every phase skips what is complete, so a phase can be re-run
(or continued on a fresh machine).
"""


LEVERS: dict[str, dict[str, Any]] = {
    "a": {"data": "t02", "distill": 0.0, "loss": "hard CE"},
    "b": {"data": "t02", "distill": 1.0, "loss": "distill 1.0"},
    "b05": {"data": "t02", "distill": 0.5, "loss": "distill 0.5"},
    "c": {"data": "t1", "distill": 0.0, "loss": "hard CE"},
    "d": {"data": "t1", "distill": 1.0, "loss": "distill 1.0"},
    # the LK loss (Samarin et al., arXiv 2602.23881): -log of the accept probability at T=1, mixed with distillation
    "e": {"data": "t02", "distill": 0.5, "accept": 0.5, "loss": "distill 0.5 + accept (-log a, T=1) 0.5"},
    # both answer sets at once: the T=0.2 answers for greedy decoding, the T=1 ones for the contexts of sampling
    "f": {"data": "t02+t1", "distill": 1.0, "loss": "distill 1.0"},
    # DFlash2 against DFlash-1 (b, the GPU recipes' default) at equal tokens: the selector's two conventions for a
    # true token outside the top-K, then D-PACE position weights instead of the fixed decay
    "v2i": {"data": "t02", "distill": 1.0, "loss": "distill 1.0 + selector (inject)", "variant": "dflash2",
            "overrides": ["draft.kind=dflash2", "loss.selector_outside=inject"]},
    "v2s": {"data": "t02", "distill": 1.0, "loss": "distill 1.0 + selector (skip)", "variant": "dflash2",
            "overrides": ["draft.kind=dflash2", "loss.selector_outside=skip"]},
    "v2i_dpace": {"data": "t02", "distill": 1.0, "loss": "distill 1.0 + selector (inject), D-PACE",
                  "variant": "dflash2", "overrides": ["draft.kind=dflash2", "loss.selector_outside=inject",
                                                      "loss.position_weights=dpace"]},
    "v2s_dpace": {"data": "t02", "distill": 1.0, "loss": "distill 1.0 + selector (skip), D-PACE",
                  "variant": "dflash2", "overrides": ["draft.kind=dflash2", "loss.selector_outside=skip",
                                                      "loss.position_weights=dpace"]},
}
DATA = {  # name -> (regenerate sampling flags, samples per prompt, data temperature label)
    "t02": (["--temperature", "0.2", "--top-p", "0.9"], 1, "0.2 (top-p 0.9)"),
    "t1": (["--temperature", "1", "--top-p", "1"], 2, "1"),
}
STEP_TOKENS = 4 * 8192  # the GPU recipe's packed step on one GPU: 4 rows of 8192 tokens
# evaluate runs per draft: (directory, arguments); acceptance side by side on one GPU, speed alone
ACCEPTANCE = {
    "t0": ["--method", "replay", "--temperatures", "0"],
    "t1": ["--method", "batched", "--temperatures", "1"],
    "t1_greedy_draft": ["--method", "batched", "--temperatures", "1", "--draft-proposals", "greedy"],
}


def run_all(jobs: list[tuple[str, list[str], dict[str, str]]], logs: Path, per_gpu: Optional[int] = None
            ) -> dict[str, int]:
    """Run every (name, argv, extra env), at most `per_gpu` (default `PER_GPU`) at a time on each GPU (`CUDA_VISIBLE_DEVICES` of its
    env; jobs without one all at once), in order; exit codes by name, logs under `logs`. Two DFlash2 trainings of
    the GPU recipe do not fit one H200 together: on one GPU the levers queue rather than run out of memory."""
    logs.mkdir(parents=True, exist_ok=True)
    pending = list(jobs)
    running: dict[str, tuple[subprocess.Popen, Any, Optional[str]]] = {}
    codes: dict[str, int] = {}

    def busy(gpu: Optional[str]) -> bool:
        return gpu is not None and sum(g == gpu for _, _, g in running.values()) >= max(per_gpu or PER_GPU, 1)

    while pending or running:
        for job in list(pending):
            name, argv, env = job
            gpu = env.get("CUDA_VISIBLE_DEVICES")
            if busy(gpu):
                continue
            pending.remove(job)
            log = open(logs / f"{name}.log", "a")
            running[name] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}),
                             log, gpu)
            print(f"[{time.strftime('%H:%M:%S')}] started {name}: {' '.join(argv)}", flush=True)
        for name, (proc, log, _) in list(running.items()):
            if proc.poll() is None:
                continue
            codes[name] = proc.returncode
            log.close()
            del running[name]
            print(f"[{time.strftime('%H:%M:%S')}] {name} exited {codes[name]}", flush=True)
            if codes[name]:
                print("".join((logs / f"{name}.log").read_text().splitlines(True)[-15:]), flush=True)
        if running:
            time.sleep(0.5)
    return codes


PER_GPU = 1  # --per-gpu: jobs at once on one GPU (speed's timing jobs always run alone)


CPU_ONLY = False  # --cpu: no GPU pinning (a dry run of every phase on a tiny target)


GPU_LIST: list[str] = []  # --gpu-list: the GPU of the i-th lever (default: GPU i)


def gpu_env(i: int) -> dict[str, str]:
    if CPU_ONLY:
        return {}
    return {"CUDA_VISIBLE_DEVICES": GPU_LIST[i % len(GPU_LIST)] if GPU_LIST else str(i)}


def python() -> list[str]:
    return [sys.executable]


def regen(args: argparse.Namespace) -> None:
    out = Path(args.out)
    n = max(args.gpus // 2, 1)
    jobs = []
    for k, (name, (flags, spp, _)) in enumerate(DATA.items()):
        path = out / "data" / f"{name}.jsonl"
        if path.exists():
            continue
        launcher = (python() + ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                                "--master-port", str(29500 + k)] if n > 1 else python())
        gpus = ",".join(str(k * n + i) for i in range(n))
        argv = launcher + ["-m", "nemo_dflash.recipes.regenerate", "--target", args.target,
                           *[x for d in args.data for x in ("--data", d)], "--out", str(path), "--turns", "all",
                           "--max-new-tokens", str(args.max_new_tokens), "--max-prompt-tokens", "1536",
                           "--sampling", "given", *flags, "--samples-per-prompt", str(spp), "--loops", "cut",
                           "--batch-size", args.batch_size, "--seed", "0", "--summary-json",
                           str(out / "data" / f"{name}.summary.json"), *args.extra]
        if args.max_minutes:
            argv += ["--max-minutes", str(args.max_minutes)]
        if args.dtype:
            argv += ["--dtype", args.dtype]
        jobs.append((f"regen_{name}", argv, {} if CPU_ONLY else {"CUDA_VISIBLE_DEVICES": gpus}))
    (out / "data").mkdir(parents=True, exist_ok=True)
    codes = run_all(jobs, out / "logs")
    if any(codes.values()):
        sys.exit(1)


def levers_of(args: argparse.Namespace) -> list[str]:
    names = [x.strip() for x in (args.levers or "a,b,c,d").split(",") if x.strip()]
    unknown = [x for x in names if x not in LEVERS]
    if unknown:
        sys.exit(f"unknown lever(s) {unknown}: choose from {', '.join(LEVERS)}")
    return names


def train(args: argparse.Namespace) -> None:
    out = Path(args.out)
    steps = max(1, round(float(args.tokens) / args.step_tokens))
    jobs = []
    for i, name in enumerate(levers_of(args)):
        lever = LEVERS[name]
        run = out / "runs" / name
        if finished(run):
            continue
        argv = python() + ["-m", "nemo_dflash.recipes.train", "--config", args.recipe, f"target.path={args.target}",
                           "data.sources=[" + ", ".join(f"{{path: {out / 'data' / (d + '.jsonl')}}}"
                                                        for d in lever["data"].split("+")) + "]",
                           f"output_dir={run}", f"train.max_steps={steps}", f"loss.distill_weight={lever['distill']}",
                           f"loss.accept_weight={lever.get('accept', 0.0)}",
                           f"train.eval_every={args.eval_every}", "wandb.mode=disabled",
                           *lever.get("overrides", []), *args.overrides]
        if args.max_minutes:
            argv.append(f"train.max_minutes={args.max_minutes}")
        jobs.append((f"train_{name}", argv, gpu_env(i)))
    codes = run_all(jobs, out / "logs")
    if any(codes.values()):
        sys.exit(1)


def finished(run: Path) -> bool:
    """The run reached its step count (a run stopped by train.max_minutes also writes final/, and resumes)."""
    summary = _read(run / "summary.json")
    return bool(summary) and not summary.get("stopped_early") and summary["steps"] >= summary["total_steps"]


def export_dir(out: Path, name: str) -> Path:
    return out / "export" / name


def evaluate_argv(args: argparse.Namespace, draft: Path, dest: Path, extra: list[str], own_last: bool = False) -> list[str]:
    """An evaluate command: the phase's flags, then --eval-extra (the later flag wins), or with `own_last` the
    other way round, so the timing phase keeps its own prompt count and time cap."""
    flags = [*args.eval_extra, *extra] if own_last else [*extra, *args.eval_extra]
    return python() + ["-m", "nemo_dflash.recipes.evaluate", "--draft", str(draft), "--target", args.target,
                       "--out", str(dest), "--protocol", args.protocol, *flags]


def evaluate(args: argparse.Namespace) -> None:
    out = Path(args.out)
    names = levers_of(args)
    exports = []
    for i, name in enumerate(names):
        exp = export_dir(out, name)
        if not finished(out / "runs" / name):
            print(f"lever {name}: its training has not reached its step count: run `train` again first")
        if not (exp / "config.json").exists():
            exports.append((f"export_{name}", python() + ["-m", "nemo_dflash.recipes.export", "--checkpoint",
                                                          str(out / "runs" / name), "--out", str(exp), "--target",
                                                          args.target], gpu_env(i)))
    run_all(exports, out / "logs")
    jobs = []
    tags = [t.strip() for t in args.acceptance.split(",") if t.strip()]
    unknown = [t for t in tags if t not in ACCEPTANCE]
    if unknown:
        sys.exit(f"unknown --acceptance run(s) {unknown}: choose from {', '.join(ACCEPTANCE)}")
    for i, name in enumerate(names):
        for tag in tags:
            extra = ACCEPTANCE[tag]
            dest = out / "eval" / name / tag
            if (dest / "results.json").exists() and json.loads((dest / "results.json").read_text()).get("complete"):
                continue
            argv = evaluate_argv(args, export_dir(out, name), dest, extra + ["--no-speedup"])
            if argv:
                jobs.append((f"eval_{name}_{tag}", argv, gpu_env(i)))
    run_all(jobs, out / "logs")


def speed(args: argparse.Namespace) -> None:
    """Batch-1 speedup, graphs on both sides, alone on each GPU; the acceptance phase after the timing is cut
    off by --max-minutes (its figures come from `eval`)."""
    out = Path(args.out)
    jobs = []
    for i, name in enumerate(levers_of(args)):
        dest = out / "eval" / name / "speed"
        argv = evaluate_argv(args, export_dir(out, name), dest, [
            "--temperatures", args.speed_temperatures, "--sampling", "target", "--method", "batched",
            "--decode", "graphs", "--num-prompts", str(args.speedup_prompts), "--speedup-prompts",
            str(args.speedup_prompts), "--speedup-only", "--max-minutes", str(args.max_minutes or 8)]
            + (["--max-new-tokens", str(args.speed_max_new_tokens)] if args.speed_max_new_tokens else []), own_last=True)
        jobs.append((f"speed_{name}", argv, gpu_env(i)))
    run_all(jobs, out / "logs", per_gpu=1)  # timed alone: another job on its GPU would slow both sides


def chain(args: argparse.Namespace) -> None:
    """Each lever's train -> export + acceptance -> speed on its own GPU, the levers side by side: a GPU
    moves on as soon as its lever's phase ends (the phases' flags as given; --max-minutes caps each phase)."""
    names = levers_of(args)
    gpus = GPU_LIST or [str(i) for i in range(len(names))]
    jobs = []
    for i, name in enumerate(names):
        argv = [sys.executable, os.path.abspath(__file__), "levers", "_chain_one", *args.argv_rest, "--levers", name,
                "--gpu-list", gpus[i % len(gpus)]]
        jobs.append((f"chain_{name}", argv, {}))
    codes = run_all(jobs, Path(args.out) / "logs")
    if any(codes.values()):
        sys.exit(1)


def _chain_one(args: argparse.Namespace) -> None:
    train(args)
    evaluate(args)
    speed(args)


# ----------------------------------------------------------------------------- report


def _read(path: Path) -> Optional[dict[str, Any]]:
    return json.loads(path.read_text()) if path.exists() else None


def _sets(res: Optional[dict[str, Any]], tkey: Optional[str] = None) -> dict[str, dict[str, Any]]:
    """{dataset: figures} of one sampling key of an evaluate results.json (the only key when tkey is None)."""
    if not res or not res.get("results"):
        return {}
    block = res["results"]
    key = tkey if tkey is not None else next(iter(block))
    return block.get(key, {})


def _speed(res: Optional[dict[str, Any]], tkey: str, dataset: str) -> Optional[dict[str, Any]]:
    return ((res or {}).get("speedup") or {}).get(tkey, {}).get(dataset)


def _sha256(path: Path) -> Optional[str]:
    """The file's sha256, or the one written beside it (`NAME.sha256`) when the file stayed on its machine."""
    if not path.exists():
        side = path.with_name(path.name + ".sha256")
        return side.read_text().split()[0] if side.exists() else None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def lever_row(out: Path, name: str, target: str) -> dict[str, Any]:
    """Every figure of one lever, read from its run and evaluation files."""
    lever = LEVERS[name]
    run = out / "runs" / name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (run / "metrics.jsonl").exists() else []
    ev = [r for r in rows if "eval_accept_len" in r]
    last = ev[-1] if ev else {}
    tokens = max((r.get("tokens", 0) for r in rows), default=0)
    summary = _read(run / "summary.json") or {}
    ev_dir = out / "eval" / name
    res = {tag: _read(ev_dir / tag / "results.json") for tag in (*ACCEPTANCE, "speed")}
    row: dict[str, Any] = {
        "draft": f"sampling lever {name}", "variant": lever.get("variant", "dflash"), "loss": lever["loss"],
        "distill_weight": lever["distill"], "accept_weight": lever.get("accept", 0.0),
        "data_temperature": " + ".join(DATA[d][2] for d in lever["data"].split("+")),
        "samples_per_prompt": sum(DATA[d][1] for d in lever["data"].split("+")),
        "train_tokens": tokens, "train_steps": summary.get("steps"), "planned_steps": summary.get("total_steps"),
        "train_seconds": summary.get("train_seconds"), "stopped_early": summary.get("stopped_early"),
        "sim_tau_heldout": last.get("eval_accept_len"),
        "sampled_tau_heldout": last.get("eval_sampled_accept_len"),
        "sampled_tau_heldout_greedy_draft": last.get("eval_sampled_accept_len_greedy_draft"),
        "loss_heldout": last.get("eval_loss"), "target": target,
        # a selector draft's own held-out figures: the unary argmax's simulated tau beside the walk's, top-K recall,
        # and the oracle walk that picks the true token whenever it is a candidate
        **{k: last.get(f"eval_{k}") for k in ("unary_accept_len", "topk_recall", "oracle_accept_len", "selector_loss")
           if f"eval_{k}" in last},
        # the median logged step time (compile and the first steps' warm-up fall outside the median)
        "step_s_median": statistics.median(steps) if (steps := [r["step_s"] for r in rows if "step_s" in r]) else None,
        # every held-out evaluation: levers that stopped at their time cap compare at a step both reached
        "heldout_evals": [{k: r.get(k) for k in ("step", "tokens", "eval_loss", "eval_accept_len",
                                                  "eval_sampled_accept_len")} for r in ev],
    }
    row.update(draft_hashes(export_dir(out, name), {r.get("draft_sha256") for r in res.values() if r}))
    for ds, short in (("humaneval", "humaneval"), ("mtbench", "mtbench")):
        t0 = _sets(res["t0"]).get(ds, {})
        t1 = _sets(res["t1"]).get(ds, {})
        t1g = _sets(res["t1_greedy_draft"]).get(ds, {})
        row[f"{short}_t0_answers"] = t0.get("answers")
        row[f"{short}_t1_answers"] = t1.get("answers")
        row[f"{short}_t0_loop_share"] = t0.get("loop_share")
        row[f"{short}_t0_tau"] = t0.get("mean_acceptance_length")
        row[f"{short}_t0_tau_no_loop"] = t0.get("mean_acceptance_length_no_loop")
        row[f"{short}_t1_tau"] = t1.get("mean_acceptance_length")
        row[f"{short}_t1_tau_no_loop"] = t1.get("mean_acceptance_length_no_loop")
        row[f"{short}_t1_tau_greedy_draft"] = t1g.get("mean_acceptance_length")
        sp = res["speed"]
        for tag, key in (("t0", "0"), ("t1", "1")):
            s = _speed(sp, key, ds)
            row[f"{short}_{tag}_speedup"] = s.get("speedup") if s else None
            row[f"{short}_{tag}_speedup_prompts"] = s.get("num_prompts") if s else None
            row[f"{short}_{tag}_speedup_no_loop"] = s.get("speedup_no_loop") if s else None
            row[f"{short}_{tag}_speedup_per_prompt"] = s.get("per_prompt_speedup") if s else None
        rkey = next((k for k in ((sp or {}).get("speedup") or {}) if k not in ("0", "1")), None)
        s = _speed(sp, rkey, ds) if rkey else None
        row[f"{short}_recommended_speedup"] = s.get("speedup") if s else None
        row[f"{short}_recommended_tau"] = s.get("mean_acceptance_length") if s else None  # the timed prompts
        row[f"{short}_recommended_speedup_prompts"] = s.get("num_prompts") if s else None
    protocols = {tag: r["protocol"] for tag, r in res.items() if r}
    row["protocol"] = {tag: {k: p.get(k) for k in ("max_new_tokens", "turns", "temperatures", "sampling", "method",
                                                    "decode", "block_size", "speedup_prompts", "num_prompts")}
                       for tag, p in protocols.items()}
    return row


def report(args: argparse.Namespace) -> None:
    out = Path(args.out)
    names = levers_of(args) if args.levers else list(LEVERS)  # by default every lever OUT has a run of
    rows = [lever_row(out, name, args.target) for name in names if (out / "runs" / name).exists()]
    cols = [("lever", lambda r: r["draft"].split()[-1]), ("loss", lambda r: r["loss"]),
            ("data T", lambda r: r["data_temperature"]), ("M tok", lambda r: r["train_tokens"] / 1e6),
            ("sim tau", lambda r: r["sim_tau_heldout"]), ("T1 exp", lambda r: r["sampled_tau_heldout"]),
            ("T1 exp argmax", lambda r: r["sampled_tau_heldout_greedy_draft"])]
    for ds in ("humaneval", "mtbench"):
        cols += [(f"{ds[:2]} T0", lambda r, d=ds: r[f"{d}_t0_tau"]),
                 (f"{ds[:2]} T0 noloop", lambda r, d=ds: r[f"{d}_t0_tau_no_loop"]),
                 (f"{ds[:2]} rec", lambda r, d=ds: r[f"{d}_recommended_tau"]),
                 (f"{ds[:2]} T1", lambda r, d=ds: r[f"{d}_t1_tau"]),
                 (f"{ds[:2]} T1 argmax", lambda r, d=ds: r[f"{d}_t1_tau_greedy_draft"]),
                 (f"{ds[:2]} x T0", lambda r, d=ds: r[f"{d}_t0_speedup"]),
                 (f"{ds[:2]} x rec", lambda r, d=ds: r[f"{d}_recommended_speedup"]),
                 (f"{ds[:2]} x T1", lambda r, d=ds: r[f"{d}_t1_speedup"])]

    def cell(v: Any) -> str:
        return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))

    print(" | ".join(c for c, _ in cols))
    for r in rows:
        print(" | ".join(cell(f(r)) for _, f in cols))
    if args.json:
        path = Path(args.json)
        table = json.loads(path.read_text()) if path.exists() else []
        stamp = {"date": args.date or time.strftime("%Y-%m-%d"), "device": args.device, "commit": args.commit,
                 "command": f"python benchmarks/drafter.py levers {{regen,train,eval,speed}} OUT {args.note}".strip()}
        if args.series:  # a later run of the same levers keeps the earlier run's rows
            stamp["series"] = args.series
        names = {(r["draft"], args.series) for r in rows}
        table = [r for r in table if (r.get("draft"), r.get("series")) not in names] + [{**stamp, **r} for r in rows]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1) + "\n")
        os.replace(tmp, path)
        print(f"{len(rows)} rows -> {path}")


def main_levers(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="drafter.py levers", description=DOC_LEVERS, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=("regen", "train", "eval", "speed", "chain", "report", "_chain_one"))
    p.add_argument("out")
    p.add_argument("--target", default="pkg:smollm2")
    p.add_argument("--data", action="append", default=[], help="regenerate --data specs (regen)")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--levers", default=None, help="a comma list (default a,b,c,d; for `report`, every lever with a run)")
    p.add_argument("--tokens", type=float, default=30e6, help="training tokens per lever (train)")
    p.add_argument("--step-tokens", type=int, default=STEP_TOKENS)
    p.add_argument("--recipe", default="smollm2_135m_gpu.yaml")
    p.add_argument("--eval-every", type=int, default=300)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--max-new-tokens", type=int, default=1024, help="regenerated answer cap (regen)")
    p.add_argument("--batch-size", default="auto", help="regenerate --batch-size")
    p.add_argument("--dtype", default=None)
    p.add_argument("--extra", default="", help="more regenerate flags, one string")
    p.add_argument("--overrides", nargs="*", default=[], help="more training overrides (key=value)")
    p.add_argument("--protocol", default="paper")
    p.add_argument("--eval-extra", default="", help="more evaluate flags (every evaluate run; the speed phase's own --num-prompts and "
                   "--max-minutes win over them), one string")
    p.add_argument("--speedup-prompts", type=int, default=20)
    p.add_argument("--speed-temperatures", default="0,1")
    p.add_argument("--speed-max-new-tokens", type=int, default=None,
                   help="answer cap of the timed prompts (default: the protocol's)")
    p.add_argument("--acceptance", default=",".join(ACCEPTANCE), help="acceptance runs of `eval`, comma list")
    p.add_argument("--gpu-list", default="", help="GPU of each lever in order, comma list (default: 0, 1, ...)")
    p.add_argument("--per-gpu", type=int, default=1,
                   help="train / eval jobs at once on one GPU (default 1: two DFlash2 trainings of the GPU recipe do "
                        "not fit one H200; evaluations fit several); `speed` always times one at a time")
    p.add_argument("--json", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--commit", default=None)
    p.add_argument("--note", default="", help="the phases' flags, recorded in the rows' command")
    p.add_argument("--date", default=None, help="the runs' date (default today)")
    p.add_argument("--series", default=None,
                   help="a name for this run of the levers, kept in its rows: rows of another series are not replaced")
    p.add_argument("--cpu", action="store_true", help="pin no GPU (a dry run on a tiny target)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.argv_rest = _without(argv[1:], ("--levers", "--gpu-list"))  # what `chain` passes on to each lever
    args.extra, args.eval_extra = shlex.split(args.extra), shlex.split(args.eval_extra)
    global CPU_ONLY, GPU_LIST, PER_GPU
    CPU_ONLY = args.cpu
    GPU_LIST = [g.strip() for g in args.gpu_list.split(",") if g.strip()]
    PER_GPU = max(1, args.per_gpu)
    {"regen": regen, "train": train, "eval": evaluate, "speed": speed, "report": report, "chain": chain,
     "_chain_one": _chain_one}[args.phase](args)


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` less each of ``flags`` and its value (``--flag v`` or ``--flag=v``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not any(a.startswith(f + "=") for f in flags):
            out.append(a)
    return out


# ====================================================================================================
# ceiling  (was t1_ceiling.py)

DOC_CEILING = """What limits acceptance at T > 0 for a target, computed from the target alone: its entropy along its own
sampled answers, and the acceptance lengths the best possible drafts of each kind would reach; with --draft, what
a real draft reaches in the same simulation at the same anchors.

    python benchmarks/drafter.py ceiling --target pkg:smollm2 --answers EVAL_DIR/answers.jsonl --dataset humaneval \\
        [--num-answers 40] [--anchors 4] [--block 16] [--rollouts 32] [--sims 32] [--temperature 1] \\
        [--draft EXPORT_DIR] [--answers-temperature 0]

Along answers the target sampled at --answers-temperature (default --temperature; an `evaluate` journal, turn 1),
at --anchors evenly spaced answer positions, with the target's own distribution p at --temperature:
- entropy: the mean entropy of p per answer token (nats), and the mean probability of its argmax;
- perfect greedy draft: proposes the target's own greedy continuation from the anchor, each proposal kept with
  probability p(x); expected block length 1 + sum_k prod_{j<=k} p_j(x_j | x_<j);
- perfect marginal draft: the best a DFlash draft can do when it samples each block slot on its own: slot k
  drawn from the target's marginal q_k (p averaged over --rollouts continuations the target samples itself),
  kept with probability min(1, p_k(x_k | x_<k) / q_k(x_k)); mean over --sims drafted blocks of the expected
  block length (the accept probabilities multiplied, not sampled);
- perfect marginal argmax: that draft proposing the argmax of each q_k, kept with probability p of it.
With --draft (an exported draft), the same two simulations with the draft's own block distributions q^d_k (one
draft forward: the anchor at slot 0, mask tokens after, the target's features strictly before the anchor, as
training and replay run it): draft_sampled and draft_argmax; slot1_overlap = sum_x min(p_1, q^d_1) (slot 1's
exact accept probability); per slot k, marginal_overlap = sum_x min(q_k, q^d_k) and the mean clamped ratio of
each simulation (marginal_slot_accept, draft_slot_accept, draft_argmax_slot_accept). The draft's draws use their
own generator: the ceilings are the same with or without --draft.
Prints tables; not a test. Minutes on a CPU for 40 answers.
"""


log = logging.getLogger("t1_ceiling")


def main_ceiling(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="drafter.py ceiling", description=DOC_CEILING, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--answers", required=True, type=Path, help="an evaluate answers.jsonl at --answers-temperature")
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--num-answers", type=int, default=40)
    p.add_argument("--anchors", type=int, default=4, help="anchors per answer, evenly spaced")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--rollouts", type=int, default=32)
    p.add_argument("--sims", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--answers-temperature", type=float, default=None,
                   help="the temperature the answers were sampled at (default: --temperature)")
    p.add_argument("--draft", type=Path, default=None, help="an exported draft: also its figures at the same anchors")
    p.add_argument("--max-answer-tokens", type=int, default=1024)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    s = SamplingParams(args.temperature, args.top_p)
    t_ans = args.temperature if args.answers_temperature is None else args.answers_temperature
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    rows = [json.loads(x) for x in args.answers.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r.get("dataset") == args.dataset and "answers" in r
            and SamplingParams.from_key(str(r.get("temperature"))) == SamplingParams(t_ans)]
    if not rows:
        raise SystemExit(f"error: no {args.dataset} answers at T={t_ans:g} in {args.answers}")
    _, prompts = load_prompt_set(args.dataset)
    by_id = {x.id: x for x in prompts}
    model, tokenizer = load_target(args.target, dtype=dtype, device=device)
    draft = hooks = None
    if args.draft is not None:
        from nemo_dflash.draft.build import load_draft_for_target

        draft = load_draft_for_target(args.draft, model.config, tokenizer, device=device, dtype=dtype)
        hooks = HFDFlashTargetModel(model, draft.target_layer_ids)
    g = torch.Generator(device=device).manual_seed(0)
    g_draft = torch.Generator(device=device).manual_seed(1)
    ent, top, figs, k = [], [], [], args.block - 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        for r in rows[: args.num_answers]:
            turn1 = next(a for a in r["answers"] if a["turn"] == 1)
            prompt = by_id[r["id"]]
            prompt_ids = encode_chat(tokenizer, prompt.history() + [{"role": "user", "content": prompt.turns[0]}])
            out_ids = turn1["output_ids"][: args.max_answer_tokens]
            if len(out_ids) < args.block + 2:
                continue
            seq = torch.tensor([prompt_ids + out_ids], device=device)
            if hooks is not None:
                with hooks.capture(stop_early=False) as captured:
                    out = model(input_ids=seq, use_cache=True)
                feats = hooks.concat(captured)
            else:
                out = model(input_ids=seq, use_cache=True)
            pl = len(prompt_ids)
            probs = s.probs(out.logits[0, pl - 1 : -1])  # p at every answer token
            ent.append(-(probs * probs.clamp(min=1e-30).log()).sum(-1))
            top.append(probs.max(-1).values)
            last = pl + len(out_ids) - k - 1
            anchors = torch.linspace(pl, last, args.anchors).long().tolist()
            dl = draft_block_logits(hooks, draft, seq, feats, anchors, args.block) if draft is not None else None
            for i, a in enumerate(anchors):
                cache = copy.deepcopy(out.past_key_values)
                crop_dynamic_cache(cache, a)
                figs.append(anchor_figures(model, cache, int(seq[0, a]), a, k, s, args.rollouts, args.sims, g,
                                           None if dl is None else dl[i], g_draft))
    ent_t, top_t = torch.cat(ent), torch.cat(top)

    def mean(key: str) -> Any:
        vals = [f[key] for f in figs]
        return [sum(col) / len(col) for col in zip(*vals)] if isinstance(vals[0], list) else sum(vals) / len(vals)

    res = {"dataset": args.dataset, "answers": len(ent), "anchors": len(figs), "block_size": args.block,
           "sampling": s.label, "answer_tokens": int(ent_t.numel()), "mean_entropy_nats": float(ent_t.mean()),
           "mean_top_probability": float(top_t.mean()),
           **{f"ceiling_{key}": mean(key) for key in CEILINGS},
           "rollouts": args.rollouts, "sims": args.sims, "answers_file": str(args.answers),
           "answers_sampling": SamplingParams(t_ans).label,
           **{key: mean(key) for key in DRAFT_FIGURES + PER_SLOT if key in figs[0]},
           "draft": None if args.draft is None else str(args.draft), "wall_s": round(time.perf_counter() - t0, 1)}
    log.info("%s, %s along %s answers, block %d: %d answers (turn 1), %d anchors, %d answer tokens", args.dataset,
             s.label, res["answers_sampling"], args.block, res["answers"], res["anchors"], res["answer_tokens"])
    log.info("| figure | value |\n| --- | ---: |")
    for key, label in (("mean_entropy_nats", "target entropy per token (nats)"),
                       ("mean_top_probability", "target probability of its argmax"),
                       ("ceiling_greedy", "perfect greedy draft: expected tokens a step"),
                       ("ceiling_marginal", "perfect marginal draft, sampled"),
                       ("ceiling_marginal_argmax", "perfect marginal draft, argmax proposals"),
                       ("draft_sampled", "the draft, sampled"),
                       ("draft_argmax", "the draft, argmax proposals"),
                       ("slot1_overlap", "slot 1: sum min(p_1, q^d_1)")):
        if key in res:
            log.info("| %s | %.3f |", label, res[key])
    cols = [key for key in PER_SLOT if key in res]
    log.info("\n| slot | %s |\n| ---: |%s", " | ".join(cols), " ---: |" * len(cols))
    for i in range(k):
        log.info("| %d | %s |", i + 1, " | ".join(f"{res[c][i]:.3f}" for c in cols))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


# ====================================================================================================
# scaling  (was scaling_run.sh)

DOC_SCALING = """FSDP2 scaling run of the qwen3_8b recipe on a random-weight Qwen3-8B target, with one resume.

    python benchmarks/drafter.py scaling --nproc 2 --steps 200 --tokenizer TOKENIZER_DIR --out OUT_DIR \
        [--conversations 200] [--log-every 20]

The target is `QWEN3_8B_CONFIG` (benchmarks/_common.py) with random weights, so no checkpoint download, and
the tokenizer files of TOKENIZER_DIR; the data are --conversations synthetic long chats (throughput does not
depend on values; enough for STEPS x NPROC rows). The trainer (`torchrun -m nemo_dflash.recipes.train
--config qwen3_8b.yaml`, distributed.strategy=fsdp2) runs the first half, checkpoints, and is stopped with
SIGTERM right after that checkpoint (a scheduler's preemption); a second run resumes it to --steps (the
resume is part of the measurement). Logs: OUT_DIR.first.log, OUT_DIR.resume.log. Prints the trainer's
metrics.jsonl per logged step: loss, step time, tokens/s (all GPUs), peak memory.
"""


def write_synthetic_chats(path: Path, n: int, seed: int = 0) -> Path:
    """`n` long chats of random common words (a 50-300-word question, a 1,500-3,000-word answer)."""
    rnd = random.Random(seed)
    words = "the of and to in is that for it as with was on be by this are from or at an have not".split()

    def text(lo: int, hi: int) -> str:
        return " ".join(rnd.choice(words) for _ in range(rnd.randint(lo, hi)))

    rows = ({"messages": [{"role": "user", "content": text(50, 300)}, {"role": "assistant", "content": text(1500, 3000)}]}
            for _ in range(n))
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main_scaling(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="drafter.py scaling", description=DOC_SCALING, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="GPUs (torchrun --nproc-per-node)")
    p.add_argument("--steps", type=int, default=200, help="train.max_steps; the first run stops at half")
    p.add_argument("--tokenizer", required=True, help="a directory of Qwen3 tokenizer files")
    p.add_argument("--out", default="outputs/scaling", help="the run's output_dir")
    p.add_argument("--conversations", type=int, default=200, help="synthetic chats to write")
    p.add_argument("--log-every", type=int, default=20, help="the recipe's train.log_every")
    args = p.parse_args(argv)
    if args.steps < 2 or args.nproc < 1:
        p.error("--steps must be at least 2 and --nproc at least 1")
    tok = Path(args.tokenizer)
    if not tok.is_dir():
        print(f"--tokenizer {tok}: no such directory", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp())
    write_qwen3_8b_config(work)
    for f in tok.iterdir():
        if f.is_file():
            shutil.copy(f, work / f.name)
    chats = write_synthetic_chats(work / "chat.jsonl", args.conversations)
    common = ["--config", "qwen3_8b.yaml", f"target.path={work}", "target.random_init=true",
              f"data.sources=[{{path: {chats}}}]", "data.holdout_fraction=0.0", "train.eval_every=null",
              f"train.log_every={args.log_every}", "wandb.mode=disabled", f"output_dir={out}",
              "distributed.strategy=fsdp2", "checkpoint.keep_last=2"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
              "-m", "nemo_dflash.recipes.train"]
    env = {**os.environ, "NEMO_DFLASH_NO_BAR": "1"}
    half = args.steps // 2
    first_log = Path(f"{out}.first.log")
    with open(first_log, "w") as log:
        first = subprocess.Popen([*launch, *common, f"train.max_steps={args.steps}", "train.max_minutes=null",
                                  f"checkpoint.every_steps={half}", "train.epochs=1"],
                                 stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        # stop the first run right after its mid-run checkpoint with SIGTERM (a scheduler's preemption)
        marker = out / "checkpoints" / f"step_{half:08d}" / "COMPLETE"
        while not marker.is_file():
            time.sleep(2)
            if first.poll() is not None:
                print("first run ended early:\n" + "".join(first_log.read_text().splitlines(True)[-30:]), flush=True)
                break
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGTERM)  # torchrun and its ranks: the session it leads
        first.wait()
    print("--- resumed", flush=True)
    resume_log = Path(f"{out}.resume.log")
    with open(resume_log, "w") as log:
        code = subprocess.run([*launch, *common, f"train.max_steps={args.steps}", f"checkpoint.every_steps={args.steps}"],
                              stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if code:
        print("".join(resume_log.read_text().splitlines(True)[-30:]), flush=True)
    metrics = out / "metrics.jsonl"
    for line in (metrics.read_text().splitlines() if metrics.is_file() else []):
        r = json.loads(line)
        if "tok_s" in r:
            print(f"step {r['step']:>4}  loss {r['loss']:.3f}  step {r['step_s'] * 1e3:.0f} ms  "
                  f"tok/s (all GPUs) {r['tok_s']:.0f}  peak {r.get('peak_mem_gb', 0):.1f} GB")
    return code


# ====================================================================================================
# accept

DOC_ACCEPT = """The speculative decoder's acceptance at T > 0, step by step, against what its own accept test expects.

    python benchmarks/drafter.py accept --target pkg:smollm2 --draft EXPORT --dataset humaneval [--prompts 12] \\
        [--max-new-tokens 256] [--temperature 1] [--top-p 1] [--json F]

Decodes the first --prompts prompts of --dataset (turn 1) with the one-prompt reference decoder and, at every step,
records from its accept test (`verify_block`): the tokens the step kept, their expectation given the drafted
tokens (1 + sum_k prod_{j<=k} min(1, p_j / q_j)), slot 1's accept probability sum_x min(p_1, q_1) and the target's
entropy there. The realized and expected means agree when the decoder's accept test is what the figures assume;
slot 1's figures at the decoder's own anchors (each block starts where the last was rejected) set beside
`drafter.py ceiling`'s, taken at evenly spaced anchors, show how much harder the positions that real decoding
drafts from are.
"""

accept_log = logging.getLogger("accept")



def main_accept(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="drafter.py accept", description=DOC_ACCEPT, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True, type=Path)
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    s = SamplingParams(args.temperature, args.top_p)
    if s.greedy:
        raise SystemExit("error: --temperature must be > 0: at T=0 replay gives the acceptance exactly")
    from nemo_dflash.draft.build import draft_weights_sha256, load_draft_for_target

    device, dtype = resolve_device_dtype(args.device, args.dtype)
    _, prompts = load_prompt_set(args.dataset)
    model, tokenizer = load_target(args.target, dtype=dtype, device=device)
    draft = load_draft_for_target(args.draft, model.config, tokenizer, device=device, dtype=dtype)
    ids = [encode_chat(tokenizer, x.history() + [{"role": "user", "content": x.turns[0]}]) for x in prompts[: args.prompts]]
    t0 = time.time()
    res = {"dataset": args.dataset, "prompts": len(ids), "turn": 1, "max_new_tokens": args.max_new_tokens,
           "sampling": s.label, "block_size": draft.config.block_size, "draft": str(args.draft),
           "draft_sha256": draft_weights_sha256(args.draft), "device": str(device), "dtype": str(dtype),
           **decoder_acceptance(model, draft, ids, s, args.max_new_tokens, args.seed)}
    res["wall_s"] = round(time.time() - t0, 1)
    accept_log.info("%s, %s, %d prompts, up to %d new tokens: %d steps", args.dataset, s.label, len(ids),
                    args.max_new_tokens, res["steps"])
    accept_log.info("| figure | value |\n| --- | ---: |")
    for key, label in (("kept_per_step", "tokens kept a step (realized)"),
                       ("expected_per_step", "tokens a step the accept test expects, given the drafts"),
                       ("slot1_accept_rate", "slot 1 accepted (realized)"), ("slot1_overlap", "slot 1: sum min(p, q)"),
                       ("slot1_target_entropy", "target entropy at slot 1 (nats)")):
        accept_log.info("| %s | %.3f |", label, res[key])
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


# ====================================================================================================
# curve

DOC_CURVE = """Acceptance against training tokens and against unique tokens, over the SmolLM2 drafter runs.

    python benchmarks/drafter.py curve docs/bench/smollm2_drafter_*_run [--rows docs/bench/drafter_summary.json] \\
        [--png docs/bench/smollm2_scaling.png]

Each RUN directory holds a training run's summary.json (the trainer's: tokens seen, the data's tokens, held-out
simulated and expected T=1 tau). A run's real tau is the drafter_summary.json row with the same training tokens
(`drafter.py summaries`), at the protocol that row records. Unique tokens are the run's data tokens (one pass).
Held-out figures come from each run's own held-out split, so they compare along one run, not across data mixes.
"""

curve_log = logging.getLogger("curve")

CURVE_COLUMNS = (("train_tokens", "M tokens", 1e-6), ("data_tokens", "M unique", 1e-6), ("epochs", "epochs", 1),
                 ("sim_tau_heldout", "sim tau", 1), ("sampled_tau_heldout", "exp T=1", 1),
                 ("humaneval_t0_tau", "HE T=0", 1), ("humaneval_t0_tau_no_loop", "HE noloop", 1),
                 ("mtbench_t0_tau", "MT T=0", 1), ("mtbench_t0_tau_no_loop", "MT noloop", 1),
                 ("humaneval_t1_tau", "HE T=1", 1), ("mtbench_t1_tau", "MT T=1", 1))


def curve_points(runs: list[Path], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per run: its summary's tokens and held-out figures, and the real tau of its drafter row."""
    by_tokens = {round(r["train_tokens"]): r for r in rows if r.get("train_tokens") and r.get("humaneval_t0_tau")
                 and not r.get("draft")}  # the levers' rows ("sampling lever a") are other drafts
    points = []
    for run in runs:
        summary = _load(run / "summary.json")
        if not summary or not summary.get("tokens_seen"):
            continue
        data = summary.get("data") or {}
        row = by_tokens.get(round(summary["tokens_seen"]), {})
        point = {"run": run.name, "train_tokens": summary["tokens_seen"], "data_tokens": data.get("tokens"),
                 "epochs": summary["tokens_seen"] / data["tokens"] if data.get("tokens") else None,
                 "sim_tau_heldout": summary.get("eval_accept_len"),
                 "sampled_tau_heldout": summary.get("eval_sampled_accept_len")}
        point.update({k: row.get(k) for k, _, _ in CURVE_COLUMNS[5:]})
        points.append(point)
    return sorted(points, key=lambda p: p["train_tokens"])


def plot_curve(points: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    series = (("sim_tau_heldout", "held-out simulated tau", "o"), ("humaneval_t0_tau", "HumanEval T=0", "s"),
              ("humaneval_t0_tau_no_loop", "HumanEval T=0, no loop", "D"), ("mtbench_t0_tau", "MT-Bench T=0", "^"),
              ("mtbench_t0_tau_no_loop", "MT-Bench T=0, no loop", "v"), ("humaneval_t1_tau", "HumanEval T=1", "x"),
              ("mtbench_t1_tau", "MT-Bench T=1", "+"))
    for ax, xkey, xlabel in ((axes[0], "train_tokens", "training tokens (M)"), (axes[1], "data_tokens", "unique tokens (M)")):
        for key, label, marker in series:
            xy = [(p[xkey] / 1e6, p[key]) for p in points if p.get(xkey) and p.get(key) is not None]
            if xy:  # along training tokens the runs join up; along unique tokens each run is its own point
                style = ("-" if key == "sim_tau_heldout" else ":") if xkey == "train_tokens" else "none"
                ax.plot(*zip(*xy), marker=marker, label=label, linestyle=style)
        if xkey == "data_tokens":
            for pt in points:
                if pt.get("data_tokens") and pt.get("sim_tau_heldout"):
                    ax.annotate(f"{pt['train_tokens'] / 1e6:.0f}M trained", (pt["data_tokens"] / 1e6, pt["sim_tau_heldout"]),
                                textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks([t for t in (10, 20, 30, 50, 100, 200, 500, 1000, 2000)
                       if any(p.get(xkey) and 0.7 * t <= p[xkey] / 1e6 <= 1.4 * t for p in points)])
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tau (tokens a step)")
    fig.suptitle("SmolLM2 drafters: held-out simulated tau, and real tau at the paper's protocol (2048 new tokens)", fontsize=9)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main_curve(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="drafter.py curve", description=DOC_CURVE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run directories holding a training summary.json")
    p.add_argument("--rows", type=Path, default=Path("docs/bench/drafter_summary.json"))
    p.add_argument("--png", type=Path, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    points = curve_points(args.runs, read_rows(args.rows) if args.rows.exists() else [])
    if not points:
        raise SystemExit("error: no training summary.json in the run directories given")
    curve_log.info("| run | " + " | ".join(h for _, h, _ in CURVE_COLUMNS) + " |")
    curve_log.info("| --- |" + " ---: |" * len(CURVE_COLUMNS))
    for pt in points:
        curve_log.info("| %s | %s |", pt["run"], " | ".join("-" if pt.get(k) is None else f"{pt[k] * f:.{1 if f != 1 else 2}f}"
                                                      for k, _, f in CURVE_COLUMNS))
    if args.png:
        plot_curve(points, args.png)
        curve_log.info("plot: %s", args.png)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from _common import run_subcommands

    return run_subcommands("drafter.py", __doc__, {"summaries": (main_summaries, DOC_SUMMARIES), "levers": (main_levers, DOC_LEVERS), "ceiling": (main_ceiling, DOC_CEILING), "scaling": (main_scaling, DOC_SCALING), "curve": (main_curve, DOC_CURVE), "accept": (main_accept, DOC_ACCEPT),
                                               "dedupe": (main_dedupe, DOC_DEDUPE)}, argv)


if __name__ == "__main__":
    raise SystemExit(main())
