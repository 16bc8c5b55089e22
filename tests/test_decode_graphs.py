"""The fixed-shape ("graphs") decoding path with one row (what `decode="graphs"` runs), eagerly on CPU: the
same step functions that are captured as CUDA graphs on a GPU, checked against HF's own greedy decoding,
against the eager reference's draft proposals, and against from-scratch recomputation of both caches.
Capture itself needs a GPU: tests/test_batched_static.py's GPU tests and `benchmarks/decode.py speed`
check the captured path there."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from nemo_dflash.engine.sampling import GREEDY, SamplingParams
from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder, autoregressive_generate, check_decode_mode
from nemo_dflash.engine.static_cache import (
    StaticDraftContextCache,
    TargetStaticCache,
    causal_mask,
    check_static_target,
)
from nemo_dflash.engine import batched_static, static_decode
from nemo_dflash.engine.batched_static import (
    BatchedStaticPlainRunner,
    BatchedStaticSpecRunner,
    batched_static_autoregressive_generate,
    batched_static_speculative_generate,
    spec_cache_length,
)
from nemo_dflash.engine.options import DEFAULT_OPTIONS, EngineOptions
from nemo_dflash.engine.static_decode import (
    LENGTH_BUCKET,
    cache_length_for,
    view_length,
    view_lengths,
)
from nemo_dflash.draft.model import DFlashContextCache
from nemo_dflash.draft.model.modeling import apply_rope
from nemo_dflash.target import HFDFlashTargetModel

from _spec_fixtures import (
    hf_greedy, make_draft, prompt, sampled_runner, sampled_step, second_token_case, tiny_llama, tiny_qwen3,
)

PROMPT_LEN = 9


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny ops: extra threads only add contention
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["qwen3", "llama-eager-attn"])
def target(request):
    if request.param == "qwen3":
        return tiny_qwen3()
    model = tiny_llama()
    model.config._attn_implementation = "eager"  # the float-mask branch
    return model


def spec_static(decoder, ids, n, sampling=GREEDY, stop=(), generator=None, options=DEFAULT_OPTIONS):
    """The one-row graphs loop, its steps run eagerly."""
    return batched_static_speculative_generate(decoder, [ids[0].tolist()], max_new_tokens=n, sampling=sampling,
                                               stop_token_ids=stop, rows=1, use_graphs=False, generator=generator,
                                               options=options)[0]


def plain_static(target, ids, n, sampling=GREEDY, stop=(), generator=None, options=DEFAULT_OPTIONS):
    return batched_static_autoregressive_generate(target, [ids[0].tolist()], max_new_tokens=n, sampling=sampling,
                                                  stop_token_ids=stop, rows=1, use_graphs=False,
                                                  generator=generator, options=options)[0]


def runner_of(decoder, greedy=True, options=DEFAULT_OPTIONS):
    return batched_static._RUNNERS[decoder][batched_static.runner_key("spec" if greedy else "spec sampled", 1, False,
                                                                      options)]


# ----------------------------------------------------------------------------- modes and bad input


def test_check_decode_mode():
    check_decode_mode("eager", "cpu")
    check_decode_mode("eager", None)
    with pytest.raises(ValueError, match="Unknown decode mode 'fast'"):
        check_decode_mode("fast", "cpu")
    with pytest.raises(ValueError, match="needs a CUDA device.*decode='eager'") as err:
        check_decode_mode("graphs", torch.device("cpu"))
    assert "\n" not in str(err.value)


def test_graphs_on_cpu_fails_before_decoding(monkeypatch):
    target = tiny_qwen3(num_layers=2)
    draft = make_draft(target, layer_ids=[0, 1])

    def boom(*a, **k):  # the error must come before any forward
        raise AssertionError("model called")

    monkeypatch.setattr(target, "forward", boom)
    with pytest.raises(ValueError, match="CUDA"):
        autoregressive_generate(target, [1, 2, 3], decode="graphs")
    with pytest.raises(ValueError, match="CUDA"):
        DFlashSpeculativeDecoder(target, draft).generate([1, 2, 3], decode="graphs")
    with pytest.raises(ValueError, match="Unknown decode mode"):
        autoregressive_generate(target, [1, 2, 3], decode="static")


def test_static_target_rejects_what_it_cannot_mask():
    model = tiny_qwen3(num_layers=2)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        check_static_target(model)
    model.config._attn_implementation = "sdpa"
    model.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="full-attention targets only.*decode='eager'"):
        check_static_target(model)


def test_causal_mask_matches_definition():
    q = torch.tensor([3, 4, 5])
    m = causal_mask(q, 8, "sdpa", torch.float32)
    want = torch.tensor([[j <= p for j in range(8)] for p in (3, 4, 5)])
    assert m.shape == (1, 1, 3, 8) and torch.equal(m[0, 0], want)
    f = causal_mask(q, 8, "eager", torch.float32)[0, 0]
    assert torch.equal(f == 0, want) and (f[~want] == torch.finfo(torch.float32).min).all()


def test_cache_length_is_bucketed():
    assert cache_length_for(9, 30, 8) == LENGTH_BUCKET
    assert cache_length_for(200, 50, 16) == 2 * LENGTH_BUCKET


# ----------------------------------------------------------------------------- greedy exactness


def test_static_plain_matches_hf_greedy(target):
    for seed in range(2):
        ids = prompt(seed)
        out = plain_static(target, ids, 25)
        assert out.output_ids == hf_greedy(target, ids, 25)
        assert out.num_target_forwards == 24 and out.decode_time_s > 0


@pytest.mark.parametrize("block_size", [8, 3, 1])
def test_static_spec_matches_hf_greedy(target, block_size):
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=8), block_size=block_size)
    for seed in range(2):
        ids = prompt(seed)
        out = spec_static(decoder, ids, 30)
        assert out.output_ids == hf_greedy(target, ids, 30)
        assert all(1 <= a <= block_size for a in out.acceptance_lengths)
        assert out.num_target_forwards == len(out.acceptance_lengths)


@pytest.mark.parametrize("bucket", [None, 16])
def test_static_draft_matches_the_eager_draft(target, bucket, monkeypatch):
    """Padded context, preallocated cache, masks and (small) length buckets must not change the
    draft's logits."""
    if bucket:
        monkeypatch.setattr(static_decode, "LENGTH_BUCKET", bucket)
    draft = make_draft(target, block_size=6)
    ids = prompt(4)
    decoder = DFlashSpeculativeDecoder(target, draft)
    eager_logits = []
    real = decoder.draft_logits

    def record(*args):
        eager_logits.append(real(*args))
        return eager_logits[-1]

    decoder.draft_logits = record
    eager = decoder.generate(ids, max_new_tokens=20)
    del decoder.draft_logits

    decoder2 = DFlashSpeculativeDecoder(target, draft)
    spec_static(decoder2, ids, 20)  # builds the runner; the wrapper records the next generation
    runner = runner_of(decoder2)
    static_logits = []
    views = _record_views(runner, "_draft_forward", static_logits)  # step 1's eager draft and the replayed ones
    static = spec_static(decoder2, ids, 20)
    assert static.output_ids == eager.output_ids
    assert len(static_logits) == len(eager_logits) > 3
    assert len({n for _, n in views}) == (1 if bucket is None else 3)
    for got, want in zip(static_logits, eager_logits):
        torch.testing.assert_close(got.reshape(want.shape), want, atol=1e-5, rtol=1e-4)


def _oracle_hook(runner, full, good=None):
    """Overwrite the proposals with the target's greedy continuation (right for the first
    `good(step)` slots, then wrong), as a perfect or partly right draft would propose."""
    calls = {"n": 0}

    def hook():
        calls["n"] += 1
        p = int(runner.pos)
        k_good = runner.B - 1 if good is None else good(calls["n"])
        toks = []
        for k in range(1, runner.B):
            j = p + k
            tok = full[j] if j < len(full) else 0
            toks.append(tok if k <= k_good else (tok + 1) % 250)
        runner.blk[0, 1:] = torch.tensor(toks)

    runner.after_draft = hook


@pytest.mark.parametrize("block_size", [8, 4])
def test_static_oracle_accepts_whole_blocks(target, block_size):
    ids = prompt(5)
    n = 1 + 4 * block_size
    ref = hf_greedy(target, ids, n + block_size)
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=8), block_size=block_size)
    spec_static(decoder, ids, 2)
    _oracle_hook(runner_of(decoder), ids[0].tolist() + ref)
    out = spec_static(decoder, ids, n)
    assert out.output_ids == ref[:n]
    assert out.acceptance_lengths == [block_size] * 4


def test_static_caches_equal_recomputation():
    """After partially accepted blocks, the verified part of the target's StaticCache and of the
    draft's static context cache equals a from-scratch computation over the verified tokens."""
    target = tiny_qwen3()
    draft = make_draft(target, block_size=6)
    ids = prompt(7)
    ref = hf_greedy(target, ids, 40)
    full = ids[0].tolist() + ref
    decoder = DFlashSpeculativeDecoder(target, draft)
    spec_static(decoder, ids, 2)
    runner = runner_of(decoder)
    _oracle_hook(runner, full, good=lambda n: n % 4)
    out = spec_static(decoder, ids, 30)
    assert out.output_ids == ref[:30]
    assert sorted(set(out.acceptance_lengths)) == [1, 2, 3, 4]

    seq = torch.tensor([full])
    n_kv = int(runner.pos)  # verified positions [0, pos) hold verified K/V
    assert PROMPT_LEN + 28 <= n_kv <= len(full)
    fresh = DynamicCache()
    target(input_ids=seq[:, :n_kv], past_key_values=fresh, use_cache=True)
    for got, want in zip(runner.kv.cache.layers, fresh.layers):
        torch.testing.assert_close(got.keys[:, :, :n_kv], want.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.values[:, :, :n_kv], want.values, atol=1e-5, rtol=1e-4)

    n_ctx = int(runner.ctx_start)  # the last draft step saw context [0, ctx_start)
    assert PROMPT_LEN < n_ctx < n_kv
    feats, _ = HFDFlashTargetModel(target, draft.target_layer_ids).forward_features(seq[:, :n_ctx])
    ctx = draft.fuse_context(feats)
    cos, sin = draft.rotary_emb(torch.arange(n_ctx).unsqueeze(0), ctx.dtype)
    for i, layer in enumerate(draft.layers):
        k, v = layer.self_attn._kv(ctx)
        torch.testing.assert_close(runner.dcache.keys[i][:, :, :n_ctx], apply_rope(k, cos, sin), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(runner.dcache.values[i][:, :, :n_ctx], v, atol=1e-5, rtol=1e-4)


def test_static_stop_tokens_and_longer_requests():
    target = tiny_qwen3()
    draft = make_draft(target, block_size=8)
    ids = prompt(11)
    ref = hf_greedy(target, ids, 40)
    stop = ref[6]
    decoder = DFlashSpeculativeDecoder(target, draft)
    out = spec_static(decoder, ids, 40, stop=[stop, 10**6])
    assert out.output_ids == ref[: ref.index(stop) + 1] and out.stopped
    plain = plain_static(target, ids, 40, stop=[stop])
    assert plain.output_ids == out.output_ids and plain.stopped
    # A request that no longer fits the cache gets a longer one (a new capture on a GPU).
    small = runner_of(decoder).max_len
    long_ids = prompt(12, n=LENGTH_BUCKET - 20)
    out = spec_static(decoder, long_ids, 40)
    assert runner_of(decoder).max_len > small
    assert out.output_ids == hf_greedy(target, long_ids, 40)


# ----------------------------------------------------------------------------- length buckets

SMALL_BUCKET = 16  # a 9-token prompt + 50 new tokens then crosses 4 views: 16, 32, 48, 64


@pytest.fixture
def small_buckets(monkeypatch):
    monkeypatch.setattr(static_decode, "LENGTH_BUCKET", SMALL_BUCKET)
    return SMALL_BUCKET


def new_plain_runner(target, max_len, options=DEFAULT_OPTIONS):
    """A fresh one-row greedy runner where the generate functions with these options will find (and reuse) it."""
    runner = BatchedStaticPlainRunner(target, 1, max_len, use_graphs=False, options=options)
    batched_static._RUNNERS.setdefault(target, {})[batched_static.runner_key("plain", 1, False, options)] = runner
    return runner


def new_spec_runner(decoder, max_len, options=DEFAULT_OPTIONS):
    runner = BatchedStaticSpecRunner(decoder, 1, max_len, use_graphs=False, options=options)
    batched_static._RUNNERS.setdefault(decoder, {})[batched_static.runner_key("spec", 1, False, options)] = runner
    return runner


def _record_views(runner, name, logits=None):
    """Wrap runner.<name> (a step taking the view length last) to record (position, view) per
    call, and the logits it returns into `logits` if given."""
    seen = []
    real = getattr(runner, name)

    def wrapped(*args):
        seen.append((int(runner.pos), args[-1]))
        out = real(*args)
        if logits is not None:
            logits.append(out.detach().clone())
        return out

    setattr(runner, name, wrapped)
    return seen


def _logits_match_hf(target, ids, output_ids, views, logits, accept_lens=None) -> bool:
    """Each step's logits against one HF forward over prompt + output: the row of a query at
    position p must equal HF's logits at p (for the verify: the rows of the accepted prefix,
    whose inputs are the true tokens). Independent of whether a tiny model's argmax repeats."""
    seq = torch.tensor([ids[0].tolist() + output_ids])
    with torch.no_grad():
        want = target(input_ids=seq).logits[0]
    for i, ((pos, _), got) in enumerate(zip(views, logits)):
        got = got.reshape(-1, got.shape[-1])  # the one row's [Q, V]
        rows = 1 if accept_lens is None else accept_lens[i]
        rows = min(rows, seq.shape[1] - pos)
        if not torch.allclose(got[:rows], want[pos: pos + rows], atol=1e-4, rtol=1e-4):
            return False
    return True


def test_view_lengths(small_buckets):
    assert [view_length(n, 64) for n in (1, 16, 17, 48, 49, 64, 90)] == [16, 16, 32, 48, 64, 64, 64]
    assert view_lengths(64) == [16, 32, 48, 64] and view_lengths(40) == [16, 32, 40]
    assert view_length(3, 64, buckets=False) == 64 and view_lengths(64, buckets=False) == [64]


def test_plain_across_buckets_matches_hf_greedy(target, small_buckets):
    ids = prompt(1)
    assert cache_length_for(PROMPT_LEN, 50, 1) == 64
    runner = new_plain_runner(target, 64)
    assert sorted(runner.steps.steps) == [16, 32, 48, 64]
    logits = []
    seen = _record_views(runner, "_step", logits)
    out = plain_static(target, ids, 50)
    assert out.output_ids == hf_greedy(target, ids, 50)
    assert _logits_match_hf(target, ids, out.output_ids, seen, logits)
    assert sorted({n for _, n in seen}) == [16, 32, 48, 64]
    assert all(n - small_buckets < pos + 1 <= n for pos, n in seen)  # the smallest view that covers pos


@pytest.mark.parametrize("block_size", [8, 3])
def test_spec_across_buckets_matches_hf_greedy(target, small_buckets, block_size):
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=8), block_size=block_size)
    ids = prompt(2)
    runner = new_spec_runner(decoder, spec_cache_length(PROMPT_LEN, 50, block_size))
    logits = []
    verify_views, draft_views = _record_views(runner, "_verify", logits), _record_views(runner, "_draft_forward")
    out = spec_static(decoder, ids, 50)
    assert runner_of(decoder) is runner
    assert out.output_ids == hf_greedy(target, ids, 50)
    assert _logits_match_hf(target, ids, out.output_ids, verify_views, logits, out.acceptance_lengths)
    assert len({n for _, n in verify_views}) >= 3
    assert all(n - small_buckets < pos + block_size <= n for pos, n in verify_views + draft_views)
    assert [n for _, n in draft_views] == [n for _, n in verify_views]  # one view per speculative step


def test_oracle_across_buckets_whole_blocks(small_buckets):
    """Whole blocks accepted: the position jumps by B and crosses a bucket inside a block."""
    target = tiny_qwen3()
    ids = prompt(5)
    block = 8
    ref = hf_greedy(target, ids, 1 + 6 * block + block)
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=8), block_size=block)
    runner = new_spec_runner(decoder, spec_cache_length(PROMPT_LEN, 1 + 6 * block, block))
    _oracle_hook(runner, ids[0].tolist() + ref)
    views = _record_views(runner, "_verify")
    out = spec_static(decoder, ids, 1 + 6 * block)
    assert runner_of(decoder) is runner
    assert out.output_ids == ref[: 1 + 6 * block] and out.acceptance_lengths == [block] * 6
    assert len({n for _, n in views}) >= 3


def test_sampling_across_buckets_equals_unbucketed(monkeypatch):
    """At T > 0 the noise is keyed by position and token, not by the view: the same seed gives the
    same tokens with small buckets as with one view over the whole cache."""
    target = tiny_qwen3()
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=8))
    ids = prompt(6)

    def both():
        spec = spec_static(decoder, ids, 50, sampling=SamplingParams(0.8), generator=torch.Generator().manual_seed(3)).output_ids
        plain = plain_static(target, ids, 50, SamplingParams(0.8), generator=torch.Generator().manual_seed(3)).output_ids
        return spec, plain

    whole = both()
    assert runner_of(decoder, greedy=False).verify_steps.steps.keys() == {LENGTH_BUCKET}
    monkeypatch.setattr(static_decode, "LENGTH_BUCKET", SMALL_BUCKET)
    bucketed = both()  # the runners are rebuilt for the new bucket
    assert sorted(runner_of(decoder, greedy=False).verify_steps.steps) == [16, 32, 48, 64, 80]
    assert bucketed == whole and len(whole[0]) == len(whole[1]) == 50


def test_no_buckets_and_lazy_capture_switches(target, small_buckets):
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=8))
    ids = prompt(3)
    ref = hf_greedy(target, ids, 40)
    whole = EngineOptions(use_buckets=False)
    assert spec_static(decoder, ids, 40, options=whole).output_ids == ref
    one = runner_of(decoder, options=whole)
    assert list(one.verify_steps.steps) == [one.max_len]  # one view, the whole cache
    lazy = EngineOptions(capture_all_buckets=False)
    runner = new_spec_runner(decoder, 128, lazy)  # bucketed, nothing made up front: views up to 128 on first use
    assert runner.verify_steps.steps == {}
    views = _record_views(runner, "_verify")
    assert spec_static(decoder, ids, 40, options=lazy).output_ids == ref and runner_of(decoder, options=lazy) is runner
    assert sorted(runner.verify_steps.steps) == sorted({n for _, n in views})
    assert 3 <= len(runner.verify_steps.steps) < len(static_decode.view_lengths(128))
    assert runner_of(decoder, options=whole) is one  # each option's runner its own cache entry
    plain_runner = new_plain_runner(target, 128, lazy)
    plain = plain_static(target, ids, 40, options=lazy)
    assert plain.output_ids == ref and sorted(plain_runner.steps.steps) == [16, 32, 48]


def _one_bucket_short(real):
    return lambda need, max_len: max(real(need, max_len) - SMALL_BUCKET, SMALL_BUCKET)


def test_a_too_short_view_is_caught(target, small_buckets, monkeypatch):
    """A bucket choice one bucket short fails the host's check, before any step runs on it."""
    monkeypatch.setattr(static_decode, "view_length", _one_bucket_short(view_length))
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=8))
    ids = prompt(4)
    with pytest.raises(RuntimeError, match="cannot hold"):
        spec_static(decoder, ids, 40)
    with pytest.raises(RuntimeError, match="cannot hold"):
        plain_static(target, ids, 40)


def test_a_too_short_view_is_noticed_by_the_exactness_checks(target, small_buckets, monkeypatch):
    """Past the host's check, a view one bucket short hides keys the step must see, and the
    logits check of the bucket tests above fails: those tests are not vacuous."""
    ids = prompt(4)
    short = _one_bucket_short(view_length)
    monkeypatch.setattr(static_decode.BucketedSteps, "view", lambda self, need: short(need, self.max_len))
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=8))
    runner = new_spec_runner(decoder, spec_cache_length(PROMPT_LEN, 40, 8))
    logits = []
    views = _record_views(runner, "_verify", logits)
    out = spec_static(decoder, ids, 40)
    assert any(n < pos + 8 for pos, n in views)  # some steps did run on a short view
    assert not _logits_match_hf(target, ids, out.output_ids, views, logits, out.acceptance_lengths)
    plain_runner = new_plain_runner(target, 64)
    logits = []
    views = _record_views(plain_runner, "_step", logits)
    out = plain_static(target, ids, 40)
    assert not _logits_match_hf(target, ids, out.output_ids, views, logits)


# ----------------------------------------------------------------------------- the caches


def test_static_draft_cache_writes_at_positions():
    cache = StaticDraftContextCache(num_layers=1, max_len=6)
    k = torch.arange(2 * 3 * 2, dtype=torch.float32).view(1, 2, 3, 2)
    cache.write_positions = torch.tensor([2, 3, 4])
    keys, values = cache.update(0, k, -k)
    assert keys.shape == (1, 2, 6, 2)
    torch.testing.assert_close(keys[:, :, 2:5], k)
    assert (keys[:, :, :2] == 0).all() and (keys[:, :, 5:] == 0).all()
    torch.testing.assert_close(values[:, :, 2:5], -k)
    cache.view_len = 4  # a view: writes still land in the whole buffer, attention gets the first 4
    cache.write_positions = torch.tensor([4, 5, 0])
    keys, values = cache.update(0, 2 * k, 3 * k)
    assert keys.shape == values.shape == (1, 2, 4, 2)
    torch.testing.assert_close(cache.keys[0][:, :, [4, 5, 0]], 2 * k)
    assert keys.data_ptr() == cache.keys[0].data_ptr()  # a view, no copy


def test_target_static_cache_writes_at_positions():
    model = tiny_qwen3(num_layers=2)
    kv = TargetStaticCache(model, 32, torch.device("cpu"), torch.float32)
    k = torch.randn(1, 2, 3, 16)
    kv.write_positions = torch.tensor([5, 6, 7])
    keys, values = kv.cache.update(k, 2 * k, 1)  # what HF's attention calls
    assert keys.shape == (1, 2, 32, 16)
    torch.testing.assert_close(keys[:, :, 5:8], k)
    torch.testing.assert_close(values[:, :, 5:8], 2 * k)
    assert (keys[:, :, :5] == 0).all() and (kv.cache.layers[0].keys == 0).all()
    kv.view_len = 16
    keys, values = kv.cache.update(k, 2 * k, 0)
    assert keys.shape == values.shape == (1, 2, 16, 16) and keys.data_ptr() == kv.cache.layers[0].keys.data_ptr()


# ----------------------------------------------------------------------------- sampling


def test_static_sampling_end_to_end_distribution():
    """Second generated token's marginal at T=1 (static path) vs the exact one from the target."""
    target, draft, ids, p2 = second_token_case()
    decoder = DFlashSpeculativeDecoder(target, draft)
    g = torch.Generator().manual_seed(0)
    n, counts = 600, torch.zeros(8)
    for _ in range(n):
        out = spec_static(decoder, ids, 2, sampling=SamplingParams(1.0), generator=g)
        counts[out.output_ids[1]] += 1
    assert (counts / n - p2).abs().max() < 0.07
    a = spec_static(decoder, ids, 12, sampling=SamplingParams(0.7), generator=torch.Generator().manual_seed(5))
    b = spec_static(decoder, ids, 12, sampling=SamplingParams(0.7), generator=torch.Generator().manual_seed(5))
    assert a.output_ids == b.output_ids and len(a.output_ids) == 12
    plain = plain_static(target, ids, 12, SamplingParams(0.7), generator=g)
    assert len(plain.output_ids) == 12


def test_device_speculative_sampling_keeps_the_target_distribution():
    """The captured sampled step (draw from q, accept with min(1, p/q), residual, bonus) against
    hand-set p and q that differ a lot: over many keys the first kept token is distributed as p's
    first row, the second as p's second row whenever the first proposal was kept, and n_acc's mean
    is the closed form sum_v min(p, q). An always-accepting or residual-free step fails this."""
    p = torch.tensor([[0.70, 0.10, 0.10, 0.05, 0.05], [0.05, 0.05, 0.10, 0.10, 0.70], [0.2] * 5])
    q = torch.tensor([[0.05, 0.05, 0.10, 0.10, 0.70], [0.70, 0.10, 0.10, 0.05, 0.05]])
    r = sampled_runner(3, 5)
    n, first, second, bonus, kept, accepted = 6000, torch.zeros(5), torch.zeros(5), torch.zeros(5), 0, 0.0
    for key in range(n):
        r.state.key.fill_(key * 7919 + 11)
        n_acc, tokens = sampled_step(r, p, q)
        first[tokens[0]] += 1
        accepted += float(n_acc >= 1)
        if n_acc >= 1:
            kept += 1
            second[tokens[1]] += 1
        if n_acc == 2:  # both proposals kept: the bonus token, drawn from p's last row
            bonus[tokens[2]] += 1
    assert (first / n - p[0]).abs().max() < 0.02
    assert (second / kept - p[1]).abs().max() < 0.03
    assert abs(accepted / n - float(torch.minimum(p[0], q[0]).sum())) < 0.02
    assert bonus.sum() > 400 and (bonus / bonus.sum() - p[2]).abs().max() < 0.07


def test_fused_elementwise_same_output_then_removed():
    """The capture-time fusion computes the models' own norms, RoPE and MLPs, and leaves no trace."""
    import transformers.models.qwen3.modeling_qwen3 as hf_qwen3

    import nemo_dflash.draft.model.modeling as draft_modeling
    from nemo_dflash.engine.graphs import fused_elementwise

    target = tiny_qwen3()
    draft = make_draft(target)
    x = prompt(3)
    decoder = DFlashSpeculativeDecoder(target, draft)
    ref_target = target(x).logits
    ref_draft = decoder.draft_logits(x[0, -1:], 9, torch.randn(1, 9, 128), DFlashContextCache(2), 8)
    originals = (hf_qwen3.apply_rotary_pos_emb, draft_modeling.apply_rope)
    with fused_elementwise(target, draft) as counts:
        assert hf_qwen3.apply_rotary_pos_emb is not originals[0] and draft_modeling.apply_rope is not originals[1]
        got_target = target(x).logits
        got_draft = decoder.draft_logits(x[0, -1:], 9, torch.randn(1, 9, 128), DFlashContextCache(2), 8)
    # norms: 4 per target layer + final; the draft's 4 per layer + hidden_norm + final
    assert counts == {"rms_norm": 4 * 4 + 1 + 4 * 2 + 2, "silu_mul": 4 + 2, "rope": 2}
    torch.testing.assert_close(got_target, ref_target, atol=1e-5, rtol=1e-4)
    assert got_draft.shape == ref_draft.shape
    assert (hf_qwen3.apply_rotary_pos_emb, draft_modeling.apply_rope) == originals
    assert not any("forward" in m.__dict__ for m in list(target.modules()) + list(draft.modules()))


def test_capture_runs_with_the_garbage_collector_off(monkeypatch):
    """A cyclic collection that starts mid-capture can free a dropped runner's graphs inside the capture, which
    CUDA refuses (the capture fails). `CapturedStep` must keep the collector off for the capture, not for the
    warm-up runs, and turn it back on afterwards, also when the step raises. Fake CUDA objects: CPU only."""
    import gc
    from contextlib import contextmanager

    from nemo_dflash.engine import graphs

    class _Stream:
        def __init__(self, device=None) -> None:
            pass

        def wait_stream(self, other) -> None:
            pass

    state = {"capturing": False}

    @contextmanager
    def _capture(graph):
        state["capturing"] = True
        try:
            yield
        finally:
            state["capturing"] = False

    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextmanager(lambda: (yield))())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", _capture)
    assert gc.isenabled()
    calls: list[tuple[bool, bool]] = []

    def step():
        calls.append((state["capturing"], gc.isenabled()))
        return "out"

    captured = graphs.CapturedStep(step, torch.device("cpu"), warmup=2)
    assert captured.outputs == "out"
    assert calls == [(False, True), (False, True), (True, False)]
    assert gc.isenabled()

    def failing():
        if state["capturing"]:
            raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError, match="capture failed"):
        graphs.CapturedStep(failing, torch.device("cpu"), warmup=1)
    assert gc.isenabled()
