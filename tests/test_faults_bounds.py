"""What a new user's probe found still ending in a traceback, a silent result, a machine exhausted or a process left
behind, each case a test named for it: a draft deeper than its target, an export cut short or holding NaN, the
standalone commands' time caps, counts and sizes bounded by the model and the machine before any load, a resumed
training under changed settings, and `evaluate --gpus` owning its --out for the whole run with its parts ending
with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_dflash.data.config import available_cpus

from _tiny_target import make_tiny_target_dir, tiny_train_args, write_chat_jsonl

CPUS = available_cpus()
GB = 1e9


class Loaded(Exception):
    """Raised where a model would load: the checks before it all passed."""


def _no_load(*a, **k):
    raise Loaded()


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> tuple[Path, Path]:
    """A 4-layer tiny Qwen3 target (hidden 32, 2 KV heads of 8, context 2048) and a chat file."""
    root = tmp_path_factory.mktemp("bounds")
    return make_tiny_target_dir(root), write_chat_jsonl(root / "chat.jsonl", n=8)


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> dict[str, Path]:
    """A 2-layer tiny target, an exported 1-layer draft of block 4 trained for it, and a prompt file."""
    from _spec_fixtures import QWEN3_MASK_ID, make_draft, save_tiny_qwen3_target, tiny_qwen3
    from nemo_dflash.serving.export import export_draft

    root = tmp_path_factory.mktemp("export")
    target = save_tiny_qwen3_target(root / "target", seed=4)
    draft = export_draft(make_draft(tiny_qwen3(num_layers=2, vocab=151936, hidden=32, seed=4), num_layers=1,
                                    block_size=4, mask_token_id=QWEN3_MASK_ID, layer_ids=[0, 1], seed=1), root / "d")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"say {w}"]}) + "\n" for w in ("alpha", "beta")))
    return {"target": target, "draft": Path(draft), "prompts": prompts}


def _one_line(call, capsys, *needles: str) -> str:
    with pytest.raises(SystemExit) as e:
        call()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    for needle in needles:
        assert needle in err[0], (needle, err[0])
    return err[0]


def _free(monkeypatch, value: float) -> None:
    monkeypatch.setattr("nemo_dflash.train.device.free_memory_bytes", lambda device: int(value))


# ---- a draft deeper than its target


def test_draft_num_layers_above_the_targets_layers_is_one_line_before_the_target_loads(assets, tmp_path, monkeypatch,
                                                                                       capsys):
    """5 draft layers pick 5 distinct layers of a 4-layer target: refused naming draft.num_layers and the most it may
    be, before the target loads (before, build_target_layer_ids' ValueError was a traceback after the load); 4 is
    accepted, and so are 5 with draft.target_layer_ids given."""
    from nemo_dflash.recipes.train import main

    monkeypatch.setattr("nemo_dflash.train.trainer.load_target", _no_load)
    target, data = assets
    _one_line(lambda: main(tiny_train_args(target, data, tmp_path / "a", "draft.num_layers=5")), capsys,
              "draft.num_layers=5", "has 4", "draft.num_layers <= 4")
    _one_line(lambda: main(tiny_train_args(target, data, tmp_path / "b", "draft.target_layer_ids=[0,1,4]")), capsys,
              "draft.target_layer_ids")
    for ok in ("draft.num_layers=4", "draft.num_layers=5 draft.target_layer_ids=[0,1,2,3]"):
        with pytest.raises(Loaded):
            main(tiny_train_args(target, data, tmp_path / ok.replace(" ", "_"), *ok.split()))


def test_draft_num_layers_above_the_target_is_one_line_where_the_target_is_only_read_at_load(assets):
    """A target whose config is read only as it loads (a .gguf): the build's own refusal is one line too
    (`LayerIdsError`, which the commands turn into exit 2), not build_target_layer_ids' bare ValueError."""
    from transformers import AutoModelForCausalLM

    from nemo_dflash.draft.build import build_draft_for_target
    from nemo_dflash.target import LayerIdsError

    target = AutoModelForCausalLM.from_pretrained(assets[0])
    with pytest.raises(LayerIdsError, match=r"draft.num_layers=5: .* has 4: give draft.num_layers <= 4"):
        build_draft_for_target(target, None, num_layers=5, block_size=4, mask_token_id=0)


# ---- an export cut short or holding NaN


def _evaluate(export, out, *extra) -> list[str]:
    return ["--draft", str(export["draft"]), "--target", str(export["target"]), "--out", str(out), "--device", "cpu",
            "--threads", "1", "--protocol", "quick", "--max-new-tokens", "4", "--datasets", str(export["prompts"]),
            "--no-speedup", *extra]


def test_a_truncated_export_is_refused_before_the_target_loads(export, tmp_path, monkeypatch, capsys):
    """An export whose model.safetensors was cut short (a partial copy): one line naming the file, before any model
    loads (before: a SafetensorError traceback once the target had loaded)."""
    import shutil

    from nemo_dflash.recipes import evaluate

    monkeypatch.setattr("nemo_dflash.evaluation.run.load_models", _no_load)
    cut = tmp_path / "cut"
    shutil.copytree(export["draft"], cut)
    weights = cut / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 100)
    line = _one_line(lambda: evaluate.main(_evaluate({**export, "draft": cut}, tmp_path / "out")), capsys,
                     str(weights), "cannot be read", "cut short")
    assert "SafetensorError" not in line
    with pytest.raises(Loaded):  # the whole export passes the same check
        evaluate.main(_evaluate(export, tmp_path / "whole"))


def test_an_export_with_nan_weights_is_refused_unless_allow_nonfinite(export, tmp_path, monkeypatch, capsys):
    """One NaN in one weight of an export (a diverged training): refused in one line naming the weight and
    --allow-nonfinite, before any model loads (before: evaluated silently); --allow-nonfinite measures it."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from nemo_dflash.recipes import evaluate

    monkeypatch.setattr("nemo_dflash.evaluation.run.load_models", _no_load)
    nan = tmp_path / "nan"
    shutil.copytree(export["draft"], nan)
    weights = nan / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(weights))
    name = sorted(k for k, t in tensors.items() if t.is_floating_point() and t.dim() == 2)[0]
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(weights), metadata=meta)
    _one_line(lambda: evaluate.main(_evaluate({**export, "draft": nan}, tmp_path / "out")), capsys,
              name, "NaN or inf", "--allow-nonfinite")
    assert not (tmp_path / "out" / "answers.jsonl").exists()
    with pytest.raises(Loaded):
        evaluate.main(_evaluate({**export, "draft": nan}, tmp_path / "out", "--allow-nonfinite"))


# ---- the standalone commands: time caps, counts and sizes bounded before any load


def _regenerate(target, data, out, *extra) -> list[str]:
    return ["--target", str(target), "--data", str(data), "--out", str(out), "--device", "cpu",
            "--max-new-tokens", "4", *extra]


@pytest.mark.parametrize("extra, needle", [
    (["--max-minutes", "nan"], "--max-minutes"),
    (["--max-bad-lines", "-1"], "--max-bad-lines"),
    (["--threads", str(CPUS + 1)], "--threads"),
    (["--threads", "100000"], "--threads"),
    (["--max-new-tokens", "1000000000"], "--max-new-tokens"),  # the tiny target's context is 2048
    (["--max-new-tokens", "2048"], "give at most 2047"),
], ids=lambda x: "=".join(x) if isinstance(x, list) else None)
def test_standalone_regenerate_refuses_nan_minutes_negative_counts_and_unbounded_sizes_before_any_load(
        assets, tmp_path, monkeypatch, capsys, extra, needle):
    from nemo_dflash.recipes import regenerate

    monkeypatch.setattr("nemo_dflash.target.loading.load_target", _no_load)
    _one_line(lambda: regenerate.main(_regenerate(*assets, tmp_path / "r.jsonl", *extra)), capsys, needle)
    assert not (tmp_path / "r.jsonl.partial").exists()


def test_regenerate_batch_times_new_tokens_is_bounded_by_free_memory_before_the_target_loads(assets, tmp_path,
                                                                                            monkeypatch, capsys):
    """--batch-size 2048 --max-new-tokens 2000 on the tiny target: its KV cache is at least 2048 rows x 2000
    positions x 512 bytes (2 x 4 layers x 2 KV heads x 8 dims x 4 bytes, fp32) = 2.1 GB. With 1 GB free it is
    refused in one line naming --batch-size (before: allocated at once after the load, 36.5 GB on a larger target);
    with 4 GB free the target loads. The pipeline's plan refuses the same recipe values."""
    from nemo_dflash.recipes import pipeline, regenerate

    monkeypatch.setattr("nemo_dflash.target.loading.load_target", _no_load)
    assert 2048 * 2000 * 2 * 4 * 2 * 8 * 4 > 0.9 * 1 * GB and 2048 * 2001 * 512 < 0.9 * 4 * GB
    argv = _regenerate(*assets, tmp_path / "r.jsonl", "--batch-size", "2048", "--max-new-tokens", "2000")
    _free(monkeypatch, 1 * GB)
    _one_line(lambda: regenerate.main(argv), capsys, "2048 rows", "KV cache", "1.0 GB is free", "--batch-size")
    from test_pipeline import RECIPE

    config = tmp_path / "run.yaml"
    config.write_text(RECIPE.format(run=tmp_path / "run", target=assets[0], chat=assets[1]))
    _one_line(lambda: pipeline.main(["--config", str(config), "regenerate.batch_size=2048",
                                     "regenerate.max_new_tokens=2000"]), capsys, "regenerate", "--batch-size")
    assert not (tmp_path / "run").exists()
    _free(monkeypatch, 4 * GB)
    with pytest.raises(Loaded):
        regenerate.main(argv)


@pytest.mark.parametrize("extra, needle", [
    (["--max-minutes", "nan"], "--max-minutes"),
    (["--max-new-tokens", "1000000000"], "exceeds the target's context (1024"),
    (["--max-new-tokens", "1025"], "exceeds the target's context (1024"),
    (["--block-size", "100000"], "trained for: give 1 to 4"),
    (["--block-size", "5"], "trained for: give 1 to 4"),
    (["--threads", str(CPUS + 1)], "--threads must be 1 to"),
    (["--threads", "100000"], "--threads must be 1 to"),
], ids=lambda x: "=".join(x) if isinstance(x, list) else None)
def test_standalone_evaluate_refuses_nan_minutes_and_counts_past_the_models_and_the_machine(
        export, tmp_path, monkeypatch, capsys, extra, needle):
    """The tiny target's context is 1024 positions and the draft's block 4: a decode past the one or a block past
    the other is refused before any model loads (before: decoded for months, or 60.8 GB allocated)."""
    from nemo_dflash.recipes import evaluate

    monkeypatch.setattr("nemo_dflash.evaluation.run.load_models", _no_load)
    argv = _evaluate(export, tmp_path / "out")
    argv = [a for i, a in enumerate(argv) if not (a == "--threads" or argv[i - 1] == "--threads")]
    _one_line(lambda: evaluate.main([*argv, *extra]), capsys, needle)


def test_the_standalone_bounds_admit_the_values_at_them(export, tmp_path, monkeypatch):
    from nemo_dflash.recipes import evaluate

    monkeypatch.setattr("nemo_dflash.evaluation.run.load_models", _no_load)
    with pytest.raises(Loaded):
        evaluate.main([*_evaluate(export, tmp_path / "out"), "--max-new-tokens", "1024", "--block-size", "4"])


def test_train_threads_above_the_cpus_is_one_line(assets, tmp_path, monkeypatch, capsys):
    from nemo_dflash.recipes.train import main

    monkeypatch.setattr("nemo_dflash.train.trainer.load_target", _no_load)
    _one_line(lambda: main(["--threads", "100000", *tiny_train_args(*assets, tmp_path / "t")]), capsys,
              f"--threads must be 1 to {CPUS}")


def test_draft_intermediate_size_is_bounded_by_the_machines_memory_before_the_target_loads(assets, tmp_path,
                                                                                           monkeypatch, capsys):
    """draft.intermediate_size=16777216 on the tiny target (hidden 32, 2 draft layers): at least 2 x 3 x 32 x
    16,777,216 MLP weights, 16 bytes each to train (fp32 weights, gradients, two Adam moments) = 51.5 GB, refused in
    one line with 24 GB free (before: allocated until an external memory limit stopped it), in `train` and in the
    pipeline's plan; 1024 is accepted."""
    from nemo_dflash.recipes import pipeline
    from nemo_dflash.recipes.train import main

    monkeypatch.setattr("nemo_dflash.train.trainer.load_target", _no_load)
    _free(monkeypatch, 24 * GB)
    assert round(16 * 2 * 3 * 32 * 16777216 / GB, 1) == 51.5
    _one_line(lambda: main(tiny_train_args(*assets, tmp_path / "a", "draft.intermediate_size=16777216")), capsys,
              "draft.intermediate_size", "51.5 GB", "24.0 GB free")
    from test_pipeline import RECIPE

    config = tmp_path / "run.yaml"
    config.write_text(RECIPE.format(run=tmp_path / "run", target=assets[0], chat=assets[1]))
    for override in ("draft.intermediate_size=16777216", "draft.num_layers=5"):
        _one_line(lambda: pipeline.main(["--config", str(config), override]), capsys, override.split("=")[0])
    assert not (tmp_path / "run").exists()
    with pytest.raises(Loaded):
        main(tiny_train_args(*assets, tmp_path / "b", "draft.intermediate_size=1024"))


# ---- a standalone training resumed under changed settings


def test_a_standalone_resume_follows_the_what_how_rule(assets, tmp_path, monkeypatch, capsys):
    """`train` killed after a checkpoint, then resumed by hand: a changed WHAT key (optim.lr) is refused in one line
    naming the key, both values and the fix, before the target loads and with config.yaml untouched (before: the run
    went on under the new rate while config.yaml claimed the whole run used it), on automatic resume and with
    checkpoint.resume=PATH into a new output_dir; a changed HOW key (train.log_every) resumes and finishes."""
    from nemo_dflash.recipes.train import main
    from nemo_dflash.train import trainer
    from nemo_dflash.train.checkpoint import list_checkpoints

    out = tmp_path / "run"
    base = ("train.max_steps=4",)
    main(tiny_train_args(*assets, out, *base, "train.max_minutes=0.0", "checkpoint.every_steps=100"))
    ckpt = list_checkpoints(out)[-1]
    config = (out / "config.yaml").read_text()
    capsys.readouterr()
    real_load = trainer.load_target
    monkeypatch.setattr(trainer, "load_target", _no_load)
    line = _one_line(lambda: main(tiny_train_args(*assets, out, *base, "optim.lr=2.5e-5")), capsys,
                     "optim.lr: checkpoint 0.003 vs this run 2.5e-05", "checkpoint.resume=none --overwrite")
    assert "Refusing to resume" in line and (out / "config.yaml").read_text() == config
    _one_line(lambda: main(tiny_train_args(*assets, tmp_path / "moved", *base, "optim.lr=2.5e-5",
                                           f"checkpoint.resume={ckpt}")), capsys, "optim.lr")
    monkeypatch.setattr(trainer, "load_target", real_load)
    summary = main(tiny_train_args(*assets, out, *base, "train.log_every=2"))
    assert summary["steps"] == 4


# ---- evaluate --gpus: its --out owned for the whole run, its parts ending with it


@pytest.mark.skipif(CPUS < 2 or not sys.platform.startswith("linux"), reason="two CPU processes, Linux flock")
def test_evaluate_gpus_holds_its_out_lock_while_its_parts_run(export, tmp_path, monkeypatch):
    """While the --gpus parts run, --out's lock is held (before: released, so a second `evaluate --out O` ran whole
    beside the first). Each part here is a stand-in interpreter that tries the lock: it exits 3 if it got it. After
    the run the lock is free."""
    from nemo_dflash.evaluation.run import lock_out
    from nemo_dflash.recipes import evaluate

    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\n" + """
import fcntl, os, sys
args = sys.argv[1:]
own = args[len(args) - 1 - args[::-1].index("--out") + 1]  # the last --out: the part's own
os.makedirs(own, exist_ok=True)
with open(os.path.join(os.path.dirname(own), ".lock"), "a") as f:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(0)
sys.exit(3)
""")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    out = tmp_path / "out"
    assert evaluate.main(_evaluate(export, out, "--gpus", "2")) == 0  # the parent decoded what the parts left
    assert [json.loads(x)["id"] for x in (out / "answers.jsonl").read_text().splitlines()[1:]] == ["prompts/0",
                                                                                                  "prompts/1"]
    lock_out(out).release()  # free again


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_evaluate_gpus_parts_die_with_their_parent(tmp_path):
    """A part started by `start_process` (here a stand-in interpreter that sleeps) ends when its parent is killed
    with SIGKILL (before: it ran on, and a rerun found its --out half-written)."""
    sleeper = tmp_path / "python"
    sleeper.write_text("#!/bin/sh\nexec sleep 120\n")
    sleeper.chmod(0o755)
    parent = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from pathlib import Path
sys.executable = {str(sleeper)!r}
from nemo_dflash.evaluation import processes as evaluate
p = evaluate.start_process([], 0, "cpu", Path({str(tmp_path / 'part0.log')!r}))
print(p.pid, flush=True)
time.sleep(120)
"""], stdout=subprocess.PIPE, text=True, cwd=str(Path(__file__).resolve().parent))
    child = int(parent.stdout.readline())

    def alive() -> bool:
        try:
            return Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[0] != "Z"
        except OSError:
            return False

    try:
        assert alive()
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(), "the part outlived its parent"
    finally:
        if alive():
            os.kill(child, signal.SIGKILL)
