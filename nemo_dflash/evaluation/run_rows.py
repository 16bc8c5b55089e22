"""A pipeline run directory's measurement rows, read from the files its stages wrote (nothing typed in).

A drafter row (`drafter_row`): the training (RUN/run/summary.json, metrics.jsonl), the evaluation
(RUN/eval/results.json, or several evaluate runs of one draft merged by `merge_evals`), the loss and data the run
trained with (its resolved recipe.yaml and the regeneration summaries beside its data sources), and the draft's
weights hash. An arm row (`arm_row`): one arm of a comparison at equal tokens (`configs/arm/*.yaml`, one run
directory an arm), the drafter row plus every held-out evaluation, the median step time and the T=1 acceptance with
argmax proposals (RUN/eval_greedy_draft/results.json, where that evaluation ran), and any further evaluate run of
the same export in RUN/eval_*/ (e.g. T=1 by the batched decoder beside T=0 by replay, or the speedup timed in its own
run): a figure comes from the first of RUN/eval, RUN/eval_greedy_draft, then RUN/eval_* in name order that has it.
A value the run did not produce is null. `benchmarks/drafter.py summaries` and `report` write these rows to docs/bench/drafter_summary.json.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path
from typing import Any, Optional

import yaml

from nemo_dflash.train.metrics import epoch_gaps as heldout_gaps, read_metrics

GREEDY_DRAFT_EVAL = "eval_greedy_draft"  # RUN/eval_greedy_draft/: evaluate --draft-proposals greedy at T=1
PROTOCOL_KEYS = ("name", "max_new_tokens", "turns", "temperatures", "sampling", "method", "decode", "block_size",
                 "speedup_prompts", "num_prompts")


def load_json(path: Path) -> Optional[dict[str, Any]]:
    return json.loads(path.read_text()) if path.is_file() else None


def train_summary(out: Path) -> Optional[dict[str, Any]]:
    """The training run's summary.json: RUN/run/ (the pipeline's output_dir), else the older runs/main/."""
    return load_json(out / "run" / "summary.json") or load_json(out / "runs" / "main" / "summary.json")


def run_metrics(out: Path) -> Optional[list[dict[str, Any]]]:
    """The training run's RUN/run/metrics.jsonl rows (a torn last line dropped, as a resume drops it)."""
    path = out / "run" / "metrics.jsonl"
    return read_metrics(path)[0] if path.is_file() else None


def epoch_gaps(out: Path, tail: float = 0.1) -> Optional[dict[str, Any]]:
    """`train.metrics.epoch_gaps` of the run in `out` (RUN/run/metrics.jsonl and its summary)."""
    rows = run_metrics(out)
    return None if rows is None else heldout_gaps(rows, train_summary(out) or {}, tail)


def merge_evals(paths: list[Path]) -> dict[str, Any]:
    """One evaluate result from several runs of the same draft (e.g. eval_speed.py's replay, sequential and
    batched phases): figures per temperature and set, the first run that has one winning. The protocol is the
    first run's, with the temperatures of all; `complete` holds when every run whose acceptance figures were
    taken covered the whole protocol (a speedup-only run on K prompts does not count); `sources` says which
    run gave what. A missing file raises FileNotFoundError naming it."""
    merged: dict[str, Any] = {"results": {}, "speedup": {}, "sources": []}
    complete = []
    for path in paths:
        ev = load_json(path)
        if ev is None:
            raise FileNotFoundError(f"no evaluate results at {path}; give a results.json that `evaluate` wrote")
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


def _data_label(summary: dict[str, Any]) -> Optional[str]:
    samp = summary.get("sampling") or {}
    temp = samp.get("temperature")
    if temp is None:
        return None
    return "%g (top-p %g)" % (temp, samp["top_p"]) if samp.get("top_p", 1.0) < 1.0 else "%g" % temp


def _loss_name(loss: dict[str, Any], draft: dict[str, Any]) -> Optional[str]:
    if not loss:
        return None
    distill, accept = loss.get("distill_weight"), loss.get("accept_weight")
    name = "distill %g" % distill if distill else "hard CE"
    if accept:
        name = ("distill %g + " % distill if distill else "") + "accept %g (%s, T=%g)" % (
            accept, loss.get("accept_form"), loss.get("accept_temperature"))
    if draft.get("kind") == "dflash2":
        name += " + selector (%s)" % loss.get("selector_outside")
    return name + (", D-PACE" if loss.get("position_weights") == "dpace" else "")


def loss_and_data(out: Path) -> dict[str, Any]:
    """The loss, the draft variant and the data temperature the run trained with: its resolved recipe.yaml, and the
    regeneration summary beside each data source (`DIR/regen.jsonl` -> `DIR/regen_summary.json`, the pipeline's
    layout; an arm may train on another arm's answers), else the run's own data/regen_summary.json."""
    recipe = out / "recipe.yaml"
    cfg = (yaml.safe_load(recipe.read_text()) or {}) if recipe.is_file() else {}
    loss, draft = cfg.get("loss") or {}, cfg.get("draft") or {}
    found = [load_json(Path(s["path"]).parent / "regen_summary.json") for s in (cfg.get("data") or {}).get(
        "sources") or [] if isinstance(s, dict) and s.get("path")]
    regens = [s for s in found if s] or [load_json(out / "data" / "regen_summary.json") or {}]
    labels = [x for x in map(_data_label, regens) if x]
    spp = [r.get("samples_per_prompt") for r in regens]
    return {"loss": _loss_name(loss, draft), "variant": draft.get("kind", "dflash") if cfg else None,
            "distill_weight": loss.get("distill_weight"), "accept_weight": loss.get("accept_weight"),
            "data_temperature": " + ".join(labels) if labels else None,
            "samples_per_prompt": sum(spp) if spp and None not in spp else None}


def sha256_file(path: Path) -> Optional[str]:
    """The file's sha256, or the one written beside it (`NAME.sha256`) when the file stayed on its machine."""
    if not path.exists():
        side = path.with_name(path.name + ".sha256")
        return side.read_text().split()[0] if side.exists() else None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
            "model_safetensors_sha256": sha256_file(export / "model.safetensors")}


def _recommended_key(ev: dict[str, Any]) -> Optional[str]:
    """The target's recommended sampling: evaluate's key of it ("0.2,p0.9"), timed on the speedup prompts."""
    return next((k for k in ev.get("speedup", {}) if k not in ("0", "1") and "greedy" not in k), None)


def _set_figures(res: dict[str, Any], ev: dict[str, Any], ds: str, t: str) -> None:
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
    res[f"{ds}_t{t}_speedup_prompts"] = s.get("num_prompts")
    spread = s.get("per_prompt_speedup") or {}
    res[f"{ds}_t{t}_speedup_per_prompt"] = ({k: spread.get(k) for k in ("prompts", "min", "median", "max")}
                                           if spread else None)
    res[f"{ds}_t{t}_plain_ms_per_token"] = s.get("ar", {}).get("time_per_token_ms")
    res[f"{ds}_t{t}_spec_ms_per_token"] = s.get("spec", {}).get("time_per_token_ms")


def drafter_row(out: Path, head: dict[str, Any], evals: Optional[list[Path]] = None) -> dict[str, Any]:
    """The run's drafter row: training, every evaluated set and temperature, the loss and data, the weights hash."""
    ev = merge_evals(evals) if evals else \
        load_json(out / "eval" / "results.json") or load_json(out / "eval" / "main" / "results.json") or {}
    train = train_summary(out) or {}
    protocol = dict(ev.get("protocol") or {})
    if "turns" in protocol:  # the name for it
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
            _set_figures(res, ev, ds, t)
    rkey = _recommended_key(ev)
    res["recommended_sampling"] = rkey
    for ds in ("humaneval", "mtbench"):
        s = ev.get("speedup", {}).get(rkey, {}).get(ds, {}) if rkey else {}
        for key, src in (("speedup", "speedup"), ("speedup_no_loop", "speedup_no_loop"),
                         ("tau", "mean_acceptance_length"), ("speedup_prompts", "num_prompts")):
            res[f"{ds}_recommended_{key}"] = s.get(src)
    speedups = [res[f"{ds}_t0_speedup"] for ds in ("humaneval", "mtbench") if res[f"{ds}_t0_speedup"] is not None]
    res["speedup_t0"] = min(speedups) if speedups else None
    res.update(loss_and_data(out))
    files = [Path(x) for x in evals] if evals else [out / "eval" / "results.json"]
    res.update(draft_hashes(out / "export", {ev.get("draft_sha256") for ev in map(load_json, files) if ev}))
    if ev.get("sources"):
        res["eval_sources"] = ev["sources"]
    return res


def drafter_key(row: dict[str, Any]) -> Optional[tuple[Any, ...]]:
    """What makes two drafter rows one measurement: the same weights (their hash) at the same protocol (name, answer
    cap, block, prompts; its temperatures may grow). A row without a weights hash is never merged."""
    if not row.get("draft_sha256"):
        return None
    protocol = row.get("protocol") or {}
    return (row["draft_sha256"], row.get("draft"), *(protocol.get(k) for k in ("name", "max_new_tokens", "block_size",
                                                                              "num_prompts")))


def arm_row(run: Path, head: dict[str, Any]) -> dict[str, Any]:
    """One arm's row (RUN is its pipeline run directory, named for the arm): `drafter_row` over RUN/eval and, where
    it ran, RUN/eval_greedy_draft and RUN/eval_* (first one with a figure wins), plus every held-out evaluation, the
    planned steps and the median step time."""
    extra = sorted(p for p in run.glob("eval_*") if p.name != GREEDY_DRAFT_EVAL)
    evals = [p / "results.json" for p in (run / "eval", run / GREEDY_DRAFT_EVAL, *extra) if (p / "results.json").is_file()]
    row = drafter_row(run, head, evals or None)
    rows = run_metrics(run) or []
    ev = [r for r in rows if "eval_accept_len" in r]
    last = ev[-1] if ev else {}
    summary = train_summary(run) or {}
    steps = [r["step_s"] for r in rows if "step_s" in r]
    row.update({
        "draft": f"sampling lever {run.name}", "arm": run.name, "variant": row.get("variant") or "dflash",
        "train_tokens": summary.get("tokens_seen", max((r.get("tokens", 0) for r in rows), default=0)),
        "planned_steps": summary.get("total_steps"), "stopped_early": summary.get("stopped_early"),
        "sim_tau_heldout": last.get("eval_accept_len", row["sim_tau_heldout"]),
        "sampled_tau_heldout": last.get("eval_sampled_accept_len", row["sampled_tau_heldout"]),
        "sampled_tau_heldout_greedy_draft": last.get("eval_sampled_accept_len_greedy_draft"),
        "loss_heldout": last.get("eval_loss"),
        # a selector draft's own held-out figures: the unary argmax's simulated tau beside the walk's, top-K recall,
        # and the oracle walk that picks the true token whenever it is a candidate
        **{k: last.get(f"eval_{k}") for k in ("unary_accept_len", "topk_recall", "oracle_accept_len", "selector_loss")
           if f"eval_{k}" in last},
        # the median logged step time (compile and the first steps' warm-up fall outside the median)
        "step_s_median": statistics.median(steps) if steps else None,
        # every held-out evaluation: arms that stopped at their time cap compare at a step both reached
        "heldout_evals": [{k: r.get(k) for k in ("step", "tokens", "eval_loss", "eval_accept_len",
                                                  "eval_sampled_accept_len")} for r in ev],
    })
    merged = merge_evals(evals) if evals else {}
    for ds in ("humaneval", "mtbench"):
        row[f"{ds}_t1_tau_greedy_draft"] = merged.get("results", {}).get("1,greedy", {}).get(ds, {}).get(
            "mean_acceptance_length")
    if row["protocol"]:
        row["protocol"] = {k: row["protocol"].get(k) for k in (*PROTOCOL_KEYS, "mtbench_turns", "speedup_decode")
                           if k in row["protocol"]}
    return row
