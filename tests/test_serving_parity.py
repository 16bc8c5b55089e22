"""The serving-parity check: our decoder and draft module against the DFlash rules applied to the
serving config and weights (a reference written from the rules, no cache, nothing shared)."""

from __future__ import annotations

import torch

import pytest

from nemo_dflash.draft.model import DFlashConfig, DFlashDraftModel
from nemo_dflash.export import serving_config_dict
from nemo_dflash.inference.parity import (
    ServingParityError, check_serving_parity, reference_draft_hidden, reference_generate, serving_weights,
)
from nemo_dflash.inference.spec_decode import DFlashSpeculativeDecoder, GenerationOutput

from _spec_fixtures import make_draft, tiny_qwen3

PROMPTS = [[3, 17, 42, 9, 100], [5, 6, 7], [200, 1, 2, 3, 4, 5, 6, 7, 8]]


def _partial_draft(target, factor=0.25, seed=0) -> DFlashDraftModel:
    torch.manual_seed(seed)
    cfg = DFlashConfig.from_target_config(
        target.config, num_hidden_layers=2, block_size=4, mask_token_id=255, target_layer_ids=[1, 2],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": factor})
    draft = DFlashDraftModel(cfg).float().eval()
    with torch.no_grad():  # sharp attention whose output outweighs the block embeddings: the rotation shows in the argmax
        for layer in draft.layers:
            layer.self_attn.q_norm.weight.mul_(4.0)
            layer.self_attn.k_norm.weight.mul_(4.0)
            layer.self_attn.v_proj.weight.mul_(30.0)
            layer.self_attn.o_proj.weight.mul_(30.0)
    return draft


def test_rebuilt_draft_equals_our_module_on_partial_rotary():
    target = tiny_qwen3()
    draft = _partial_draft(target)
    g = torch.Generator().manual_seed(0)
    emb, ctx = torch.randn(4, 64, generator=g), torch.randn(6, 128, generator=g)
    pos = torch.arange(10)
    w = {k: v.float() for k, v in draft.state_dict().items()}
    ref = reference_draft_hidden(w, serving_config_dict(draft.config), emb, ctx, pos)
    with torch.no_grad():
        ours = draft(noise_embedding=emb[None], target_hidden=ctx[None], position_ids=pos[None])[0]
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)


def test_random_draft_passes_and_matches_step_for_step():
    target = tiny_qwen3()
    draft = make_draft(target, num_layers=2, block_size=4)
    rep = check_serving_parity(target, draft, PROMPTS, cfg=serving_config_dict(draft.config), max_new_tokens=12,
                               min_agreement=1.0)
    assert rep.steps > 0 and rep.proposal_agreement == 1.0 and rep.ours_tau == rep.reference_tau


def test_full_acceptance_is_the_same_both_ways():
    """A target and draft whose outputs are constant (zero final norms): every drafted token is
    accepted, so multi-token steps, cache crops and the bonus token are exercised."""
    target = tiny_qwen3()
    draft = make_draft(target, num_layers=1, block_size=4)
    with torch.no_grad():
        target.model.norm.weight.zero_()
        draft.norm.weight.zero_()
    weights = serving_weights(draft)
    ref = reference_generate(target, weights, serving_config_dict(draft.config), PROMPTS[0], 11)
    assert ref.acceptance_lengths == [4, 4, 4] and len(ref.output_ids) == 11  # 1 + 4 + 4 + 2 kept of the last 4
    rep = check_serving_parity(target, draft, PROMPTS, cfg=serving_config_dict(draft.config), max_new_tokens=11,
                               min_agreement=1.0)
    assert rep.ours_tau == rep.reference_tau == 4.0


def test_served_config_without_partial_rotary_fails_loudly():
    """What export wrote before partial_rotary_factor was carried: the engines rotate the whole head."""
    target = tiny_qwen3()
    draft = _partial_draft(target)
    cfg = serving_config_dict(draft.config)
    assert cfg.pop("partial_rotary_factor") == 0.25
    with pytest.raises(ServingParityError, match=r"drafted tokens agree .*% < 98%"):
        check_serving_parity(target, draft, PROMPTS[:2], cfg=cfg, max_new_tokens=8)
    check_serving_parity(target, draft, PROMPTS[:2], cfg=serving_config_dict(draft.config), max_new_tokens=8)  # agrees


def test_acceptance_disagreement_fails_loudly(monkeypatch):
    """A decoder that counts one token too few per step (the bonus dropped) is caught."""
    target = tiny_qwen3()
    draft = make_draft(target, num_layers=1, block_size=4)
    real = DFlashSpeculativeDecoder.generate

    def off_by_one(self, *a, **k) -> GenerationOutput:
        out = real(self, *a, **k)
        out.acceptance_lengths = [n - 1 for n in out.acceptance_lengths]
        return out

    monkeypatch.setattr(DFlashSpeculativeDecoder, "generate", off_by_one)
    with pytest.raises(ServingParityError, match="prompt 0: acceptance differs from step 0"):
        check_serving_parity(target, draft, PROMPTS[:1], cfg=serving_config_dict(draft.config), max_new_tokens=6)


def test_export_cli_runs_the_check_before_writing(tmp_path, monkeypatch):
    """A real target dir (tiny Qwen3, the real Qwen3 tokenizer): the check passes and export writes;
    a disagreement is one line, exit 2, nothing written."""
    from _tiny_target import make_tiny_target_dir

    import nemo_dflash.inference.parity as parity
    from nemo_dflash.recipes import export as cli
    from nemo_dflash.target.loading import load_target

    target_dir = make_tiny_target_dir(tmp_path)
    target, _ = load_target(str(target_dir), dtype="fp32")
    src = tmp_path / "draft"
    make_draft(target, num_layers=1, block_size=4).save_pretrained(src)
    calls = []
    real = parity.check_serving_parity

    def spy(*a, **k):
        calls.append(len(a[2]))
        return real(*a, **k)

    monkeypatch.setattr(parity, "check_serving_parity", spy)
    assert cli.main(["--checkpoint", str(src), "--out", str(tmp_path / "ok"), "--target", str(target_dir),
                     "--parity-prompts", "1"]) == 0
    assert calls == [1] and (tmp_path / "ok" / "config.json").exists()

    def disagree(*a, **k):
        raise parity.ServingParityError("serving parity on 2 prompts: drafted tokens agree 10.0% < 98%")

    monkeypatch.setattr(parity, "check_serving_parity", disagree)
    with pytest.raises(SystemExit) as e:
        cli.main(["--checkpoint", str(src), "--out", str(tmp_path / "bad"), "--target", str(target_dir),
                  "--parity-prompts", "2"])
    assert e.value.code == 2 and not (tmp_path / "bad").exists()
    for extra in (["--parity-prompts", "2"], ["--target", str(target_dir), "--parity-prompts", "4"]):
        with pytest.raises(SystemExit) as e:  # no --target; more prompts than built in
            cli.main(["--checkpoint", str(src), "--out", str(tmp_path / "bad"), *extra])
        assert e.value.code == 2 and not (tmp_path / "bad").exists()
