"""The commands' shared convention (`nemo_dflash.recipes._cli`): one device/dtype resolver, user
errors as one line with exit status 2."""

from __future__ import annotations

import argparse

import pytest
import torch

from nemo_dflash.recipes._cli import (
    UsageError, add_batch_size_arg, add_device_args, fail, one_line, resolve_device_dtype, user_errors,
)


def test_device_and_dtype_are_decided_in_one_place(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device_dtype("auto", "auto") == ("cpu", "fp32")
    assert resolve_device_dtype(None, None) == ("cpu", "fp32")
    assert resolve_device_dtype("cpu", "bf16") == ("cpu", "bf16")
    with pytest.raises(UsageError, match="--device cuda but torch sees no GPU"):
        resolve_device_dtype("cuda", "auto")
    with pytest.raises(UsageError, match="--dtype 'fp8'"):
        resolve_device_dtype("cpu", "fp8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device_dtype("auto", "auto") == ("cuda", "bf16")
    assert resolve_device_dtype("cuda", "fp16") == ("cuda", "fp16")


def test_device_flags_are_declared_alike():
    p = argparse.ArgumentParser()
    add_device_args(p)
    assert vars(p.parse_args([])) == {"device": "auto", "dtype": "auto"}
    with pytest.raises(SystemExit):
        p.parse_args(["--device", "tpu"])


def test_batch_size_auto_is_said_with_the_engines_numbers():
    from nemo_dflash.engine.plain import AUTO_ROWS_CAP, CPU_AUTO_ROWS

    p = argparse.ArgumentParser()
    add_batch_size_arg(p, "rows in flight")
    (action,) = [a for a in p._actions if a.dest == "batch_size"]
    assert action.help == (f"rows in flight; auto: as many as the GPU's free memory holds, at most {AUTO_ROWS_CAP:,} "
                           f"(on a CPU: {CPU_AUTO_ROWS})")
    assert p.parse_args(["--batch-size", "auto"]).batch_size == "auto"
    assert p.parse_args(["--batch-size", "16"]).batch_size == 16


def test_user_errors_are_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        with user_errors(ValueError):
            raise ValueError("The draft does not fit the target:\n  - a\n  - b")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == "error: The draft does not fit the target: - a - b\n"
    with pytest.raises(SystemExit) as e:
        with user_errors():  # default: UsageError
            resolve_device_dtype("cpu", "fp8")
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1
    with pytest.raises(KeyError):  # not a user error: the traceback stays
        with user_errors(ValueError):
            raise KeyError("bug")
    with pytest.raises(SystemExit):
        fail("x")
    assert one_line(ValueError("")) == "ValueError"


def test_evaluate_resolves_auto_device(monkeypatch):
    """`evaluate --device auto` (the default) goes through the shared resolver."""
    from nemo_dflash.recipes import evaluate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = evaluate.build_parser().parse_args(["--draft", "d", "--target", "t", "--out", "o"])
    opts = evaluate.run_options(args)
    assert (opts.device, opts.dtype) == ("cpu", "fp32")
    args = evaluate.build_parser().parse_args(["--draft", "d", "--target", "t", "--out", "o", "--device", "cuda"])
    with pytest.raises(UsageError):
        evaluate.run_options(args)


@pytest.mark.parametrize("extra,message", [
    (["--device", "cuda"], "--device cuda but torch sees no GPU"),  # the shared resolver, before any file
    ([], "data source not found: 'missing.jsonl'"),
    (["--data", "chats.txt"], "unsupported data file"),
    (["--prepare-ahead", "-1"], "--prepare-ahead must be >= 0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),  # NaN passed every comparison
    (["--temperature", "inf"], "--temperature must be a finite number >= 0"),  # inf sampled uniformly
    (["--top-p", "nan"], "--top-p must be in (0, 1]"),
])
def test_regenerate_user_errors_are_one_line_before_any_model(extra, message, tmp_path, monkeypatch, capsys):
    """`regenerate` decides --device/--dtype with `resolve_device_dtype` (no copy of it left) and reports
    what the user can fix in one line with exit 2, before a target is loaded."""
    from nemo_dflash.recipes import regenerate

    assert not hasattr(regenerate, "_pick_device_dtype")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chats.txt").write_text("{}\n")

    def no_load(*a, **k):
        raise AssertionError("the target was loaded before the user error was found")

    monkeypatch.setattr("nemo_dflash.target.loading.load_target", no_load)
    data = ["--data", "missing.jsonl"] if "--data" not in extra else []
    with pytest.raises(SystemExit) as e:
        regenerate.main(["--target", "t", "--out", "o.jsonl", *data, *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err


@pytest.mark.parametrize("temps", ["nan", "0,nan", "inf", "-1"])
def test_evaluate_refuses_non_finite_temperatures_in_one_line(temps, tmp_path, monkeypatch, capsys):
    """`evaluate --temperatures nan` crashed after loading the models; now one line, exit 2, nothing loaded."""
    from nemo_dflash.recipes import evaluate

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the user error was found")

    monkeypatch.setattr("nemo_dflash.target.loading.load_target", no_load)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--draft", "d", "--target", "t", "--out", "o", "--temperatures", temps])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "finite numbers >= 0" in err


@pytest.fixture
def threads_restored(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # recorded, so the teardown puts the variable back as it was
    monkeypatch.delenv("OMP_NUM_THREADS")
    yield
    torch.set_num_threads(before)


def test_gpu_training_takes_one_host_thread_unless_told_otherwise(threads_restored, monkeypatch):
    """`device.limit_host_threads`: one torch thread on a GPU device (torchrun's setting), torch's own on a
    CPU device, and ``--threads N`` (which records OMP_NUM_THREADS) is kept on a GPU too."""
    from nemo_dflash.train.device import limit_host_threads
    from nemo_dflash.recipes._cli import set_threads

    torch.set_num_threads(2)
    assert limit_host_threads(torch.device("cpu")) is None and torch.get_num_threads() == 2
    assert limit_host_threads(torch.device("cuda", 0)) == 1 and torch.get_num_threads() == 1
    set_threads(2)
    assert torch.get_num_threads() == 2
    assert limit_host_threads(torch.device("cuda", 0)) is None and torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # empty: not a choice
    assert limit_host_threads(torch.device("cuda")) == 1 and torch.get_num_threads() == 1
