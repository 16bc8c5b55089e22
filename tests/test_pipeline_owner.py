"""`recipes.pipeline`: one owner per run directory. A `run.dir` holding what the pipeline did not write (a model, a
user's files, another run's training) is refused in one line before anything is written; a second pipeline on a
run directory in use is refused before it writes its recipe.yaml; an `output_dir` holding a training this run
directory never started is not adopted."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_dflash.files import FileLock
from nemo_dflash.recipes import pipeline

from test_pipeline import RECIPE, snapshot, tiny  # noqa: F401 (tiny: the module's tiny target)


@pytest.fixture
def no_load(monkeypatch):
    monkeypatch.setattr("nemo_dflash.target.loading.load_target", lambda *a, **k: pytest.fail("a model loaded"))


def write_recipe(tiny: dict, run: Path, body: str = RECIPE, **extra: str) -> str:  # noqa: F811
    path = run.parent / f"{run.name}.yaml"
    path.write_text(body.format(run=run, target=tiny["target"], chat=tiny["chat"]) +
                    "".join(f"{k}: {v}\n" for k, v in extra.items()))
    return str(path)


def refused(capsys, argv: list[str], *words: str) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        pipeline.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    for w in words:
        assert w in err[0], (w, err[0])
    return err[0]


FOREIGN = {  # a folder run.dir may point at, by mistake: what it holds
    "model": {"config.json": "{}", "model.safetensors": "not really", "tokenizer.json": "{}"},
    "user_files": {"summary.json": '{"mine": 1}\n', "recipe.yaml": "mine: 1\n"},
    "another_runs_training": {"config.yaml": "optim: {lr: 1}\n", "metrics.jsonl": "{}\n", "summary.json": "{}\n"},
}


@pytest.mark.parametrize("kind", list(FOREIGN))
def test_a_run_dir_holding_files_the_pipeline_did_not_write_is_refused_before_any_write(tiny, tmp_path, capsys,
                                                                                         no_load, kind):  # noqa: F811
    run = tmp_path / kind
    run.mkdir()
    for name, text in FOREIGN[kind].items():
        (run / name).write_text(text)
    before = snapshot(run)
    line = refused(capsys, ["--config", write_recipe(tiny, run)], f"run.dir {run}", "did not write")
    assert sorted(FOREIGN[kind])[0] in line
    assert snapshot(run) == before and sorted(p.name for p in run.iterdir()) == sorted(FOREIGN[kind])


def test_a_second_pipeline_on_a_run_dir_in_use_is_refused_before_it_writes_its_recipe(tiny, tmp_path, capsys,
                                                                                     no_load):  # noqa: F811
    run = tmp_path / "run"
    (run / "stages").mkdir(parents=True)
    holder = FileLock(run / "stages" / "pipeline.lock")  # another pipeline, running there
    holder.acquire()
    try:
        before = snapshot(run)
        refused(capsys, ["--config", write_recipe(tiny, run), "stages=prompts"], "in use by another pipeline",
                "run.dir")
        assert snapshot(run) == before and not (run / "recipe.yaml").exists()
    finally:
        holder.release()
    assert pipeline.main(["--config", write_recipe(tiny, run), "stages=prompts"]) == {"prompts": "done"}
    assert not (run / "stages" / "pipeline.lock").exists()  # released (and removed) at the end


def test_an_output_dir_holding_another_runs_training_is_not_adopted(tiny, tmp_path, capsys, no_load):  # noqa: F811
    """output_dir=RUN_A/train from run directory B: A's resumable training is not taken as B's own (before, B
    resumed it under its own settings and rewrote A's config.yaml)."""
    a_train = tmp_path / "a" / "train"
    step = a_train / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("{}\n")
    (a_train / "config.yaml").write_text("optim: {lr: 0.003}\n")
    before = snapshot(tmp_path / "a")
    run_b = tmp_path / "b"
    config = write_recipe(tiny, run_b, RECIPE.replace("output_dir: {run}/train", f"output_dir: {a_train}"))
    refused(capsys, ["--config", config, "stages=train", "optim.lr=1e-4"], "redo=train", str(a_train))
    assert snapshot(tmp_path / "a") == before and not run_b.exists()


def test_a_training_whose_config_names_this_run_dir_is_its_own(tiny, tmp_path, no_load):  # noqa: F811
    """A training started from this run directory before stages recorded their starts (its config.yaml's run.dir
    is this one) is continued, not refused as another run's."""
    import yaml

    run = tmp_path / "run"
    train = run / "train"
    step = train / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("{}\n")
    config = write_recipe(tiny, run)
    (train / "config.yaml").write_text(yaml.safe_dump({"run": {"dir": str(run)}, "optim": {"lr": 0.003}}))
    cfg = pipeline.load_recipe(config, [], data_optional=True)
    plan = pipeline.Pipeline(cfg, ["train"], [])
    assert [(s.name, s.action) for s in plan.selected] == [("train", "run")]
    (train / "config.yaml").write_text(yaml.safe_dump({"run": {"dir": str(tmp_path / "another")}}))
    with pytest.raises(pipeline.UsageError, match="redo=train"):
        pipeline.Pipeline(cfg, ["train"], [])
