"""Issue 50, what a command writes: the one output guard (never an input, replaced only with --overwrite,
--overwrite deletes only what this product wrote), one writer per output, ranges checked before any load,
and a full disk (a real ENOSPC from the kernel: the file is /dev/full) as one line with nothing half-written
left that a later run trusts."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import zlib
from pathlib import Path

import pytest

import nemo_dflash.target.loading
from _spec_fixtures import make_draft, tiny_qwen3
from _tiny_target import make_tiny_target_dir, tiny_train_args, write_chat_jsonl
from _fault_fixtures import unwritable_dir  # noqa: F401  (fixtures)

STEP2, STEP4 = "step_00000002", "step_00000004"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return make_tiny_target_dir(root), write_chat_jsonl(root / "chat.jsonl", n=12)


@pytest.fixture(scope="module")
def loaded(assets):
    from nemo_dflash.target.loading import load_target

    return load_target(str(assets[0]), dtype="fp32")


@pytest.fixture()
def no_load(monkeypatch):
    """Any model load fails the test: the refusal must come first."""
    import nemo_dflash.train.trainer

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(nemo_dflash.target.loading, "load_target", refuse)
    monkeypatch.setattr(nemo_dflash.train.trainer, "load_target", refuse)


@pytest.fixture()
def cached(monkeypatch, loaded):
    """regenerate gets the module's loaded tiny target instead of reading it again."""
    monkeypatch.setattr(nemo_dflash.target.loading, "load_target", lambda *a, **k: loaded)
    return loaded


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    root = Path(root)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p): (p.stat().st_size, zlib.crc32(p.read_bytes())) for p in files}


def _refused(exc, capsys, *needles: str) -> str:
    """One line on stderr naming each of ``needles``, exit status 2, no traceback."""
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    err = err[err.index("error: "):] if "error: " in err else err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def _regen(target, data, out, *extra) -> list[str]:
    return ["--target", str(target), "--data", str(data), "--out", str(out), "--device", "cpu", "--num-samples", "2",
            "--max-new-tokens", "2", "--decontaminate", "off", *extra]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ----------------------------------------------------------------- item 1: --summary-json


def test_item01_summary_json_not_overwritten(assets, tmp_path, no_load, capsys):
    from nemo_dflash.recipes.regenerate import main

    target, data = assets
    summary = tmp_path / "summary.json"
    summary.write_text("precious\n")
    before = _snapshot(data)
    with pytest.raises(SystemExit) as exc:  # an existing file: only with --overwrite
        main(_regen(target, data, tmp_path / "regen.jsonl", "--summary-json", str(summary)))
    _refused(exc, capsys, f"--summary-json {summary} already exists", "--overwrite")
    with pytest.raises(SystemExit) as exc:  # its own input: never, even with --overwrite
        main(_regen(target, data, tmp_path / "regen.jsonl", "--summary-json", str(data), "--overwrite"))
    _refused(exc, capsys, f"--summary-json {data} is the input --data")
    with pytest.raises(SystemExit) as exc:  # its fresh --out
        main(_regen(target, data, tmp_path / "regen.jsonl", "--summary-json", str(tmp_path / "regen.jsonl")))
    _refused(exc, capsys, "--out and --summary-json are the same file")
    assert summary.read_text() == "precious\n" and _snapshot(data) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


# ----------------------------------------------------------------- item 2: NAME=PATH and PATH@WEIGHT inputs


@pytest.mark.parametrize("spec", ["chat={}", "{}@2", "named={}@0.5", "link"])
def test_item02_data_specs_are_inputs_too(assets, tmp_path, no_load, capsys, spec):
    from nemo_dflash.recipes.regenerate import main

    target, _ = assets
    data = write_chat_jsonl(tmp_path / "mine.jsonl", n=4)
    before = _snapshot(data)
    out = data
    if spec == "link":  # --out a link to the input: the same file once resolved
        out = tmp_path / "link.jsonl"
        out.symlink_to(data)
        entry = str(data)
    else:
        entry = spec.format(data)
    with pytest.raises(SystemExit) as exc:
        main(_regen(target, entry, out, "--overwrite"))
    _refused(exc, capsys, "is the input --data", "choose another --out")
    assert _snapshot(data) == before


# ----------------------------------------------------------------- item 3: the holdout file


def test_item03_holdout_file_never_replaces_the_input(assets, tmp_path, no_load, capsys):
    from nemo_dflash.recipes.regenerate import main

    target, _ = assets
    data = write_chat_jsonl(tmp_path / "X.holdout.jsonl", n=4)
    before = _snapshot(data)
    with pytest.raises(SystemExit) as exc:
        main(_regen(target, f"x={data}@2", tmp_path / "X.jsonl", "--holdout", "2", "--overwrite"))
    _refused(exc, capsys, f"--holdout's file {data} is the input --data")
    assert _snapshot(data) == before and not (tmp_path / "X.jsonl").exists()


# ----------------------------------------------------------------- items 4, 5: export --overwrite


@pytest.fixture()
def draft_run(tmp_path):
    target = tiny_qwen3()
    run = tmp_path / "run"
    make_draft(target, num_layers=2, block_size=4).save_pretrained(run / "final" / "draft")
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    return run, target_dir


def test_item04_export_never_deletes_the_target(draft_run, capsys):
    from nemo_dflash.recipes.export import main

    run, target_dir = draft_run
    before = _snapshot(target_dir)
    for out in (target_dir, target_dir / "exported", target_dir.parent):
        with pytest.raises(SystemExit) as exc:
            main(["--checkpoint", str(run), "--out", str(out), "--target", str(target_dir), "--overwrite"])
        _refused(exc, capsys, "overlaps the input --target" if out != target_dir.parent else "overlaps the input")
    assert _snapshot(target_dir) == before


def test_item05_export_overwrite_replaces_only_an_export(draft_run, tmp_path, capsys):
    from nemo_dflash.recipes.export import main

    run, target_dir = draft_run
    out = tmp_path / "exp"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exc:  # someone's files
        main(["--checkpoint", str(run), "--out", str(out), "--overwrite"])
    _refused(exc, capsys, "--overwrite refused", "notes.txt", "choose another --out")
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    assert main(["--checkpoint", str(run), "--out", str(out)]) == 0
    assert main(["--checkpoint", str(run), "--out", str(out), "--overwrite"]) == 0  # its own export: replaced
    (out / "README.md").write_text("added by hand")
    with pytest.raises(SystemExit) as exc:  # an export with a file added: not only what export wrote
        main(["--checkpoint", str(run), "--out", str(out), "--overwrite"])
    _refused(exc, capsys, "--overwrite refused", "README.md")
    fake = tmp_path / "fake"  # the export's two names, but not written by export (a target's files)
    fake.mkdir()
    for name in ("config.json", "model.safetensors"):
        (fake / name).write_bytes((target_dir / name).read_bytes())
    before = _snapshot(fake)
    with pytest.raises(SystemExit) as exc:
        main(["--checkpoint", str(run), "--out", str(fake), "--overwrite"])
    _refused(exc, capsys, "--overwrite refused")
    assert _snapshot(fake) == before


# ----------------------------------------------------------------- item 9: one writer per --out


def test_item09_two_regenerate_runs_on_one_out(assets, tmp_path, cached, monkeypatch, capsys):
    import nemo_dflash.data.regenerate as regen
    from nemo_dflash.recipes.regenerate import main

    target, data = assets
    out = tmp_path / "regen.jsonl"
    args = _regen(target, data, out, "--num-samples", "4")
    real, second = regen.regenerate_conversations, []

    def first_run_generating(*a, **k):  # while the first run writes, a second one starts on the same --out
        if not second:
            second.append("started")
            with pytest.raises(SystemExit) as exc:
                main(args)
            second[0] = _refused(exc, capsys, f"--out {out} is being written by another regenerate",
                                 f"pid {os.getpid()}")
        yield from real(*a, **k)

    monkeypatch.setattr(regen, "regenerate_conversations", first_run_generating)
    main(args)
    assert second != ["started"]
    sources = [r["source"] for r in _lines(out)]
    assert len(sources) == 4 == len(set(sources))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["regen.jsonl", "regen_report"]  # the lock goes with the run
    monkeypatch.setattr(regen, "regenerate_conversations", real)
    main(args + ["--overwrite"])  # and a later run takes the output again


# ----------------------------------------------------------------- item 12: train's output_dir


class _Loaded(Exception):
    """Raised where the target would load: the output_dir was claimed by then."""


def test_item12_output_dir_symlink_and_empty(assets, tmp_path, monkeypatch, capsys):
    import nemo_dflash.train.trainer
    from nemo_dflash.recipes.train import main

    def loaded(*a, **k):
        raise _Loaded

    monkeypatch.setattr(nemo_dflash.train.trainer, "load_target", loaded)
    real = tmp_path / "real_run"
    (real / "checkpoints").mkdir(parents=True)
    (real / "config.yaml").write_text("old: run\n")
    (real / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    with pytest.raises(_Loaded):
        main(tiny_train_args(*assets, link, "checkpoint.resume=none") + ["--overwrite"])
    assert link.is_symlink() and link.resolve() == real.resolve()  # the link kept, the run it points to replaced
    assert sorted(p.name for p in real.iterdir()) in ([], [".lock"])  # the old run is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real_run"]  # nothing renamed aside and kept
    cwd_before = sorted(os.listdir(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(tiny_train_args(*assets, ""))
    _refused(exc, capsys, "output_dir is empty", "output_dir=PATH")
    assert sorted(os.listdir(tmp_path)) == cwd_before


# ----------------------------------------------------------------- item 14: ranges before any load


@pytest.mark.parametrize("flag,value", [("--batch-size", "1000000000"), ("--samples-per-prompt", "100000000")])
def test_item14_regenerate_batch_size_and_samples_have_ranges(assets, tmp_path, no_load, capsys, flag, value):
    from nemo_dflash.recipes.regenerate import main

    target, data = assets
    with pytest.raises(SystemExit) as exc:
        main(_regen(target, data, tmp_path / "regen.jsonl", flag, value))
    _refused(exc, capsys, f"{flag} {value}", "give at most")
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------- item 15: a full disk


def _full_at(path: str | os.PathLike) -> None:
    """Make ``path`` a link to /dev/full: the real write call that follows gets ENOSPC from the kernel."""
    if not os.path.lexists(path):
        os.symlink("/dev/full", path)


@contextlib.contextmanager
def _file_size_limit(nbytes: int):
    """The kernel refuses writes past ``nbytes`` (EFBIG) in this process: how a writer whose temp file name
    cannot be known beforehand (safetensors, in Rust) meets a real write error at its real write call."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    prev = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error from write(), not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, prev)


# where the disk fills up, and the reason the one line gives
_FULL = {"optimizer state": "No space left on device", "final draft": "No space left on device",
         "draft weights": "File too large"}


@pytest.mark.parametrize("where", list(_FULL))
def test_item15_disk_full_while_training_is_one_line(assets, tmp_path, monkeypatch, capsys, where):
    import torch.distributed.checkpoint.filesystem as dcp_fs

    import nemo_dflash.train.checkpoint as checkpoint
    from nemo_dflash.recipes.train import main

    real_save_file, real_stream = checkpoint.save_file, dcp_fs.FileSystem.create_stream
    real_draft_dir = checkpoint.save_draft_dir

    def create_stream(self, path, mode):  # torch.distributed.checkpoint's writer meets ENOSPC
        if where == "optimizer state" and f".tmp-{STEP4}" in str(path) and str(path).endswith(".distcp"):
            _full_at(path)
        return real_stream(self, path, mode)

    def save_draft_dir(draft, out_dir, state, *a, **k):  # final/'s config.json (transformers' writer) meets ENOSPC
        if where == "final draft" and ".tmp-final" in str(out_dir):
            Path(out_dir).mkdir(parents=True)
            _full_at(Path(out_dir) / "config.json")
        return real_draft_dir(draft, out_dir, state, *a, **k)

    def save_file(tensors, path, *a, **k):  # safetensors' writer (Rust, its own temp file) meets EFBIG
        if where == "draft weights" and f".tmp-{STEP4}" in str(path) and str(path).endswith("model.safetensors"):
            with _file_size_limit(4096):
                return real_save_file(tensors, path, *a, **k)
        return real_save_file(tensors, path, *a, **k)

    monkeypatch.setattr(dcp_fs.FileSystem, "create_stream", create_stream)
    monkeypatch.setattr(checkpoint, "save_draft_dir", save_draft_dir)
    monkeypatch.setattr(checkpoint, "save_file", save_file)
    out = tmp_path / "run"
    args = tiny_train_args(*assets, out, "train.max_steps=4", "checkpoint.every_steps=2", "train.eval_every=0")
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    line = err[err.index("error: "):]
    assert line.count("\n") == 1 and _FULL[where] in line and "run the same command" in line, line
    left = sorted(p.name for p in out.rglob("*") if p.name.startswith((".tmp", ".old-")))
    assert left == [], left  # nothing half-written that a later run could trust
    assert not (out / "final").exists()
    assert [p.name for p in checkpoint.list_checkpoints(out)] == [STEP2, STEP4] if where == "final draft" else [STEP2]
    monkeypatch.undo()  # space freed: the same command finishes from the last complete checkpoint
    summary = main(args)
    assert summary["steps"] == 4
    checkpoint.verify_complete(out / "final")


def test_item15_disk_full_while_regenerating_is_one_line(assets, tmp_path, cached, capsys):
    from nemo_dflash.recipes.regenerate import main

    target, data = assets
    out = tmp_path / "regen.jsonl"
    _full_at(tmp_path / "regen.jsonl.tmp")  # the finished output's temp file is on a full disk
    with pytest.raises(SystemExit) as exc:
        main(_regen(target, data, out))
    _refused(exc, capsys, f"cannot write {out}", "No space left on device", "run the same command again")
    assert not out.exists() and not os.path.lexists(tmp_path / "regen.jsonl.tmp")
    kept = _lines(tmp_path / "regen.jsonl.partial")  # the answers are kept, whole, for the next run
    assert len(kept) == 2
    summary = main(_regen(target, data, out))
    assert summary["written"] == 2 and summary["written_this_run"] == 0
    assert [r["source"] for r in _lines(out)] == [r["source"] for r in kept]


# ----------------------------------------------------------------- item 19: permissions before the work




def test_item19_unwritable_outputs_refused_before_the_work(assets, tmp_path, unwritable_dir, no_load, monkeypatch,
                                                           capsys):
    import nemo_dflash.data.prompts
    from nemo_dflash.recipes import prompts, regenerate

    def no_work(*a, **k):
        raise AssertionError("the prompts were made before the refusal")

    monkeypatch.setattr(nemo_dflash.data.prompts, "read_source", no_work)
    monkeypatch.setattr(nemo_dflash.data.prompts, "magpie_prompts", no_work)
    target, data = assets
    with pytest.raises(SystemExit) as exc:
        prompts.main(["--source", "gsm_symbolic:5", "--out", str(unwritable_dir / "x.jsonl")])
    _refused(exc, capsys, "is not writable")
    with pytest.raises(SystemExit) as exc:
        prompts.main(["--target", str(target), "--out", str(unwritable_dir / "x.jsonl"), "--device", "cpu"])
    _refused(exc, capsys, "is not writable")
    with pytest.raises(SystemExit) as exc:
        regenerate.main(_regen(target, data, tmp_path / "regen.jsonl", "--summary-json",
                               str(unwritable_dir / "s.json")))
    _refused(exc, capsys, "--summary-json's directory", "is not writable")
    assert not (tmp_path / "regen.jsonl").exists()


# ----------------------------------------------------------------- item 20: messages that name the cause


def test_item20_regenerate_messages_name_the_cause(assets, tmp_path, cached, monkeypatch, capsys):
    from nemo_dflash.recipes.regenerate import main

    target, data = assets
    with pytest.raises(SystemExit) as exc:  # an answer cap beyond the context (2,048 tokens)
        main(_regen(target, data, tmp_path / "a.jsonl")[:-4] + ["--max-new-tokens", "1000000000",
                                                                 "--decontaminate", "off"])
    err = _refused(exc, capsys, "--max-new-tokens 1000000000", "context of 2048 tokens", "at most 2047")
    assert "--max-prompt-tokens -" not in err and "--holdout" not in err
    _, tokenizer = cached  # a chat template the Jinja sandbox refuses
    monkeypatch.setattr(tokenizer, "chat_template", "{{ ''.__class__.__mro__ }}{{ messages[0]['content'] }}")
    with pytest.raises(SystemExit) as exc:
        main(_regen(target, data, tmp_path / "b.jsonl"))
    err = _refused(exc, capsys, "no usable conversations", "template_error", "chat template", "fix the template")
    assert "--holdout" not in err


# ----------------------------------------------------------------- item 21: a sharded draft's index


def test_item21_sharded_index_never_points_outside_the_draft(tmp_path):
    from nemo_dflash.draft.build import DraftError, load_draft

    draft = make_draft(tiny_qwen3(), num_layers=2, block_size=4)
    inside = tmp_path / "draft"
    draft.save_pretrained(inside)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (inside / "model.safetensors").rename(elsewhere / "model.safetensors")
    weights = {k: "../elsewhere/model.safetensors" for k in draft.state_dict()}
    (inside / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weights}))
    with pytest.raises(DraftError, match="outside"):
        load_draft(inside)
    (elsewhere / "model.safetensors").rename(inside / "shard.safetensors")  # the same weights, inside: loads
    (inside / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "shard.safetensors" for k in draft.state_dict()}}))
    assert set(load_draft(inside).state_dict()) == set(draft.state_dict())
