"""`nemo_dflash.draft.build`, the one place that makes a draft for a target: the registry's classes on every
path (build and load), one check of layer ids and of the mask token, and clean errors in the command."""

from __future__ import annotations

import pytest
import torch

from _tiny_target import make_tiny_target_dir, write_chat_jsonl
from _tiny_models import MASK_ID, train_draft, train_qwen3
from nemo_dflash.draft.build import (
    DraftError,
    MaskTokenError,
    build_draft_for_target,
    check_draft_fits_target,
    check_mask_token_id,
    load_draft,
    load_draft_for_target,
)
from nemo_dflash.config import ConfigError, load_recipe
from nemo_dflash.draft.model import DFlashConfig, DFlashDraftModel
from nemo_dflash.draft.registry import DFLASH_DRAFT_REGISTRY, DraftSpec
from nemo_dflash.target import HFDFlashTargetModel, LayerIdsError, check_target_layer_ids


class _FamilyDraft(DFlashDraftModel):
    """A family's own draft class (same weight layout: the serving contract)."""


class _FamilyConfig(DFlashConfig):
    pass


@pytest.fixture
def family(monkeypatch):
    """Qwen3 targets get their own draft and config classes from the registry for this test."""
    monkeypatch.setitem(DFLASH_DRAFT_REGISTRY, "Qwen3ForCausalLM",
                        DraftSpec(draft_cls=_FamilyDraft, config_cls=_FamilyConfig, default_mask_token_id=None))


def test_build_and_load_both_use_the_registry_classes(family, tmp_path):
    target = train_qwen3()
    target.config.architectures = ["Qwen3ForCausalLM"]
    built = build_draft_for_target(target, None, num_layers=1, block_size=4, mask_token_id=MASK_ID)
    assert type(built) is _FamilyDraft and type(built.config) is _FamilyConfig
    built.save_pretrained(tmp_path / "draft")
    loaded = load_draft_for_target(tmp_path / "draft", target.config)
    assert type(loaded) is _FamilyDraft and type(loaded.config) is _FamilyConfig
    assert all(torch.equal(a, b) for a, b in zip(built.state_dict().values(), loaded.state_dict().values()))
    assert type(load_draft(tmp_path / "draft")) is DFlashDraftModel  # no target named: the stock classes


def test_a_spec_outside_the_serving_contract_is_refused():
    with pytest.raises(TypeError, match="must subclass DFlashDraftModel"):
        DraftSpec(draft_cls=torch.nn.Linear)
    with pytest.raises(TypeError, match="must subclass DFlashConfig"):
        DraftSpec(config_cls=dict)


@pytest.mark.parametrize("ids,problem", [([], "empty"), ([1, 1], "repeat"), ([0, 6], "[6] outside [0, 5]"),
                                         ([-1], "[-1]")])
def test_layer_ids_are_checked_by_one_function_on_every_path(ids, problem):
    """The recipe (no target yet, so no depth), the builder, the fit check and the target wrapper all
    report the same problem through `check_target_layer_ids`."""
    target = train_qwen3()  # 6 layers
    with pytest.raises(LayerIdsError, match="draft.target_layer_ids") as e:
        if ids:  # an empty list means "the default" to the builder
            build_draft_for_target(target, None, num_layers=2, block_size=4, target_layer_ids=ids, mask_token_id=MASK_ID)
        else:
            check_target_layer_ids(ids, 6, key="draft.target_layer_ids")
    assert problem in str(e.value)
    with pytest.raises(LayerIdsError, match="target_layer_ids"):
        HFDFlashTargetModel(target, ids)
    cfg = train_draft(target).config
    cfg.dflash_config["target_layer_ids"] = ids
    with pytest.raises(DraftError, match=r"target_layer_ids"):
        check_draft_fits_target(cfg, target.config)
    if "outside" not in problem:  # the depth is unknown before the target loads
        with pytest.raises(ConfigError, match="draft.target_layer_ids"):
            load_recipe("qwen3_8b.yaml", [f"draft.target_layer_ids={ids}"])


def test_mask_token_is_checked_by_one_function():
    assert check_mask_token_id(5, 256) == 5
    for bad in (None, -1, 256):
        with pytest.raises(MaskTokenError):
            check_mask_token_id(bad, 256)
    target = train_qwen3()
    with pytest.raises(MaskTokenError, match="mask_token_id 999"):
        build_draft_for_target(target, None, num_layers=1, block_size=4, mask_token_id=999)
    cfg = train_draft(target).config
    cfg.dflash_config["mask_token_id"] = 999
    with pytest.raises(DraftError, match="mask_token_id 999"):
        check_draft_fits_target(cfg, target.config)


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return make_tiny_target_dir(root), write_chat_jsonl(root / "chat.jsonl", n=8)


def _train_args(target, data, out, *extra):
    return ["--config", "qwen3_8b.yaml", f"target.path={target}", "target.dtype=fp32", "draft.num_layers=2",
            "draft.block_size=4", f"data.sources=[{{path: {data}}}]", "data.max_length=96", "loss.num_anchors=8",
            "train.micro_batch_size=2", "distributed.strategy=none", "wandb.mode=disabled", f"output_dir={out}",
            "train.max_steps=1", *extra]


@pytest.mark.parametrize("bad,message", [
    ("draft.target_layer_ids=[0,9]", "[9] outside [0, 3]"),
    ("draft.mask_token_id=99999999", "mask_token_id 99999999"),
    ("draft.init_from=RUN", "does not fit the target"),
])
def test_train_command_reports_draft_errors_in_one_line(tiny_assets, tmp_path, capsys, bad, message):
    """Layer ids past the target's depth, a mask token off its table and an `init_from` draft of another
    target are found once the target loads: one line, exit 2, no traceback."""
    from nemo_dflash.recipes.train import main

    target, data = tiny_assets
    if "RUN" in bad:
        other = train_qwen3()  # hidden size 64, the tiny target's is 32
        train_draft(other).save_pretrained(tmp_path / "other")
        bad = bad.replace("RUN", str(tmp_path / "other"))
    with pytest.raises(SystemExit) as exc:
        main(_train_args(target, data, tmp_path / "run", bad))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert exc.value.code == 2 and len(errors) == 1 and message in errors[0] and "Traceback" not in err
