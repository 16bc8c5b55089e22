"""Speculative decoding on targets with recurrent state (Qwen3.5's Gated-DeltaNet layers
interleaved with full attention): the decoder must use the target's own cache and roll the
conv / recurrent states back after a partial acceptance. References: HF's own greedy
`generate`, and a fresh prefill over the verified tokens for the cache contents."""

from __future__ import annotations

import pytest
import torch

from nemo_dflash.engine.sampling import SamplingParams
from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder, autoregressive_generate
from nemo_dflash.engine.recurrent_cache import make_target_cache
from nemo_dflash.draft.model import DFlashConfig, DFlashContextCache, DFlashDraftModel

from _spec_fixtures import export_round_trip, hf_greedy, make_draft, prompt, three_token_law, train_on_greedy_answer

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):  # pragma: no cover
    pytest.skip("this transformers has no Qwen3.5", allow_module_level=True)

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
SMALL = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, max_position_embeddings=512, tie_word_embeddings=True, layer_types=LAYER_TYPES,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_qwen3_5(vocab: int = 256, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3_5TextConfig(vocab_size=vocab, **SMALL)
    return transformers.Qwen3_5ForCausalLM(cfg).float().eval()


def tiny_qwen3_5_moe(vocab: int = 256, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3_5MoeTextConfig(
        vocab_size=vocab, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, **{k: v for k, v in SMALL.items() if k != "intermediate_size"},
    )
    return transformers.Qwen3_5MoeForCausalLM(cfg).float().eval()


def tiny_qwen3_next(vocab: int = 256, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3NextConfig(
        vocab_size=vocab, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, **SMALL,
    )
    return transformers.Qwen3NextForCausalLM(cfg).float().eval()


def draft_for(target: torch.nn.Module, num_layers: int = 2, block_size: int = 4) -> DFlashDraftModel:
    torch.manual_seed(1)
    cfg = DFlashConfig.from_target_config(
        target.config, num_hidden_layers=num_layers, block_size=block_size, mask_token_id=255,
        target_layer_ids=[1, 2], intermediate_size=128,  # Qwen3.5-MoE has no dense FFN width to copy
    )
    return DFlashDraftModel(cfg).float().eval()


@pytest.fixture(scope="module")
def qwen3_5():
    return tiny_qwen3_5()


def half_oracle(decoder: DFlashSpeculativeDecoder, full: list[int], monkeypatch) -> None:
    """Run the real draft (its cache is exercised) but propose the target's greedy tokens for the
    first `n % block` slots and a wrong token after: every acceptance length 1..B occurs."""
    real = decoder.draft_logits
    calls = {"n": 0}

    def forced(last, position, feats, cache, block_size):
        logits = real(last, position, feats, cache, block_size)
        calls["n"] += 1
        good = calls["n"] % block_size
        out = torch.full_like(logits, -1e4)
        for k in range(1, block_size):
            j = position + k
            ok = full[j] if j < len(full) else 0
            out[k - 1, ok if k <= good else (ok + 1) % 250] = 0.0
        return out

    monkeypatch.setattr(decoder, "draft_logits", forced)


def test_random_draft_equals_greedy(qwen3_5):
    draft = make_draft(qwen3_5, block_size=4)
    decoder = DFlashSpeculativeDecoder(qwen3_5, draft)
    for seed in range(2):
        ids = prompt(seed)
        assert decoder.generate(ids, max_new_tokens=20).output_ids == hf_greedy(qwen3_5, ids, 20)


def test_autoregressive_equals_greedy(qwen3_5):
    ids = prompt(3)
    assert autoregressive_generate(qwen3_5, ids, max_new_tokens=12).output_ids == hf_greedy(qwen3_5, ids, 12)


def test_partial_acceptance_rolls_back_recurrent_state(qwen3_5, monkeypatch):
    """Every acceptance length occurs; the output is the greedy one, and the target's cache after
    decoding (K/V, conv and recurrent states) equals a fresh prefill over the verified tokens."""
    target, blk = qwen3_5, 4
    draft = make_draft(target, block_size=blk)
    ids = prompt(7)
    ref = hf_greedy(target, ids, 40)
    full = ids[0].tolist() + ref
    decoder = DFlashSpeculativeDecoder(target, draft)
    half_oracle(decoder, full, monkeypatch)
    cache = make_target_cache(target)
    out = decoder.generate(ids, max_new_tokens=30, past_key_values=cache, draft_cache=DFlashContextCache(2))
    assert out.output_ids == ref[:30]
    assert sorted(set(out.acceptance_lengths)) == [1, 2, 3, 4]

    n_kv = cache.layers[1].keys.shape[-2]
    assert ids.shape[1] + 28 <= n_kv <= len(full)
    fresh = make_target_cache(target)
    target(input_ids=torch.tensor([full[:n_kv]]), past_key_values=fresh, use_cache=True)
    for i, (got, want) in enumerate(zip(cache.layers, fresh.layers)):
        if LAYER_TYPES[i] == "full_attention":
            torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-4)
        else:
            torch.testing.assert_close(got.conv_states[0], want.conv_states[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(got.recurrent_states[0], want.recurrent_states[0], atol=1e-4, rtol=1e-3)


def test_oracle_draft_accepts_whole_blocks(qwen3_5, monkeypatch):
    blk = 4
    draft = make_draft(qwen3_5, block_size=blk)
    ids = prompt(5)
    n = 1 + 4 * blk
    ref = hf_greedy(qwen3_5, ids, n + blk)
    decoder = DFlashSpeculativeDecoder(qwen3_5, draft)
    full = ids[0].tolist() + ref
    real = decoder.draft_logits

    def forced(last, position, feats, cache, block_size):
        logits = torch.full_like(real(last, position, feats, cache, block_size), -1e4)
        for k in range(1, block_size):
            logits[k - 1, full[position + k]] = 0.0
        return logits

    monkeypatch.setattr(decoder, "draft_logits", forced)
    out = decoder.generate(ids, max_new_tokens=n)
    assert out.output_ids == ref[:n] and out.acceptance_lengths == [blk] * 4


@pytest.mark.parametrize("build", [tiny_qwen3_5_moe, tiny_qwen3_next], ids=["qwen3_5_moe", "qwen3_next"])
def test_other_hybrid_families_equal_greedy(build, monkeypatch):
    target = build()
    draft = draft_for(target)
    ids = prompt(11)
    ref = hf_greedy(target, ids, 16)
    decoder = DFlashSpeculativeDecoder(target, draft)
    half_oracle(decoder, ids[0].tolist() + ref + [0] * 8, monkeypatch)
    out = decoder.generate(ids, max_new_tokens=16)
    assert out.output_ids == ref
    assert max(out.acceptance_lengths) > 1 and min(out.acceptance_lengths) < 4


def test_graphs_mode_refuses_recurrent_targets_in_one_line(qwen3_5):
    draft = make_draft(qwen3_5, block_size=4)
    for call in (
        lambda: DFlashSpeculativeDecoder(qwen3_5, draft).generate(prompt(0), max_new_tokens=4, decode="graphs"),
        lambda: autoregressive_generate(qwen3_5, prompt(0), max_new_tokens=4, decode="graphs"),
    ):
        with pytest.raises(ValueError) as e:
            call()
        msg = str(e.value)
        assert "recurrent" in msg and "decode='eager'" in msg and "\n" not in msg


def test_bare_dynamic_cache_is_refused(qwen3_5):
    from transformers import DynamicCache

    draft = make_draft(qwen3_5, block_size=4)
    with pytest.raises(ValueError, match="make_target_cache"):
        DFlashSpeculativeDecoder(qwen3_5, draft).generate(prompt(0), max_new_tokens=4, past_key_values=DynamicCache())


def test_sampling_keeps_target_distribution_across_rollbacks():
    """T=1, block 2: the 3rd token follows a rollback whenever step 1 rejects its draft. Its
    marginal must equal the exact one computed from the target over all 8 x 8 prefixes."""
    target = tiny_qwen3_5(vocab=8, seed=3)
    draft = make_draft(target, block_size=2, mask_token_id=7, layer_ids=[0, 3])
    ids = torch.tensor([[1, 5, 2, 3]])
    want = three_token_law(target, ids).sum((0, 1))
    decoder = DFlashSpeculativeDecoder(target, draft)
    g = torch.Generator().manual_seed(0)
    n, counts, rejected = 800, torch.zeros(8), 0
    for _ in range(n):
        out = decoder.generate(ids, max_new_tokens=3, sampling=SamplingParams(1.0), generator=g)
        counts[out.output_ids[2]] += 1
        rejected += out.acceptance_lengths[0] == 1
    assert rejected > n // 5  # the rollback path is actually taken
    assert (counts / n - want).abs().max() < 0.06


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_multimodal_qwen3_5_text_path_equals_greedy(moe, monkeypatch):
    """Qwen3_5(Moe)ForConditionalGeneration, the class the published Qwen3.5 checkpoints name: the
    draft is shaped from `text_config`, decoding runs the language model on text-only prompts."""
    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    if moe:
        text = dict({k: v for k, v in SMALL.items() if k != "intermediate_size"}, vocab_size=256,
                    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
        cfg = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
        target = transformers.Qwen3_5MoeForConditionalGeneration(cfg).float().eval()
    else:
        cfg = transformers.Qwen3_5Config(text_config=dict(SMALL, vocab_size=256), vision_config=vision)
        target = transformers.Qwen3_5ForConditionalGeneration(cfg).float().eval()
    draft = draft_for(target)
    ids = prompt(0)
    ref = hf_greedy(target, ids, 12)
    decoder = DFlashSpeculativeDecoder(target, draft)
    half_oracle(decoder, ids[0].tolist() + ref + [0] * 8, monkeypatch)
    out = decoder.generate(ids, max_new_tokens=12)
    assert out.output_ids == ref and max(out.acceptance_lengths) > 1


@pytest.mark.parametrize("build", [tiny_qwen3_5, tiny_qwen3_5_moe, tiny_qwen3_next],
                         ids=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_draft_learns_the_targets_greedy_answer(build, tmp_path):
    """Train a 1-layer draft on the target's own greedy continuation of one prompt (features from
    the hybrid target, no cache), then decode that prompt: still exactly greedy, and the draft's
    blocks are now accepted (tau > 1.5 at block 4; an untrained draft gets 1.0 here)."""
    target = build()
    draft = draft_for(target, num_layers=1)
    ids = prompt(4)
    before = DFlashSpeculativeDecoder(target, draft).generate(ids, max_new_tokens=40)
    ref, sim_tau = train_on_greedy_answer(target, draft, ids)
    after = DFlashSpeculativeDecoder(target, draft).generate(ids, max_new_tokens=40)
    assert before.output_ids == after.output_ids == ref
    assert after.mean_acceptance_length > 1.5 > before.mean_acceptance_length and sim_tau > 1.5
    exported = export_round_trip(draft, tmp_path)  # the serving format round-trips for this family too
    assert DFlashSpeculativeDecoder(target, exported).generate(ids, max_new_tokens=40).output_ids == ref
