"""Shared fixtures: tiny random-weight targets (Qwen3 and Llama, the training shape of tests/_tiny_models.py) and
drafts built on them; the slow tests' marks."""

from __future__ import annotations

from pathlib import Path

import pytest

import nemo_dflash.train.trainer  # noqa: F401  binds the real load_target before any test patches the loader's
from nemo_dflash import HFDFlashTargetModel

from _tiny_models import train_draft, train_llama, train_qwen3  # the one set of builders (tests/_tiny_models.py)


@pytest.fixture(params=["qwen3", "llama"])
def target_and_draft(request):
    target = train_qwen3() if request.param == "qwen3" else train_llama()
    draft = train_draft(target)
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    return wrapper, draft


_SLOW = frozenset(line.strip() for line in Path(__file__).with_name("slow.txt").read_text().splitlines()
                  if line.strip() and not line.startswith("#"))


def pytest_collection_modifyitems(config, items):
    """Mark the tests tests/slow.txt lists `slow`: `make test-fast` (-m "not slow") leaves them to `make test`."""
    for item in items:
        if item.nodeid in _SLOW:
            item.add_marker(pytest.mark.slow)
