"""Drafter runs: a SmolLM2 run's summary rows, the rows of arms run side by side, the T > 0 acceptance ceiling, the
FSDP2 scaling run of a large-target recipe, and tau against training tokens over the drafter runs.

    python benchmarks/drafter.py summaries OUT_DIR --device "NVIDIA H200" [--regen-json ...] [--drafter-json ...]
    python benchmarks/drafter.py report RUNS/a RUNS/b ... --device "NVIDIA H200" [--drafter-json ...]
    python benchmarks/drafter.py ceiling --target pkg:smollm2 --answers EVAL_DIR/answers.jsonl --dataset humaneval
    python benchmarks/drafter.py scaling --nproc 2 --steps 200 --tokenizer TOKENIZER_DIR --out OUT_DIR
    python benchmarks/drafter.py curve docs/bench/smollm2_drafter_*_run --png docs/bench/smollm2_scaling.png
    python benchmarks/drafter.py accept --target pkg:smollm2 --draft EXPORT --dataset humaneval --temperature 1
    python benchmarks/drafter.py dedupe docs/bench/drafter_summary.json

Every training here is the trainer's own (`nemo_dflash.recipes.train` or the pipeline), timed or read from
the files it wrote; the arms are pipeline runs (`+arm=NAME`, configs/arm/), which `report` only reads. Each
subcommand has its own flags (`drafter.py SUBCOMMAND --help`).
"""

from __future__ import annotations

import argparse
import ast
import copy
import gzip
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _common, beside this file

import torch  # noqa: E402
import yaml  # noqa: E402

from _common import append_rows, fold_rows, provenance, read_rows, upsert_rows, write_qwen3_8b_config, write_rows  # noqa: E402
from nemo_dflash.evaluation.protocol import encode_chat, load_prompt_set  # noqa: E402
from nemo_dflash.evaluation.ceiling import (  # noqa: E402
    CEILINGS, DRAFT_FIGURES, PER_SLOT, anchor_figures, decoder_acceptance, draft_block_logits,
)
from nemo_dflash.engine.spec_decode import crop_dynamic_cache  # noqa: E402
from nemo_dflash.recipes._cli import resolve_device_dtype  # noqa: E402
from nemo_dflash.engine.sampling import SamplingParams  # noqa: E402
from nemo_dflash.target import HFDFlashTargetModel  # noqa: E402
from nemo_dflash.target.loading import load_target  # noqa: E402
from nemo_dflash.evaluation.run_rows import (  # noqa: E402
    arm_row, drafter_key, drafter_row, load_json, run_metrics, train_summary,
)


# ====================================================================================================
# summaries  (was smollm2_summaries.py)

DOC_SUMMARIES = """The rows of a SmolLM2 drafter run directory, read from its files.

OUT_DIR is a pipeline run directory (`recipes.pipeline ... run.dir=OUT_DIR`, docs/train.md): data/regen.jsonl and
data/regen_summary.json, run/summary.json (training), eval/results.json. Run directories of the older drafter script
(logs/regenerate.log, runs/main/, eval/main/) are read too.

    python benchmarks/drafter.py summaries OUT_DIR --device "NVIDIA H200" [--command "..."] [--commit C] \
        [--eval RESULTS.json ...] [--data OUT_DIR/data/regen.jsonl[.gz]] [--throughput regen_throughput.json ...] \
        [--regen-json docs/bench/regen_summary.json] [--drafter-json docs/bench/drafter_summary.json]

Each JSON is a list of rows {"date", "commit", "device", "command", ...figures} (nemo_dflash/evaluation/rows.py);
this script appends to it, so its last row is the current figure. The drafter rows are keyed by the draft's
weights hash and the protocol (`drafter_key`): a second summary of a draft already there (e.g. one more evaluate
run merged in) updates that row instead of adding a duplicate. Regeneration rows: the regenerated
set (counted in the data file), the loop/cap counts and the throughput of the regeneration (from its
log), then one row per row of any `regen.py throughput --json` file given. Drafter row: training
tokens and held-out simulated tau (the run's summary), tau per dataset and temperature, first-256 tau,
loop share and speedup (evaluate's results.json), with evaluate's protocol. Nothing is typed in: a
value the run did not produce is null. Without a JSON path the rows are printed.
"""


def _open(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


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
    train = train_summary(out)
    if train:
        res.update(tokens=train["data"]["tokens"], supervised_tokens=train["data"]["supervised_tokens"])
    rows = []
    for path in throughput:
        found = load_json(path) or {}
        for row in found if isinstance(found, list) else found.get("rows", []):
            rows.append({**head, "what": f"regen.py throughput {row.get('mode')}", **row, "file": str(path)})
    return rows + [res]


def train_throughput_row(out: Path, head: dict[str, Any], after_step: int = 200) -> Optional[dict[str, Any]]:
    """The training step's speed in the run itself, from RUN/run/metrics.jsonl: the median of the logged windows
    after `after_step` (windows holding an evaluation or a checkpoint are slower; the median leaves them out),
    per GPU as every row of train_throughput.json. The world size is the run's summary's, or, for runs whose
    summary predates that key, the token slots of a step over one rank's (micro-batch x packed row)."""
    summary = train_summary(out) or {}
    rows = run_metrics(out)
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
    variant = (cfg.get("draft") or {}).get("kind", "dflash")
    return {**head, "shape": "smollm2_135m", "variant": variant,
            "case": (f"the recipe's training run: {variant} draft, {world} GPU(s) x mbs {mbs} x {pack} packed, "
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
    try:
        drafter = [] if args.no_drafter_row else [drafter_row(args.out, head, args.eval)]
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
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
# report  (the arms' rows: configs/arm/*.yaml, one pipeline run directory an arm)

DOC_REPORT = r"""The arms of a comparison at equal tokens side by side, every figure read from their run directories.

    python benchmarks/drafter.py report RUNS/a RUNS/b ... [--drafter-json docs/bench/drafter_summary.json] \
        --device "NVIDIA H200" [--command "..."] [--commit C] [--date D] [--series NAME]

An arm is a pipeline run of one base recipe and one option of the `arm` config group (configs/arm/*.yaml: the data's
sampling temperature, loss.distill_weight and loss.accept_weight, DFlash2's selector convention, D-PACE), in a run
directory named for the arm:

    python -m nemo_dflash.recipes.pipeline --config smollm2_135m_gpu.yaml +arm=a run.dir=RUNS/a
    python -m nemo_dflash.recipes.pipeline --config smollm2_135m_gpu.yaml +arm=v2i run.dir=RUNS/v2i \
        stages=train,export,evaluate          # the T=0.2 arms train on arm a's answers (arm c's: c's T=1 answers)

and, for T=1 with the draft proposing its argmax, one more evaluation of its export beside it:

    python -m nemo_dflash.recipes.evaluate --draft RUNS/b/export --target pkg:smollm2 --out RUNS/b/eval_greedy_draft \
        --protocol paper --method batched --temperatures 1 --draft-proposals greedy --no-speedup

Each row (`nemo_dflash.evaluation.run_rows.arm_row`): "draft": "sampling lever ARM", the `variant` (draft.kind), the
loss and data temperature (the resolved recipe.yaml, the regeneration summaries beside its data sources), training
tokens, steps and every held-out evaluation, tau and speedup per set at T=0, the recommended sampling and T=1, the
weights hash, and evaluate's `protocol`. Prints the table; --drafter-json replaces the rows of the same arm and
--series there (another series' rows stay), appends the others, and keeps one row per weights hash and protocol
(`drafter_key`, as `summaries` does).
"""


def _report_table(rows: list[dict[str, Any]]) -> None:
    cols = [("arm", "arm"), ("variant", "variant"), ("loss", "loss"), ("data T", "data_temperature"),
            ("M tok", "train_tokens"), ("sim tau", "sim_tau_heldout"), ("T1 exp", "sampled_tau_heldout")]
    for ds in ("humaneval", "mtbench"):
        cols += [(f"{ds[:2]} {label}", f"{ds}_{key}") for label, key in (
            ("T0", "t0_tau"), ("T0 noloop", "t0_tau_no_loop"), ("rec", "recommended_tau"), ("T1", "t1_tau"),
            ("T1 argmax", "t1_tau_greedy_draft"), ("x T0", "t0_speedup"), ("x rec", "recommended_speedup"),
            ("x T1", "t1_speedup"))]

    def cell(key: str, v: Any) -> str:
        if v is None:
            return "-"
        return f"{v / 1e6:.1f}" if key == "train_tokens" else f"{v:.2f}" if isinstance(v, float) else str(v)

    print(" | ".join(c for c, _ in cols))
    for r in rows:
        print(" | ".join(cell(k, r.get(k)) for _, k in cols))


def main_report(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="drafter.py report", description=DOC_REPORT,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="pipeline run directories, one an arm, named for it")
    p.add_argument("--drafter-json", type=Path, default=None, help="write the rows here (e.g. "
                   "docs/bench/drafter_summary.json)")
    p.add_argument("--device", default=None, help="the GPU the arms ran on (needed with --drafter-json)")
    p.add_argument("--command", default=None, help="the commands that ran the arms (default: this one)")
    p.add_argument("--commit", default=None, help="the commit the arms ran, when it is not this checkout's")
    p.add_argument("--date", default=None, help="the runs' date (default today)")
    p.add_argument("--series", default=None,
                   help="a name for this run of the arms, kept in its rows: rows of another series are not replaced")
    args = p.parse_args(argv)
    missing = [str(r) for r in args.runs if not (r / "recipe.yaml").is_file() and not (r / "run").is_dir()]
    if missing:
        print(f"error: {', '.join(missing)}: not a pipeline run directory (no recipe.yaml, no run/): give "
              "RUNS/<arm> of `pipeline ... +arm=<arm> run.dir=RUNS/<arm>`", file=sys.stderr)
        return 2
    if args.drafter_json is not None and not args.device:
        print("error: --drafter-json needs --device (the GPU the arms ran on, e.g. 'NVIDIA H200')", file=sys.stderr)
        return 2
    head = provenance(args.device or "unknown", args.command)
    head.update({k: v for k, v in (("commit", args.commit), ("date", args.date), ("series", args.series)) if v})
    try:
        rows = [arm_row(run, head) for run in args.runs]
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _report_table(rows)
    if args.drafter_json is not None:
        names = {(r["draft"], args.series) for r in rows}
        kept = [r for r in read_rows(args.drafter_json) if (r.get("draft"), r.get("series")) not in names]
        write_rows(args.drafter_json, fold_rows(kept + rows, drafter_key))  # one row per weights and protocol
        print(f"{len(rows)} rows -> {args.drafter_json}")
    return 0


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
        summary = load_json(run / "summary.json")
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

    return run_subcommands("drafter.py", __doc__, {"summaries": (main_summaries, DOC_SUMMARIES), "report": (main_report, DOC_REPORT), "ceiling": (main_ceiling, DOC_CEILING), "scaling": (main_scaling, DOC_SCALING), "curve": (main_curve, DOC_CURVE), "accept": (main_accept, DOC_ACCEPT),
                                               "dedupe": (main_dedupe, DOC_DEDUPE)}, argv)


if __name__ == "__main__":
    raise SystemExit(main())
