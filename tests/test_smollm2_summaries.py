"""benchmarks/drafter.py summaries: the drafter row is read from the run's files, merging several evaluate runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _torchrun import run_command

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "drafter.py"


def _results(path: Path, method: str, complete: bool, results: dict, speedup: dict, temps: list) -> Path:
    path.write_text(json.dumps({"protocol": {"name": "paper", "method": method, "decode": "graphs" if speedup else "eager",
                                             "temperatures": temps, "turns": 2},
                                "complete": complete, "results": results, "speedup": speedup}))
    return path


def _figures(tau: float) -> dict:
    return {"answers": 3, "mean_acceptance_length": tau, "mean_acceptance_length_first256": tau - 0.5, "loop_share": 0.25}


def test_drafter_row_merges_replay_sequential_and_batched_runs(tmp_path):
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "regenerate.log").write_text("")
    (out / "runs" / "main").mkdir(parents=True)
    (out / "runs" / "main" / "summary.json").write_text(json.dumps({"tokens_seen": 123, "steps": 7, "eval_accept_len": 4.5, "data": {"tokens": 50, "supervised_tokens": 40}}))
    replay = _results(tmp_path / "replay.json", "replay", True,
                      {"0": {"mtbench": _figures(4.0), "humaneval": _figures(3.0)}}, {}, [0.0])
    speed = {"answers": 2, "speedup": 2.5, "ar": {"time_per_token_ms": 2.0}, "spec": {"time_per_token_ms": 0.8},
             "per_prompt_speedup": {"prompts": 2, "min": 1.5, "median": 2.0, "max": 3.5}}
    sequential = _results(tmp_path / "seq.json", "sequential", False,  # 2 prompts only: not the whole protocol
                          {"0": {"mtbench": _figures(9.0), "humaneval": _figures(9.0)}},
                          {"0": {"mtbench": {**speed, "speedup": 1.9}, "humaneval": speed}}, [0.0])
    batched = _results(tmp_path / "t1.json", "batched", True,
                       {"1": {"mtbench": _figures(1.5), "humaneval": _figures(1.75)}}, {}, [1.0])
    res = run_command([sys.executable, str(SCRIPT), "summaries", str(out), "--device", "GPU", "--commit", "abc (training)",
                       "--eval", str(replay), str(sequential), str(batched)], 120)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    row = json.loads(text[text.rindex("[\n {"):])[-1]
    # acceptance from the whole-protocol replay, not the 2-prompt sequential run given after it
    assert (row["mtbench_t0_tau"], row["humaneval_t0_tau"], row["humaneval_t0_tau_first256"]) == (4.0, 3.0, 2.5)
    assert (row["mtbench_t1_tau"], row["humaneval_t1_tau"]) == (1.5, 1.75)
    assert row["humaneval_t0_speedup"] == 2.5 and row["speedup_t0"] == 1.9  # the smaller set's speedup
    assert row["humaneval_t0_speedup_per_prompt"] == {"prompts": 2, "min": 1.5, "median": 2.0, "max": 3.5}
    assert row["humaneval_t0_spec_ms_per_token"] == 0.8 and row["humaneval_t1_speedup"] is None
    assert row["complete"] is True  # the incomplete run gave only the speedup
    assert row["protocol"]["temperatures"] == [0.0, 1.0] and row["protocol"]["speedup_decode"] == "graphs"
    assert row["commit"] == "abc (training)" and row["train_tokens"] == 123 and row["sim_tau_heldout"] == 4.5
    assert [s["taken"] for s in row["eval_sources"]][1] == ["speedup T=0 mtbench", "speedup T=0 humaneval"]


def test_a_missing_results_file_is_refused_in_one_line(tmp_path):
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "regenerate.log").write_text("")
    res = run_command([sys.executable, str(SCRIPT), "summaries", str(out), "--device", "GPU", "--eval", str(tmp_path / "nope.json")], 120)
    assert res.returncode != 0 and res.stderr.strip().splitlines()[-1].startswith("error: no evaluate results at")


def test_a_pipeline_run_directory_is_read(tmp_path):
    """`recipes.pipeline ... run.dir=OUT` (docs/train.md): data/regen_summary.json, run/summary.json, eval/results.json."""
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    (out / "data" / "regen.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n")
    (out / "data" / "regen_summary.json").write_text(json.dumps({
        "tokens_per_s": 1000.0, "generated_tokens": 5000, "generate_seconds": 5.0, "answers": 1, "looping_before": 1,
        "looping_after": 0, "capped_before": 0, "capped_after": 0, "ranks_detail": [{}, {}],
        "sampling": {"temperature": 0.2, "top_p": 0.9, "from": "given"}}) + "\n")
    (out / "run").mkdir()
    (out / "run" / "summary.json").write_text(json.dumps({"tokens_seen": 321, "steps": 9, "eval_accept_len": 2.5,
                                                          "data": {"tokens": 50, "supervised_tokens": 40}}))
    (out / "eval").mkdir()
    _results(out / "eval" / "results.json", "replay", True,
             {"0": {"mtbench": _figures(4.0), "humaneval": _figures(3.0)}}, {}, [0.0])
    regen_json = tmp_path / "regen_rows.json"
    res = run_command([sys.executable, str(SCRIPT), "summaries", str(out), "--device", "GPU", "--commit", "abc",
                       "--regen-json", str(regen_json)], 120)
    assert res.returncode == 0, res.stderr
    drafter = json.loads(res.stdout[res.stdout.rindex("[\n {"):])[-1]
    assert (drafter["train_tokens"], drafter["train_steps"], drafter["sim_tau_heldout"]) == (321, 9, 2.5)
    assert (drafter["mtbench_t0_tau"], drafter["humaneval_t0_tau"]) == (4.0, 3.0)
    regen = json.loads(regen_json.read_text())[-1]
    assert (regen["pipeline_tokens_per_s"], regen["world"], regen["conversations"]) == (1000.0, 2, 1)
    assert (regen["tokens"], regen["looping_before"], regen["sampling"]["top_p"]) == (50, 1, 0.9)


def _training_run(out: Path, summary: dict) -> None:
    run = out / "run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("train: {micro_batch_size: 2, compile: true}\ndata: {pack_length: 100}\n"
                                     "loss: {num_anchors: 8, distill_weight: 1.0, impl: chunked}\n")
    rows = [{"step": 100, "tok_s": 9e9, "mfu": 0.9, "step_s": 0.001, "peak_mem_gb": 1.0},  # warm-up: left out
            {"step": 225, "tok_s": 800.0, "mfu": 0.20, "step_s": 0.5, "peak_mem_gb": 3.0},
            {"step": 250, "tok_s": 400.0, "mfu": 0.10, "step_s": 1.0, "peak_mem_gb": 3.0},  # an evaluation window
            {"step": 250, "eval_loss": 1.0},
            {"step": 275, "tok_s": 820.0, "mfu": 0.21, "step_s": 0.49, "peak_mem_gb": 3.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps(summary))


def test_the_training_throughput_row_is_the_median_window_per_gpu(tmp_path):
    """Median of the windows after step 200 (800 of 400/800/820), divided by the run's world (4): 200 a GPU.
    A summary without `world` (older runs) gives it from the tokens a step over one rank's slots: 790/(2 x 100)."""
    for name, summary in (("new", {"steps": 300, "tokens_seen": 237000, "world": 4, "data": {"train_samples": 9}}),
                          ("old", {"steps": 300, "tokens_seen": 237000, "data": {"train_samples": 9}})):
        out = tmp_path / name
        _training_run(out, summary)
        rows = tmp_path / f"{name}.json"
        rows.write_text("[]")
        run_command([sys.executable, str(SCRIPT), "summaries", str(out), "--device", "GPU", "--no-drafter-row",
                     "--train-json", str(rows)], 120).check_returncode()
        (row,) = json.loads(rows.read_text())
        assert row["world"] == 4 and row["tokens_per_s"] == 200.0 and row["tokens_per_s_note"] == "per GPU"
        assert row["mfu"] == 0.20 and row["step_ms"] == 500.0 and row["mbs"] == 2 and row["steps"] == 300
        assert "median of the 3 logged windows after step 200" in row["case"]


def test_train_json_without_training_files_is_refused_in_one_line(tmp_path):
    rows = tmp_path / "rows.json"
    rows.write_text("[]")
    res = run_command([sys.executable, str(SCRIPT), "summaries", str(tmp_path), "--device", "GPU",
                       "--no-drafter-row", "--train-json", str(rows)], 120)
    assert res.returncode != 0 and "--train-json" in res.stderr and json.loads(rows.read_text()) == []


def test_the_gap_per_epoch_is_held_out_minus_training_loss_at_each_epochs_end():
    """Epochs of 100 steps, 250 steps run: training loss 2.0 / 1.5 / 1.2 over each end's last 10 steps (noise
    before them left out), held-out 1.9 / 1.6 / 1.4 there: gaps -0.1, +0.1 and +0.2 at epochs 1, 2 and 2.5.
    Without `steps_per_epoch` in the summary the epoch is the train split's tokens (1000 x 8/10) over the
    tokens a step (2000/250): 100 steps again, marked estimated."""
    from nemo_dflash.train.metrics import epoch_gaps

    train = [{"step": s, "loss": 9.0} for s in range(5, 90, 5)]
    train += [{"step": s, "loss": 2.0} for s in range(91, 101)] + [{"step": s, "loss": 1.5} for s in range(191, 201)]
    train += [{"step": s, "loss": 1.2} for s in range(241, 251)]
    evals = [{"step": 100, "eval_loss": 1.9}, {"step": 200, "eval_loss": 1.6}, {"step": 250, "eval_loss": 1.4}]
    for name, extra in (("exact", {"steps_per_epoch": 100}), ("estimated", {})):
        summary = {"steps": 250, "tokens_seen": 2000, "data": {"tokens": 1000, "samples": 10, "train_samples": 8},
                   **extra}
        gaps = epoch_gaps(train + evals, summary)
        assert gaps["estimated"] is (name == "estimated") and gaps["steps_per_epoch"] == 100
        got = [(p["epoch"], p["train_loss"], p["eval_loss"], p["gap"]) for p in gaps["points"]]
        assert got == [(1.0, 2.0, 1.9, -0.1), (2.0, 1.5, 1.6, 0.1), (2.5, 1.2, 1.4, 0.2)]


def test_the_drafter_row_carries_no_loop_recommended_loss_data_temperature_and_hash(tmp_path):
    """The sampling issue's keys: no-loop tau, the recommended sampling's speedup (evaluate's key "0.2,p0.9"), the
    loss and data temperature from the run's recipe and regeneration summary, and the export's weights hash
    checked against the one the evaluation recorded (a file that names another draft makes the match false)."""
    import torch
    from safetensors.torch import save_file

    from nemo_dflash.draft.build import draft_weights_sha256

    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    (out / "data" / "regen_summary.json").write_text(json.dumps({"samples_per_prompt": 2,
                                                                 "sampling": {"temperature": 0.2, "top_p": 0.9}}))
    (out / "recipe.yaml").write_text("loss:\n  distill_weight: 1.0\n  accept_weight: 0.0\n")
    (out / "run").mkdir()
    (out / "run" / "summary.json").write_text(json.dumps({"tokens_seen": 1, "steps": 1, "data": {"tokens": 5, "supervised_tokens": 4}}))
    (out / "export").mkdir()
    save_file({"w": torch.arange(4.0)}, str(out / "export" / "model.safetensors"))
    (out / "export" / "config.json").write_text("{}")
    sha = draft_weights_sha256(out / "export")
    rec = {"answers": 2, "speedup": 1.8, "speedup_no_loop": 1.4, "mean_acceptance_length": 3.5, "num_prompts": 2}

    def write(name: str, draft_sha: str) -> Path:
        path = _results(tmp_path / name, "batched", True,
                        {"0": {"mtbench": {**_figures(4.0), "mean_acceptance_length_no_loop": 3.25, "answers_no_loop": 2},
                               "humaneval": _figures(3.0)}},
                        {"0.2,p0.9": {"mtbench": rec}}, [0.0, "0.2,p0.9"])
        path.write_text(json.dumps({**json.loads(path.read_text()), "draft_sha256": draft_sha}))
        return path

    def row(results: Path) -> dict:
        res = run_command([sys.executable, str(SCRIPT), "summaries", str(out), "--device", "GPU", "--eval", str(results)], 120)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout[res.stdout.rindex("[\n {"):])[-1]

    good = row(write("good.json", sha))
    assert (good["mtbench_t0_tau_no_loop"], good["mtbench_t0_answers_no_loop"], good["humaneval_t0_tau_no_loop"]) == (3.25, 2, None)
    assert good["recommended_sampling"] == "0.2,p0.9"
    assert (good["mtbench_recommended_speedup"], good["mtbench_recommended_speedup_no_loop"],
            good["mtbench_recommended_tau"], good["humaneval_recommended_speedup"]) == (1.8, 1.4, 3.5, None)
    assert (good["loss"], good["data_temperature"], good["samples_per_prompt"]) == ("distill 1", "0.2 (top-p 0.9)", 2)
    assert good["draft_sha256"] == sha and good["eval_draft_sha256_match"] is True
    assert row(write("other.json", "0" * 64))["eval_draft_sha256_match"] is False


def test_the_scaling_curve_joins_each_run_summary_to_its_drafter_row(tmp_path):
    """`drafter.py curve`: a run's point takes its tokens and held-out tau from its summary.json and its real tau
    from the drafter row with the same training tokens; a lever's row (another draft) with those tokens is not taken."""
    run = tmp_path / "smollm2_drafter_9m_run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"tokens_seen": 9_000_000, "eval_accept_len": 2.5,
                                                  "data": {"tokens": 3_000_000}}))
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([{"draft": "sampling lever a", "train_tokens": 9_000_000, "humaneval_t0_tau": 9.0},
                                {"train_tokens": 9_000_000.0, "humaneval_t0_tau": 2.25, "mtbench_t1_tau": 1.5}]))
    png = tmp_path / "curve.png"
    res = run_command([sys.executable, str(SCRIPT), "curve", str(run), "--rows", str(rows), "--png", str(png)], 120)
    assert res.returncode == 0, res.stderr
    line = next(x for x in (res.stdout + res.stderr).splitlines() if x.startswith("| smollm2_drafter_9m_run"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1:5] == ["9.0", "3.0", "3.00", "2.50"] and cells[6] == "2.25" and cells[-1] == "1.50"
    assert png.stat().st_size > 0


def test_a_second_summary_of_one_draft_updates_its_row_instead_of_adding_one(tmp_path):
    """`summaries --drafter-json` twice for one draft at one protocol (the second time without the training files
    and with one more evaluate run) leaves one row: the second run's measured values, the first run's
    training tokens where the second had none, and the first row's provenance under `merged_rows`."""
    out = tmp_path / "out"
    (out / "run").mkdir(parents=True)
    (out / "run" / "summary.json").write_text(json.dumps({"tokens_seen": 777, "steps": 3, "data": {"tokens": 5}}))
    t0 = _results(tmp_path / "t0.json", "replay", True, {"0": {"mtbench": _figures(4.0), "humaneval": _figures(3.0)}},
                  {}, [0.0])
    t0.write_text(json.dumps({**json.loads(t0.read_text()), "draft_sha256": "a" * 64}))
    rec = _results(tmp_path / "rec.json", "batched", True, {}, {"0.2,p0.9": {"mtbench": {"answers": 2, "speedup": 1.8}}},
                   ["0.2,p0.9"])
    rec.write_text(json.dumps({**json.loads(rec.read_text()), "draft_sha256": "a" * 64}))
    rows = tmp_path / "drafter_summary.json"
    rows.write_text(json.dumps([{"date": "2026-01-01", "commit": "c0", "device": "GPU", "command": "older",
                                 "draft_sha256": None, "humaneval_t0_tau": 1.0}]))
    for commit, evals in (("c1", [t0]), ("c2", [t0, rec])):
        res = run_command([sys.executable, str(SCRIPT), "summaries", str(out), "--device", "GPU", "--commit", commit,
                           "--eval", *map(str, evals), "--drafter-json", str(rows)], 120)
        assert res.returncode == 0, res.stderr
        (out / "run" / "summary.json").unlink(missing_ok=True)
    older, row = json.loads(rows.read_text())
    assert older["command"] == "older"  # a row without a weights hash is never merged
    assert row["commit"] == "c2" and row["train_tokens"] == 777 and row["mtbench_recommended_speedup"] == 1.8
    assert row["mtbench_t0_tau"] == 4.0 and [m["commit"] for m in row["merged_rows"]] == ["c1"]


def test_dedupe_folds_the_rows_of_one_draft_and_protocol(tmp_path):
    """`drafter.py dedupe FILE`: rows of one weights hash and protocol fold into the later one's place (dates never
    go back); another protocol, another lever name or a row without a hash stays a row of its own."""
    head = {"device": "GPU", "command": "x"}
    paper, quick = {"name": "paper", "max_new_tokens": 2048}, {"name": "quick", "max_new_tokens": 64}
    given = [{**head, "date": "2026-01-01", "commit": "a", "draft_sha256": "h1", "protocol": paper, "train_tokens": 5, "tau": 2.0},
             {**head, "date": "2026-01-02", "commit": "b", "draft_sha256": "h1", "protocol": quick, "tau": 1.5},
             {**head, "date": "2026-01-02", "commit": "c", "draft_sha256": None, "tau": 9.0},
             {**head, "date": "2026-01-03", "commit": "d", "draft_sha256": "h1", "protocol": paper, "train_tokens": None,
              "tau": 2.5, "rec": 3.0},
             {**head, "date": "2026-01-03", "commit": "e", "draft_sha256": "h1", "draft": "lever b", "protocol": paper, "tau": 7.0}]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(given))
    res = run_command([sys.executable, str(SCRIPT), "dedupe", str(path)], 120)
    assert res.returncode == 0, res.stderr
    rows = json.loads(path.read_text())
    assert [r["commit"] for r in rows] == ["b", "c", "d", "e"]
    merged = rows[2]
    assert (merged["train_tokens"], merged["tau"], merged["rec"]) == (5, 2.5, 3.0)
    assert merged["merged_rows"] == [{"date": "2026-01-01", "commit": "a", "device": "GPU", "command": "x"}]
    assert [r["date"] for r in rows] == sorted(r["date"] for r in rows)
