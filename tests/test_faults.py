"""What is never lost (docs/guarantees.md): commands refuse, in one line and before any model loads, what
would destroy or mix results; damaged checkpoints are named and skipped, never trusted."""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from _tiny_target import tiny_train_args as _args
from _fault_fixtures import assets, finished_run, unwritable_dir  # noqa: F401  (fixtures)
from _torchrun import scaled

REPO = Path(__file__).resolve().parent.parent
STEP2, STEP4 = "step_00000002", "step_00000004"


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file below ``root`` (the lock file aside) with its size and CRC-32."""
    return {p.relative_to(root).as_posix(): (p.stat().st_size, zlib.crc32(p.read_bytes()))
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


def _no_load(monkeypatch) -> None:
    import nemo_dflash.train.trainer

    def no_load(*a, **k):
        raise AssertionError("the target was loaded before the refusal")

    monkeypatch.setattr(nemo_dflash.train.trainer, "load_target", no_load)


def _refused(exc, capsys, *needles: str, loaded: bool = False) -> str:
    """One line on stderr, `error: ...` naming each of ``needles``, exit status 2, no traceback (after a
    model load, ``loaded``, the loader's progress bar may come before it)."""
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    if loaded:  # the loader's (and the training's) progress bars come before it, on stderr too
        assert err.count("error: ") == 1, err
        err = err[err.index("error: "):]
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def _flip_byte(path: Path) -> None:
    """Damage a file in place without changing its size (bit rot, a bad copy)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _cut_short(path: Path) -> None:
    """A file cut short (a full disk, a partial copy)."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _state_file(ckpt: Path) -> Path:
    return max((ckpt / "state").glob("*.distcp"), key=lambda p: p.stat().st_size)


# ----------------------------------------------------------------- issue 33 item 1: export never writes over its input


@pytest.mark.parametrize("source,out", [
    ("final/draft", "."),  # the reported case: --out is the run holding the draft
    (".", "final/draft"),  # --out is the draft itself
    (f"checkpoints/{STEP2}/draft", "checkpoints"),  # --out contains the draft
    (".", "exported"),  # --out inside the run the draft belongs to
])
def test_export_refuses_an_out_that_overlaps_its_input(finished_run, tmp_path, capsys, source, out):
    from nemo_dflash.recipes.export import main

    run = _copy(finished_run, tmp_path)
    before = _snapshot(run)
    with pytest.raises(SystemExit) as exc:
        main(["--checkpoint", str(run / source), "--out", str(run / out), "--overwrite"])
    _refused(exc, capsys, "overlaps the input", "choose an --out outside")
    assert _snapshot(run) == before


# ----------------------------------------------------------------- item 2: a fresh run never mixes into another run


def test_fresh_run_into_a_finished_run_is_refused_then_replaced_with_overwrite(
        assets, finished_run, tmp_path, monkeypatch, capsys):
    from nemo_dflash.recipes.train import main

    run = _copy(finished_run, tmp_path)
    before = _snapshot(run)
    with monkeypatch.context() as m:
        _no_load(m)
        with pytest.raises(SystemExit) as exc:
            main(_args(*assets, run, "train.max_steps=2", "checkpoint.resume=none"))
        _refused(exc, capsys, "holds another run", "--overwrite")
        assert _snapshot(run) == before
        # a run with no checkpoint to resume (auto) would start afresh too: refused the same way
        shutil.rmtree(run / "checkpoints")
        before = _snapshot(run)
        with pytest.raises(SystemExit) as exc:
            main(_args(*assets, run, "train.max_steps=2"))
        _refused(exc, capsys, "holds another run", "no complete checkpoint")
        assert _snapshot(run) == before
    # --overwrite: the old run is gone as a whole (no old checkpoint, metric row or aside copy left)
    run2 = tmp_path / "run2"
    shutil.copytree(finished_run, run2)
    summary = main(_args(*assets, run2, "train.max_steps=2", "checkpoint.every_steps=1", "checkpoint.resume=none",
                         "train.eval_every=0") + ["--overwrite"])
    assert summary["steps"] == 2
    steps = [r["step"] for r in map(json.loads, (run2 / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == [1, 2]
    assert sorted(p.name for p in (run2 / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run2"]


# ----------------------------------------------------------------- item 5 / issue 31: damaged checkpoints


@pytest.mark.parametrize("damage", ["flipped byte in draft weights", "state file cut short",
                                    "state file cut short, marker of an older version"])
def test_damaged_checkpoint_is_named_and_the_older_one_resumed(assets, finished_run, tmp_path, capsys, caplog,
                                                               damage):
    from nemo_dflash.recipes.train import main

    run = _copy(finished_run, tmp_path)
    bad = run / "checkpoints" / STEP4
    if damage.startswith("flipped"):
        _flip_byte(bad / "draft" / "model.safetensors")
    else:
        _cut_short(_state_file(bad))
    if damage.endswith("older version"):
        (bad / "COMPLETE").write_text("ok\n")  # lists no files: the damage is found by loading
    caplog.clear()
    with caplog.at_level(logging.INFO):
        summary = main(_args(*assets, run, "train.max_steps=5", "checkpoint.every_steps=2"))
    warnings = [r.getMessage() for r in caplog.records
                if r.name.startswith("nemo_dflash") and r.levelno >= logging.WARNING and STEP4 in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert "cannot be loaded" in warnings[0] and f"falling back to the next older, {run / 'checkpoints' / STEP2}" \
        in warnings[0]
    resumed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Resumed from")]
    assert resumed == [f"Resumed from {run / 'checkpoints' / STEP2} (step 2)"]
    assert summary["steps"] == 5


def test_the_checkpoint_saved_after_a_fallback_is_never_pruned(assets, finished_run, tmp_path, caplog):
    """keep_last=1 after falling back past a damaged step 4: the new step 3 is kept (the damaged one is
    newer), and the next resume continues from it."""
    from nemo_dflash.recipes.train import main

    run = _copy(finished_run, tmp_path)
    _flip_byte(run / "checkpoints" / STEP4 / "draft" / "model.safetensors")
    main(_args(*assets, run, "train.max_steps=3", "checkpoint.every_steps=2", "checkpoint.keep_last=1"))
    assert (run / "checkpoints" / "step_00000003" / "COMPLETE").is_file()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        main(_args(*assets, run, "train.max_steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=1"))
    assert f"Resumed from {run / 'checkpoints' / 'step_00000003'} (step 3)" in caplog.messages


def test_no_intact_checkpoint_is_refused_before_the_model_loads(assets, finished_run, tmp_path, monkeypatch,
                                                                capsys):
    from nemo_dflash.recipes.train import main

    run = _copy(finished_run, tmp_path)
    _flip_byte(run / "checkpoints" / STEP4 / "draft" / "model.safetensors")
    _cut_short(_state_file(run / "checkpoints" / STEP2))
    before = _snapshot(run)
    _no_load(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        main(_args(*assets, run, "train.max_steps=6"))
    _refused(exc, capsys, f"checkpoint {run / 'checkpoints' / STEP4} cannot be loaded", "model.safetensors",
             "nor can the 1 older one", "restore its files")
    with pytest.raises(SystemExit) as exc:  # a checkpoint named explicitly
        main(_args(*assets, run, "train.max_steps=6", f"checkpoint.resume={run / 'checkpoints' / STEP2}"))
    _refused(exc, capsys, f"{STEP2}/state", "cut short")
    assert _snapshot(run) == before


def test_export_refuses_damaged_draft_files(finished_run, tmp_path, capsys):
    from nemo_dflash.recipes.export import main

    run = _copy(finished_run, tmp_path)
    _flip_byte(run / "final" / "draft" / "model.safetensors")
    with pytest.raises(SystemExit) as exc:
        main(["--checkpoint", str(run), "--out", str(tmp_path / "exp")])
    _refused(exc, capsys, str(run / "final" / "draft" / "model.safetensors"), "damaged")
    _cut_short(run / "checkpoints" / STEP4 / "draft" / "model.safetensors")
    with pytest.raises(SystemExit) as exc:
        main(["--checkpoint", str(run / "checkpoints" / STEP4), "--out", str(tmp_path / "exp")])
    _refused(exc, capsys, "model.safetensors has", "cut short")
    assert not (tmp_path / "exp").exists()
    assert main(["--checkpoint", str(run / "checkpoints" / STEP2), "--out", str(tmp_path / "exp")]) == 0


def test_complete_marker_is_written_after_the_files_are_flushed_and_records_them(assets, tmp_path, monkeypatch):
    """The order of a checkpoint's writes: every file fsync'd, then COMPLETE (listing each file's size and
    CRC-32, checked here against zlib) renamed into place."""
    from nemo_dflash.recipes.train import main

    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, *a, **k):
        events.append(("replace", str(dst)))
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "run"
    main(_args(*assets, out, "train.max_steps=2", "checkpoint.every_steps=2", "train.eval_every=0"))
    monkeypatch.undo()
    for root, tmp_name in ((out / "checkpoints" / STEP2, f".tmp-{STEP2}"), (out / "final", ".tmp-final")):
        marker = json.loads((root / "COMPLETE").read_text())
        files = {p.relative_to(root).as_posix(): p for p in root.rglob("*") if p.is_file() and p.name != "COMPLETE"}
        assert set(marker["files"]) == set(files) and files
        for rel, p in files.items():
            assert marker["files"][rel] == {"size": p.stat().st_size, "crc32": f"{zlib.crc32(p.read_bytes()):08x}"}
        tmp = str(root.parent.resolve() / tmp_name)
        marked = events.index(("replace", f"{tmp}/COMPLETE"))
        flushed = {path for kind, path in events[:marked] if kind == "fsync"}
        assert {f"{tmp}/{rel}" for rel in files} <= flushed
        assert ("fsync", f"{tmp}/.COMPLETE.tmp") in events[:marked]


# ----------------------------------------------------------------- issue 31: one training per output_dir


_HOLDER = """
import sys, time
from nemo_dflash.config import load_recipe
from nemo_dflash.train.trainer import Trainer
trainer = Trainer(load_recipe(sys.argv[2], sys.argv[3:]))
print("READY", flush=True)
time.sleep(300)
"""


def test_second_training_on_the_same_output_dir_refuses_and_a_killed_one_leaves_no_lock(assets, tmp_path, capsys):
    from nemo_dflash.recipes.train import main

    out = tmp_path / "run"
    args = _args(*assets, out, "train.max_steps=2", "train.eval_every=0")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, *args], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    try:
        started, _, _ = select.select([holder.stdout], [], [], scaled(120))  # the holder's READY, or its end
        assert started and holder.stdout.readline().strip() == "READY", "the holder never took the lock"
        before = _snapshot(out)
        with pytest.raises(SystemExit) as exc:
            main(args)
        _refused(exc, capsys, f"output_dir {out} is in use by another training (pid {holder.pid})")
        assert _snapshot(out) == before
    finally:
        holder.kill()  # SIGKILL: no cleanup runs; the kernel drops the lock
        holder.wait()
    assert main(args)["steps"] == 2


# ----------------------------------------------------------------- item 6: output places checked before the work




def test_a_checkpoint_write_that_fails_mid_run_is_one_line(assets, tmp_path, monkeypatch, capsys):
    """A full disk at the second save: one line, exit 2, the first checkpoint intact, no half-written one."""
    import errno

    import nemo_dflash.train.checkpoint as checkpoint
    from nemo_dflash.recipes.train import main

    real_save_file, calls = checkpoint.save_file, []

    def save_file(tensors, path, *a, **k):
        calls.append(path)
        if ".tmp-step_00000004" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_save_file(tensors, path, *a, **k)

    monkeypatch.setattr(checkpoint, "save_file", save_file)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(_args(*assets, out, "train.max_steps=4", "checkpoint.every_steps=2", "train.eval_every=0"))
    _refused(exc, capsys, "cannot write the checkpoint of step 4", "No space left on device", "run the same command",
             loaded=True)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [STEP2]
    checkpoint.verify_complete(out / "checkpoints" / STEP2)


@pytest.mark.parametrize("where", ["output_dir", "checkpoints"])
def test_unwritable_output_places_are_refused_before_the_model_loads(assets, tmp_path, unwritable_dir,
                                                                     monkeypatch, capsys, where):
    from nemo_dflash.recipes.train import main

    if where == "output_dir":
        out = unwritable_dir / "run"
    else:
        out = tmp_path / "run"
        out.mkdir()
        (out / "checkpoints").symlink_to(unwritable_dir, target_is_directory=True)
    _no_load(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        main(_args(*assets, out, "train.max_steps=2", "checkpoint.every_steps=1"))
    _refused(exc, capsys, "is not writable", "choose a writable")


def test_out_places_of_the_other_commands(assets, finished_run, tmp_path, unwritable_dir, capsys):
    """export, regenerate and evaluate: an --out under a regular file or in an unwritable place is one line
    naming the cause, before any model loads (these --target values could not even be loaded)."""
    from nemo_dflash.recipes import evaluate, export, regenerate

    target, data = assets
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    calls = {
        "export": lambda out: export.main(["--checkpoint", str(finished_run), "--out", str(out)]),
        "regenerate": lambda out: regenerate.main(["--target", str(tmp_path / "no_model"), "--data", str(data),
                                                   "--out", f"{out}/regen.jsonl", "--device", "cpu"]),
        "evaluate": lambda out: evaluate.main(["--draft", str(finished_run), "--target", str(tmp_path / "no_model"),
                                               "--out", str(out), "--device", "cpu"]),
    }
    for name, call in calls.items():
        with pytest.raises(SystemExit) as exc:
            call(a_file / "sub")
        _refused(exc, capsys, f"{a_file} is a regular file, not a directory")
        with pytest.raises(SystemExit) as exc:
            call(unwritable_dir / "sub")
        _refused(exc, capsys, "is not writable")
    with pytest.raises(SystemExit) as exc:  # regenerate's output over its own input
        regenerate.main(["--target", str(target), "--data", str(data), "--out", str(data), "--overwrite",
                         "--device", "cpu"])
    _refused(exc, capsys, "is the input --data")
    with pytest.raises(SystemExit) as exc:  # evaluate's answers inside the draft's run
        evaluate.main(["--draft", str(finished_run), "--target", str(target), "--out", str(finished_run / "eval"),
                       "--device", "cpu"])
    _refused(exc, capsys, "overlaps --draft")


# ----------------------------------------------------------------- item 7: messages that name the real cause


def test_target_dir_without_config_json_is_named(assets, tmp_path, finished_run, monkeypatch, capsys):
    from nemo_dflash.recipes import export, train

    _, data = assets
    not_a_model = tmp_path / "not_a_model"
    not_a_model.mkdir()
    (not_a_model / "tokenizer.json").write_text("{}")
    _no_load(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        train.main(_args(not_a_model, data, tmp_path / "run"))
    _refused(exc, capsys, f"target.path {not_a_model} has no config.json")
    with pytest.raises(SystemExit) as exc:
        export.main(["--checkpoint", str(finished_run), "--out", str(tmp_path / "exp"), "--target", str(not_a_model)])
    _refused(exc, capsys, f"--target {not_a_model} has no config.json")
    assert not (tmp_path / "run").exists() and not (tmp_path / "exp").exists()


def test_a_max_length_that_leaves_no_room_names_data_max_length(assets, tmp_path, monkeypatch, capsys):
    from nemo_dflash.recipes.train import main

    target, data = assets
    with monkeypatch.context() as m:
        _no_load(m)
        with pytest.raises(SystemExit) as exc:  # no room for a block at all: refused before loading
            main(_args(target, data, tmp_path / "a", "data.max_length=4"))
        _refused(exc, capsys, "data.max_length=4", "raise data.max_length")
    with pytest.raises(SystemExit) as exc:  # room for a block, but every reply starts later
        main(_args(target, data, tmp_path / "b", "data.max_length=6"))
    _refused(exc, capsys, "data.max_length=6", "raise data.max_length", loaded=True)
