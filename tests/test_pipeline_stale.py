"""`recipes.pipeline` as a build graph: a stage whose inputs changed (an upstream stage run again, an input file
edited in place) runs again, and so does every stage after it; an incomplete stage is never continued under
settings other than those it started with."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file

from nemo_dflash.recipes import export, pipeline
from nemo_dflash.recipes.stage_graph import Fingerprints, entry_path

from _tiny_target import write_chat_jsonl
from test_pipeline import RECIPE, snapshot, spy_resume, tiny  # noqa: F401 (tiny: the module's tiny target)

LATER = ("train", "export", "evaluate")


@pytest.fixture
def own(tiny, tmp_path) -> dict:  # noqa: F811
    """A complete run of its own, its chat file a copy the test may edit."""
    chat = write_chat_jsonl(tmp_path / "chat.jsonl", n=6)
    run = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(RECIPE.format(run=run, target=tiny["target"], chat=chat))
    assert pipeline.main(["--config", str(config)]) == {s: "done" for s in pipeline.STAGES}
    return {"run": run, "config": str(config), "chat": chat, "target": tiny["target"]}


def marker(run: Path, stage: str) -> dict:
    return json.loads((run / "stages" / f"{stage}.json").read_text())


def sha(path: Path) -> str:
    data = path.read_bytes()
    return f"{len(data)}:{hashlib.sha256(data).hexdigest()}"


def test_redo_of_regenerate_makes_every_downstream_stage_stale(own):
    """`redo=regenerate stages=regenerate` over fewer conversations, then the whole recipe: train, export and
    evaluate run again on the new data (before, they were skipped and the old draft served as current)."""
    run, config = own["run"], own["config"]
    old_regen = sha(run / "data" / "regen.jsonl")
    assert pipeline.main(["--config", config, "stages=regenerate", "redo=regenerate",
                          "regenerate.num_samples=3"]) == {"regenerate": "redone"}
    assert sha(run / "data" / "regen.jsonl") != old_regen
    assert {s: marker(run, s).get("stale") for s in LATER} == {s: "regenerate" for s in LATER}
    listed = json.loads((run / "summary.json").read_text())["stages"]  # the summary says so too
    assert {s: listed[s].get("stale") for s in pipeline.STAGES} == {"prompts": None, "regenerate": None,
                                                                     **{s: "regenerate" for s in LATER}}
    outcome = pipeline.main(["--config", config, "regenerate.num_samples=3"])
    assert outcome == {"prompts": "skipped", "regenerate": "skipped", **{s: "redone" for s in LATER}}
    regen = str(run / "data" / "regen.jsonl")
    assert marker(run, "train")["inputs"][f"data.sources[0]:{regen}"] == sha(run / "data" / "regen.jsonl")
    assert marker(run, "train")["summary"]["steps"] == 4
    assert pipeline.main(["--config", config, "regenerate.num_samples=3"]) == {s: "skipped" for s in pipeline.STAGES}


def test_redo_of_train_makes_export_and_evaluate_stale_downstream(own, tmp_path):
    """`redo=train stages=train` with another lr, then the whole recipe: the export is made again from the new
    final draft (its tensors are those of an export of train/ made by hand), and evaluated again."""
    run, config = own["run"], own["config"]
    assert pipeline.main(["--config", config, "stages=train", "redo=train", "optim.lr=1e-3"]) == {"train": "redone"}
    assert {s: marker(run, s).get("stale") for s in ("export", "evaluate")} == {"export": "train", "evaluate": "train"}
    outcome = pipeline.main(["--config", config, "optim.lr=1e-3"])
    assert outcome == {"prompts": "skipped", "regenerate": "skipped", "train": "skipped", "export": "redone",
                       "evaluate": "redone"}
    export.main(["--checkpoint", str(run / "train"), "--out", str(tmp_path / "by_hand"), "--target", str(own["target"])])
    ours, by_hand = load_file(run / "export" / "model.safetensors"), load_file(tmp_path / "by_hand" / "model.safetensors")
    assert ours.keys() == by_hand.keys() and all(ours[k].equal(by_hand[k]) for k in ours)
    weights = (run / "export" / "model.safetensors").read_bytes()
    assert weights == (tmp_path / "by_hand" / "model.safetensors").read_bytes()  # deterministic bytes
    recorded = marker(run, "export")["summary"]["sha256"]
    assert recorded["model.safetensors"] == hashlib.sha256(weights).hexdigest()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stages"]["export"]["summary"]["sha256"] == recorded


def test_an_input_edited_in_place_makes_its_stage_and_every_downstream_stage_stale(own):
    """Same path, other contents: regenerate runs again on the new conversations, then every later stage."""
    run, config, chat = own["run"], own["config"], own["chat"]
    write_chat_jsonl(chat, n=6, seed=1)  # edited in place
    questions = {json.loads(line)["conversations"][0]["value"] for line in chat.read_text().splitlines()}
    outcome = pipeline.main(["--config", config])
    assert outcome == {"prompts": "skipped", **{s: "redone" for s in ("regenerate", *LATER)}}
    rows = [json.loads(line) for line in (run / "data" / "regen.jsonl").read_text().splitlines()]
    chat_rows = [r for r in rows if r["dataset"] == "chat"]
    assert chat_rows and all(r["messages"][0]["content"] in questions for r in chat_rows)
    assert marker(run, "regenerate")["inputs"][f"regenerate.data:{chat}"] == sha(chat)


def test_a_killed_training_with_stale_settings_is_refused_not_resumed(tiny, tmp_path, monkeypatch, capsys):  # noqa: F811
    """Killed after a checkpoint, rerun with another optim.lr: refused in one line naming redo=train, nothing
    written (before, it resumed under the new rate while its marker claimed the whole run used it); redo=train
    then starts afresh under the new rate."""
    from nemo_dflash.train import checkpoint

    run = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(RECIPE.format(run=run, target=tiny["target"], chat=tiny["chat"]))
    real_save = checkpoint.Checkpointer.save

    def save_then_die(self, step, tokens_seen):
        real_save(self, step, tokens_seen)
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.Checkpointer, "save", save_then_die)
    stages = "stages=prompts,regenerate,train"
    with pytest.raises(KeyboardInterrupt):
        pipeline.main(["--config", str(config), stages])
    monkeypatch.setattr(checkpoint.Checkpointer, "save", real_save)
    before = snapshot(run)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        pipeline.main(["--config", str(config), stages, "optim.lr=1e-3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert "redo=train" in err[0] and "optim.lr" in err[0] and "--overwrite" not in err[0]
    assert snapshot(run) == before
    resumed = spy_resume(monkeypatch)
    assert pipeline.main(["--config", str(config), stages, "optim.lr=1e-3", "redo=train"]) == {
        "prompts": "skipped", "regenerate": "skipped", "train": "redone"}
    assert resumed == [None]  # a fresh start, not the killed run's checkpoint
    assert marker(run, "train")["settings"]["optim"]["lr"] == 1e-3


def test_fingerprints_follow_contents_and_reuse_a_hash_while_mtime_holds(tmp_path, monkeypatch):
    f = tmp_path / "a.jsonl"
    f.write_text("one\n")
    fp = Fingerprints(tmp_path / "cache.json")
    assert fp.file(f) == sha(f)
    fp.save()
    again = Fingerprints(tmp_path / "cache.json")
    monkeypatch.setattr("nemo_dflash.recipes.stage_graph._sha256", lambda p: pytest.fail("hashed again"))
    assert again.file(f) == sha(f)
    monkeypatch.undo()
    old, mtime = sha(f), f.stat().st_mtime_ns
    f.write_text("two\n")  # edited in place: same size, a new mtime
    os.utime(f, ns=(mtime + 10**9, mtime + 10**9))
    assert again.file(f) == sha(f) != old
    assert again.file(tmp_path / "missing") is None


def test_a_source_entry_names_its_file_and_not_a_builtin(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text("")
    assert entry_path(f"chat={f}@2") == f and entry_path(str(f)) == f and entry_path(f"{f}@0.5") == f
    assert entry_path("sharegpt") is None and entry_path("code:2") is None


def test_a_kill_between_regenerates_last_output_and_its_marker_keeps_the_dataset(
        tiny, tmp_path, monkeypatch):  # noqa: F811
    """Killed after regenerate wrote its data and summary, before the stage's marker: the next run finds the
    outputs complete (written since the stage started) and writes the marker, regenerating nothing (before, the
    complete dataset was refused as left by something else, and redo= threw it away)."""
    from nemo_dflash.recipes import regenerate

    run = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(RECIPE.format(run=run, target=tiny["target"], chat=tiny["chat"]))
    real = pipeline.Pipeline._complete

    def die_before_the_marker(self, stage, *a, **k):
        if stage.name == "regenerate":
            raise KeyboardInterrupt
        return real(self, stage, *a, **k)

    monkeypatch.setattr(pipeline.Pipeline, "_complete", die_before_the_marker)
    with pytest.raises(KeyboardInterrupt):
        pipeline.main(["--config", str(config), "stages=prompts,regenerate"])
    monkeypatch.undo()
    assert not (run / "stages" / "regenerate.json").exists()
    data = (run / "data" / "regen.jsonl").read_bytes()
    written = json.loads((run / "data" / "regen_summary.json").read_text().splitlines()[0])["written"]
    monkeypatch.setattr(regenerate, "main", lambda *a, **k: pytest.fail("regenerated again"))
    assert pipeline.main(["--config", str(config), "stages=prompts,regenerate"]) == {
        "prompts": "skipped", "regenerate": "done"}
    assert (run / "data" / "regen.jsonl").read_bytes() == data
    assert marker(run, "regenerate")["summary"]["written"] == written == len(data.splitlines())
    assert marker(run, "regenerate")["outputs"]["data/regen.jsonl"] == sha(run / "data" / "regen.jsonl")
    assert not (run / "stages" / "regenerate.started.json").exists()
