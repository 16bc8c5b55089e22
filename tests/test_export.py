"""Export to the vLLM/SGLang serving contract, and loading drafts back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from nemo_dflash.serving.export import (
    SERVING_CONFIG_KEYS,
    check_draft_fits_target,
    export_draft,
    load_draft,
    serving_weight_shapes,
)
from nemo_dflash.draft.model import DFlashConfig
from nemo_dflash.recipes.export import main as export_main

from _spec_fixtures import make_draft, tiny_llama, tiny_qwen3

LAYER_NAMES = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)


def contract_names(num_layers: int) -> set[str]:
    """The serving contract, written out independently of nemo_dflash.serving.export."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    names |= {f"layers.{i}.{n}" for i in range(num_layers) for n in LAYER_NAMES}
    return names


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3()


@pytest.fixture()
def draft(target):
    return make_draft(target, num_layers=2, block_size=8)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_export_writes_exactly_the_contract(draft, tmp_path):
    out = export_draft(draft, tmp_path / "exp")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    w = read_weights(out / "model.safetensors")
    assert set(w) == contract_names(2) == set(serving_weight_shapes(draft.config))
    assert all(v.dtype == torch.bfloat16 for v in w.values())
    assert not any(k.startswith("model.") or "embed_tokens" in k or "lm_head" in k for k in w)
    for k, v in w.items():
        torch.testing.assert_close(v, draft.state_dict()[k].to(torch.bfloat16), atol=0, rtol=0)

    cfg = json.loads((out / "config.json").read_text())
    assert set(cfg) == set(SERVING_CONFIG_KEYS)
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["tie_word_embeddings"] is False and cfg["torch_dtype"] == "bfloat16" and cfg["dtype"] == "bfloat16"
    assert cfg["dflash_config"] == {"mask_token_id": 255, "target_layer_ids": [1, 2]}
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 4 and cfg["num_hidden_layers"] == 2
    assert cfg["rope_theta"] == 10000.0 and "rope_scaling" not in cfg and "rope_parameters" not in cfg
    assert "target_hidden_size" not in cfg
    for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "max_position_embeddings", "vocab_size", "hidden_act", "attention_bias", "rms_norm_eps"):
        assert cfg[k] == getattr(draft.config, k), k


def test_export_import_same_logits_bf16(target, draft, tmp_path):
    out = export_draft(draft, tmp_path / "exp")
    loaded = load_draft(out)
    assert loaded.dtype == torch.bfloat16
    ref = make_draft(target, num_layers=2, block_size=8).to(torch.bfloat16)  # same seed -> same weights
    g = torch.Generator().manual_seed(0)
    noise = target.get_input_embeddings()(torch.randint(0, 250, (1, 8), generator=g))
    feats = torch.randn(1, 5, 2 * 64, generator=g)
    pos = torch.arange(13).unsqueeze(0)
    with torch.no_grad():
        a = target.lm_head(loaded(noise, feats, pos).float())
        b = target.lm_head(ref(noise, feats, pos).float())
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_training_dir_round_trip_and_checkpoint_roots(draft, tmp_path):
    run = tmp_path / "run"
    draft.save_pretrained(run / "checkpoints" / "step_10" / "draft")
    make_draft(tiny_qwen3(), seed=7).save_pretrained(run / "checkpoints" / "step_2" / "draft")
    for path in (run / "checkpoints" / "step_10" / "draft", run / "checkpoints" / "step_10", run):
        loaded = load_draft(path)
        assert loaded.dtype == torch.float32
        for k, v in draft.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[k], v, atol=0, rtol=0)
    draft.save_pretrained(run / "final" / "draft")
    assert load_draft(run, dtype="bf16").dtype == torch.bfloat16
    # Export straight from the run dir, then import the export.
    out = export_draft(run, tmp_path / "exp")
    assert load_draft(out).config.target_layer_ids == draft.config.target_layer_ids


def test_non_default_rope_round_trip(target, tmp_path):
    tc = target.config
    cfg = DFlashConfig.from_target_config(
        tc, num_hidden_layers=1, block_size=4, mask_token_id=255, target_layer_ids=[1],
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
    )
    from nemo_dflash.draft.model import DFlashDraftModel

    out = export_draft(DFlashDraftModel(cfg), tmp_path / "exp")
    written = json.loads((out / "config.json").read_text())
    assert written["rope_theta"] == 5e5 and written["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert load_draft(out).config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}


def test_published_style_config_loads(draft, tmp_path):
    """A z-lab-style export: extra Qwen3 fields, rope_scaling null, auto_map, an embed table."""
    d = tmp_path / "pub"
    d.mkdir()
    cfg = json.loads((export_draft(draft, tmp_path / "exp") / "config.json").read_text())
    cfg.update({"auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "rope_scaling": None, "use_cache": True,
                "layer_types": ["full_attention"] * 2, "transformers_version": "4.57.1", "sliding_window": None,
                "use_sliding_window": False, "max_window_layers": 2, "bos_token_id": 1, "eos_token_id": 2})
    (d / "config.json").write_text(json.dumps(cfg))
    w = read_weights(tmp_path / "exp" / "model.safetensors")
    w["embed_tokens.weight"] = torch.zeros(256, 64, dtype=torch.bfloat16)
    save_file(w, str(d / "model.safetensors"))
    loaded = load_draft(d)
    assert loaded.config.mask_token_id == 255 and loaded.config.block_size == 8


def _write(dir_: Path, cfg: dict, weights: dict[str, torch.Tensor]) -> Path:
    dir_.mkdir(parents=True, exist_ok=True)
    (dir_ / "config.json").write_text(json.dumps(cfg))
    save_file(weights, str(dir_ / "model.safetensors"))
    return dir_


def test_bad_inputs_fail_clearly(draft, target, tmp_path):
    out = export_draft(draft, tmp_path / "exp")
    cfg = json.loads((out / "config.json").read_text())
    w = read_weights(out / "model.safetensors")

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_draft(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="No config.json"):
        load_draft(tmp_path / "empty")
    only_cfg = tmp_path / "only_cfg"
    only_cfg.mkdir()
    (only_cfg / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_draft(only_cfg)
    (only_cfg / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="pickle"):
        load_draft(only_cfg)

    with pytest.raises(ValueError, match="unknown names.*layers.0.self_attn.rotary"):
        load_draft(_write(tmp_path / "unk", cfg, {**w, "layers.0.self_attn.rotary.inv_freq": torch.zeros(2)}))
    with pytest.raises(ValueError, match="`model.` prefix"):
        load_draft(_write(tmp_path / "pref", cfg, {"model." + k: v for k, v in w.items()}))
    with pytest.raises(ValueError, match="missing 'layers.1.mlp.up_proj.weight'"):
        load_draft(_write(tmp_path / "miss", cfg, {k: v for k, v in w.items() if k != "layers.1.mlp.up_proj.weight"}))
    with pytest.raises(ValueError, match=r"wrong shapes.*fc.weight: \(64, 192\) != expected \(64, 128\)"):
        load_draft(_write(tmp_path / "shape", cfg, {**w, "fc.weight": torch.zeros(64, 192, dtype=torch.bfloat16)}))
    with pytest.raises(ValueError, match="not a DFlash draft"):
        load_draft(_write(tmp_path / "tgt", {**cfg, "architectures": ["Qwen3ForCausalLM"]}, w))
    no_mask = {**cfg, "dflash_config": {"target_layer_ids": [1, 2]}}
    with pytest.raises(ValueError, match="mask_token_id"):
        load_draft(_write(tmp_path / "nomask", no_mask, w))
    causal = {**cfg, "dflash_config": {**cfg["dflash_config"], "causal": True}}
    with pytest.raises(ValueError, match="causal"):
        load_draft(_write(tmp_path / "causal", causal, w))
    with pytest.raises(ValueError, match="target_hidden_size"):
        load_draft(_write(tmp_path / "th", {**cfg, "target_hidden_size": 128}, w))
    (tmp_path / "bad_json").mkdir()
    (tmp_path / "bad_json" / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_draft(tmp_path / "bad_json")


def test_export_validates_before_writing_and_never_clobbers(draft, tmp_path):
    draft.extra = nn.Parameter(torch.zeros(3))  # not a contract name
    with pytest.raises(ValueError, match="unknown names 'extra'"):
        export_draft(draft, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    del draft.extra

    out = tmp_path / "exp"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_draft(draft, out)
    with pytest.raises(FileExistsError, match="only replaces an export"):  # someone's files: never deleted
        export_draft(draft, out, overwrite=True)
    assert (out / "keep.txt").exists()
    (out / "keep.txt").unlink()
    export_draft(draft, out)
    export_draft(draft, out, overwrite=True)  # an export: replaced
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # no temp dirs left behind
    empty = tmp_path / "empty"
    empty.mkdir()
    export_draft(draft, empty)  # an empty dir is fine


def test_check_draft_fits_target(target):
    draft = make_draft(target)
    check_draft_fits_target(draft.config, target.config)
    with pytest.raises(ValueError, match="hidden_size 48 != target hidden_size 64"):
        check_draft_fits_target(make_draft(tiny_llama()).config, target.config)
    cfg = DFlashConfig.from_target_config(target.config, num_hidden_layers=1, block_size=4,
                                          mask_token_id=300, target_layer_ids=[1, 9])
    cfg.num_target_layers = 36
    with pytest.raises(ValueError) as e:
        check_draft_fits_target(cfg, target.config)
    msg = str(e.value)
    assert "target_layer_ids [1, 9]" in msg and "num_target_layers 36" in msg and "mask_token_id 300" in msg


def test_export_cli(draft, tmp_path, capsys):
    run = tmp_path / "run"
    draft.save_pretrained(run / "final" / "draft")
    target_dir = tmp_path / "target"
    tiny_qwen3().save_pretrained(target_dir)
    args = ["--checkpoint", str(run), "--out", str(tmp_path / "exp"), "--target", str(target_dir)]
    assert export_main(args) == 0
    assert set(read_weights(tmp_path / "exp" / "model.safetensors")) == contract_names(2)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # user errors: one line, exit 2, as every command
        export_main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--overwrite" in err and err.count("\n") == 1 and err.startswith("error: ")
    assert export_main(args + ["--overwrite"]) == 0
    tiny_llama().save_pretrained(tmp_path / "llama")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        export_main(["--checkpoint", str(run), "--out", str(tmp_path / "x"), "--target", str(tmp_path / "llama")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "hidden_size" in err and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [err.splitlines()[-1]]
    with pytest.raises(SystemExit) as e:
        export_main(["--checkpoint", str(tmp_path / "nowhere"), "--out", str(tmp_path / "y")])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_export_and_training_drafts_honour_the_umask(draft, tmp_path, umask):
    """A server running as another user must be able to read an export (mkdtemp makes 0700 dirs,
    safetensors 0600 files): modes follow the umask, as a plain open()/mkdir() would."""
    import stat

    from nemo_dflash.train.checkpoint import save_draft_dir
    from nemo_dflash.train.distributed import DistState

    old = os.umask(umask)
    try:
        out = export_draft(draft, tmp_path / "exp")
        save_draft_dir(draft, tmp_path / "train_draft", DistState())
    finally:
        os.umask(old)
    for root in (out, tmp_path / "train_draft"):
        assert stat.S_IMODE(root.stat().st_mode) == 0o777 & ~umask
        for f in root.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f
