"""`evaluate`'s refusals of bad input (issue 27) and its journal keyed on the draft's weights, with
complete-marked checkpoints verified before use (issue 33, item 3): one line, exit 2, before any
model loads, and nothing in --out lost."""

from __future__ import annotations

import json
import shutil

import pytest

from nemo_dflash.serving.export import export_draft
from nemo_dflash.files import write_complete_marker
from nemo_dflash.evaluation import run as eval_run
from nemo_dflash.recipes import evaluate as evaluate_cmd

from _spec_fixtures import QWEN3_MASK_ID, make_draft, save_tiny_qwen3_target, tiny_llama, tiny_qwen3
from _spec_fixtures import single_thread  # noqa: F401 (an autouse fixture, applied by importing it)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_qwen3_target(tmp_path_factory.mktemp("target"), seed=4)


def _draft(seed: int = 1, **kw):
    target = tiny_qwen3(num_layers=2, vocab=151936, hidden=32, seed=4)
    return make_draft(target, num_layers=1, block_size=4, mask_token_id=QWEN3_MASK_ID, layer_ids=[0, 1], seed=seed,
                      **kw)


def _cli(target, draft, out, *extra):
    return evaluate_cmd.main(["--draft", str(draft), "--target", str(target), "--out", str(out), "--device", "cpu",
                              "--threads", "1", "--protocol", "quick", "--num-prompts", "2", "--max-new-tokens", "5",
                              "--datasets", "mtbench", "--no-speedup", *extra])


def _refused(capsys, fn, *args) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        fn(*args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr(eval_run, "load_models", lambda *a, **k: pytest.fail("a model was loaded"))


# ----------------------------------------------------------------------------- issue 27: bad input


def _edit_config(draft_dir, **changes):
    cfg = json.loads((draft_dir / "config.json").read_text())
    for k, v in changes.items():
        if k in ("target_layer_ids", "mask_token_id"):
            cfg["dflash_config"][k] = v
        else:
            cfg[k] = v
    (draft_dir / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("how, message", [
    ("hidden", "hidden_size 48 != target hidden_size 32"),
    ("vocab", "vocab_size 32000 != target vocab_size 151936"),
    ("layers", "num_target_layers 36 != the target's num_hidden_layers 2"),
])
def test_a_draft_for_another_target_is_refused_before_any_model(how, message, target_dir, tmp_path, capsys, no_model):
    if how == "hidden":  # a draft built for a Llama target of hidden size 48 (a training draft dir)
        draft = tmp_path / "d"
        make_draft(tiny_llama(num_layers=2, vocab=151936), num_layers=1, block_size=4, mask_token_id=QWEN3_MASK_ID,
                   layer_ids=[0, 1]).save_pretrained(draft)
    else:
        draft = export_draft(_draft(), tmp_path / "d")
        if how == "vocab":  # trained on a 32000-token table
            _edit_config(draft, vocab_size=32000)
        else:  # trained on a 36-layer target, reading its layers 1..33
            _edit_config(draft, num_target_layers=36, target_layer_ids=[1, 33])
    err = _refused(capsys, _cli, target_dir, draft, tmp_path / "out")
    assert message in err and "does not fit the target" in err
    assert not (tmp_path / "out" / "answers.jsonl").exists()


@pytest.mark.parametrize("extra, message", [
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--protocol", "fast"], "--protocol 'fast' is unknown"),
    (["--datasets", "gsm9k"], "Unknown dataset 'gsm9k'"),
])
def test_bad_counts_and_names_are_one_line(extra, message, target_dir, tmp_path, capsys, no_model):
    draft = export_draft(_draft(), tmp_path / "d")
    assert message in _refused(capsys, _cli, target_dir, draft, tmp_path / "out", *extra)


# ----------------------------------------------------------------------------- issue 33.3: the journal's key


def test_new_weights_at_the_same_path_are_another_evaluation(target_dir, tmp_path, capsys):
    draft = export_draft(_draft(seed=1), tmp_path / "d")
    out = tmp_path / "out"
    assert _cli(target_dir, draft, out) == 0
    journal = (out / "answers.jsonl").read_text()
    assert json.loads(journal.split("\n")[0])["header"]["draft_sha256"]

    # the same weights at another path: the answers are reused (nothing decoded again)
    moved = tmp_path / "moved"
    shutil.copytree(draft, moved)
    assert _cli(target_dir, moved, out) == 0
    assert (out / "answers.jsonl").read_text() == journal

    # more training into the same path: refused, the old answers kept
    shutil.rmtree(draft)
    export_draft(_draft(seed=2), draft)
    err = _refused(capsys, _cli, target_dir, draft, out)
    assert "draft's weights" in err and "--overwrite" in err
    assert (out / "answers.jsonl").read_text() == journal
    assert _cli(target_dir, draft, out, "--overwrite") == 0
    assert (out / "answers.jsonl").read_text() != journal


def test_a_damaged_checkpoint_is_refused_before_loading(target_dir, tmp_path, capsys, no_model):
    """A run's checkpoint whose weights were changed after COMPLETE was written (same size, one byte)."""
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_00000010"
    _draft().save_pretrained(step / "draft")
    write_complete_marker(step)
    weights = step / "draft" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    err = _refused(capsys, _cli, target_dir, run, tmp_path / "out")
    assert "model.safetensors is damaged" in err and "CRC-32" in err


def test_an_intact_checkpoint_is_evaluated(target_dir, tmp_path):
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_00000010"
    _draft().save_pretrained(step / "draft")
    write_complete_marker(step)
    assert _cli(target_dir, run, tmp_path / "out") == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["complete"] and len(res["draft_sha256"]) == 64
