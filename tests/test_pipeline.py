"""`recipes.pipeline`: one recipe runs every stage on a tiny random target; a second run skips what is complete,
changed settings are refused (nothing rewritten), `redo=` reruns a stage, a killed training resumes; and every
command's defaults are its recipe section's."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from nemo_dflash.config import EvaluateConfig, ExportConfig, PromptJobConfig, RegenerateConfig, load_recipe
from nemo_dflash.recipes import evaluate, export, pipeline, prompts, regenerate
from nemo_dflash.recipes._cli import section_argv

from _tiny_target import make_tiny_target_dir, write_chat_jsonl
from _torchrun import run_command

RECIPE = """
run: {{dir: {run}}}
output_dir: {run}/train
target: {{path: {target}, dtype: fp32}}
draft: {{num_layers: 2, block_size: 4}}
data: {{max_length: 64, holdout_fraction: 0.2}}
loss: {{num_anchors: 8}}
optim: {{lr: 3.0e-3}}
train: {{micro_batch_size: 2, log_every: 1, max_steps: 4}}
checkpoint: {{every_steps: 2}}
distributed: {{strategy: none}}
wandb: {{mode: disabled}}
prompts:
  jobs:
    - {{name: code, source: "code:2"}}
regenerate:
  data: [{chat}]
  max_new_tokens: 4
  batch_size: 8
  device: cpu
evaluate: {{protocol: quick, num_prompts: 1, max_new_tokens: 4, temperatures: "0", no_speedup: true, device: cpu}}
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pipeline")
    target = make_tiny_target_dir(root)
    chat = write_chat_jsonl(root / "chat.jsonl", n=6)
    return {"root": root, "target": target, "chat": chat}


def recipe(tiny: dict, run: Path) -> Path:
    path = run.parent / f"{run.name}.yaml"
    path.write_text(RECIPE.format(run=run, target=tiny["target"], chat=tiny["chat"]))
    return path


@pytest.fixture(scope="module")
def done(tiny) -> dict:
    """The whole pipeline, run once (the tests below read it and run it again)."""
    run = tiny["root"] / "run"
    config = recipe(tiny, run)
    outcome = pipeline.main(["--config", str(config)])
    return {"run": run, "config": config, "outcome": outcome}


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_every_stage_runs_and_leaves_its_outputs_and_marker(done):
    run = done["run"]
    assert done["outcome"] == {s: "done" for s in pipeline.STAGES}
    assert (run / "prompts" / "code.jsonl").is_file()
    regen = [json.loads(line) for line in (run / "data" / "regen.jsonl").read_text().splitlines()]
    assert {r["dataset"] for r in regen} == {"chat", "code"}  # the prompt job's file joined regenerate's sources
    assert (run / "train" / "final" / "draft" / "config.json").is_file()
    assert (run / "export" / "config.json").is_file()
    assert json.loads((run / "eval" / "results.json").read_text())["complete"] is True
    recorded = load_recipe(str(run / "recipe.yaml"), data_optional=True)  # the resolved recipe reads back the same
    assert recorded == load_recipe(str(done["config"]), data_optional=True)
    for stage in pipeline.STAGES:
        marker = json.loads((run / "stages" / f"{stage}.json").read_text())
        assert marker["digest"] == pipeline.digest(marker["settings"])
    assert json.loads((run / "stages" / "train.json").read_text())["summary"]["steps"] == 4
    assert set(json.loads((run / "summary.json").read_text())["stages"]) == set(pipeline.STAGES)


def test_a_second_run_skips_every_stage_and_says_so(done, caplog):
    before = snapshot(done["run"])
    with caplog.at_level("INFO", logger="nemo_dflash.pipeline"):
        outcome = pipeline.main(["--config", str(done["config"])])
    assert outcome == {s: "skipped" for s in pipeline.STAGES}
    assert sum("skipped" in r.getMessage() for r in caplog.records) >= len(pipeline.STAGES)
    after = snapshot(done["run"])
    assert {k: v for k, v in after.items() if k != "summary.json"} == {k: v for k, v in before.items()
                                                                      if k != "summary.json"}


def test_keys_that_change_no_output_leave_a_complete_stage_complete(done):
    """HOW keys (`config.how`: logging, workers, timeouts, job limits) are not settings: a new log interval or
    tokenizer worker count does not refuse or retrain the complete training (before, each forced a retrain)."""
    before = snapshot(done["run"])
    assert pipeline.main(["--config", str(done["config"]), "stages=regenerate,train", "train.log_every=3",
                          "data.tokenize_workers=1", "distributed.timeout_minutes=5", "regenerate.max_bad_lines=5",
                          "checkpoint.keep_last=1", "wandb.mode=offline"]) == {"regenerate": "skipped",
                                                                             "train": "skipped"}
    after = snapshot(done["run"])
    assert {k: v for k, v in after.items() if k not in ("summary.json", "recipe.yaml")} == {
        k: v for k, v in before.items() if k not in ("summary.json", "recipe.yaml")}


def test_a_marker_written_with_how_keys_and_an_upstream_digest_still_matches(done):
    """A marker of an earlier version recorded HOW keys in its settings and the upstream stage's digest
    (`after`): compared as this version compares them, it still matches (no forced retrain on upgrade)."""
    path = done["run"] / "stages" / "train.json"
    saved = path.read_bytes()
    old = json.loads(saved)
    old["settings"]["train"]["log_every"] = 1
    old["settings"]["data"]["tokenize_workers"] = None
    old["settings"]["after"] = {"regenerate": "0123456789abcdef"}
    old["digest"] = pipeline.digest(old["settings"])
    path.write_text(json.dumps(old))
    try:
        assert pipeline.main(["--config", str(done["config"]), "stages=train"]) == {"train": "skipped"}
    finally:
        path.write_bytes(saved)


@pytest.mark.parametrize("override, stage", [("regenerate.max_new_tokens=5", "regenerate"),
                                             ("optim.lr=1e-3", "train"), ("evaluate.num_prompts=2", "evaluate")])
def test_changed_settings_are_refused_in_one_line_and_nothing_is_rewritten(done, override, stage, capsys):
    before = snapshot(done["run"])
    with pytest.raises(SystemExit) as e:
        pipeline.main(["--config", str(done["config"]), override])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"redo={stage}" in err[0] and override.split("=")[0] in err[0]
    assert snapshot(done["run"]) == before


def test_redo_reruns_the_stage_and_the_stages_reading_its_outputs(done):
    run = done["run"]
    export_before = json.loads((run / "stages" / "export.json").read_text())
    outcome = pipeline.main(["--config", str(done["config"]), "stages=export,evaluate", "redo=export",
                             "evaluate.num_prompts=2"])  # evaluate's settings change: allowed, it is redone
    assert outcome == {"export": "redone", "evaluate": "redone"}
    assert json.loads((run / "stages" / "export.json").read_text())["finished"] >= export_before["finished"]
    results = json.loads((run / "eval" / "results.json").read_text())
    assert results["protocol"]["num_prompts"] == 2
    assert pipeline.main(["--config", str(done["config"]), "stages=evaluate", "evaluate.num_prompts=2"]) == {
        "evaluate": "skipped"}


def spy_resume(monkeypatch) -> list:
    """The step each later training resumes from (None for a fresh start), in order."""
    from nemo_dflash.train import checkpoint

    real_resume, resumed = checkpoint.Checkpointer.resume, []

    def spy(self):
        saved = real_resume(self)
        resumed.append(None if saved is None else int(saved["step"]))
        return saved

    monkeypatch.setattr(checkpoint.Checkpointer, "resume", spy)
    return resumed


def test_a_killed_training_resumes_from_its_checkpoint(tiny, monkeypatch):
    from nemo_dflash.train import checkpoint

    run = tiny["root"] / "killed"
    config = recipe(tiny, run)
    real_save = checkpoint.Checkpointer.save

    def save_then_die(self, step, tokens_seen):
        real_save(self, step, tokens_seen)
        raise KeyboardInterrupt  # the job is killed right after its first checkpoint

    monkeypatch.setattr(checkpoint.Checkpointer, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        pipeline.main(["--config", str(config), "stages=prompts,regenerate,train"])
    assert not (run / "stages" / "train.json").exists()  # not complete
    monkeypatch.setattr(checkpoint.Checkpointer, "save", real_save)
    resumed = spy_resume(monkeypatch)
    outcome = pipeline.main(["--config", str(config), "stages=prompts,regenerate,train"])
    assert outcome == {"prompts": "skipped", "regenerate": "skipped", "train": "done"}
    assert resumed == [2]
    assert json.loads((run / "stages" / "train.json").read_text())["summary"]["steps"] == 4


def test_a_time_capped_training_ends_with_a_draft_and_the_next_run_continues_it(tiny, monkeypatch):
    """train.max_minutes stops training mid-schedule: no train marker, but the last checkpoint is exported and
    evaluated, marked as a time-capped draft; the same command with another cap (a job limit, not a setting)
    continues from the checkpoint the cap wrote, then exports and evaluates again."""
    from nemo_dflash.draft.build import draft_weights_sha256

    run = tiny["root"] / "capped"
    config = recipe(tiny, run)
    # 0: stop after the first step; no periodic checkpoints: the cap saves the one the next run continues from
    outcome = pipeline.main(["--config", str(config), "train.max_minutes=0", "checkpoint.every_steps=null"])
    assert outcome == {"prompts": "done", "regenerate": "done", "train": "time-capped", "export": "done",
                       "evaluate": "done"}
    assert not (run / "stages" / "train.json").exists()
    summary = json.loads((run / "summary.json").read_text())
    steps = summary["incomplete"]["train"]["steps"]
    assert 1 <= steps < 4 and summary["time_capped_draft"]["steps"] == steps
    assert summary["time_capped_draft"]["total_steps"] == 4
    for stage in ("export", "evaluate"):
        assert json.loads((run / "stages" / f"{stage}.json").read_text())["time_capped_draft"]["steps"] == steps
    weights = (run / "export" / "model.safetensors").read_bytes()
    results = json.loads((run / "eval" / "results.json").read_text())
    # the evaluation is of the export just written, and complete
    assert results["complete"] and results["draft_sha256"] == draft_weights_sha256(str(run / "export"))

    resumed = spy_resume(monkeypatch)
    outcome = pipeline.main(["--config", str(config), "train.max_minutes=30", "checkpoint.every_steps=null"])
    assert outcome == {"prompts": "skipped", "regenerate": "skipped", "train": "done", "export": "redone",
                       "evaluate": "redone"}
    assert resumed == [steps]  # the capped run's last step, not a fresh start
    marker = json.loads((run / "stages" / "train.json").read_text())
    assert marker["summary"]["steps"] == 4 and marker["summary"]["stopped_early"] is None
    assert "max_minutes" not in marker["settings"]["train"]
    assert (run / "export" / "model.safetensors").read_bytes() != weights  # the trained-on draft, re-exported
    summary = json.loads((run / "summary.json").read_text())
    assert "time_capped_draft" not in summary and "incomplete" not in summary
    assert not any("time_capped_draft" in json.loads((run / "stages" / f"{s}.json").read_text())
                   for s in ("export", "evaluate"))
    # a later run under yet another cap skips the complete stages
    again = pipeline.main(["--config", str(config), "train.max_minutes=5", "checkpoint.every_steps=null"])
    assert set(again.values()) == {"skipped"}


def test_a_time_capped_training_alone_stops_the_run(tiny):
    """stages=train: nothing after it to run, the capped training is incomplete (the same command continues)."""
    run = tiny["root"] / "capped_alone"
    config = recipe(tiny, run)
    outcome = pipeline.main(["--config", str(config), "stages=prompts,regenerate,train", "train.max_minutes=0"])
    assert outcome == {"prompts": "done", "regenerate": "done", "train": "incomplete"}
    assert not (run / "export").exists()
    assert json.loads((run / "summary.json").read_text())["incomplete"]["train"]["stopped_by"] == pipeline.TIME_CAP
    from nemo_dflash.train.trainer import StopReason

    assert pipeline.TIME_CAP == StopReason.TIME_LIMIT.value  # the pipeline names the trainer's reason without importing it


def test_a_time_capped_evaluation_reports_what_it_measured(tiny):
    """evaluate.max_minutes: the summary keeps what the evaluation measured and names what it did not; the same
    command continues it from its answers."""
    run = tiny["root"] / "eval_capped"
    config = recipe(tiny, run)
    outcome = pipeline.main(["--config", str(config), "evaluate.max_minutes=1e-6"])
    assert outcome["evaluate"] == "incomplete" and not (run / "stages" / "evaluate.json").exists()
    stopped = json.loads((run / "summary.json").read_text())["incomplete"]["evaluate"]
    assert stopped["complete"] is False and stopped["stopped_by"] == "evaluate.max_minutes"
    # quick protocol, 1 prompt a set, T=0, no speedup: each set's one prompt is either measured or named missing
    measured = {name for name in stopped.get("results", {}).get("0", {})}
    missing = {m["dataset"] for m in stopped["not_measured"] if m["acceptance_prompts_missing"]}
    assert missing and not measured & missing and all(m["acceptance_prompts"] == 1 for m in stopped["not_measured"])
    outcome = pipeline.main(["--config", str(config)])
    assert outcome["evaluate"] == "done"
    results = json.loads((run / "eval" / "results.json").read_text())
    assert results["complete"] and "not_measured" not in results and set(results["results"]["0"]) >= missing


LEFT_BY_HAND = {  # stage -> an output of it a command run by hand left behind (no marker)
    "prompts": "prompts/code.jsonl", "regenerate": "data/regen.jsonl", "train": "train/config.yaml",
    "export": "export/model.safetensors",
}


@pytest.mark.parametrize("stage", list(LEFT_BY_HAND))
def test_outputs_without_a_marker_are_refused_naming_redo(tiny, tmp_path, monkeypatch, capsys, stage):
    """The stage's command would refuse them ("exists: pass --overwrite"); in the pipeline the fix is redo=STAGE:
    one line, exit 2, before any model loads or any file is written."""
    run = tmp_path / "run"
    left = run / LEFT_BY_HAND[stage]
    left.parent.mkdir(parents=True)
    left.write_text("{}\n")
    monkeypatch.setattr("nemo_dflash.target.loading.load_target", lambda *a, **k: pytest.fail("a model loaded"))
    before = snapshot(run)
    with pytest.raises(SystemExit) as e:
        pipeline.main(["--config", str(recipe(tiny, run)), f"stages={stage}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert f"redo={stage}" in err[0] and str(left.parent) in err[0] and "--overwrite" not in err[0]
    assert snapshot(run) == before  # nothing written: no recipe.yaml, no marker
    if stage == "prompts":  # the fix named works (a built-in source: no model)
        monkeypatch.undo()
        assert pipeline.main(["--config", str(recipe(tiny, run)), "stages=prompts", "redo=prompts"]) == {
            "prompts": "redone"}
        assert (run / "stages" / "prompts.json").is_file() and left.read_text() != "{}\n"


# ---- under torchrun: 2 gloo ranks on CPU ----

REPO = Path(__file__).resolve().parents[1]
TWO_RANKS = ["stages=regenerate,train", "distributed.strategy=ddp", "prompts.jobs=[]"]


def torchrun(config: Path, script: str = "-m nemo_dflash.recipes.pipeline", args: Sequence[str] = TWO_RANKS,
             **env: str) -> subprocess.CompletedProcess:
    """The pipeline on ``config`` under 2 gloo ranks on this machine (one thread each)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "NEMO_DFLASH_NO_BAR": "1", **env}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *script.split(),
           "--config", str(config), *args]
    return run_command(cmd, 240, env=env)


def losses(run: Path) -> dict[int, float]:
    """step -> loss; the last record of a step wins (a killed run may have logged it before)."""
    recs = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def final_draft(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "train" / "final" / "draft" / "model.safetensors"))


@pytest.fixture(scope="module")
def two_ranks(tiny) -> dict:
    """regenerate and train, uninterrupted, on 2 ranks. Rank 0 merges the ranks' shards 3 s late, so rank 1 ends
    regenerate long before the file exists: train would fail its data check on rank 1 unless the pipeline waits."""
    run = tiny["root"] / "ranks"
    config = recipe(tiny, run)
    proc = torchrun(config, str(REPO / "tests" / "_pipeline_slow_merge.py"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"run": run, "config": config}


def test_two_ranks_regenerate_and_train_end_to_end(tiny, two_ranks):
    run = two_ranks["run"]
    assert json.loads((run / "summary.json").read_text())["last_invocation"] == {"regenerate": "done", "train": "done"}
    # the ranks' shards merged into the file one process writes (docs/data.md), byte for byte
    single = tiny["root"] / "ranks_single"
    assert pipeline.main(["--config", str(recipe(tiny, single)), "stages=regenerate", "prompts.jobs=[]"]) == {
        "regenerate": "done"}
    assert (run / "data" / "regen.jsonl").read_bytes() == (single / "data" / "regen.jsonl").read_bytes()
    train = json.loads((run / "stages" / "train.json").read_text())
    assert train["summary"]["steps"] == 4 and train["settings"]["distributed"]["strategy"] == "ddp"
    assert sorted(losses(run)) == [1, 2, 3, 4]
    assert set(final_draft(run))  # rank 0 wrote the whole draft


def test_two_ranks_killed_mid_training_continue_where_they_stopped(tiny, two_ranks):
    """Rank 0 is SIGKILLed right after the step-2 checkpoint; the same command then skips regenerate (complete)
    and resumes training: the losses and the final draft of the uninterrupted run, bit for bit on CPU
    (docs/train.md)."""
    run = tiny["root"] / "ranks_killed"
    config = recipe(tiny, run)
    proc = torchrun(config, str(REPO / "tests" / "_pipeline_killed_rank.py"), PIPELINE_KILL_RANK="0",
                    PIPELINE_KILL_STEP="2")
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert (run / "stages" / "regenerate.json").is_file() and not (run / "stages" / "train.json").exists()
    ckpts = sorted(p.name for p in (run / "train" / "checkpoints").iterdir() if (p / "COMPLETE").is_file())
    assert ckpts == ["step_00000002"]

    proc = torchrun(config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Resumed from" in proc.stderr and "step_00000002" in proc.stderr
    assert json.loads((run / "summary.json").read_text())["last_invocation"] == {"regenerate": "skipped",
                                                                                "train": "done"}
    full = two_ranks["run"]
    assert (run / "data" / "regen.jsonl").read_bytes() == (full / "data" / "regen.jsonl").read_bytes()
    assert losses(run) == losses(full)
    got, want = final_draft(run), final_draft(full)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_two_ranks_killed_mid_regenerate_continue_where_they_stopped(tiny):
    """The first rank about to write its third conversation in the regenerate stage is SIGKILLed (its journal holds
    two; the ranks share one queue, so which rank gets there first is a race); no marker is written. The same command then continues the ranks' journals (``resumed_done`` > 0:
    nothing done is generated again) and writes the bytes of an uninterrupted run with the same seed (one
    process: the same file as 2 ranks, docs/data.md), and the stage's marker."""
    chat = write_chat_jsonl(tiny["root"] / "chat16.jsonl", n=16, seed=3)
    args = ["stages=regenerate", "prompts.jobs=[]", f"regenerate.data=[{chat}]", "regenerate.batch_size=2"]
    ref = tiny["root"] / "regen_whole"
    assert pipeline.main(["--config", str(recipe(tiny, ref)), *args]) == {"regenerate": "done"}
    run = tiny["root"] / "regen_killed"
    config = recipe(tiny, run)
    proc = torchrun(config, str(REPO / "tests" / "_pipeline_killed_rank.py"), args, PIPELINE_KILL_RANK="any",
                    PIPELINE_KILL_AT="2")
    assert proc.returncode != 0, proc.stderr[-3000:]
    data = run / "data"
    journals = [data / f"regen.jsonl.rank{r}-of-2.partial" for r in range(2)]  # a rank stopped early may have none
    written = [j.read_bytes().count(b"\n") if j.exists() else 0 for j in journals]
    assert 2 in written and sum(written) < 16, written  # killed mid-stage, a rank with its first two written
    assert not (data / "regen.jsonl").exists() and not (run / "stages" / "regenerate.json").exists()

    proc = torchrun(config, args=args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "continuing" in proc.stderr
    marker = json.loads((run / "stages" / "regenerate.json").read_text())
    summary = marker["summary"]
    assert summary["resumed_done"] >= 2 and summary["written_this_run"] == summary["written"] - summary["resumed_done"]
    assert summary["written"] == 16 and summary["ranks"] == 2
    assert json.loads((run / "summary.json").read_text())["last_invocation"] == {"regenerate": "done"}
    assert (data / "regen.jsonl").read_bytes() == (ref / "data" / "regen.jsonl").read_bytes()
    assert not list(data.glob("regen.jsonl.rank*"))  # the journals are merged and removed


def test_stages_and_redo_name_real_stages(capsys):
    for arg in ("stages=regen", "redo=trian", "stages="):
        with pytest.raises(SystemExit) as e:
            pipeline.parse_args(["--config", "x.yaml", arg])
        assert e.value.code == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_source_without_its_package_is_refused_before_any_model_loads(tiny, tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pydantic" else real(name, *a))
    monkeypatch.setattr("nemo_dflash.target.loading.load_target", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit) as e:
        pipeline.main(["--config", str(recipe(tiny, tmp_path / "run")), "regenerate.data=[gsm_symbolic:10]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "pydantic" in err[0] and "pip install" in err[0]
    assert not (tmp_path / "run").exists()


def test_a_bad_stage_value_names_its_recipe_key(tiny, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        pipeline.main(["--config", str(recipe(tiny, tmp_path / "run")), "regenerate.loops=sometimes"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "regenerate.loops" in err[0]


# ---- one source of truth: each command's defaults are its recipe section's ----

COMMANDS = [  # (module, section, the flags the pipeline fills in, the section's pipeline-only fields)
    (prompts, PromptJobConfig, ["--out", "x.jsonl"], ("name", "weight")),
    (regenerate, RegenerateConfig, ["--target", "t", "--data", "sharegpt", "--out", "x.jsonl"], ()),
    (export, ExportConfig, ["--checkpoint", "c", "--out", "o"], ()),
    (evaluate, EvaluateConfig, ["--draft", "d", "--target", "t", "--out", "o"], ()),
]
# The flags the pipeline sets itself (paths, the target, --overwrite): no recipe key.
FILLED_BY_THE_PIPELINE = {"target", "out", "overwrite", "summary_json", "checkpoint", "draft",
                          "part",  # part: evaluate sets it for its own --gpus processes
                          "config", "overrides", "job"}  # the stand-alone command's recipe itself (--config RECIPE,
                                                        # prompts' --job NAME: which prompts.jobs item)


@pytest.mark.parametrize("module, section, required, only", COMMANDS, ids=lambda x: getattr(x, "__name__", ""))
def test_each_commands_defaults_are_its_sections(module, section, required, only):
    parsed = vars(module.build_parser().parse_args(required))
    want = {f.name: getattr(section(), f.name) for f in dataclasses.fields(section) if f.name not in only}
    if module is regenerate:
        want["data"] = ["sharegpt"]  # required: given above
    assert {k: parsed[k] for k in want} == want
    # every flag is a recipe key or one the pipeline fills in: no flag the recipe cannot set
    assert set(parsed) - set(want) <= FILLED_BY_THE_PIPELINE


@pytest.mark.parametrize("module, section, required, only", COMMANDS, ids=lambda x: getattr(x, "__name__", ""))
def test_a_section_given_as_flags_parses_back_to_itself(module, section, required, only):
    """Every field set away from its default: the command line the pipeline builds means the same values."""
    changed = {}
    for f in dataclasses.fields(section):
        value = getattr(section(), f.name)
        if f.name in only:
            continue
        if isinstance(value, bool):
            changed[f.name] = not value
        elif isinstance(value, list):
            changed[f.name] = ["a=b.jsonl", "c"]
    changed.update({k: v for k, v in {"seed": 7, "temperature": 0.5, "top_p": 0.9, "max_new_tokens": 9,
                                      "user_max_new_tokens": 15,
                                      "turns": {regenerate: "all", prompts: "2-3"}.get(module, 2), "batch_size": 12,
                                      "serving_engine": "vllm" if module is export else None}.items()
                    if k in {f.name for f in dataclasses.fields(section)} and v is not None})
    if module is evaluate:
        changed["batch_size"] = "12"
    obj = section(**({"name": "n"} if "name" in only else {}), **changed)
    parsed = vars(module.build_parser().parse_args([*required, *section_argv(module.build_parser(), obj, only)]))
    for k, v in changed.items():
        assert parsed[k] == (["sharegpt", *v] if (module, k) == (regenerate, "data") else v), k


def test_a_null_user_cap_leaves_a_prompt_jobs_settings_as_they_were():
    """prompts.jobs[].user_max_new_tokens null (the default) is not in the stage's settings, so a prompts marker
    written before the key existed still matches; a value set is a setting (changing it is refused or redone)."""
    job = PromptJobConfig(name="m")
    drop = ("threads", "user_max_new_tokens")  # threads: how the job runs (config.how), not what it writes
    before = {k: v for k, v in dataclasses.asdict(job).items() if k not in drop}
    assert pipeline._section(job) == before
    assert pipeline._section(PromptJobConfig(name="m", user_max_new_tokens=512)) == {**before,
                                                                                         "user_max_new_tokens": 512}


def test_two_ranks_prompt_jobs_then_magpie_on_every_rank(tiny, monkeypatch):
    """The prompts stage under torchrun after the pipeline's own barrier group: a source job on rank 0, then a
    Magpie job on both ranks (a third process group in one launch: each must rendezvous under its own keys),
    writing the file one process writes."""
    run = tiny["root"] / "ranks_magpie"
    jobs = ('prompts.jobs=[{name: code, source: "code:2"}, {name: mag, topics: "chat=3,code=2", turns: "1-2", '
            'max_new_tokens: 16, batch_size: 4, device: cpu, dtype: fp32}]')
    proc = torchrun(recipe(tiny, run), script=str(REPO / "tests" / "_magpie_forced.py"), args=["stages=prompts", jobs],
                    MAGPIE_PIPELINE=str(tiny["target"]))  # the random target made to end its turns
    assert proc.returncode == 0, proc.stderr[-3000:]
    from _magpie_forced import forced_engine
    from transformers import AutoTokenizer

    forced_engine(monkeypatch, AutoTokenizer.from_pretrained(str(tiny["target"])))
    single = tiny["root"] / "ranks_magpie_single"
    assert pipeline.main(["--config", str(recipe(tiny, single)), "stages=prompts", jobs]) == {"prompts": "done"}
    for name in ("code", "mag"):
        assert (run / "prompts" / f"{name}.jsonl").read_bytes() == (single / "prompts" / f"{name}.jsonl").read_bytes()
    assert not list((run / "prompts").glob("*.magpie.jsonl"))  # the rank shards are gone
