"""Batched fixed-shape decoding (the CUDA-graph path, run eagerly on CPU) against the one-prompt
decoders, answer for answer (fp32, T=0), and at T > 0 against the target's exact distribution."""

from __future__ import annotations

import pytest
import torch

from _spec_fixtures import make_draft, plain_answers_with_a_stop, random_prompts, second_token_case, single_thread, tiny_llama, tiny_qwen3  # noqa: F401
from nemo_dflash.draft.model import DFlashContextCache
from nemo_dflash.engine.batched_static import (
    PREFILL_TOKENS, batched_static_autoregressive_generate, batched_static_speculative_generate, check_batch,
    prefill_batches,
)
from nemo_dflash.engine import batched_static
from nemo_dflash.engine.options import DEFAULT_OPTIONS, EngineOptions
from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder, autoregressive_generate
from nemo_dflash.engine.sampling import GREEDY, SamplingParams


def _prompts(n: int) -> list[list[int]]:
    return random_prompts(n, seed=11, max_len=40)


# Each engine option set away from its default (`filled_blocks`: on, as off a GPU).
FLIPPED = {"fold_gqa": False, "use_buckets": False, "capture_all_buckets": False, "fuse_elementwise": False,
           "fuse_sampling": False, "avoid_cudnn_attention": False, "filled_blocks": True}


def test_long_accepted_blocks_and_a_reused_runner():
    """A draft trained on the target's own answer accepts long prefixes (rows drift far apart);
    the second call reuses the first call's runner and caches (stale entries must stay hidden)."""
    from _spec_fixtures import trained_like_decoder

    prompts = _prompts(4)
    decoder = trained_like_decoder(tiny_qwen3(), prompts)
    want = [decoder.generate(torch.tensor([p]), max_new_tokens=40) for p in prompts]
    assert max(max(w.acceptance_lengths) for w in want) > 2
    for order in (prompts, prompts[::-1]):
        got = batched_static_speculative_generate(decoder, order, max_new_tokens=40, use_graphs=False)
        exp = want if order is prompts else want[::-1]
        assert [g.output_ids for g in got] == [w.output_ids for w in exp]
        assert [g.acceptance_lengths for g in got] == [w.acceptance_lengths for w in exp]


@pytest.mark.parametrize("make_target", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
def test_plain_rows_equal_plain_decoding(make_target):
    """Rows 1 and 2 hold prompts of one length (one prefill forward)."""
    target = make_target()
    base = _prompts(3)
    prompts = [base[0], base[1], base[1][::-1], base[2]]
    want, stop = plain_answers_with_a_stop(target, prompts, 25, row=1, k=3)
    got = batched_static_autoregressive_generate(target, prompts, max_new_tokens=25, stop_token_ids=[stop],
                                                 rows=6, use_graphs=False)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    assert [g.stopped for g in got] == [w.stopped for w in want]


def test_prefill_batches_are_shortest_first_within_the_padded_token_cap():
    assert prefill_batches([2, 2, 1, 3, 2]) == [[2, 0, 1, 4, 3]]
    assert prefill_batches([5]) == [[0]]
    n = PREFILL_TOKENS // 4  # n rows of 4 (padded) tokens fit one forward, the next starts another
    assert prefill_batches([4] * (n + 1)) == [list(range(n)), [n]]
    assert prefill_batches([1] * (n - 1) + [4, 4]) == [list(range(n)), [n]]  # the longest row pads them all
    assert prefill_batches([PREFILL_TOKENS + 1] * 2) == [[0], [1]]  # over the cap: a forward of its own
    batches = prefill_batches([7, 300, 3, 90, 1000, 12, 5, 640])
    assert sorted(i for b in batches for i in b) == list(range(8))
    assert all(len(b) * max([7, 300, 3, 90, 1000, 12, 5, 640][i] for i in b) <= PREFILL_TOKENS for b in batches)


def test_refuses_no_rows():
    target = tiny_qwen3()
    with pytest.raises(ValueError, match="rows must be >= 1"):
        batched_static_autoregressive_generate(target, [[1, 2], [3]], rows=0, use_graphs=False)


@pytest.mark.parametrize("make_target", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
@pytest.mark.parametrize("block", [1, 4, 8])
def test_speculative_rows_equal_the_one_prompt_decoder(make_target, block):
    """The same tokens and acceptance lengths per prompt, for prompts of different lengths, a stop token that
    ends some answers early, and the cap; with more rows than prompts (padding rows), as many, or fewer
    (continuous batching: prompts enter rows as answers end, each on a row that held a longer or shorter
    prompt before). At a cap of one token the rows pass from prompt to prompt without a decode step."""
    target = make_target()
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=8), block_size=block)
    prompts = _prompts(9)
    free = [decoder.generate(torch.tensor([p]), max_new_tokens=24) for p in prompts]
    stop = free[2].output_ids[4]
    want = [decoder.generate(torch.tensor([p]), max_new_tokens=24, stop_token_ids=[stop]) for p in prompts]
    assert any(w.stopped for w in want) and any(not w.stopped for w in want)
    for rows in (1, 3, 9, 11):
        got = batched_static_speculative_generate(decoder, prompts, max_new_tokens=24, stop_token_ids=[stop],
                                                  rows=rows, use_graphs=False)
        assert [g.output_ids for g in got] == [w.output_ids for w in want], rows
        assert [g.acceptance_lengths for g in got] == [w.acceptance_lengths for w in want], rows
        assert [g.stopped for g in got] == [w.stopped for w in want], rows
    got = batched_static_speculative_generate(decoder, prompts, max_new_tokens=1, rows=2, use_graphs=False)
    assert [g.output_ids for g in got] == [f.output_ids[:1] for f in free]


def test_continuous_batching_with_long_accepted_blocks():
    """A draft that accepts long prefixes: a prompt entering a row mid-run must draft its first block against
    its own prompt (a row drafting from its previous prompt's state would accept other lengths)."""
    from _spec_fixtures import trained_like_decoder

    base = _prompts(6)
    decoder = trained_like_decoder(tiny_qwen3(), base)  # trained on base[0]'s answer: it enters last
    prompts = base[1:] + [base[0]]
    want = [decoder.generate(torch.tensor([p]), max_new_tokens=40) for p in prompts]
    assert want[-1].acceptance_lengths[0] > 2
    for rows in (1, 2):
        got = batched_static_speculative_generate(decoder, prompts, max_new_tokens=40, rows=rows, use_graphs=False)
        assert [g.output_ids for g in got] == [w.output_ids for w in want], rows
        assert [g.acceptance_lengths for g in got] == [w.acceptance_lengths for w in want], rows


def test_a_prompt_whose_first_token_stops_gives_its_row_to_the_next():
    """Every answer of one token (the stop): the rows pass from prompt to prompt without a decode step."""
    target = tiny_qwen3()
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=4))
    prompts = _prompts(6)
    firsts = [decoder.generate(torch.tensor([p]), max_new_tokens=1).output_ids[0] for p in prompts]
    got = batched_static_speculative_generate(decoder, prompts, max_new_tokens=8, stop_token_ids=firsts, rows=2,
                                              use_graphs=False)
    assert [g.output_ids for g in got] == [[f] for f in firsts] and all(g.stopped for g in got)
    got = batched_static_autoregressive_generate(target, prompts, max_new_tokens=8, stop_token_ids=firsts, rows=2,
                                                 use_graphs=False)
    assert [g.output_ids for g in got] == [[f] for f in firsts]


@pytest.mark.parametrize("make_target", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
def test_continuous_plain_rows_equal_plain_decoding(make_target):
    target = make_target()
    prompts = _prompts(7)
    want, stop = plain_answers_with_a_stop(target, prompts, 25, row=1, k=3)
    for rows in (1, 3):
        got = batched_static_autoregressive_generate(target, prompts, max_new_tokens=25, stop_token_ids=[stop],
                                                     rows=rows, use_graphs=False)
        assert [g.output_ids for g in got] == [w.output_ids for w in want], rows
        assert [g.stopped for g in got] == [w.stopped for w in want], rows


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_refills_wait_for_rows_and_batch_their_prefills_without_changing_an_answer(kind, monkeypatch):
    """With `refill_rows`, freed rows wait until that many are free (or no row decodes) and their prompts enter in
    one right-padded prefill: fewer prefill forwards, the same answers, at T=0 (the one-prompt decoders') and at
    T=1 (each prompt's key is drawn in the prompts' order, its draws keyed by position, whenever it enters)."""
    target = tiny_qwen3()
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=4), block_size=4)
    prompts = [p + [5] for p in _prompts(9)]  # at least 2 tokens: a forward of more than one token a row is a prefill
    prefills = []
    real = type(target.model).forward  # the decoder's: a prefill runs it alone (the LM head on last tokens only)

    def forward(self, *a, **k):
        if k["input_ids"].shape[1] not in (1, 4):
            prefills.append(k["input_ids"].shape[0])
        return real(self, *a, **k)

    want, stop = plain_answers_with_a_stop(target, prompts, 12, row=1, k=3)  # answers of different lengths
    monkeypatch.setattr(type(target.model), "forward", forward)

    def run(sampling: SamplingParams, refill: int) -> list:
        prefills.clear()
        gen = torch.Generator().manual_seed(3)
        kw = dict(max_new_tokens=12, sampling=sampling, rows=3, use_graphs=False, generator=gen,
                  refill_rows=refill, stop_token_ids=[stop])
        outs = (batched_static_autoregressive_generate(target, prompts, **kw) if kind == "plain" else
                batched_static_speculative_generate(decoder, prompts, **kw))
        return [o.output_ids for o in outs], list(prefills)

    ref = [w.output_ids for w in want] if kind == "plain" else [
        decoder.generate(torch.tensor([p]), max_new_tokens=12, stop_token_ids=[stop]).output_ids for p in prompts]
    at_once, forwards_at_once = run(GREEDY, 1)
    batched, forwards_batched = run(GREEDY, 3)
    assert at_once == ref and batched == ref
    assert sum(forwards_batched) == sum(forwards_at_once) == 9  # every prompt prefilled once
    assert forwards_batched == [3, 3, 3] and len(forwards_at_once) > 3  # rows entering alone or in twos
    assert run(SamplingParams(1.0), 3)[0] == run(SamplingParams(1.0), 1)[0] != at_once  # sampled, and the same samples


@pytest.mark.parametrize("make_target", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
def test_steps_reading_filled_blocks_only_give_the_one_prompt_answers(make_target, monkeypatch):
    """`EngineOptions.filled_blocks`: the plain step and the verify attend with flex over each row's filled KV blocks
    (eager flex on CPU) instead of SDPA over the bucketed view. Prompts enter rows mid-run, rows drift apart and
    cross a 128-position block: each answer is the one-prompt decoder's, and every step's target attention took the
    flex path (its calls counted: one a layer a step)."""
    from nemo_dflash.engine import static_cache

    from _spec_fixtures import trained_like_decoder

    filled = EngineOptions(filled_blocks=True)
    prompts = _prompts(5) + [list(range(3, 123))]  # the last one's answer crosses position 128
    decoder = trained_like_decoder(make_target(), prompts, block_size=4)  # long accepted blocks: every query counts
    target = decoder.target.model
    want_plain, stop = plain_answers_with_a_stop(target, prompts, 20, row=1, k=3)
    want_spec = [decoder.generate(torch.tensor([p]), max_new_tokens=20, stop_token_ids=[stop]) for p in prompts]
    calls = []
    real = static_cache.FilledBlocks.__init__

    def counting(self, *a, **k):
        real(self, *a, **k)
        flex = self.flex
        self.flex = lambda *x, **y: calls.append(1) or flex(*x, **y)

    monkeypatch.setattr(static_cache.FilledBlocks, "__init__", counting)
    got = batched_static_autoregressive_generate(target, prompts, max_new_tokens=20, stop_token_ids=[stop], rows=3,
                                                 use_graphs=False, options=filled)
    assert [g.output_ids for g in got] == [w.output_ids for w in want_plain]
    layers = target.config.num_hidden_layers
    assert len(calls) >= layers * max(len(w.output_ids) for w in want_plain) and len(calls) % layers == 0
    got = batched_static_speculative_generate(decoder, prompts, max_new_tokens=20, stop_token_ids=[stop], rows=3,
                                              use_graphs=False, options=filled)
    assert [g.output_ids for g in got] == [w.output_ids for w in want_spec]
    assert [g.acceptance_lengths for g in got] == [w.acceptance_lengths for w in want_spec]
    assert max(a for w in want_spec for a in w.acceptance_lengths) >= 3


def test_filled_blocks_read_each_rows_blocks_up_to_its_furthest_query():
    """`FilledBlocks`' block structure (what a GPU's flex kernel reads; eager flex on CPU applies the mask everywhere)
    against the blocks written out: row r reads KV blocks 0..max(q_pos[r]) // 128, nothing past them."""
    from nemo_dflash.engine.static_cache import FilledBlocks

    fb = FilledBlocks(rows=3, queries=4, max_len=512, group=3, device=torch.device("cpu"))
    fb.set(torch.tensor([[5, 6, 7, 8], [126, 127, 128, 129], [400, 401, 402, 403]]))
    dense = fb.mask.to_dense()[:, 0, 0]  # [rows, KV blocks]: 1 where a block is read
    assert dense.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(1.0)], ids=["0.0", "1.0"])
def test_plain_windows_of_steps_give_the_same_answers(sampling):
    """`window` plain steps a host read-back: answers ending (stop token, cap) inside a window are cut where they
    end, prompts enter rows between windows, and every answer is the one-step loop's (T=0: plain decoding's), its
    acceptance lengths one forward a token."""
    target = tiny_qwen3()
    prompts = _prompts(9)
    want, stop = plain_answers_with_a_stop(target, prompts, 13, row=1, k=3)

    def run(window: int) -> list:
        return batched_static_autoregressive_generate(
            target, prompts, max_new_tokens=13, stop_token_ids=[stop], rows=3, use_graphs=False, window=window,
            sampling=sampling, generator=torch.Generator().manual_seed(2))

    one = run(1)
    if sampling.greedy:
        assert [o.output_ids for o in one] == [w.output_ids for w in want]
    for window in (4, 13, 20):
        got = run(window)
        assert [g.output_ids for g in got] == [o.output_ids for o in one], window
        assert [g.stopped for g in got] == [o.stopped for o in one]
        assert [g.acceptance_lengths for g in got] == [[1] * (len(g.output_ids) - 1) for g in got]
    assert any(len(o.output_ids) == 13 for o in one) and (not sampling.greedy or any(o.stopped for o in one))
    with pytest.raises(ValueError, match="window must be in"):
        run(0)


def test_continuous_sampled_rows_with_a_one_token_nucleus_are_the_greedy_answers():
    """At T > 0 with top-k 1 every draw is the argmax: the sampled steps' keys, q and accept test for prompts
    that entered mid-run must then give the greedy answers; and the same generator seed, the same answers."""
    target = tiny_qwen3()
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=4))
    prompts = _prompts(7)
    setting = SamplingParams(1.0, top_k=1)
    want = batched_static_speculative_generate(decoder, prompts, max_new_tokens=20, use_graphs=False)
    got = batched_static_speculative_generate(decoder, prompts, max_new_tokens=20, sampling=setting, rows=3,
                                              use_graphs=False, generator=torch.Generator().manual_seed(0))
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    plain = batched_static_autoregressive_generate(target, prompts, max_new_tokens=20, sampling=setting, rows=3,
                                                   use_graphs=False, generator=torch.Generator().manual_seed(0))
    assert [g.output_ids for g in plain] == [w.output_ids for w in want]
    runs = [batched_static_speculative_generate(decoder, prompts, max_new_tokens=20, sampling=SamplingParams(1.0), rows=3,
                                                use_graphs=False, generator=torch.Generator().manual_seed(5))
            for _ in range(2)]
    assert [o.output_ids for o in runs[0]] == [o.output_ids for o in runs[1]]


@pytest.mark.parametrize("setting", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9)], ids=["t1", "top_p"])
def test_one_sampled_plain_row_is_what_autoregressive_generate_gives(setting, monkeypatch):
    """Plain decoding at T > 0: `autoregressive_generate(decode="graphs")` is this loop with one row (its steps
    run eagerly here), the same answer from the same generator, a stop included; rows of a larger batch are
    valid answers of their own keys."""
    from nemo_dflash.engine import spec_decode

    monkeypatch.setattr(spec_decode, "check_decode_mode", lambda decode, device: None)  # graphs mode on a CPU
    real = batched_static.batched_static_autoregressive_generate
    monkeypatch.setattr(spec_decode, "batched_static_autoregressive_generate",
                        lambda *a, **k: real(*a, **{**k, "use_graphs": False}))
    target = tiny_qwen3()
    prompts = _prompts(4)
    for i, p in enumerate(prompts):
        want = real(target, [p], max_new_tokens=25, sampling=setting, stop_token_ids=[7], rows=1,
                    use_graphs=False, generator=torch.Generator().manual_seed(i))[0]
        got = autoregressive_generate(target, torch.tensor([p]), max_new_tokens=25, sampling=setting,
                                      stop_token_ids=[7], generator=torch.Generator().manual_seed(i), decode="graphs")
        assert got.output_ids == want.output_ids
    outs = batched_static_autoregressive_generate(target, prompts, max_new_tokens=25, sampling=setting,
                                                  use_graphs=False, generator=torch.Generator().manual_seed(0))
    assert [len(o.output_ids) for o in outs] == [25] * 4 and len({tuple(o.output_ids) for o in outs}) == 4


def test_sampled_plain_rows_follow_the_target():
    """The second token of plain batched decoding at T=1, over 3,000 rows of one prompt (each its own key):
    its frequencies match the target's exact marginal within 0.03."""
    target, _, ids, p2 = second_token_case()
    n = 3000
    outs = batched_static_autoregressive_generate(target, [ids[0].tolist()] * n, max_new_tokens=2, sampling=SamplingParams(1.0),
                                                  use_graphs=False, generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(torch.tensor([o.output_ids[1] for o in outs]), minlength=p2.numel()).float()
    assert (counts / n - p2).abs().max() < 0.03


def _record_draft(decoder) -> tuple[list[torch.Tensor], object]:
    """Every draft forward's block hidden states [rows, B, H], in call order."""
    calls: list[torch.Tensor] = []
    handle = decoder.draft.register_forward_hook(lambda m, a, out: calls.append(out.detach().clone()))
    return calls, handle


@pytest.mark.parametrize("make_target", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
def test_every_rows_draft_sees_what_the_one_prompt_draft_sees(make_target):
    """Stronger than equal answers (a random draft's proposals are mostly rejected either way): each
    row's draft output at every step equals the one-prompt decoder's, so each row's context, positions
    and masks are its own. The prompts, of different lengths, are prefilled and drafted in one right-padded
    forward (shortest first)."""
    from _spec_fixtures import trained_like_decoder

    base = _prompts(3)
    prompts = [base[0], base[1], base[1][::-1], base[0][:11]]  # 27, 4, 4 and 11 tokens
    batches = prefill_batches([len(p) for p in prompts])
    assert len(batches) == 1 and len({len(p) for p in prompts}) >= 3  # one forward, padded rows
    decoder = trained_like_decoder(make_target(), prompts)
    # In float64: the padded batch's matmuls round otherwise than one row's, and in float32 the difference grows
    # over the steps past any tolerance that still tells a wrong context from rounding (by 3e-4 at step 20 on
    # some CPUs); a wrong context, position or mask moves the outputs by far more than float64's rounding.
    decoder.target.model.double()
    decoder.draft.double()
    want, lens = [], []
    for p in prompts:
        calls, handle = _record_draft(decoder)
        out = decoder.generate(torch.tensor([p]), max_new_tokens=30)
        handle.remove()
        want.append([c[0] for c in calls])
        lens.append(len(out.acceptance_lengths))
    calls, handle = _record_draft(decoder)
    got = batched_static_speculative_generate(decoder, prompts, max_new_tokens=30, rows=5, use_graphs=False)
    handle.remove()
    assert [len(g.acceptance_lengths) for g in got] == lens
    first, later = calls[0], calls[1:]  # step 1: the prefill's rows, shortest first; then every row
    for r in range(len(prompts)):
        rows = [first[batches[0].index(r)]] + [step[r] for step in later[: lens[r] - 1]]
        assert len(rows) == len(want[r])
        for k, (g, w) in enumerate(zip(rows, want[r])):
            assert g.dtype == torch.float64
            torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-9, msg=lambda m: f"row {r} step {k}: {m}")


def test_sampled_rows_past_the_prompts_leave_the_answers_samples():
    """Padding rows draw too (the draws then differ from the eager decoder's), and the rows' answers
    still start as the target's filtered distribution says: the first token's frequencies over 3,000 rows
    of one prompt against the exact filtered p."""
    target = tiny_qwen3()
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=4))
    s = SamplingParams(1.0, top_p=0.8)
    ids = [3, 5, 7]
    with torch.no_grad():
        want = s.probs(target(torch.tensor([ids])).logits[0, -1])
    n = 3000
    got = batched_static_speculative_generate(decoder, [ids] * n, max_new_tokens=2, sampling=s, rows=n + 3,
                                              use_graphs=False, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(torch.tensor([g.output_ids[0] for g in got]), minlength=want.numel()).float()
    assert (counts / n - want).abs().max() < 0.03


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_sampled_plain_and_one_row_graphs_are_the_eager_runs():
    """On a GPU, in fp32: plain batched decoding at T=1 with top-p on CUDA graphs gives the eager run's tokens
    from the same seed, and the one-prompt calls on graphs (one captured row) give the one-row eager run's
    answer, plain and speculative (the keyed draws inside captured steps)."""
    import copy

    from _spec_fixtures import trained_like_decoder

    prompts = _prompts(4)
    cpu = trained_like_decoder(tiny_qwen3(), prompts)
    target = copy.deepcopy(cpu.target.model).cuda()
    decoder = DFlashSpeculativeDecoder(target, copy.deepcopy(cpu.draft).cuda(), block_size=cpu.block_size)
    s = SamplingParams(1.0, top_p=0.95)
    kw = dict(max_new_tokens=30, sampling=s)
    want = batched_static_autoregressive_generate(target, prompts, use_graphs=False,
                                                  generator=torch.Generator("cuda").manual_seed(0), **kw)
    got = batched_static_autoregressive_generate(target, prompts, generator=torch.Generator("cuda").manual_seed(0),
                                                 **kw)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    ids = torch.tensor([prompts[1]], device="cuda")
    one = autoregressive_generate(target, ids, generator=torch.Generator("cuda").manual_seed(3), decode="graphs", **kw)
    row = batched_static_autoregressive_generate(target, prompts[1:2], rows=1, use_graphs=False,
                                                 generator=torch.Generator("cuda").manual_seed(3), **kw)[0]
    assert row.output_ids == one.output_ids
    one = decoder.generate(ids, generator=torch.Generator("cuda").manual_seed(4), decode="graphs", **kw)
    row = batched_static_speculative_generate(decoder, prompts[1:2], rows=1, use_graphs=False,
                                              generator=torch.Generator("cuda").manual_seed(4), **kw)[0]
    assert row.output_ids == one.output_ids and row.acceptance_lengths == one.acceptance_lengths


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_sampled_rows_with_graphs_are_the_eager_runs():
    """The captured path on a GPU at T=1, in fp32 (near ties do not flip): the same tokens and acceptance
    lengths as the same decoder run eagerly from the same seed, and the first token's frequencies over 4,000
    rows of one prompt against the exact p."""
    import copy

    from _spec_fixtures import trained_like_decoder

    prompts = _prompts(5)
    cpu = trained_like_decoder(tiny_qwen3(), prompts)
    decoder = DFlashSpeculativeDecoder(copy.deepcopy(cpu.target.model).cuda(), copy.deepcopy(cpu.draft).cuda(),
                                       block_size=cpu.block_size)
    s = SamplingParams(1.0)
    kw = dict(max_new_tokens=30, sampling=s)
    want = batched_static_speculative_generate(decoder, prompts, generator=torch.Generator("cuda").manual_seed(0),
                                               use_graphs=False, **kw)
    got = batched_static_speculative_generate(decoder, prompts, generator=torch.Generator("cuda").manual_seed(0),
                                              **kw)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    assert [g.acceptance_lengths for g in got] == [w.acceptance_lengths for w in want]
    for sampling in (GREEDY, s):  # continuous batching: prompts entering rows between graph replays
        order = prompts[1:] + [prompts[0]]
        want = batched_static_speculative_generate(decoder, order, generator=torch.Generator("cuda").manual_seed(2),
                                                   rows=2, use_graphs=False, max_new_tokens=30, sampling=sampling)
        got = batched_static_speculative_generate(decoder, order, generator=torch.Generator("cuda").manual_seed(2),
                                                  rows=2, max_new_tokens=30, sampling=sampling)
        assert [g.output_ids for g in got] == [w.output_ids for w in want]
        assert [g.acceptance_lengths for g in got] == [w.acceptance_lengths for w in want]
    ids, n = prompts[0], 4000
    with torch.no_grad():
        p = s.probs(decoder.target.model(torch.tensor([ids], device="cuda")).logits[0, -1]).cpu()
    outs = batched_static_speculative_generate(decoder, [ids] * n, max_new_tokens=2, sampling=s,
                                               generator=torch.Generator("cuda").manual_seed(1))
    counts = torch.bincount(torch.tensor([o.output_ids[0] for o in outs]), minlength=p.numel()).float()
    assert (counts / n - p).abs().max() < 0.03


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("setting", sorted(FLIPPED))
def test_gpu_captured_rows_under_each_option_are_the_eager_unfolded_runs(setting):
    """On a GPU, in fp32: captured plain and speculative rows with each engine option at either value (the grouped-
    query fold, filled KV blocks on compiled flex, buckets, capture up front, the fused elementwise and sampling
    kernels, cuDNN in the eager prefills) give the tokens and acceptance lengths of the eager runs through HF's own
    SDPA, at T=0 and T=1, prompts entering rows between replays (one of them long enough to cross a 128-position
    block; the captured plain rows 4 steps a read-back)."""
    import copy

    from _spec_fixtures import trained_like_decoder

    prompts = _prompts(5) + [list(range(3, 123))]
    unfolded = EngineOptions(fold_gqa=False, filled_blocks=False)
    cpu = trained_like_decoder(tiny_qwen3(), prompts)
    target = copy.deepcopy(cpu.target.model).cuda()
    decoder = DFlashSpeculativeDecoder(target, copy.deepcopy(cpu.draft).cuda(), block_size=cpu.block_size)
    for sampling in (GREEDY, SamplingParams(1.0)):
        kw = dict(rows=2, max_new_tokens=30, sampling=sampling)
        runs = []
        for value, graphs in ((None, False), (False, True), (True, True)):
            options = unfolded if value is None else unfolded.but(**{setting: value})
            runs.append((
                batched_static_autoregressive_generate(target, prompts, use_graphs=graphs, window=4 if graphs else 1,
                                                       generator=torch.Generator("cuda").manual_seed(5),
                                                       options=options, **kw),
                batched_static_speculative_generate(decoder, prompts, use_graphs=graphs,
                                                    generator=torch.Generator("cuda").manual_seed(5),
                                                    options=options, **kw)))
        for run in runs[1:]:
            for a, b in zip(run, runs[0]):
                assert [o.output_ids for o in a] == [o.output_ids for o in b]
                assert [o.acceptance_lengths for o in a] == [o.acceptance_lengths for o in b]


def test_runners_with_different_options_are_distinct_cache_entries():
    """A runner's captured steps hold the options they were made under: a call under other options gets a runner of
    its own (its own cache entry, keyed by the options), a call under the same options (equal, not the same object)
    the kept one, and the first runner is still there for the first options."""
    target = tiny_qwen3()
    prompts = _prompts(2)
    made = []
    for options in (EngineOptions(fold_gqa=False), EngineOptions(fold_gqa=False), DEFAULT_OPTIONS,
                    EngineOptions(fold_gqa=False)):
        batched_static_autoregressive_generate(target, prompts, max_new_tokens=4, use_graphs=False, options=options)
        made.append(batched_static.plain_runner(target, GREEDY, 2, 0, False, options))
    assert made[0] is made[1] is made[3] and made[2] is not made[0]
    assert made[0].options == EngineOptions(fold_gqa=False) and made[2].options == DEFAULT_OPTIONS
    assert made[0].step_key != made[2].step_key
    assert set(batched_static._RUNNERS[target]) == {batched_static.runner_key("plain", 2, False, EngineOptions(fold_gqa=False)),
                                                    batched_static.runner_key("plain", 2, False)}


def _options_run(decoder, prompts, options):
    """Speculative rows at T=0 and plain rows at T=1 (top-k 20) under `options`: prompts entering 3 rows mid-run,
    one of them long enough to cross a 128-position view and KV block. (answers, acceptance lengths) of both."""
    kw = dict(max_new_tokens=20, rows=3, use_graphs=False, options=options)
    spec = batched_static_speculative_generate(decoder, prompts, **kw)
    plain = batched_static_autoregressive_generate(decoder.target.model, prompts, sampling=SamplingParams(1.0, top_k=20),
                                                   generator=torch.Generator().manual_seed(4), **kw)
    return [(o.output_ids, o.acceptance_lengths) for o in spec + plain]


@pytest.mark.parametrize("field", sorted(FLIPPED))
def test_each_engine_option_gives_the_answers_of_the_option_off(field, monkeypatch):
    """Every `EngineOptions` field set away from its default: the speculative (T=0) and plain sampled (T=1) rows'
    answers and acceptance lengths are those of the default options, from runners of their own made under those
    options, and (where a CPU shows it) the option took effect: no folded attention, one view over the whole cache,
    no step made up front, eager forwards free to pick cuDNN, the target steps on flex over filled blocks, no compiled
    sampling on a GPU. The fused kernels run on a GPU only (their answers: the GPU test below and
    `test_fused_sampling_*`)."""
    import dataclasses

    from _spec_fixtures import trained_like_decoder
    from nemo_dflash.engine import static_cache, static_decode

    assert set(FLIPPED) == {f.name for f in dataclasses.fields(EngineOptions)}  # a new option is tested here too
    monkeypatch.setattr(static_decode, "LENGTH_BUCKET", 128)  # two views (128, 256), and whole KV blocks
    prompts = _prompts(4) + [list(range(3, 123))]
    decoder = trained_like_decoder(tiny_qwen3(), prompts, block_size=4)
    folded, backends, made_up_front = [], [], []
    real_fold, real_backends, real_steps = (static_cache.folded_gqa_sdpa, batched_static.eager_attention_backends,
                                            static_decode.BucketedSteps.__init__)
    monkeypatch.setattr(static_cache, "folded_gqa_sdpa", lambda *a, **k: folded.append(1) or real_fold(*a, **k))
    monkeypatch.setattr(batched_static, "eager_attention_backends",
                        lambda device, avoid=True: backends.append(avoid) or real_backends(device, avoid))

    def steps_init(self, *a, **k):
        real_steps(self, *a, **k)
        made_up_front.append(len(self.steps))

    monkeypatch.setattr(static_decode.BucketedSteps, "__init__", steps_init)
    want = _options_run(decoder, prompts, DEFAULT_OPTIONS)
    assert folded and all(backends) and made_up_front == [2, 2, 2]  # the defaults: both views of 3 steps
    folded.clear(), backends.clear(), made_up_front.clear()
    options = DEFAULT_OPTIONS.but(**{field: FLIPPED[field]})
    got = _options_run(decoder, prompts, options)
    assert got == want
    assert max(max(a) for _, a in want[:5]) >= 3  # long blocks accepted
    fused_on, cuda = static_decode.fused_sampling_on, torch.device("cuda")
    key = batched_static.runner_key("spec", 3, False, options)
    runner, default = batched_static._RUNNERS[decoder][key], batched_static._RUNNERS[decoder][key[:3] + (DEFAULT_OPTIONS,)]
    assert runner is not default and runner.options == options and default.options == DEFAULT_OPTIONS
    effect = {"fold_gqa": not folded, "use_buckets": list(runner.verify_steps.steps) == [runner.max_len] == [256],
              "capture_all_buckets": made_up_front and not any(made_up_front),
              "avoid_cudnn_attention": backends and not any(backends),
              "filled_blocks": runner.filled is not None and default.filled is None,
              # on a GPU only: the sampled steps' math compiled (its runs: the GPU tests)
              "fuse_elementwise": fused_on(cuda, runner.options) is False and fused_on(cuda, default.options),
              "fuse_sampling": fused_on(cuda, runner.options) is False and fused_on(cuda, default.options)}
    assert effect[field]


def test_the_engines_eager_forwards_avoid_per_shape_attention_kernels(monkeypatch):
    """Every prefill and first draft block (a new shape per prompt length) runs inside `eager_attention_backends`,
    and no verify or later draft step does (captured steps keep PyTorch's kernel choice): on a run where prompts
    enter rows mid-run, prompts of 5-8 tokens and blocks of 4, so a forward's length tells which it is. Both rows
    end at one step, so the prompts enter in pairs: two prefills, right-padded to 6 and 8 tokens."""
    import contextlib

    inside = []

    @contextlib.contextmanager
    def recording(device, avoid_cudnn=True):
        assert avoid_cudnn  # the default options
        inside.append(True)
        try:
            yield
        finally:
            inside.pop()

    monkeypatch.setattr(batched_static, "eager_attention_backends", recording)
    target = tiny_qwen3()
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=4), block_size=4)
    runner = batched_static.spec_runner(decoder, GREEDY, 2, 256, False)
    target_calls, draft_calls = [], []  # (tokens a row, inside the backends)
    real_forward, real_draft = type(target.model).forward, runner._draft_forward  # the decoder: prefills run it alone

    def forward(self, *a, **k):
        target_calls.append((k["input_ids"].shape[1], bool(inside)))
        return real_forward(self, *a, **k)

    def draft_forward(noise, feats, *a, **k):
        draft_calls.append((feats.shape[1], bool(inside)))
        return real_draft(noise, feats, *a, **k)

    monkeypatch.setattr(type(target.model), "forward", forward)
    monkeypatch.setattr(runner, "_draft_forward", draft_forward)
    prompts = [[(7 * j + 3 * i) % 50 + 3 for j in range(5 + i)] for i in range(4)]  # the last two enter mid-run
    batched_static_speculative_generate(decoder, prompts, max_new_tokens=6, rows=2, use_graphs=False)
    assert sorted(n for n, _ in target_calls if n != 4) == [6, 8] and any(n == 4 for n, _ in target_calls)
    assert all(ins == (n != 4) for n, ins in target_calls)  # prefills inside, verifies outside
    assert sorted(n for n, _ in draft_calls if n != 4) == [6, 8] and any(n == 4 for n, _ in draft_calls)
    assert all(ins == (n != 4) for n, ins in draft_calls)  # first blocks inside, later steps outside


def test_one_runner_serves_every_setting_of_its_kind():
    """T=1 with top-p 0.95, then T=0.5 with top-p 0.9, on one decoder (one runner for both: T and the filters'
    values are buffers): the second answers equal those of a fresh decoder's runner from the same seed, so
    nothing of the first setting lingers. Unfiltered sampling has a runner of its own (no sort in its graph)."""
    from _spec_fixtures import trained_like_decoder

    from nemo_dflash.engine import batched_static

    prompts = _prompts(3)
    decoder = trained_like_decoder(tiny_qwen3(), prompts)
    fresh = trained_like_decoder(tiny_qwen3(), prompts)
    second = SamplingParams(0.5, top_p=0.9)
    kw = dict(max_new_tokens=20, use_graphs=False)
    batched_static_speculative_generate(decoder, prompts, sampling=SamplingParams(1.0, top_p=0.95),
                                        generator=torch.Generator().manual_seed(5), **kw)
    got = batched_static_speculative_generate(decoder, prompts, sampling=second,
                                              generator=torch.Generator().manual_seed(6), **kw)
    assert len(batched_static._RUNNERS[decoder]) == 1  # the sampled runner, reused
    want = batched_static_speculative_generate(fresh, prompts, sampling=second,
                                               generator=torch.Generator().manual_seed(6), **kw)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    assert [g.acceptance_lengths for g in got] == [w.acceptance_lengths for w in want]
    batched_static_speculative_generate(decoder, prompts, sampling=SamplingParams(1.0), generator=torch.Generator(), **kw)
    assert len(batched_static._RUNNERS[decoder]) == 2


def test_refuses_empty_input():
    with pytest.raises(ValueError, match="at least one prompt"):
        check_batch([[1, 2], []], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        check_batch([[1, 2]], 0)
    target = tiny_qwen3()
    decoder = DFlashSpeculativeDecoder(target, make_draft(target))
    with pytest.raises(ValueError, match="at least one prompt"):
        batched_static_speculative_generate(decoder, [[1, 2], []], use_graphs=False)


def test_t1_keeps_the_target_distribution():
    """The second token (the first one the draft proposes) of 8,000 rows of one prompt, against its exact
    marginal (tolerance ~5 standard errors). The marginal of the draft's unverified proposals is more than
    twice the tolerance away from it, so a decoder that skipped the verification would fail."""
    target, draft, ids, p2 = second_token_case()
    decoder = DFlashSpeculativeDecoder(target, draft)
    n, tol = 8000, 0.02
    outs = batched_static_speculative_generate(decoder, [ids[0].tolist()] * n, max_new_tokens=2, sampling=SamplingParams(1.0),
                                               use_graphs=False, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(torch.tensor([o.output_ids[1] for o in outs]), minlength=8).float()
    assert (counts / n - p2).abs().max() < tol
    with torch.no_grad():  # the draft's proposal for slot 1 after each first token, averaged over p(first)
        p1 = torch.softmax(target(ids).logits[0, -1], -1)
        feats = decoder.target.forward_features(ids)[0]
        q = torch.stack([decoder.draft_logits(torch.tensor([t]), ids.shape[1], feats,
                                              DFlashContextCache(len(draft.layers)), 4)[0].softmax(-1)
                         for t in range(8)])
    assert ((p1.unsqueeze(1) * q).sum(0) - p2).abs().max() > 2 * tol


def test_t1_over_several_steps_keeps_the_joint_distribution():
    """The first three tokens of 6,000 rows of one prompt (vocabulary 8, block 4): tokens 2 and 3 come from
    proposals accepted in step 1, or from the step after a rejection, so the accept path, the bonus token
    and the next step's context all count. Against the exact law of the target (every 3-token path
    enumerated): the (t2, t3) frequencies within 0.07 in total variation and each token's marginal within
    0.025 (about 4 standard errors)."""
    from _spec_fixtures import three_token_law

    target, draft, ids, _ = second_token_case()
    decoder = DFlashSpeculativeDecoder(target, draft)
    joint = three_token_law(target, ids)
    n = 6000
    outs = batched_static_speculative_generate(decoder, [ids[0].tolist()] * n, max_new_tokens=3, sampling=SamplingParams(1.0),
                                               use_graphs=False, generator=torch.Generator().manual_seed(2))
    _assert_three_token_law(outs, joint, n)


def test_t1_with_continuous_batching_keeps_the_joint_distribution():
    """The same law when 6,000 prompts share 500 rows: every prompt after the first 500 enters a row mid-run
    (its prefill, first token, key and first draft block on their own), so the refill path is judged too."""
    from _spec_fixtures import three_token_law

    target, draft, ids, _ = second_token_case()
    decoder = DFlashSpeculativeDecoder(target, draft)
    n = 6000
    outs = batched_static_speculative_generate(decoder, [ids[0].tolist()] * n, max_new_tokens=3, sampling=SamplingParams(1.0),
                                               rows=500, use_graphs=False, generator=torch.Generator().manual_seed(3))
    _assert_three_token_law(outs, three_token_law(target, ids), n)


def _assert_three_token_law(outs, joint: torch.Tensor, n: int) -> None:
    assert all(len(o.output_ids) == 3 for o in outs)
    assert any(o.acceptance_lengths[0] >= 2 for o in outs)  # some rows kept a proposal in step 1
    assert any(len(o.acceptance_lengths) >= 2 for o in outs)  # and some needed a second step
    codes = torch.tensor([o.output_ids[0] * 64 + o.output_ids[1] * 8 + o.output_ids[2] for o in outs])
    freq = (torch.bincount(codes, minlength=512).float() / n).view(8, 8, 8)
    # sampling noise alone: E[TV] over the 64 (t2, t3) cells ~0.04 here; a marginal's standard error < 0.0065
    assert 0.5 * (freq.sum(0) - joint.sum(0)).abs().sum() < 0.07
    for dims in ((0, 1), (0, 2), (1, 2)):
        assert (freq.sum(dims) - joint.sum(dims)).abs().max() < 0.025, dims


@pytest.mark.parametrize("rows,chosen", [(1, None), (3, None), (2, [1, 2]), (2, [3, 0])])
def test_write_at_puts_each_rows_kv_at_its_positions(rows, chosen):
    """`static_cache.write_at` against a plain loop over rows and positions: [Q] positions shared by the rows,
    [R, Q] positions of their own (one row takes the index_copy_ path, several the scatter_), and a forward's
    rows sent to chosen rows of the buffers (a prefill's: in order or not)."""
    from nemo_dflash.engine.static_cache import write_at

    g = torch.Generator().manual_seed(rows)
    total, heads, length, dim, q = 4, 2, 10, 3, 3
    targets = list(range(rows)) if chosen is None else chosen
    for shared in (True, False):
        pos = (torch.tensor([2, 5, 7]) if shared else
               torch.stack([torch.randperm(length, generator=g)[:q] for _ in range(rows)]))
        keys = torch.randn(total if chosen is not None else rows, heads, length, dim, generator=g)
        values = torch.randn(keys.shape, generator=g)
        k = torch.randn(rows, heads, q, dim, generator=g)
        v = torch.randn(rows, heads, q, dim, generator=g)
        want_k, want_v = keys.clone(), values.clone()
        for r in range(rows):
            for j in range(q):
                p = int(pos[j] if shared else pos[r, j])
                want_k[targets[r], :, p] = k[r, :, j]
                want_v[targets[r], :, p] = v[r, :, j]
        got_k, got_v = write_at(keys, values, k, v, pos, None if chosen is None else torch.tensor(chosen))
        assert torch.equal(keys, want_k) and torch.equal(values, want_v)  # in place
        assert got_k is keys and got_v is values


@pytest.mark.parametrize("q_len,mask_rows", [(1, 3), (4, 3), (5, 1)])
def test_folded_gqa_attention_equals_attention_written_out(q_len, mask_rows):
    """`static_cache.folded_gqa_sdpa` (query heads that share a K/V head folded into its query rows) against
    softmax attention written out per row, head and query in float64, query head h reading K/V head h // 3;
    a mask of one row per batch row, or one row broadcast over the batch (a prefill's)."""
    from nemo_dflash.engine.static_cache import folded_gqa_sdpa

    g = torch.Generator().manual_seed(q_len)
    rows, heads, kv_heads, keys, dim, scale = 3, 6, 2, 11, 4, 0.7
    q = torch.randn(rows, heads, q_len, dim, generator=g, dtype=torch.float64)
    k = torch.randn(rows, kv_heads, keys, dim, generator=g, dtype=torch.float64)
    v = torch.randn(rows, kv_heads, keys, dim, generator=g, dtype=torch.float64)
    q_pos = torch.tensor([2, 6, 5])[:mask_rows].view(-1, 1) + torch.arange(q_len)  # [mask_rows, Q]
    mask = (torch.arange(keys).view(1, 1, -1) <= q_pos.unsqueeze(-1)).unsqueeze(1)  # [mask_rows, 1, Q, keys]
    got, _ = folded_gqa_sdpa(torch.nn.Module(), q, k, v, mask, scaling=scale)
    assert got.shape == (rows, q_len, heads, dim)
    for r in range(rows):
        for h in range(heads):
            for i in range(q_len):
                seen = int(q_pos[r % mask_rows, i]) + 1
                w = torch.softmax(k[r, h // 3, :seen] @ q[r, h, i] * scale, dim=0)
                assert torch.allclose(got[r, i, h], w @ v[r, h // 3, :seen], atol=1e-12)


def test_the_engine_attends_with_folded_heads_and_restores_the_target(monkeypatch):
    """Every target forward of both runners (prefills, steps, verifies) goes through the folded attention,
    the answers are those of HF's own SDPA (`EngineOptions.fold_gqa` off), and the target is left on "sdpa"
    afterwards."""
    from nemo_dflash.engine import static_cache

    calls = []
    real = static_cache.folded_gqa_sdpa
    monkeypatch.setattr(static_cache, "folded_gqa_sdpa", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    target = tiny_qwen3()
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=4), block_size=4)
    prompts = _prompts(3)
    runs = {}
    for fold in (True, False):
        kw = dict(max_new_tokens=12, rows=2, use_graphs=False, options=EngineOptions(fold_gqa=fold))
        runs[fold] = (batched_static_autoregressive_generate(target, prompts, **kw),
                      batched_static_speculative_generate(decoder, prompts, **kw))
        assert target.config._attn_implementation == "sdpa"
        if fold:
            q_lens = {shape[2] for shape in calls}
            assert 1 in q_lens and 4 in q_lens and max(q_lens) > 4  # plain steps, verifies, prefills
            calls.clear()
    assert not calls  # the fold off: HF's SDPA alone
    for a, b in zip(runs[True], runs[False]):
        assert [o.output_ids for o in a] == [o.output_ids for o in b]


@pytest.mark.parametrize("setting", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9), SamplingParams(1.0, top_k=20),
                                     SamplingParams(1.0, draft="greedy")], ids=["t1", "top_p", "top_k", "greedy_draft"])
def test_one_sampled_row_is_what_generate_gives_on_graphs(setting, monkeypatch):
    """At T > 0 `DFlashSpeculativeDecoder.generate(decode="graphs")` is this loop with one row (its steps run
    eagerly here): the same answer and steps from the same generator, a stop token included, for every kind
    of sampled step; proposals are kept, not only rejected."""
    from _spec_fixtures import trained_like_decoder

    from nemo_dflash.engine import spec_decode

    monkeypatch.setattr(spec_decode, "check_decode_mode", lambda decode, device: None)  # graphs mode on a CPU
    real = batched_static.batched_static_speculative_generate
    monkeypatch.setattr(spec_decode, "batched_static_speculative_generate",
                        lambda *a, **k: real(*a, **{**k, "use_graphs": False}))
    prompts = _prompts(4)
    decoder = trained_like_decoder(tiny_qwen3(), prompts)
    kept = 0
    for i, p in enumerate(prompts):
        want = real(decoder, [p], max_new_tokens=30, sampling=setting, stop_token_ids=[7], rows=1,
                    use_graphs=False, generator=torch.Generator().manual_seed(i))[0]
        kept += sum(a > 1 for a in want.acceptance_lengths)
        got = decoder.generate(torch.tensor([p]), max_new_tokens=30, sampling=setting, stop_token_ids=[7],
                               generator=torch.Generator().manual_seed(i), decode="graphs")
        assert got.output_ids == want.output_ids and got.acceptance_lengths == want.acceptance_lengths
    assert kept > 0  # proposals were kept, not only rejected


def test_each_prompt_entering_a_row_draws_with_its_own_key():
    """40 copies of one prompt through 2 rows at T=1: a row that kept its previous prompt's key would repeat
    that answer draw for draw; every answer here is its own."""
    target = tiny_qwen3()
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=4))
    prompt = _prompts(1)[0]
    for outs in (batched_static_speculative_generate(decoder, [prompt] * 40, max_new_tokens=8, sampling=SamplingParams(1.0),
                                                     rows=2, use_graphs=False, generator=torch.Generator().manual_seed(1)),
                 batched_static_autoregressive_generate(target, [prompt] * 40, max_new_tokens=8, sampling=SamplingParams(1.0),
                                                        rows=2, use_graphs=False,
                                                        generator=torch.Generator().manual_seed(1))):
        assert len({tuple(o.output_ids) for o in outs}) == 40


@pytest.mark.parametrize("kind", ["spec", "plain"])
def test_follow_ups_from_on_done_are_decoded_as_more_prompts(kind):
    """`on_done` sees each answer as it ends and may return a follow-up (a next turn built on that answer):
    it is decoded as one more prompt, entering the first free row, and its answer is the one-prompt
    decoder's for that prompt; outputs come back in request order. A follow-up the caches cannot hold is
    refused in one line naming `max_prompt_tokens`."""
    target = tiny_qwen3()
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=4))
    prompts = _prompts(4)
    seen: list[int] = []
    follow_ups: list[list[int]] = []

    def on_done(i, out):
        seen.append(i)
        if i < len(prompts):  # a second turn for every first one
            follow_ups.append(prompts[i] + out.output_ids + [7, 8])
            return follow_ups[-1]
        return None

    kw = dict(max_new_tokens=12, rows=2, use_graphs=False, on_done=on_done, max_prompt_tokens=60)
    if kind == "spec":
        got = batched_static_speculative_generate(decoder, prompts, **kw)
        one = lambda p: decoder.generate(torch.tensor([p]), max_new_tokens=12)  # noqa: E731
    else:
        got = batched_static_autoregressive_generate(target, prompts, **kw)
        one = lambda p: autoregressive_generate(target, torch.tensor([p]), max_new_tokens=12)  # noqa: E731
    assert sorted(seen) == list(range(8)) and len(got) == 8
    want = [one(p) for p in prompts + follow_ups]
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    assert [g.acceptance_lengths for g in got] == [w.acceptance_lengths for w in want]
    with pytest.raises(ValueError, match="max_prompt_tokens >= ") as e:
        batched_static_speculative_generate(decoder, prompts[:1], max_new_tokens=12, use_graphs=False,
                                            on_done=lambda i, out: [1] * 500 if i == 0 else None)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["spec", "plain"])
def test_fused_sampling_draws_what_the_unfused_step_draws(kind, monkeypatch, caplog):
    """The sampled steps' math compiled (what a GPU runs, `EngineOptions.fuse_sampling`; inductor on the CPU
    here) draws the same tokens as the same functions run op by op, with and without top-p / top-k, and
    keeps every row's own key: 12 prompts through 5 rows at T=1, block 4."""
    import torch._dynamo.utils as dutils

    from nemo_dflash.engine import static_decode

    target = tiny_qwen3()
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=4))
    prompts = _prompts(12)

    def run(setting: SamplingParams) -> list[tuple[list[int], list[int]]]:
        batched_static.drop_runners(decoder)
        batched_static.drop_runners(target)
        gen = torch.Generator().manual_seed(5)
        if kind == "spec":
            outs = batched_static_speculative_generate(decoder, prompts, max_new_tokens=12, sampling=setting,
                                                       rows=5, use_graphs=False, generator=gen)
        else:
            outs = batched_static_autoregressive_generate(target, prompts, max_new_tokens=12, sampling=setting,
                                                          rows=5, use_graphs=False, generator=gen)
        return [(o.output_ids, o.acceptance_lengths) for o in outs]

    settings = [SamplingParams(1.0), SamplingParams(0.8, top_p=0.9, top_k=20)]
    unfused = [run(s) for s in settings]
    init = static_decode.SampledStepState.__init__
    monkeypatch.setattr(static_decode.SampledStepState, "__init__",
                        lambda self, rows, device, fused=None, **kw: init(self, rows, device, fused=True, **kw))
    graphs = dutils.counters["stats"]["unique_graphs"]
    with caplog.at_level("WARNING"):
        fused = [run(s) for s in settings]
    assert dutils.counters["stats"]["unique_graphs"] > graphs  # the compiled functions ran
    assert "did not compile" not in caplog.text
    assert fused == unfused
    assert len({tuple(o) for o, _ in fused[0]}) == len(prompts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_fused_sampling_keeps_the_joint_distribution():
    """On a GPU, captured steps with the sampling math compiled (`EngineOptions.fuse_sampling`): the exact
    three-token law of the target, 6,000 prompts through 500 rows (entering rows included)."""
    from _spec_fixtures import three_token_law

    target, draft, ids, _ = second_token_case()
    joint = three_token_law(target, ids)
    dev = torch.device("cuda")
    decoder = DFlashSpeculativeDecoder(target.to(dev), draft.to(dev))
    n = 6000
    outs = batched_static_speculative_generate(decoder, [ids[0].tolist()] * n, max_new_tokens=3, sampling=SamplingParams(1.0),
                                               rows=500, use_graphs=True,
                                               generator=torch.Generator(device=dev).manual_seed(3))
    runners = list(batched_static._RUNNERS[decoder].values())
    assert runners and all(r.state.fused for r in runners)  # compiled, and no fallback to the op-by-op math
    _assert_three_token_law(outs, joint, n)
