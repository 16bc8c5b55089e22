"""The package facades load their names on first use (PEP 562, `nemo_dflash.lazy_exports`): every public name must
still import from where users import it, and importing the top package must not import torch."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

FACADES = ["nemo_dflash", "nemo_dflash.data", "nemo_dflash.draft", "nemo_dflash.draft.model", "nemo_dflash.target"]


@pytest.mark.parametrize("name", FACADES)
def test_every_public_name_resolves_to_its_module(name):
    facade = importlib.import_module(name)
    assert facade.__all__, name
    for attr in facade.__all__:
        value = getattr(facade, attr)
        (module,) = [m for m, names in facade._EXPORTS.items() if attr in names]  # each name in one module
        source = importlib.import_module(module)
        assert value is getattr(source, attr), (name, attr)
        assert attr in dir(facade)
    with pytest.raises(AttributeError):
        getattr(facade, "no_such_name")


def test_the_seeds_names_import_from_the_top_package_without_torch_first():
    code = ("import sys, nemo_dflash; assert 'torch' not in sys.modules, 'import nemo_dflash loaded torch'; "
            "from nemo_dflash import DFlashTargetBatch, HFDFlashTargetModel, build_target_layer_ids, "
            "DFLASH_DRAFT_REGISTRY, resolve_dflash_draft_spec, DraftSpec, DFlashDraftModel; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
