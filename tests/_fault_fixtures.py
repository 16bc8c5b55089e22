"""Fixtures the fault tests share: tiny target and data, a finished two-checkpoint run, an unwritable directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from _tiny_target import make_tiny_target_dir, tiny_train_args as _args, write_chat_jsonl


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return make_tiny_target_dir(root), write_chat_jsonl(root / "chat.jsonl", n=24)


@pytest.fixture(scope="module")
def finished_run(assets, tmp_path_factory):
    """A finished run with complete checkpoints at steps 2 and 4; tests work on copies of it."""
    from nemo_dflash.recipes.train import main

    out = tmp_path_factory.mktemp("runs") / "run"
    main(_args(*assets, out, "train.max_steps=4", "checkpoint.every_steps=2"))
    return out


@pytest.fixture()
def unwritable_dir(tmp_path):
    """A directory this process cannot create files in (root ignores modes: then a sysfs directory)."""
    if os.geteuid() != 0:
        d = tmp_path / "read_only"
        d.mkdir()
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    d = Path("/sys/kernel")
    try:
        (d / "nemo_dflash_probe").open("w").close()
    except OSError:
        yield d
        return
    pytest.skip("no directory this root process cannot write to")
