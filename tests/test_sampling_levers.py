"""benchmarks/drafter.py levers: every figure of a lever's row is read from its run's and evaluations' files,
and a run stopped by its time limit is continued, not taken as finished."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("drafter", REPO / "benchmarks" / "drafter.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _results(path: Path, key: str, sets: dict, speedup: dict | None = None, sha: str = "w" * 64) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.json").write_text(json.dumps({
        "draft_sha256": sha, "complete": True, "protocol": {"max_new_tokens": 2048, "temperatures": [key]},
        "results": {key: sets} if sets else {}, "speedup": speedup or {}}))


def _set(tau: float, no_loop: float) -> dict:
    return {"answers": 40, "mean_acceptance_length": tau, "mean_acceptance_length_no_loop": no_loop,
            "loop_share": 0.1}


def test_lever_row_reads_every_figure_from_the_files(tmp_path):
    levers = _script()
    out = tmp_path / "out"
    run = out / "runs" / "b"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 5, "loss": 6.0, "tokens": 500.0, "step_s": 9.0},
        {"step": 10, "loss": 5.0, "tokens": 1000.0, "step_s": 0.25},
        {"step": 15, "loss": 5.0, "tokens": 1500.0, "step_s": 0.5},
        {"step": 10, "eval_loss": 4.0, "eval_accept_len": 2.5, "eval_sampled_accept_len": 1.9,
         "eval_sampled_accept_len_greedy_draft": 1.7, "tokens": 1000.0},
        {"step": 20, "eval_loss": 3.5, "eval_accept_len": 2.75, "eval_sampled_accept_len": 2.0,
         "eval_sampled_accept_len_greedy_draft": 1.8, "tokens": 2000.0}]) + "\n")
    (run / "summary.json").write_text(json.dumps({"steps": 20, "total_steps": 40, "train_seconds": 9.0,
                                                  "stopped_early": "train.max_minutes reached"}))
    ev = out / "eval" / "b"
    _results(ev / "t0", "0", {"humaneval": _set(3.0, 2.5), "mtbench": _set(2.0, 1.9)})
    _results(ev / "t1", "1", {"humaneval": _set(2.2, 2.1), "mtbench": _set(1.6, 1.6)})
    _results(ev / "t1_greedy_draft", "1,greedy", {"humaneval": _set(1.5, 1.5), "mtbench": _set(1.4, 1.4)})
    sp = {"speedup": 1.2, "num_prompts": 20, "mean_acceptance_length": 2.9, "speedup_no_loop": 1.1,
          "per_prompt_speedup": {"median": 1.15}}
    rec = {"speedup": 0.9, "num_prompts": 7, "mean_acceptance_length": 1.8}
    _results(ev / "speed", "0", {}, {"0": {"humaneval": sp}, "0.2,p0.9": {"mtbench": rec}})
    (out / "export" / "b").mkdir(parents=True)
    (out / "export" / "b" / "model.safetensors.sha256").write_text("f" * 64 + "\n")

    row = levers.lever_row(out, "b", "pkg:smollm2")
    assert (row["loss"], row["distill_weight"], row["data_temperature"]) == ("distill 1.0", 1.0, "0.2 (top-p 0.9)")
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
    assert row["humaneval_t1_speedup"] is None  # not timed
    assert (row["mtbench_recommended_speedup"], row["mtbench_recommended_tau"]) == (0.9, 1.8)
    assert row["mtbench_recommended_speedup_prompts"] == 7
    # the weights hash: the one every evaluation file recorded (the weights stayed on their machine)
    assert row["draft_sha256"] == "w" * 64 and row["eval_draft_sha256_match"] is True
    assert row["model_safetensors_sha256"] == "f" * 64
    _results(ev / "t1", "1", {"humaneval": _set(2.2, 2.1)}, sha="x" * 64)  # another draft's answers
    assert levers.lever_row(out, "b", "pkg:smollm2")["eval_draft_sha256_match"] is False

    # a run its time limit stopped is continued by `train`; one that ran its steps is finished
    assert not levers.finished(run)
    (run / "summary.json").write_text(json.dumps({"steps": 40, "total_steps": 40}))
    assert levers.finished(run)


def test_chain_gives_each_lever_its_gpu_and_every_other_flag(tmp_path, monkeypatch):
    """`chain` starts one `_chain_one` per lever with the same flags, its own --levers and --gpu-list; each
    runs train, eval (only the --acceptance runs asked for) and speed (--speedup-only) on that GPU."""
    levers = _script()
    seen = []

    def fake_run_all(jobs, logs, per_gpu=None):
        seen.append(jobs)
        return {name: 0 for name, _, _ in jobs}

    monkeypatch.setattr(levers, "run_all", fake_run_all)
    out = str(tmp_path / "out")
    levers.main(["levers", "chain", out, "--levers", "a,c", "--gpu-list", "2,3", "--acceptance", "t0,t1",
                 "--speed-max-new-tokens", "1024", "--max-minutes", "6.5",
                 "--eval-extra", "--num-prompts 40 --max-minutes 4"])
    (jobs,) = seen
    assert [j[0] for j in jobs] == ["chain_a", "chain_c"]
    for (_, argv, _), lever, gpu in zip(jobs, "ac", "23"):
        assert argv[2:5] == ["levers", "_chain_one", out]
        assert argv[-4:] == ["--levers", lever, "--gpu-list", gpu]
        assert "a,c" not in argv and "2,3" not in argv and argv.count("--acceptance") == 1

    seen.clear()
    levers.main(jobs[1][1][2:])  # lever c's chain, in this process
    train_jobs, export_jobs, eval_jobs, speed_jobs = seen
    assert [j[0] for j in train_jobs] == ["train_c"] and train_jobs[0][2] == {"CUDA_VISIBLE_DEVICES": "3"}
    assert [j[0] for j in eval_jobs] == ["eval_c_t0", "eval_c_t1"]
    assert all(env == {"CUDA_VISIBLE_DEVICES": "3"} for _, _, env in export_jobs + eval_jobs + speed_jobs)
    (_, speed_argv, _), = speed_jobs
    assert "--speedup-only" in speed_argv and speed_argv[speed_argv.index("--max-new-tokens") + 1] == "1024"

    def last(argv, flag):  # what evaluate's argparse takes: the last occurrence
        return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]
    # --eval-extra reaches every evaluate run; the acceptance runs take its prompt count and cap, the timing
    # phase keeps its own (its cap was cut to the acceptance runs' 4 minutes before, and HumanEval T=1 went untimed)
    assert all(last(a, "--max-minutes") == "4" and last(a, "--num-prompts") == "40" for _, a, _ in eval_jobs)
    assert last(speed_argv, "--max-minutes") == "6.5" and last(speed_argv, "--num-prompts") == "20"


def test_lever_f_trains_on_both_answer_sets_and_its_row_names_both(tmp_path, monkeypatch):
    """Lever f: one training on the T=0.2 and the T=1 answers together (two data sources), and its row says so."""
    levers = _script()
    seen = []
    monkeypatch.setattr(levers, "run_all", lambda jobs, logs, per_gpu=None: seen.append(jobs) or {n: 0 for n, _, _ in jobs})
    out = tmp_path / "out"
    levers.main(["levers", "train", str(out), "--levers", "f", "--tokens", "1e6"])
    ((name, argv, _),) = seen[0]
    sources = next(a for a in argv if a.startswith("data.sources="))
    assert name == "train_f" and sources == (f"data.sources=[{{path: {out / 'data' / 't02.jsonl'}}}, "
                                             f"{{path: {out / 'data' / 't1.jsonl'}}}]")
    assert "loss.distill_weight=1.0" in argv
    (out / "runs" / "f").mkdir(parents=True)
    row = levers.lever_row(out, "f", "pkg:smollm2")
    assert (row["data_temperature"], row["samples_per_prompt"]) == ("0.2 (top-p 0.9) + 1", 3)


def test_report_keeps_another_series_rows_and_replaces_its_own(tmp_path, capsys):
    """`report --json`: a second run of a lever (`--series`) is appended beside the first run's row; running the
    same series again replaces its own row, never the other's."""
    import argparse

    levers = _script()
    out = tmp_path / "out"
    run = out / "runs" / "b"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 5, "eval_accept_len": 2.0, "tokens": 50.0}) + "\n")
    table = tmp_path / "rows.json"
    table.write_text(json.dumps([{"draft": "sampling lever b", "commit": "old", "train_tokens": 1.0}]))

    def report(series):
        ns = argparse.Namespace(out=str(out), target="pkg:smollm2", levers="b", json=str(table), date="2026-01-02",
                                device="cpu", commit="new", note="", series=series)
        levers.report(ns)
        return json.loads(table.read_text())

    rows = report("second")
    assert [(r["draft"], r.get("series"), r["commit"]) for r in rows] == \
        [("sampling lever b", None, "old"), ("sampling lever b", "second", "new")]
    assert rows[1]["train_tokens"] == 50.0
    assert len(report("second")) == 2  # its own row replaced, the first run's kept
    rows = report(None)  # no series: the first run's row is the one replaced
    assert [(r.get("series"), r["commit"]) for r in rows] == [("second", "new"), (None, "new")]

    # without --levers, `report` takes every lever OUT holds a run of (not only a, b, c, d)
    (out / "runs" / "f").mkdir()
    (out / "runs" / "f" / "metrics.jsonl").write_text(json.dumps({"step": 5, "eval_accept_len": 1.5}) + "\n")
    ns = argparse.Namespace(out=str(out), target="pkg:smollm2", levers=None, json=None, date=None, device="cpu",
                            commit=None, note="", series=None)
    capsys.readouterr()
    levers.report(ns)
    printed = [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert printed == ["b", "f"]


def test_run_all_queues_the_jobs_of_one_gpu_and_runs_other_gpus_beside_them(tmp_path):
    """At most --per-gpu jobs at once on one GPU (two DFlash2 trainings of the GPU recipe do not fit one H200): each
    job writes its start and end time; the two jobs of GPU 0 never overlap, GPU 1's job overlaps one of them, and
    with per_gpu=2 GPU 0's two overlap."""
    import sys

    levers = _script()
    job = ("import sys, time; t = time.time(); time.sleep(0.4); "
           "open(sys.argv[1], 'w').write(f'{t} {time.time()}')")

    def spans(per_gpu):
        jobs = [(f"j{i}", [sys.executable, "-c", job, str(tmp_path / f"{per_gpu}_{i}")], {"CUDA_VISIBLE_DEVICES": g})
                for i, g in enumerate("001")]
        codes = levers.run_all(jobs, tmp_path / "logs", per_gpu=per_gpu)
        assert codes == {"j0": 0, "j1": 0, "j2": 0}
        return [tuple(map(float, (tmp_path / f"{per_gpu}_{i}").read_text().split())) for i in range(3)]

    def overlap(a, b):
        return a[0] < b[1] and b[0] < a[1]

    (a, b, c) = spans(1)
    assert not overlap(a, b) and (overlap(a, c) or overlap(b, c))
    (a, b, _) = spans(2)
    assert overlap(a, b)
