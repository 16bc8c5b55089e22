"""The sampling levers as pipeline arms: each arm is the GPU recipe plus one option of the `arm` config group
(configs/arm/), run in a run directory of its own; `evaluation.run_rows.arm_row` reads every figure of an arm's
row from that directory's files, and `benchmarks/drafter.py report` (run as a command) writes the rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nemo_dflash.config import REPO_CONFIGS, load_recipe
from nemo_dflash.evaluation.run_rows import arm_row

REPO = Path(__file__).resolve().parent.parent

# The levers as `drafter.py levers` defined them before they became arms (its LEVERS table): data, distillation and
# acceptance weights, draft kind, the selector's convention and the position weights.
LEVERS = {
    "a": ("t02", 0.0, 0.0, "dflash", None, "decay"), "b": ("t02", 1.0, 0.0, "dflash", None, "decay"),
    "b05": ("t02", 0.5, 0.0, "dflash", None, "decay"), "c": ("t1", 0.0, 0.0, "dflash", None, "decay"),
    "d": ("t1", 1.0, 0.0, "dflash", None, "decay"), "e": ("t02", 0.5, 0.5, "dflash", None, "decay"),
    "f": ("t02+t1", 1.0, 0.0, "dflash", None, "decay"), "v2i": ("t02", 1.0, 0.0, "dflash2", "inject", "decay"),
    "v2s": ("t02", 1.0, 0.0, "dflash2", "skip", "decay"),
    "v2i_dpace": ("t02", 1.0, 0.0, "dflash2", "inject", "dpace"),
    "v2s_dpace": ("t02", 1.0, 0.0, "dflash2", "skip", "dpace"),
    "v2f_dpace": ("t02+t1", 1.0, 0.0, "dflash2", "skip", "dpace"),
}
ANSWERS = {"t02": "a", "t1": "c"}  # the arm whose regenerate stage writes each answer set


def test_every_lever_is_an_arm_of_the_gpu_recipe(tmp_path):
    runs = tmp_path / "RUNS"
    assert sorted(p.stem for p in (REPO_CONFIGS / "arm").glob("*.yaml")) == sorted(LEVERS)
    for arm, (data, distill, accept, kind, outside, weights) in LEVERS.items():
        cfg = load_recipe("smollm2_135m_gpu.yaml", [f"+arm={arm}", f"run.dir={runs / arm}"])
        assert (cfg.loss.distill_weight, cfg.loss.accept_weight, cfg.draft.kind) == (distill, accept, kind), arm
        assert outside is None or cfg.loss.selector_outside == outside, arm
        assert cfg.loss.position_weights == weights, arm
        assert cfg.output_dir == f"{runs / arm}/run" and cfg.train.max_steps == 916, arm  # 30 M tokens, 32,768 a step
        sources = [Path(s.path).resolve() for s in cfg.data.sources]
        assert sources == [(runs / ANSWERS[d] / "data" / "regen.jsonl").resolve() for d in data.split("+")], arm
        if arm in ANSWERS.values():  # the arm that writes an answer set samples it as the lever did
            temp, top_p, spp = (0.2, 0.9, 1) if arm == "a" else (1.0, 1.0, 2)
            assert (cfg.regenerate.temperature, cfg.regenerate.top_p, cfg.regenerate.samples_per_prompt) == \
                (temp, top_p, spp), arm


def _results(path: Path, results: dict, speedup: dict | None = None, sha: str = "w" * 64) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.json").write_text(json.dumps({
        "draft_sha256": sha, "complete": True,
        "protocol": {"name": "paper", "max_new_tokens": 2048, "temperatures": sorted(results), "method": "batched"},
        "results": results, "speedup": speedup or {}}))


def _set(tau: float, no_loop: float) -> dict:
    return {"answers": 40, "mean_acceptance_length": tau, "mean_acceptance_length_no_loop": no_loop,
            "loop_share": 0.1}


def _answers(runs: Path, arm: str, temperature: float, top_p: float, spp: int) -> Path:
    data = runs / arm / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "regen_summary.json").write_text(json.dumps({"sampling": {"temperature": temperature, "top_p": top_p},
                                                         "samples_per_prompt": spp}) + "\n")
    return data / "regen.jsonl"


def _arm_run(runs: Path, arm: str, sources: list[Path], recipe: dict | None = None) -> Path:
    run = runs / arm
    (run / "run").mkdir(parents=True, exist_ok=True)
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe or {
        "loss": {"distill_weight": 1.0, "accept_weight": 0.0}, "draft": {"kind": "dflash"},
        "data": {"sources": [{"path": str(s)} for s in sources]}}))
    return run


def test_an_arm_finds_the_answers_of_arm_a_before_its_own_run_directory_exists(tmp_path, capsys):
    """`${run.dir}/../a/data/regen.jsonl` names arm a's answers through RUNS/b, which the run creates: the path is
    normalised, so the pre-load check finds the file (the OS would not follow `..` through a missing folder)."""
    from nemo_dflash.recipes.train import check_paths

    runs = tmp_path / "RUNS"
    answers = _answers(runs, "a", 0.2, 0.9, 1)
    answers.write_text("")
    cfg = load_recipe("smollm2_135m_gpu.yaml", ["+arm=b", f"run.dir={runs / 'b'}", "target.path=/nonexistent.gguf"])
    assert not (runs / "b").exists() and cfg.data.sources[0].path == str(answers)
    with pytest.raises(SystemExit) as e:
        check_paths(cfg)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "target.path" in err and "data.sources" not in err  # data found, target refused


def test_arm_row_reads_every_figure_from_the_files(tmp_path):
    runs = tmp_path / "RUNS"
    run = _arm_run(runs, "b", [_answers(runs, "a", 0.2, 0.9, 1)])
    (run / "run" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 5, "loss": 6.0, "tokens": 500.0, "step_s": 9.0},
        {"step": 10, "loss": 5.0, "tokens": 1000.0, "step_s": 0.25},
        {"step": 15, "loss": 5.0, "tokens": 1500.0, "step_s": 0.5},
        {"step": 10, "eval_loss": 4.0, "eval_accept_len": 2.5, "eval_sampled_accept_len": 1.9,
         "eval_sampled_accept_len_greedy_draft": 1.7, "tokens": 1000.0},
        {"step": 20, "eval_loss": 3.5, "eval_accept_len": 2.75, "eval_sampled_accept_len": 2.0,
         "eval_sampled_accept_len_greedy_draft": 1.8, "tokens": 2000.0}]) + "\n")
    (run / "run" / "summary.json").write_text(json.dumps({"steps": 20, "total_steps": 40, "train_seconds": 9.0,
                                                          "stopped_early": "train.max_minutes reached"}))
    sp = {"speedup": 1.2, "num_prompts": 20, "mean_acceptance_length": 2.9, "speedup_no_loop": 1.1,
          "per_prompt_speedup": {"median": 1.15}}
    rec = {"speedup": 0.9, "num_prompts": 7, "mean_acceptance_length": 1.8}
    _results(run / "eval", {"0": {"humaneval": _set(3.0, 2.5), "mtbench": _set(2.0, 1.9)},
                            "1": {"humaneval": _set(2.2, 2.1), "mtbench": _set(1.6, 1.6)}},
             {"0": {"humaneval": sp}, "0.2,p0.9": {"mtbench": rec}})
    _results(run / "eval_greedy_draft", {"1,greedy": {"humaneval": _set(1.5, 1.5), "mtbench": _set(1.4, 1.4)}})
    (run / "export").mkdir()
    (run / "export" / "model.safetensors.sha256").write_text("f" * 64 + "\n")

    row = arm_row(run, {"date": "2026-01-02"})
    assert (row["draft"], row["arm"], row["variant"], row["date"]) == ("sampling lever b", "b", "dflash", "2026-01-02")
    assert (row["loss"], row["distill_weight"], row["data_temperature"]) == ("distill 1", 1.0, "0.2 (top-p 0.9)")
    assert row["samples_per_prompt"] == 1  # read beside arm a's answers, which this arm trained on
    assert (row["train_tokens"], row["train_steps"], row["planned_steps"]) == (2000.0, 20, 40)
    assert row["stopped_early"] == "train.max_minutes reached"
    assert (row["sim_tau_heldout"], row["sampled_tau_heldout"], row["sampled_tau_heldout_greedy_draft"]) == \
        (2.75, 2.0, 1.8)  # the last held-out evaluation
    assert row["step_s_median"] == 0.5  # the warm-up step's 9 s does not move it
    assert [(e["step"], e["eval_accept_len"], e["eval_sampled_accept_len"]) for e in row["heldout_evals"]] == \
        [(10, 2.5, 1.9), (20, 2.75, 2.0)]  # and every one before it
    assert (row["humaneval_t0_tau"], row["humaneval_t0_tau_no_loop"], row["humaneval_t1_tau"]) == (3.0, 2.5, 2.2)
    assert (row["mtbench_t1_tau"], row["mtbench_t1_tau_greedy_draft"]) == (1.6, 1.4)
    assert (row["humaneval_t0_speedup"], row["humaneval_t0_speedup_no_loop"]) == (1.2, 1.1)
    assert row["humaneval_t0_speedup_prompts"] == 20
    assert row["humaneval_t1_speedup"] is None  # not timed
    assert row["recommended_sampling"] == "0.2,p0.9"  # not the argmax-proposal evaluation's key
    assert (row["mtbench_recommended_speedup"], row["mtbench_recommended_tau"]) == (0.9, 1.8)
    assert row["mtbench_recommended_speedup_prompts"] == 7
    assert (row["protocol"]["name"], row["protocol"]["max_new_tokens"], row["protocol"]["method"]) == \
        ("paper", 2048, "batched")
    # the weights hash: the one every evaluation file recorded (the weights stayed on their machine)
    assert row["draft_sha256"] == "w" * 64 and row["eval_draft_sha256_match"] is True
    assert row["model_safetensors_sha256"] == "f" * 64
    _results(run / "eval_greedy_draft", {"1,greedy": {"humaneval": _set(1.5, 1.5)}}, sha="x" * 64)  # another draft's
    assert arm_row(run, {})["eval_draft_sha256_match"] is False


def test_arm_row_takes_the_figures_of_further_evaluate_runs_after_eval(tmp_path):
    """T=0 by replay in RUN/eval, T=1 by the batched decoder and the timed speedups in RUN/eval_* runs of their own:
    each figure comes from the first run that has it (RUN/eval, then RUN/eval_* by name)."""
    run = _arm_run(tmp_path / "RUNS", "v2s", [])
    _results(run / "eval", {"0": {"humaneval": _set(3.0, 2.5), "mtbench": _set(2.0, 1.9)}})
    _results(run / "eval_a_t1", {"1": {"humaneval": _set(2.2, 2.1), "mtbench": _set(1.6, 1.6)},
                                 "0": {"humaneval": _set(9.0, 9.0)}})  # a later run's T=0 does not replace eval's
    _results(run / "eval_b_speed", {"1": {"humaneval": _set(7.0, 7.0)}},
             {"0": {"humaneval": {"speedup": 0.8, "num_prompts": 10}},
              "0.2,p0.9": {"humaneval": {"speedup": 0.9, "num_prompts": 10, "mean_acceptance_length": 1.7}},
              "1": {"mtbench": {"speedup": 0.7, "num_prompts": 10}}})
    (run / "eval_c_empty").mkdir()  # a directory without results.json is not a run
    row = arm_row(run, {})
    assert (row["humaneval_t0_tau"], row["humaneval_t0_tau_no_loop"]) == (3.0, 2.5)
    assert (row["humaneval_t1_tau"], row["mtbench_t1_tau"]) == (2.2, 1.6)  # eval_a_t1 before eval_b_speed
    assert (row["humaneval_t0_speedup"], row["mtbench_t1_speedup"], row["humaneval_t1_speedup"]) == (0.8, 0.7, None)
    assert (row["recommended_sampling"], row["humaneval_recommended_speedup"]) == ("0.2,p0.9", 0.9)
    assert row["protocol"]["temperatures"] == [0.0, "0.2,p0.9", 1.0]  # every run's, in order


def test_arm_f_names_both_answer_sets_and_a_dflash2_arm_its_selector(tmp_path):
    """Arm f trains on arm a's T=0.2 and arm c's T=1 answers (one and two samples a prompt); a DFlash2 arm's row has
    its variant and its loss names the selector's convention and D-PACE."""
    runs = tmp_path / "RUNS"
    f = _arm_run(runs, "f", [_answers(runs, "a", 0.2, 0.9, 1), _answers(runs, "c", 1.0, 1.0, 2)])
    row = arm_row(f, {})
    assert (row["data_temperature"], row["samples_per_prompt"]) == ("0.2 (top-p 0.9) + 1", 3)
    v2 = _arm_run(runs, "v2s_dpace", [runs / "a" / "data" / "regen.jsonl"], {
        "loss": {"distill_weight": 1.0, "accept_weight": 0.0, "selector_outside": "skip", "position_weights": "dpace"},
        "draft": {"kind": "dflash2"}, "data": {"sources": [{"path": str(runs / "a" / "data" / "regen.jsonl")}]}})
    row = arm_row(v2, {})
    assert (row["variant"], row["loss"]) == ("dflash2", "distill 1 + selector (skip), D-PACE")
    assert row["train_tokens"] == 0 and row["humaneval_t0_tau"] is None  # nothing trained or measured yet


def test_report_keeps_another_series_rows_and_replaces_its_own(tmp_path):
    """`drafter.py report --drafter-json`: a second run of an arm (`--series`) is appended beside the first run's row;
    running the same series again replaces its own row, never the other's; a folder that is no run is one line, exit 2."""
    runs = tmp_path / "RUNS"
    run = _arm_run(runs, "b", [_answers(runs, "a", 0.2, 0.9, 1)])
    (run / "run" / "metrics.jsonl").write_text(json.dumps({"step": 5, "eval_accept_len": 2.0, "tokens": 50.0}) + "\n")
    table = tmp_path / "rows.json"
    table.write_text(json.dumps([{"date": "2026-01-01", "commit": "old", "device": "cpu", "command": "c",
                                  "draft": "sampling lever b", "train_tokens": 1.0}]))

    def report(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO / "benchmarks" / "drafter.py"), "report", *extra],
                              capture_output=True, text=True, cwd=REPO, timeout=240,
                              env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})

    flags = ["--drafter-json", str(table), "--device", "cpu", "--commit", "new", "--date", "2026-01-02"]
    res = report(str(run), *flags, "--series", "second")
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(table.read_text())
    assert [(r["draft"], r.get("series"), r["commit"]) for r in rows] == \
        [("sampling lever b", None, "old"), ("sampling lever b", "second", "new")]
    assert rows[1]["train_tokens"] == 50.0 and rows[1]["sim_tau_heldout"] == 2.0
    assert res.stdout.splitlines()[1].split(" | ")[:2] == ["b", "dflash"]  # the table: the arm, its variant
    res = report(str(run), *flags)  # no series: the first run's row is the one replaced
    assert res.returncode == 0, res.stderr[-2000:]
    assert [(r.get("series"), r["commit"]) for r in json.loads(table.read_text())] == [("second", "new"), (None, "new")]
    res = report(str(tmp_path), *flags)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "not a pipeline run directory" in res.stderr
