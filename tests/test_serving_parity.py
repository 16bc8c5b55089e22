"""The serving-parity check: our decoder and draft module against the DFlash rules applied to the
serving config and weights (a reference written from the rules, no cache, nothing shared)."""

from __future__ import annotations

import torch

import pytest

from nemo_dflash.draft.model import DFlashConfig, DFlashDraftModel
from nemo_dflash.serving.export import serving_config_dict
from nemo_dflash.evaluation.parity import (
    ServingParityError, check_serving_parity, reference_acceptance, reference_draft_hidden, serving_weights,
)
from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder, GenerationOutput

from _spec_fixtures import make_draft, tiny_qwen3, train_on_greedy_answer

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


def _hf_greedy(target, prompt, n):
    """The target's greedy tokens, by HF generate."""
    out = target.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def _reference_by_forwards(target, weights, cfg, prompt, max_new_tokens, blk):
    """The rules decoded step by step, a full target forward to verify each block (what the walk replaces)."""
    from nemo_dflash.evaluation.parity import _features

    layer_ids, mask_id = cfg["dflash_config"]["target_layer_ids"], cfg["dflash_config"]["mask_token_id"]
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    out, lens = [_hf_greedy(target, prompt, 1)[0]], []
    with torch.no_grad():
        while len(out) < max_new_tokens:
            seq = prompt + out
            _, ctx = _features(target, seq[:-1], layer_ids)
            emb = embed(torch.tensor([seq[-1]] + [mask_id] * (blk - 1)))
            hid = reference_draft_hidden(weights, cfg, emb, ctx, torch.arange(len(seq) - 1 + blk))
            drafted = head(hid[1:]).argmax(-1).tolist()
            tgt = _features(target, seq + drafted, layer_ids, keep=blk)[0].argmax(-1).tolist()
            n = 0
            while n < blk - 1 and drafted[n] == tgt[n]:
                n += 1
            lens.append(n + 1)
            out += (drafted[:n] + [tgt[n]])[: max_new_tokens - len(out)]
    return out, lens


def test_the_walk_equals_the_rules_decoded_with_a_forward_a_step():
    """The reference walks one forward over the greedy answer; the same rules decoded step by step, each block
    verified by a forward of its own, give the same tokens and acceptance lengths (a draft that accepts some)."""
    target = tiny_qwen3()
    draft = make_draft(target, block_size=4)
    train_on_greedy_answer(target, draft, torch.tensor([PROMPTS[0]]), steps=60)  # long steps there, short elsewhere
    cfg, weights = serving_config_dict(draft.config), {k: v.float() for k, v in draft.state_dict().items()}
    seen = []
    for prompt in PROMPTS:
        out, lens = _reference_by_forwards(target, weights, cfg, prompt, 24, 4)
        ref = reference_acceptance(target, weights, cfg, prompt, _hf_greedy(target, prompt, 24 + 4), 24, 4)
        assert (ref.output_ids, ref.acceptance_lengths) == (out, lens)
        seen += lens
    assert {1, 4} <= set(seen), seen  # rejected blocks and whole blocks both walked
    bad = _hf_greedy(target, PROMPTS[0], 18)
    bad[5] = (bad[5] + 1) % 256  # a token that is not the target's argmax
    assert reference_acceptance(target, weights, cfg, PROMPTS[0], bad, 14, 4).not_greedy_at == 5


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
    greedy = _hf_greedy(target, PROMPTS[0], 11 + 4)
    ref = reference_acceptance(target, weights, serving_config_dict(draft.config), PROMPTS[0], greedy, 11)
    assert ref.acceptance_lengths == [4, 4, 4] and ref.output_ids == greedy[:11]  # 1 + 4 + 4 + 2 kept of the last 4
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

    import nemo_dflash.evaluation.parity as parity
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
