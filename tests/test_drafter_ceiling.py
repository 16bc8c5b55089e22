"""evaluation.ceiling (what `benchmarks/drafter.py ceiling --draft` reports): the real draft's block distributions
and its simulated acceptance at one anchor, against the spec decoder's own draft step and an exact enumeration of every drafted block (tiny models)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from _spec_fixtures import make_draft, single_thread, tiny_qwen3  # noqa: F401  (single_thread: autouse)
from nemo_dflash.draft.model import DFlashContextCache
from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder
from nemo_dflash.engine.sampling import GREEDY, SamplingParams
from nemo_dflash.evaluation import ceiling
from nemo_dflash.target import HFDFlashTargetModel

SEQ = [1, 5, 2, 3, 6, 0, 4, 2, 1, 6, 3]  # vocab 8, the mask token (7) left out
BLOCK, K = 4, 3


@pytest.fixture(scope="module")
def models():
    target = tiny_qwen3(num_layers=2, vocab=8, hidden=32, seed=3)
    draft = make_draft(target, block_size=BLOCK, layer_ids=[0, 1], seed=5)
    with torch.no_grad():
        target.model.norm.weight.mul_(4)  # a peaked p (random weights give a flat one)
    return target, draft


def reference_draft_logits(target, draft, a: int) -> torch.Tensor:
    """[K, V]: the spec decoder's own draft step at anchor position `a`, from a fresh draft cache fed the features
    of the prefix before `a` (a forward of the prefix alone)."""
    seq = torch.tensor([SEQ])
    feats, _ = HFDFlashTargetModel(target, draft.target_layer_ids).forward_features(seq[:, :a])
    return DFlashSpeculativeDecoder(target, draft).draft_logits(seq[0, a:a + 1], a, feats,
                                                                DFlashContextCache(len(draft.layers)), BLOCK).float()


def exact_figures(target, a: int, qd: torch.Tensor, s: SamplingParams, late: int = 0) -> dict:
    """Every block x in V^K: weight prod_k qd_k(x_k), accept probs min(1, p_k/qd_k) from full forwards (no cache);
    `late` 1: p read one position early (a misaligned verification, which the test must tell apart)."""
    v = qd.shape[-1]
    xs = torch.tensor(list(itertools.product(range(v), repeat=K)))  # [V^K, K]
    ctx = torch.tensor(SEQ[: a + 1]).expand(len(xs), -1)
    p = s.probs(target(torch.cat([ctx, xs[:, :-1]], 1)).logits[:, a - late: a - late + K].float())  # [N, K, V]
    qx = qd.gather(-1, xs.T).T  # [N, K]
    w = qx.prod(-1)
    ratio = torch.where(qx > 0, p.gather(-1, xs.unsqueeze(-1)).squeeze(-1) / qx.clamp(min=1e-30), 0.0).clamp(max=1.0)
    xa = qd.argmax(-1)
    row = int((xs == xa).all(-1).nonzero()[0, 0])  # the argmax block's row
    pa = p[row].gather(-1, xa.unsqueeze(-1)).squeeze(-1)
    p1 = p[0, 0]
    return {"draft_sampled": float((w * (1 + ratio.cumprod(-1).sum(-1))).sum()),
            "draft_argmax": float(1 + pa.cumprod(-1).sum()),
            "slot1_overlap": float(torch.minimum(p1, qd[0]).sum()),
            "draft_slot_accept": (w.unsqueeze(-1) * ratio).sum(0)}


def test_draft_block_logits_match_the_decoder_step(models):
    """One draft forward over three anchors gives, at each, the block the spec decoder's own draft step drafts."""
    target, draft = models
    anchors, seq = [3, 6, 7], torch.tensor([SEQ])
    hooks = HFDFlashTargetModel(target, draft.target_layer_ids)
    with torch.no_grad():
        feats, _ = hooks.forward_features(seq, need_logits=True)
        got = ceiling.draft_block_logits(hooks, draft, seq, feats, anchors, BLOCK)
        refs = [reference_draft_logits(target, draft, a) for a in anchors]
    assert got.shape == (len(anchors), K, 8)
    for g, r in zip(got, refs):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_draft_simulation_matches_an_exact_enumeration(models, temperature, top_p):
    """draft_sampled / draft_argmax / slot1_overlap / draft_slot_accept at one anchor against every block enumerated.
    q^d: the draft's block there, sharpened by noise (a random draft's is nearly flat, which would hide a
    misaligned verification); the ceilings do not move with the draft's figures (own generator)."""
    target, draft = models
    s, a, seq = SamplingParams(temperature, top_p), 6, torch.tensor([SEQ])
    with torch.no_grad():
        dl = reference_draft_logits(target, draft, a) + 2 * torch.randn(K, 8, generator=torch.Generator().manual_seed(0))

        def figures(draft_logits):
            cache = target(input_ids=seq[:, :a], use_cache=True).past_key_values
            return ceiling.anchor_figures(target, cache, SEQ[a], a, K, s, rollouts=64, sims=40000,
                                          g=torch.Generator().manual_seed(0), draft_logits=draft_logits,
                                          g_draft=torch.Generator().manual_seed(1))

        fig, alone = figures(dl), figures(None)
        want = exact_figures(target, a, s.probs(dl), s)
        wrong = exact_figures(target, a, s.probs(dl), s, late=1)
    for key in ("greedy", "marginal", "marginal_argmax", "marginal_slot_accept"):
        assert fig[key] == alone[key], key
    assert fig["draft_argmax"] == pytest.approx(want["draft_argmax"], abs=1e-5)
    assert fig["slot1_overlap"] == pytest.approx(want["slot1_overlap"], abs=1e-5)
    assert fig["marginal_overlap"][0] == pytest.approx(fig["slot1_overlap"], abs=1e-5)  # slot 1's marginal is p_1
    # sampled figures: Monte Carlo over 40000 drafted blocks (standard error < 0.01)
    assert abs(want["draft_sampled"] - wrong["draft_sampled"]) > 0.2  # the check below can tell them apart
    assert fig["draft_sampled"] == pytest.approx(want["draft_sampled"], abs=0.03)
    torch.testing.assert_close(torch.tensor(fig["draft_slot_accept"]), want["draft_slot_accept"], atol=0.015, rtol=0)
    assert len(fig["marginal_overlap"]) == len(fig["draft_argmax_slot_accept"]) == K


def test_accept_records_what_the_decoder_kept_and_what_its_accept_test_expected(models):
    """`drafter.py accept`: over many steps of the reference decoder at T=1 the kept tokens a step match the
    expectation of its accept test given the drafts (a statistical check that fails for a decoder accepting
    more or less than min(1, p/q)); the steps' kept tokens add up to the tokens generated; slot 1's overlap is a
    probability."""
    target, draft = models
    prompts = [[1, 5, 2], [3, 6, 0, 4], [2, 1], [6, 3, 5, 1, 0]] * 6
    res = ceiling.decoder_acceptance(target, draft, prompts, SamplingParams(1.0), max_new_tokens=40)
    assert res["steps"] > 200
    assert abs(res["kept_per_step"] - res["expected_per_step"]) < 4 * res["kept_per_step_stderr"] + 0.02
    assert 0.0 < res["slot1_overlap"] <= 1.0 and 0.0 <= res["slot1_accept_rate"] <= 1.0

    import nemo_dflash.engine.spec_decode as spec_decode

    original = spec_decode.verify_block
    spec_decode.verify_block = functools.partial(_keep_all, original)
    try:
        broken = ceiling.decoder_acceptance(target, draft, prompts[:8], SamplingParams(1.0), max_new_tokens=40)
    finally:
        spec_decode.verify_block = original
    assert broken["kept_per_step"] - broken["expected_per_step"] > 4 * broken["kept_per_step_stderr"]


def _keep_all(original, draft_tokens, target_logits, sampling=GREEDY, draft_probs=None, generator=None):
    """A broken accept test: keeps the whole block whatever p says (the next token as the real one picks it)."""
    _, nxt = original(draft_tokens, target_logits, sampling, draft_probs, generator)
    return draft_tokens.shape[0], nxt
