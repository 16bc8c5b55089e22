"""Issue 50, runs and data: finite or nothing, the target's and the data's identity on resume and evaluate, one
evaluate per --out, ranges checked before any load, one-line recipe errors, torn metrics lines, lone surrogates
and bounded records. One test per item, named for it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from _tiny_target import make_tiny_target_dir, tiny_train_args as _args, write_chat_jsonl
from _fault_fixtures import assets, finished_run  # noqa: F401  (fixtures)

STEP2 = "step_00000002"


def _copy(run: Path, dst: Path) -> Path:
    shutil.copytree(run, dst)
    return dst


def _no_load(monkeypatch) -> None:
    import nemo_dflash.train.trainer

    monkeypatch.setattr(nemo_dflash.train.trainer, "load_target",
                        lambda *a, **k: pytest.fail("the target was loaded before the refusal"))


def _refused(fn, capsys, *needles: str, after_bars: bool = False) -> str:
    """``fn()`` exits with status 2 and one line `error: ...` on stderr naming each of ``needles``."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        fn()
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    if after_bars:  # progress bars of a run that loaded and trained come first
        assert err.count("error: ") == 1, err
        err = err[err.index("error: "):]
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


# ----------------------------------------------------------------------------- item 6: finite or nothing


@pytest.mark.parametrize("stop, refused", [
    ("train.max_bad_steps=1", "final/draft is not written"),  # stopped for non-finite steps: no final draft
    ("train.max_bad_steps=100", "the checkpoint of step 2 is not written"),  # reached max_steps: no last checkpoint
])
def test_item06_diverged_run_writes_no_final(assets, tmp_path, monkeypatch, capsys, stop, refused):
    """A run whose weights went NaN (what optim.lr=inf did) writes no final/draft, no COMPLETE and no checkpoint
    from them; the one-line message names the divergence and the fix."""
    import torch

    import nemo_dflash.train.trainer as trainer
    from nemo_dflash.recipes.train import main

    build = trainer.draft_for_recipe

    def diverged(*a, **k):
        draft = build(*a, **k)
        with torch.no_grad():
            for p in draft.parameters():
                p.fill_(float("nan"))
        return draft

    monkeypatch.setattr(trainer, "draft_for_recipe", diverged)
    out = tmp_path / "run"
    _refused(lambda: main(_args(*assets, out, "train.max_steps=2", "checkpoint.every_steps=2", stop,
                                "data.holdout_fraction=0")), capsys, "NaN or inf", refused, "optim.lr", after_bars=True)
    assert not (out / "final").exists() and not (out / ".tmp-final").exists()
    ckpts = out / "checkpoints"
    assert not ckpts.exists() or not any(ckpts.iterdir())


# ----------------------------------------------------------------------------- item 7: identity on resume


def test_item07_resume_refuses_other_target_weights_data_or_run(assets, finished_run, tmp_path, monkeypatch, capsys):
    from nemo_dflash.recipes.train import main

    target, data = assets
    _no_load(monkeypatch)
    run = _copy(finished_run, tmp_path / "run")
    meta = json.loads((run / "checkpoints" / "step_00000004" / "meta.json").read_text())
    assert meta["target_weights"] and len(meta["data_sha256"]) == 1

    # another target of the same architecture and shapes (other weights) at another path
    other_target = make_tiny_target_dir(tmp_path / "other", seed=1)
    _refused(lambda: main(_args(other_target, data, run, "train.max_steps=6", "checkpoint.every_steps=2")), capsys,
             "target.path holds other weights", "new output_dir")

    # the data file's contents changed at the same path
    changed = tmp_path / "chat.jsonl"
    write_chat_jsonl(changed, n=24, seed=7)
    _refused(lambda: main(_args(target, changed, run, "train.max_steps=6", "checkpoint.every_steps=2")), capsys,
             "data.sources[0] hold(s) other contents")

    # another run's checkpoint into a directory holding its own run: both runs' files would be mixed
    other_run = _copy(finished_run, tmp_path / "other_run")
    _refused(lambda: main(_args(target, data, run, "train.max_steps=6", "checkpoint.every_steps=2",
                                f"checkpoint.resume={other_run / 'checkpoints' / STEP2}")), capsys,
             "belongs to another run", "checkpoint.resume=auto")


# ----------------------------------------------------------------------------- item 8: identity on evaluate, one per --out


def test_item08_evaluate_journal_is_keyed_on_target_and_data_and_out_is_locked(tmp_path, capsys):
    from _spec_fixtures import QWEN3_MASK_ID, make_draft, save_tiny_qwen3_target, tiny_qwen3
    from nemo_dflash.serving.export import export_draft
    from nemo_dflash.evaluation.run import lock_out
    from nemo_dflash.recipes import evaluate as evaluate_cmd

    target = save_tiny_qwen3_target(tmp_path / "target", seed=4)
    draft = export_draft(make_draft(tiny_qwen3(num_layers=2, vocab=151936, hidden=32, seed=4), num_layers=1,
                                    block_size=4, mask_token_id=QWEN3_MASK_ID, layer_ids=[0, 1], seed=1),
                         tmp_path / "d")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"say {w}"]}) + "\n" for w in ("alpha", "beta")))
    out = tmp_path / "out"

    def cli(*extra):
        return evaluate_cmd.main(["--draft", str(draft), "--target", str(target), "--out", str(out), "--device", "cpu",
                                  "--threads", "1", "--protocol", "quick", "--max-new-tokens", "4",
                                  "--datasets", str(prompts), "--no-speedup", *extra])

    assert cli() == 0
    journal = (out / "answers.jsonl").read_text()
    header = json.loads(journal.split("\n")[0])["header"]
    assert header["target_weights"] and header["datasets_sha256"] == {"prompts": header["datasets_sha256"]["prompts"]}

    # one evaluate per --out: a second one while the first holds it is refused, the journal untouched
    lock = lock_out(out)
    try:
        _refused(cli, capsys, "in use by another evaluate", "--out")
    finally:
        lock.release()
    assert (out / "answers.jsonl").read_text() == journal

    # the prompt file edited at the same path: another evaluation
    prompts.write_text("".join(json.dumps({"turns": [f"say {w}"]}) + "\n" for w in ("gamma", "delta")))
    _refused(cli, capsys, "a dataset file's contents", "--overwrite")
    assert (out / "answers.jsonl").read_text() == journal
    prompts.write_text("".join(json.dumps({"turns": [f"say {w}"]}) + "\n" for w in ("alpha", "beta")))

    # other target weights (same shapes) at the same path: another evaluation
    shutil.rmtree(target)
    save_tiny_qwen3_target(target, seed=5)
    _refused(cli, capsys, "the target's weights", "--overwrite")
    assert (out / "answers.jsonl").read_text() == journal


# ----------------------------------------------------------------------------- item 10: a damaged init_from


def test_item10_damaged_init_from_is_refused_before_the_model_loads(assets, finished_run, tmp_path, monkeypatch,
                                                                     capsys):
    from nemo_dflash.recipes.train import main

    _no_load(monkeypatch)
    run = _copy(finished_run, tmp_path / "src")
    weights = run / "checkpoints" / STEP2 / "draft" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # bit rot: same size, other bytes
    weights.write_bytes(bytes(data))
    _refused(lambda: main(_args(*assets, tmp_path / "new", "train.max_steps=2",
                                f"draft.init_from={run / 'checkpoints' / STEP2}")), capsys,
             "draft.init_from=", "model.safetensors is damaged", "another checkpoint")
    assert not (tmp_path / "new" / "config.yaml").exists()


# ----------------------------------------------------------------------------- item 11: a torn metrics line


def test_item11_torn_metrics_line_is_dropped_on_resume(tmp_path):
    from nemo_dflash.train.metrics import MetricsLogger

    rows = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "lo')
    metrics = MetricsLogger(tmp_path, SimpleNamespace(mode="disabled", project="p", name=None), {}, 10, True)
    try:
        metrics.resume_at(3)
    finally:
        metrics.close()
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == rows[:3] and metrics.records == rows[:3]


# ----------------------------------------------------------------------------- item 13: worker counts


def test_item13_worker_counts_are_at_most_the_cpus(assets, tmp_path, monkeypatch, capsys):
    from nemo_dflash.data.config import available_cpus
    from nemo_dflash.recipes import evaluate as evaluate_cmd
    from nemo_dflash.recipes.train import main

    _no_load(monkeypatch)
    cpus = available_cpus()
    _refused(lambda: main(_args(*assets, tmp_path / "run", "data.num_workers=100000")), capsys,
             f"data.num_workers must be in [0, {cpus}]")
    assert not (tmp_path / "run").exists()
    _refused(lambda: evaluate_cmd.main(["--draft", str(tmp_path / "d"), "--target", str(assets[0]), "--out",
                                        str(tmp_path / "out"), "--workers", "100000"]), capsys,
             f"--workers must be at most {cpus}")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- item 14: records and weights bounded


def test_item14_parquet_record_size_and_source_weight_are_bounded(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nemo_dflash.config import ConfigError, load_recipe
    from nemo_dflash.data.sources import MAX_RECORD_CHARS, BadRecordCounter, DataError, apply_weight, read_conversations

    def conv(answer: str) -> list[dict[str, str]]:
        return [{"from": "human", "value": "hi"}, {"from": "gpt", "value": answer}]

    path = tmp_path / "chats.parquet"
    pq.write_table(pa.table({"conversations": [conv("short"), conv("x" * (MAX_RECORD_CHARS + 1)), conv("end")]}), path)
    bad = BadRecordCounter()
    convs = list(read_conversations(str(path), bad=bad))
    assert [c.messages[1]["content"] for c in convs] == ["short", "end"] and bad.count == 1

    with pytest.raises(DataError, match="weight must be in"):
        apply_weight([1, 2, 3], 1e9, seed=0)
    with pytest.raises(ConfigError, match=r"data.sources\[0\].weight must be at most 100"):
        load_recipe("qwen3_8b.yaml", [f"data.sources=[{{path: {path}, weight: 1e9}}]"])


# ----------------------------------------------------------------------------- item 16: ranges before any load


@pytest.mark.parametrize("override, key", [
    ("optim.grad_clip=-1", "optim.grad_clip"), ("optim.lr=inf", "optim.lr"), ("train.log_every=0", "train.log_every"),
    ("train.epochs=nan", "train.epochs"), ("train.epochs=inf", "train.epochs"), ("train.epochs=0", "train.epochs"),
    ("train.epochs=-1", "train.epochs"), ("optim.betas=[1.5,0.9]", "optim.betas"), ("optim.eps=-1", "optim.eps"),
    ("optim.weight_decay=-1", "optim.weight_decay"), ("loss.ce_chunk_size=0", "loss.ce_chunk_size"),
    ("draft.intermediate_size=-1", "draft.intermediate_size"),
])
def test_item16_ranges_are_checked_before_any_load(assets, tmp_path, monkeypatch, capsys, override, key):
    from nemo_dflash.recipes.train import main

    _no_load(monkeypatch)
    _refused(lambda: main(_args(*assets, tmp_path / "run", override)), capsys, key)
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- item 17: recipe errors in one line


def test_item17_unresolved_interpolation_and_yaml_syntax_errors_are_one_line(tmp_path, monkeypatch, capsys):
    from nemo_dflash.recipes.train import main

    monkeypatch.delenv("NEMO_DFLASH_NO_SUCH_VAR", raising=False)
    _refused(lambda: main(["--config", "qwen3_8b.yaml", "optim.lr=${foo}", "--print-config"]), capsys,
             "'optim.lr' is an interpolation that does not resolve", "foo")
    _refused(lambda: main(["--config", "qwen3_8b.yaml", "optim.lr=${oc.env:NEMO_DFLASH_NO_SUCH_VAR}",
                           "--print-config"]), capsys, "NEMO_DFLASH_NO_SUCH_VAR")
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("defaults: [_self_]\noptim: {lr: [1,\n")
    _refused(lambda: main(["--config", str(recipe), "--print-config"]), capsys, "broken.yaml, line 3", "not valid YAML")


# ----------------------------------------------------------------------------- item 18: lone surrogates


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_item18_a_lone_surrogate_record_is_skipped_by_train_and_evaluate(tmp_path, suffix):
    from nemo_dflash.data.sources import BadRecordCounter, read_conversations
    from nemo_dflash.evaluation.protocol import load_chat_file

    def rec(text: str) -> str:  # the JSON text of one record, the escape written as a file holds it
        return '{"conversations": [{"from": "human", "value": "%s"}, {"from": "gpt", "value": "ok"}]}' % text

    records = [rec("plain"), rec("lone \\ud800 here"), rec("pair \\ud83d\\ude00 kept")]
    path = tmp_path / f"chats{suffix}"
    path.write_text("\n".join(records) + "\n" if suffix == ".jsonl" else "[" + ",".join(records) + "]")
    bad = BadRecordCounter()
    convs = list(read_conversations(str(path), bad=bad))  # training data
    assert [c.messages[0]["content"] for c in convs] == ["plain", "pair \U0001F600 kept"] and bad.count == 1
    assert [p.turns for p in load_chat_file(path)] == [["plain"], ["pair \U0001F600 kept"]]  # evaluate's prompts


def test_item20_an_unfinished_list_override_names_the_fix():
    """`optim.betas=[0.9,` (a list cut short) used to say 'AnyNode is not a ListConfig'."""
    from nemo_dflash.config import ConfigError, load_recipe

    with pytest.raises(ConfigError) as e:
        load_recipe("smollm2_135m.yaml", ["optim.betas=[0.9,"])
    msg = str(e.value)
    assert "AnyNode" not in msg and "'[0.9,' is not a complete list" in msg and "optim.betas=[0.9,0.95]" in msg
    assert len(msg.splitlines()) == 1
