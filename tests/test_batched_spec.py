"""Batched speculative decoding against the one-prompt decoder (T=0, answer for answer) and
against the target's own distribution (T=1)."""

from __future__ import annotations

import pytest
import torch

from _spec_fixtures import make_draft, plain_answers_with_a_stop, random_prompts, second_token_case, single_thread, tiny_llama, tiny_qwen3  # noqa: F401
from nemo_dflash.draft.model import DFlashContextCache
from nemo_dflash.inference import batched_spec
from nemo_dflash.inference.batched_spec import _compact, batched_autoregressive_generate, batched_speculative_generate
from nemo_dflash.inference.spec_decode import DFlashSpeculativeDecoder


def _prompts(n: int) -> list[list[int]]:
    return random_prompts(n, seed=7, max_len=17)


@pytest.mark.parametrize("make_target", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
@pytest.mark.parametrize("block", [1, 4, 8])
def test_t0_equals_the_one_prompt_decoder_answer_for_answer(make_target, block, monkeypatch):
    """fp32: the same tokens and the same acceptance length at every step, for prompts of different
    lengths, a stop token that ends some answers early, and the cap; with the caches compacted
    often (the threshold lowered) and never."""
    target = make_target()
    draft = make_draft(target, block_size=8)
    decoder = DFlashSpeculativeDecoder(target, draft, block_size=block)
    prompts = _prompts(6)
    free = [decoder.generate(torch.tensor([p]), max_new_tokens=30) for p in prompts]
    stop = free[0].output_ids[5]  # ends the first answer (and maybe others) early
    want = [decoder.generate(torch.tensor([p]), max_new_tokens=30, stop_token_ids=[stop]) for p in prompts]
    assert any(w.stopped for w in want) and any(not w.stopped for w in want)
    compactions = []
    real = batched_spec._compact
    monkeypatch.setattr(batched_spec, "_compact", lambda *a: compactions.append(1) or real(*a))
    for share in (batched_spec.COMPACT_DEAD_SHARE, 0.0, 1.0):
        monkeypatch.setattr(batched_spec, "COMPACT_DEAD_SHARE", share)
        compactions.clear()
        got = batched_speculative_generate(decoder, prompts, max_new_tokens=30, stop_token_ids=[stop])
        if share in (0.0, 1.0):  # 0.0: compacted whenever a slot is dead; 1.0: never
            assert bool(compactions) == (share == 0.0)
        for w, g in zip(want, got):
            assert g.output_ids == w.output_ids
            assert g.acceptance_lengths == w.acceptance_lengths
            assert g.stopped == w.stopped


def test_a_trained_like_draft_accepts_the_same_blocks_in_batch():
    """A draft that agrees with the target often (its own greedy answer trained in) exercises long
    accepted prefixes, where rows drift furthest apart."""
    from _spec_fixtures import trained_like_decoder

    prompts = _prompts(4)
    decoder = trained_like_decoder(tiny_qwen3(), prompts)
    want = [decoder.generate(torch.tensor([p]), max_new_tokens=40) for p in prompts]
    got = batched_speculative_generate(decoder, prompts, max_new_tokens=40)
    assert max(max(w.acceptance_lengths) for w in want) > 2
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    assert [g.acceptance_lengths for g in got] == [w.acceptance_lengths for w in want]


def test_t1_keeps_the_target_distribution():
    """The second token (the first one the draft proposes) of 8,000 rows of one prompt, against
    its exact marginal (tolerance ~5 standard errors). The marginal of the draft's unverified
    proposals is more than twice the tolerance away from it, so a decoder that skipped the
    verification would fail."""
    target, draft, ids, p2 = second_token_case()
    decoder = DFlashSpeculativeDecoder(target, draft)
    n, tol = 8000, 0.02
    outs = batched_speculative_generate(decoder, [ids[0].tolist()] * n, max_new_tokens=2, temperature=1.0,
                                        generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(torch.tensor([o.output_ids[1] for o in outs]), minlength=8).float()
    assert (counts / n - p2).abs().max() < tol
    with torch.no_grad():  # the draft's proposal for slot 1 after each first token, averaged over p(first)
        p1 = torch.softmax(target(ids).logits[0, -1], -1)
        feats = decoder.target.forward_features(ids)[0]
        q = torch.stack([decoder.draft_logits(torch.tensor([t]), ids.shape[1], feats,
                                              DFlashContextCache(len(draft.layers)), 4)[0].softmax(-1)
                         for t in range(8)])
    assert ((p1.unsqueeze(1) * q).sum(0) - p2).abs().max() > 2 * tol


def test_compact_keeps_each_rows_live_entries_in_order():
    valid = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    t = torch.arange(3 * 2 * 5 * 1, dtype=torch.float).view(3, 2, 5, 1)
    new_valid, (c,) = _compact(valid, [t])
    assert new_valid.tolist() == [[True, True, True, False, False], [True, False, False, False, False], [True] * 5]
    for b in range(3):
        live = t[b, :, valid[b]]
        assert torch.equal(c[b, :, : live.shape[1]], live)


def test_refuses_empty_input():
    target = tiny_qwen3()
    decoder = DFlashSpeculativeDecoder(target, make_draft(target))
    with pytest.raises(ValueError, match="at least one prompt"):
        batched_speculative_generate(decoder, [[1, 2], []])
    with pytest.raises(ValueError, match="max_new_tokens"):
        batched_speculative_generate(decoder, [[1, 2]], max_new_tokens=0)



@pytest.mark.parametrize("make_target", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
@pytest.mark.parametrize("share", [0.0, 1.0], ids=["compacted", "never-compacted"])
def test_batched_plain_decoding_equals_one_prompt_decoding(make_target, share, monkeypatch):
    """The speedup baseline at concurrency B: each row's tokens are the one-prompt greedy answer,
    stop tokens and the cap included, with the cache compacted whenever a slot is dead or never."""
    monkeypatch.setattr(batched_spec, "COMPACT_DEAD_SHARE", share)
    target = make_target()
    prompts = _prompts(5)
    want, stop = plain_answers_with_a_stop(target, prompts, 25, row=1, k=4)
    got = batched_autoregressive_generate(target, prompts, max_new_tokens=25, stop_token_ids=[stop])
    assert any(w.stopped for w in want) and any(not w.stopped for w in want)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    assert [g.stopped for g in got] == [w.stopped for w in want]


def test_verify_blocks_matches_verify_block_in_distribution():
    """The batched rule against the one-row rule on a hand-made case (vocabulary 4, two drafted
    slots, draft and target disagreeing): the joint frequencies of (accepted, next token) over
    20,000 rows each agree within 0.015; at T=0 the two agree exactly."""
    from nemo_dflash.sampling import verify_block, verify_blocks

    # slot 1 is accepted with probability 0.3/0.6, slot 2 with 0.25/0.7: 0, 1 and 2 accepted all occur
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]]).log()
    q = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.1, 0.1, 0.7, 0.1]])
    drafts = torch.tensor([1, 2])
    n = 20000
    g = torch.Generator().manual_seed(1)
    n_acc, nxt = verify_blocks(drafts.expand(n, -1), logits.expand(n, -1, -1), 1.0, q.expand(n, -1, -1), g)
    batched = torch.bincount(n_acc * 4 + nxt, minlength=12).float() / n
    one = torch.zeros(12)
    for _ in range(n):
        a, t = verify_block(drafts, logits, 1.0, q, g)
        one[a * 4 + t] += 1
    assert (batched - one / n).abs().max() < 0.015
    assert batched[:4].sum() == pytest.approx(0.5, abs=0.02) and batched[8:].sum() == pytest.approx(0.5 * 0.25 / 0.7, abs=0.02)
    n_acc, nxt = verify_blocks(drafts.view(1, -1), logits.view(1, 3, 4), 0.0, None)
    assert (int(n_acc), int(nxt)) == verify_block(drafts, logits, 0.0)
