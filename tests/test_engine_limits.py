"""Export refuses (one line, exit 2, nothing written) what the serving engines reject, and warns of
what only one engine rejects. Each case is a tiny draft whose config breaks one documented limit."""

from __future__ import annotations

import logging

import pytest
import torch

from nemo_dflash.draft.model import DFlashConfig, DFlashDraftModel
from nemo_dflash.serving.engine_limits import EngineLimitError
from nemo_dflash.serving.export import export_draft
from nemo_dflash.recipes.export import main as export_main

from _spec_fixtures import make_draft, tiny_qwen3


def _draft(layer_ids=(1, 2), mask=255, head_dim=16, heads=4, rope=None, depth=4) -> DFlashDraftModel:
    torch.manual_seed(0)
    target = tiny_qwen3(num_layers=depth).config
    over = dict(head_dim=head_dim, num_attention_heads=heads, num_key_value_heads=heads // 2)
    if rope is not None:
        over["rope_parameters"] = rope
    cfg = DFlashConfig.from_target_config(target, num_hidden_layers=1, block_size=4, mask_token_id=mask,
                                          target_layer_ids=list(layer_ids), **over)
    return DFlashDraftModel(cfg).float()


def test_a_draft_within_every_limit_exports_silently(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="nemo_dflash.serving.engine_limits"):
        export_draft(_draft(), tmp_path / "ok", engine="sglang")
    assert not caplog.records


def test_layer_above_n_minus_2_refused_for_sglang_and_warned_otherwise(tmp_path, caplog):
    draft = _draft(layer_ids=(1, 3))  # 4-layer target: 3 > N-2 = 2
    with pytest.raises(EngineLimitError, match=r"above N-2 = 2.*serve with vLLM"):
        export_draft(draft, tmp_path / "sg", engine="sglang")
    assert not (tmp_path / "sg").exists()
    with caplog.at_level(logging.WARNING, logger="nemo_dflash.serving.engine_limits"):
        export_draft(draft, tmp_path / "any")  # vLLM can capture it: a warning, written
        export_draft(draft, tmp_path / "vllm", engine="vllm")
    assert (tmp_path / "any" / "config.json").exists() and (tmp_path / "vllm" / "config.json").exists()
    assert sum("sglang: target_layer_ids [1, 3]" in r.getMessage() for r in caplog.records) == 2


def test_mask_token_outside_the_embedding_table_refused(tmp_path):
    with pytest.raises(EngineLimitError, match=r"mask_token_id 256 is not a row .* \[0, 256\)"):
        export_draft(_draft(mask=256), tmp_path / "m")
    # Given the target's table (smaller than the draft config says), the target's rows decide.
    with pytest.raises(EngineLimitError, match=r"mask_token_id 255 is not a row .* \[0, 200\)"):
        export_draft(_draft(mask=255), tmp_path / "m", target_vocab=200)
    assert not (tmp_path / "m").exists()


def test_head_dims_the_engines_reject(tmp_path, caplog):
    with pytest.raises(EngineLimitError, match="head_dim 160 is rejected by vLLM"):
        export_draft(_draft(head_dim=160, heads=2), tmp_path / "h", engine="vllm")
    with caplog.at_level(logging.WARNING, logger="nemo_dflash.serving.engine_limits"):
        export_draft(_draft(head_dim=160, heads=2), tmp_path / "h")  # SGLang serves it: a warning
    assert any("vllm: head_dim 160" in r.getMessage() for r in caplog.records)
    with pytest.raises(EngineLimitError, match="head_dim 12 is not a multiple of 8"):
        export_draft(_draft(head_dim=12), tmp_path / "h12")


def test_rope_types_the_engines_reject(tmp_path):
    with pytest.raises(EngineLimitError, match="M-RoPE"):
        export_draft(_draft(rope={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                  "mrope_section": [2, 3, 3]}), tmp_path / "r")
    with pytest.raises(EngineLimitError, match="rope type 'proportional'"):
        from nemo_dflash.serving.export import serving_config_dict
        from nemo_dflash.serving.engine_limits import check_engine_limits

        cfg = serving_config_dict(_draft().config)
        cfg["rope_scaling"] = {"rope_type": "proportional", "factor": 1.0}
        check_engine_limits(cfg)


def test_export_cli_one_line_exit_2(tmp_path, capsys):
    src = tmp_path / "draft"
    _draft(layer_ids=(1, 3)).save_pretrained(src)
    capsys.readouterr()  # save_pretrained's progress bar
    with pytest.raises(SystemExit) as e:
        export_main(["--checkpoint", str(src), "--out", str(tmp_path / "out"), "--serving-engine", "sglang"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "SGLang cannot capture" in err
    assert not (tmp_path / "out").exists()
    assert export_main(["--checkpoint", str(src), "--out", str(tmp_path / "out"), "--engine", "vllm"]) == 0


def test_fixture_draft_is_clean(tmp_path):
    """The suite's shared draft (layers [1, 2] of 4, mask 255 of 256) is inside every limit."""
    export_draft(make_draft(tiny_qwen3()), tmp_path / "f", engine="sglang")
