"""The serving-parity check on DFlash2 drafts: the reference's convolution and selector walk (written from the
rules, tests/test_serving_parity.py's reference extended) against our draft module and decoder, a hand-computed
walk, and served weights that differ from what our draft runs caught."""

from __future__ import annotations

import pytest
import torch

from _spec_fixtures import train_on_greedy_answer
from _tiny_models import make_draft, tiny_qwen3
from test_dflash2 import dflash2_like

from nemo_dflash.draft.model.dflash2 import CandidateSelector, selector_walk
from nemo_dflash.evaluation.parity import (
    ServingParityError, check_serving_parity, reference_acceptance, reference_draft_hidden, reference_unary,
    reference_walk, serving_weights,
)
from nemo_dflash.serving.export import serving_config_dict

PROMPTS = [[3, 17, 42, 9, 100], [5, 6, 7], [200, 1, 2, 3, 4, 5, 6, 7, 8]]


@pytest.fixture(scope="module")
def trained():
    """(target, a DFlash2 draft): random conv and selector (not the identity init), output_multiplier 0.5, trained a
    little on a greedy answer so some blocks are accepted; soft-capping 20 set afterwards (training has none)."""
    target = tiny_qwen3()
    draft = dflash2_like(make_draft(target, num_layers=2, block_size=4), rank=8, top_k=4, output_multiplier=0.5)
    train_on_greedy_answer(target, draft, torch.tensor([PROMPTS[0]]), steps=60)
    draft.config.dflash_config["final_logit_softcapping"] = 20.0
    assert draft.config.final_logit_softcapping == 20.0
    for layer in draft.layers:  # the convolutions are not the identity
        assert layer.attention_conv.base_kernel[:, 1:].abs().min() > 0 and layer.mlp_conv.kernel_projection.weight.any()
    return target, draft


def test_rebuilt_dflash2_draft_equals_our_module(trained):
    """The reference's convolutions (two a layer, per-token kernels, causal over the block) give our module's states."""
    target, draft = trained
    g = torch.Generator().manual_seed(0)
    emb, ctx = torch.randn(4, 64, generator=g), torch.randn(6, 128, generator=g)
    w = {k: v.float() for k, v in draft.state_dict().items()}
    ref = reference_draft_hidden(w, serving_config_dict(draft.config), emb, ctx, torch.arange(10))
    with torch.no_grad():
        ours = draft(noise_embedding=emb[None], target_hidden=ctx[None], position_ids=torch.arange(10)[None])[0]
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    cfg = serving_config_dict(draft.config)
    cfg["dflash_config"] = {**cfg["dflash_config"], "conv_kernel_size": 0}
    assert not torch.allclose(reference_draft_hidden(w, cfg, emb, ctx, torch.arange(10)), ref, atol=1e-2)


def test_dflash2_draft_passes_the_check(trained):
    """Drafted tokens (the walk's) agree, and our decoder's output and per-step acceptance equal the reference's;
    the reference's DFlash-1 reading of the same export (no conv, or each slot's argmax) would not agree."""
    target, draft = trained
    cfg = serving_config_dict(draft.config)
    rep = check_serving_parity(target, draft, PROMPTS, cfg=cfg, max_new_tokens=16, min_agreement=1.0)
    assert rep.steps > 0 and rep.proposal_agreement == 1.0 and rep.ours_tau == rep.reference_tau > 1.0
    weights = serving_weights(draft)
    for field in ("conv_kernel_size", "selector_rank"):  # the rules without the conv / without the walk
        dflash1 = {**cfg, "dflash_config": {**cfg["dflash_config"], field: 0}}
        agree = total = 0
        for prompt in PROMPTS:
            ref = reference_acceptance(target, weights, dflash1, prompt, _greedy(target, prompt, 16 + 4), 16, 4,
                                       our_draft=draft)
            agree, total = agree + ref.proposals_agree, total + ref.proposals
        assert agree < 0.9 * total, (field, agree, total)


def _greedy(target, prompt, n):
    out = target.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def _swap_codebooks(w):
    a, b = "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"
    w[a], w[b] = w[b], w[a]


def _zero_kernel_projection(w):
    w["layers.0.attention_conv.kernel_projection.weight"] = torch.zeros_like(
        w["layers.0.attention_conv.kernel_projection.weight"])


@pytest.mark.parametrize("edit", [_swap_codebooks, _zero_kernel_projection])
def test_served_weights_unlike_the_drafts_fail(trained, edit):
    """Served weights an engine would read differently from what our draft runs: the check refuses."""
    target, draft = trained
    weights = serving_weights(draft)
    edit(weights)
    with pytest.raises(ServingParityError, match="drafted tokens agree"):
        check_serving_parity(target, draft, PROMPTS[:2], cfg=serving_config_dict(draft.config), weights=weights,
                             max_new_tokens=12)


def test_served_weights_without_the_selector_fail(trained):
    target, draft = trained
    weights = {k: v for k, v in serving_weights(draft).items() if not k.startswith("candidate_selector.")}
    with pytest.raises(ServingParityError, match=r"served weights lack 3 of the draft's \(candidate_selector"):
        check_serving_parity(target, draft, PROMPTS[:1], cfg=serving_config_dict(draft.config), weights=weights)


# ----------------------------------------------------------------------------- the walk by hand

# V = 5 tokens, hidden = rank = 2, P = I (so P h = h), K = 2 candidates, 3 slots.
HAND_UNARY = torch.tensor([[0.0, 2.0, 1.5, 0.0, 0.0],   # C_0 = [1, 2]
                           [0.0, 0.0, 0.0, 1.0, 3.0],   # C_1 = [4, 3]
                           [1.0, 0.0, 0.0, 0.0, 1.5]])  # C_2 = [4, 0]
HAND_HIDDEN = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, -1.0]])
HAND_WEIGHTS = {
    "candidate_selector.hidden_projection.weight": torch.eye(2),
    "candidate_selector.predecessor_codebook": torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [1.0, 1.0],
                                                             [0.0, 0.0]]),
    "candidate_selector.successor_codebook": torch.tensor([[0.5, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.5],
                                                           [0.0, 0.0]]),
}
# anchor 0: slot 0 ctx = A[0] * h_0 = [1, 0]; s(1) = 2 + 0 = 2, s(2) = 1.5 + <[1, 0], [1, 0]> = 2.5 -> 2 (not u's
#   argmax 1). slot 1 ctx = A[2] * h_1 = [0, 2]; s(4) = 3 + 0 = 3, s(3) = 1 + <[0, 2], [0, 1.5]> = 4 -> 3.
#   slot 2 ctx = A[3] * h_2 = [1, -1]; s(4) = 1.5 + 0, s(0) = 1 + <[1, -1], [0.5, 0]> = 1.5: a tie -> the first
#   candidate, 4 (the last of the maxima would be 0).
# anchor 1: A[1] = 0, so slot 0 takes u's argmax 1; slot 1 ctx = A[1] * h_1 = 0 -> 4 (given 1, not 2: each slot is
#   chosen given the token chosen before it); slot 2 ctx = A[4] * h_2 = 0 -> u's argmax 4.
HAND_PATHS = {0: [2, 3, 4], 1: [1, 4, 4]}


@pytest.mark.parametrize("anchor", sorted(HAND_PATHS))
def test_reference_walk_by_hand(anchor):
    assert reference_walk(HAND_WEIGHTS, 2, HAND_HIDDEN, HAND_UNARY, anchor) == HAND_PATHS[anchor]
    selector = CandidateSelector(hidden_size=2, vocab_size=5, rank=2, top_k=2)  # and our walk, on the same case
    selector.load_state_dict({k.removeprefix("candidate_selector."): v for k, v in HAND_WEIGHTS.items()})
    with torch.no_grad():
        tokens, _ = selector_walk(selector, HAND_HIDDEN[None], HAND_UNARY[None], torch.tensor([anchor]))
    assert tokens[0].tolist() == HAND_PATHS[anchor]


def test_reference_unary_applies_multiplier_then_cap_once():
    cfg = {"dflash_config": {"output_multiplier": 0.5, "final_logit_softcapping": 2.0}}
    x = torch.tensor([-8.0, 0.0, 1.0, 8.0])
    torch.testing.assert_close(reference_unary(cfg, x), 2.0 * torch.tanh(x * 0.5 / 2.0))
    torch.testing.assert_close(reference_unary({"dflash_config": {}}, x), x)  # DFlash-1: the plain logits


def test_a_unary_transform_applied_twice_fails(trained, monkeypatch):
    """Our walk fed logits transformed again (output_multiplier twice, the bug `slot_logits` fixed): caught."""
    from nemo_dflash.draft.model import DFlash2DraftModel

    target, draft = trained
    real = DFlash2DraftModel.propose_block

    def twice(self, hidden, unary, anchors, *a, **k):
        return real(self, hidden, self.unary_logits(unary), anchors, *a, **k)

    monkeypatch.setattr(DFlash2DraftModel, "propose_block", twice)
    with pytest.raises(ServingParityError, match="drafted tokens agree"):
        check_serving_parity(target, draft, PROMPTS, cfg=serving_config_dict(draft.config), max_new_tokens=16)
