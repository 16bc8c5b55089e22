"""Speculative decoding: exact at T=0 (vs the target's own greedy decoding), correct cache
bookkeeping, long acceptance with an oracle draft, and distribution-preserving sampling."""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
import torch
from transformers import DynamicCache

from nemo_dflash.engine.sampling import SamplingParams
from nemo_dflash.engine.spec_decode import (
    DFlashSpeculativeDecoder,
    autoregressive_generate,
    crop_dynamic_cache,
    speculative_generate,
    verify_block,
)
from nemo_dflash.draft.model import DFlashContextCache
from nemo_dflash.draft.model.modeling import apply_rope
from nemo_dflash.target import HFDFlashTargetModel

from _spec_fixtures import make_draft, second_token_case, tiny_llama, tiny_qwen3

PROMPT_LEN = 9


@contextmanager
def single_thread():
    """Thousands of tiny ops: extra threads only add contention on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


def hf_greedy(target, ids: torch.Tensor, n: int, eos=None) -> list[int]:
    out = target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0,
        eos_token_id=eos,
    )
    return out[0, ids.shape[1]:].tolist()


def prompt(seed: int, vocab: int = 250, n: int = PROMPT_LEN) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request):
    return tiny_qwen3() if request.param == "qwen3" else tiny_llama()


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen3()


def oracle(decoder: DFlashSpeculativeDecoder, full_seq: list[int], monkeypatch) -> None:
    """Run the real draft (so its cache is exercised) but override its proposals with the
    target's greedy continuation, as a perfect draft would propose."""
    real = decoder.draft_logits

    def forced(last, position, feats, cache, block_size):
        logits = real(last, position, feats, cache, block_size)
        forced_logits = torch.full_like(logits, -1e4)
        for k in range(1, block_size):
            j = position + k
            forced_logits[k - 1, full_seq[j] if j < len(full_seq) else 0] = 0.0
        return forced_logits

    monkeypatch.setattr(decoder, "draft_logits", forced)


# ----------------------------------------------------------------------------- greedy exactness


@pytest.mark.parametrize("block_size", [8, 3, 1])
def test_greedy_matches_target_random_draft(target, block_size):
    draft = make_draft(target, block_size=8)
    decoder = DFlashSpeculativeDecoder(target, draft, block_size=block_size)
    for seed in range(2):
        ids = prompt(seed)
        ref = hf_greedy(target, ids, 30)
        out = decoder.generate(ids, max_new_tokens=30)
        assert out.output_ids == ref
        assert all(1 <= a <= block_size for a in out.acceptance_lengths)
        assert out.num_target_forwards == len(out.acceptance_lengths)
        # Each step yields at least one token; the prefill yields the first.
        assert 1 + sum(out.acceptance_lengths) >= 30


def test_autoregressive_baseline_matches_hf(target):
    ids = prompt(3)
    out = autoregressive_generate(target, ids, max_new_tokens=25)
    assert out.output_ids == hf_greedy(target, ids, 25)
    assert out.num_target_forwards == 24 and out.acceptance_lengths == [1] * 24
    assert out.decode_time_s > 0 and out.time_per_output_token > 0


@pytest.mark.parametrize("block_size", [8, 4])
def test_oracle_draft_accepts_whole_blocks(target, block_size, monkeypatch):
    draft = make_draft(target, block_size=8)
    ids = prompt(5)
    n = 1 + 4 * block_size  # prefill token + exactly 4 full blocks
    ref = hf_greedy(target, ids, n + block_size)
    decoder = DFlashSpeculativeDecoder(target, draft, block_size=block_size)
    oracle(decoder, ids[0].tolist() + ref, monkeypatch)
    out = decoder.generate(ids, max_new_tokens=n)
    assert out.output_ids == ref[:n]
    assert out.acceptance_lengths == [block_size] * 4
    assert out.mean_acceptance_length == block_size


def test_caches_equal_no_cache_recomputation(qwen, monkeypatch):
    """After decoding (with partially accepted blocks), the target's KV cache and the draft's
    context cache must equal a from-scratch recomputation over the verified sequence."""
    target = qwen
    draft = make_draft(target, block_size=6)
    ids = prompt(7)
    ref = hf_greedy(target, ids, 40)
    full = ids[0].tolist() + ref
    decoder = DFlashSpeculativeDecoder(target, draft)
    real = decoder.draft_logits
    calls = {"n": 0}

    def half_oracle(last, position, feats, cache, block_size):
        # Right for the first few slots, then wrong: exercises partial acceptance + cropping.
        logits = real(last, position, feats, cache, block_size)
        calls["n"] += 1
        good = calls["n"] % 4  # 0..3 correct slots
        out = torch.full_like(logits, -1e4)
        for k in range(1, block_size):
            j = position + k
            tok = full[j] if k <= good else (full[j] + 1) % 250
            out[k - 1, tok] = 0.0
        return out

    monkeypatch.setattr(decoder, "draft_logits", half_oracle)
    kv, dcache = DynamicCache(), DFlashContextCache(len(draft.layers))
    out = decoder.generate(ids, max_new_tokens=30, past_key_values=kv, draft_cache=dcache)
    assert out.output_ids == ref[:30]
    assert sorted(set(out.acceptance_lengths)) == [1, 2, 3, 4]

    seq = torch.tensor([full])
    # Target cache: verified tokens only, identical to a fresh prefill over them.
    n_kv = kv.get_seq_length()
    assert PROMPT_LEN + 28 <= n_kv <= len(full)
    fresh = DynamicCache()
    target(input_ids=seq[:, :n_kv], past_key_values=fresh, use_cache=True)
    for got, want in zip(kv.layers, fresh.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-4)

    # Draft cache: the rotated K/V of the fused target features of the verified tokens.
    n_ctx = dcache.get_seq_length()
    assert PROMPT_LEN <= n_ctx < n_kv + 1
    feats, _ = HFDFlashTargetModel(target, draft.target_layer_ids).forward_features(seq[:, :n_ctx])
    ctx = draft.fuse_context(feats)
    cos, sin = draft.rotary_emb(torch.arange(n_ctx).unsqueeze(0), ctx.dtype)
    for i, layer in enumerate(draft.layers):
        k, v = layer.self_attn._kv(ctx)
        torch.testing.assert_close(dcache.keys[i], apply_rope(k, cos, sin), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(dcache.values[i], v, atol=1e-5, rtol=1e-4)


def test_stop_tokens_truncate(qwen, monkeypatch):
    target = qwen
    draft = make_draft(target, block_size=8)
    ids = prompt(11)
    ref = hf_greedy(target, ids, 40)
    stop = ref[6]
    first = ref.index(stop)
    for use_oracle in (False, True):
        decoder = DFlashSpeculativeDecoder(target, draft)
        if use_oracle:  # the stop token lands mid-block
            oracle(decoder, ids[0].tolist() + ref, monkeypatch)
        out = decoder.generate(ids, max_new_tokens=40, stop_token_ids=[stop, 10**6])
        assert out.output_ids == ref[: first + 1]
        assert out.stopped
        assert out.output_ids == hf_greedy(target, ids, 40, eos=stop)
    # A limit mid-block truncates too.
    decoder = DFlashSpeculativeDecoder(target, draft)
    oracle(decoder, ids[0].tolist() + ref, monkeypatch)
    out = decoder.generate(ids, max_new_tokens=5)
    assert out.output_ids == ref[:5] and not out.stopped


def test_crop_dynamic_cache():
    cache = DynamicCache()
    k = torch.randn(1, 2, 7, 4)
    cache.update(k, k.clone(), 0)
    crop_dynamic_cache(cache, 10)  # longer than the cache: no-op
    assert cache.get_seq_length() == 7
    crop_dynamic_cache(cache, 4)
    assert cache.get_seq_length() == 4
    torch.testing.assert_close(cache.layers[0].keys, k[:, :, :4])


def test_bad_inputs(qwen):
    draft = make_draft(qwen)
    decoder = DFlashSpeculativeDecoder(qwen, draft)
    with pytest.raises(ValueError, match="one prompt at a time"):
        decoder.generate(torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoder.generate([1, 2, 3], max_new_tokens=0)
    other = make_draft(tiny_llama())  # hidden 48 vs 64
    with pytest.raises(ValueError, match="hidden_size"):
        DFlashSpeculativeDecoder(qwen, other)


# ----------------------------------------------------------------------------- sampling


def test_verify_block_sampling_preserves_target_distribution():
    """Speculative sampling: the kept token at slot 1 is distributed as the target's p."""
    g = torch.Generator().manual_seed(0)
    vocab, n = 6, 8000
    p_logits = torch.randn(2, vocab, generator=g) * 1.5
    q = torch.softmax(torch.randn(1, vocab, generator=g) * 1.5, -1)
    counts = torch.zeros(vocab)
    with single_thread():
        for _ in range(n):
            d = torch.multinomial(q[0], 1, generator=g)
            n_acc, nxt = verify_block(d, p_logits, sampling=SamplingParams(1.0), draft_probs=q, generator=g)
            counts[int(d) if n_acc == 1 else nxt] += 1
    p = torch.softmax(p_logits[0], -1)
    assert (counts / n - p).abs().max() < 0.03
    # q == p: everything is accepted and the bonus comes from row 1.
    d = torch.tensor([2])
    n_acc, _ = verify_block(d, p_logits[:1].expand(2, -1), SamplingParams(1.0), torch.softmax(p_logits[:1], -1), g)
    assert n_acc == 1


def test_sampling_end_to_end_distribution():
    """Second generated token's marginal at T=1 vs the exact one from the target."""
    target, draft, ids, p2 = second_token_case()
    decoder = DFlashSpeculativeDecoder(target, draft)
    g = torch.Generator().manual_seed(0)
    n, counts = 800, torch.zeros(8)
    with single_thread():
        for _ in range(n):
            out = decoder.generate(ids, max_new_tokens=2, sampling=SamplingParams(1.0), generator=g)
            counts[out.output_ids[1]] += 1
    assert (counts / n - p2).abs().max() < 0.06
    # Same seed, same output; the AR baseline samples too.
    a = speculative_generate(target, draft, ids, max_new_tokens=12, sampling=SamplingParams(0.7),
                             generator=torch.Generator().manual_seed(5))
    b = speculative_generate(target, draft, ids, max_new_tokens=12, sampling=SamplingParams(0.7),
                             generator=torch.Generator().manual_seed(5))
    assert a.output_ids == b.output_ids and len(a.output_ids) == 12
    ar = autoregressive_generate(target, ids, max_new_tokens=12, sampling=SamplingParams(0.7), generator=g)
    assert len(ar.output_ids) == 12


# ----------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def smollm2():
    from nemo_dflash.target.loading import load_target

    return load_target("pkg:smollm2", dtype="fp32")


def test_smollm2_greedy_exact(smollm2):
    """The real SmolLM2-135M-Instruct: spec decoding with a random draft == HF greedy."""
    target, tok = smollm2
    draft = make_draft(target, num_layers=1, block_size=8, mask_token_id=0, layer_ids=[1, 15, 27])
    decoder = DFlashSpeculativeDecoder(target, draft)
    for text in ("What is the capital of France?", "Write a Python function that reverses a string."):
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        ids = tok(chat, return_tensors="pt", add_special_tokens=False).input_ids
        t0 = time.perf_counter()
        ref = hf_greedy(target, ids, 24, eos=tok.eos_token_id)
        t1 = time.perf_counter()
        out = decoder.generate(ids, max_new_tokens=24, stop_token_ids=[tok.eos_token_id])
        t2 = time.perf_counter()
        print(f"smollm2 {len(ref)} tokens: hf greedy {t1 - t0:.2f}s, spec decode {t2 - t1:.2f}s")
        assert out.output_ids == ref
