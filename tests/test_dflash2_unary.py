"""DFlash2's unary logits, u = softcap(output_multiplier * lm_head(h)), enter every decoder exactly once.

Reference: the selector's walk written out by hand from the lm_head's raw logits with the transform applied once
(``C * tanh(M * x / C)``), on the drafts' contexts as training and replay form them (`draft_block_hidden`), for a
draft with a multiplier and a soft-cap. Checked: the eager decoder's and the engine's rows' proposals at T=0
(tokens) and at T > 0 (the q they report for the accept test, given the tokens they drew), replay's drafted tokens,
and the ceiling benchmark's draft logits. Applied twice (as decoders once did), 38 of 80 blocks at T=0 propose
other tokens and every q differs.
"""

from __future__ import annotations

import pytest
import torch

from _spec_fixtures import second_token_case, single_thread  # noqa: F401  (fixture)
from test_dflash2 import dflash2_like

from nemo_dflash import HFDFlashTargetModel
from nemo_dflash.engine.sampling import GREEDY, SamplingParams
from nemo_dflash.objective.trainer_module import draft_block_hidden

MULTIPLIER, SOFTCAP = 0.5, 5.0
PROMPTS = [[1, 5, 2, 3], [3, 1, 4, 1, 5, 2], [7, 6], [2, 5, 5]]
BLOCK, MASK = 4, 7  # second_token_case's draft: block 4, the last row of its 8-token vocabulary the mask


@pytest.fixture(scope="module")
def case():
    target, draft, _, _ = second_token_case()
    d2 = dflash2_like(draft, rank=4, top_k=4, group=8, output_multiplier=MULTIPLIER,
                      final_logit_softcapping=SOFTCAP)
    assert d2.config.output_multiplier == MULTIPLIER and d2.config.final_logit_softcapping == SOFTCAP
    return target, d2


def once(logits: torch.Tensor) -> torch.Tensor:
    return SOFTCAP * torch.tanh(MULTIPLIER * logits.float() / SOFTCAP)


def reference_blocks(target, d2, seq: list[int], anchors: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [A, B-1, H], once-transformed unary logits [A, B-1, V]) of the blocks at `anchors` of `seq`."""
    wrapper = HFDFlashTargetModel(target, d2.config.target_layer_ids)
    ids = torch.tensor([seq])
    a = torch.tensor([anchors])
    with torch.no_grad():
        feats, _ = wrapper.forward_features(ids)
        hidden = draft_block_hidden(d2, wrapper.get_input_embeddings(), ids, feats, torch.ones_like(ids), a,
                                    torch.ones_like(a, dtype=torch.bool), BLOCK, MASK, backend="sdpa")
        hidden = hidden.view(len(anchors), BLOCK, -1)[:, 1:]
        return hidden, once(wrapper.get_output_embeddings()(hidden))


def hand_scores(sel, h: torch.Tensor, u: torch.Tensor, prev: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(candidates, their pair scores u(b) + <A[prev] * (P h), B[b]>) of one slot, written out."""
    cand = u.topk(sel.top_k).indices
    ph = sel.hidden_projection.weight @ h
    return cand, torch.stack([u[c] + (sel.predecessor_codebook[prev] * ph * sel.successor_codebook[c]).sum()
                              for c in cand])


def hand_greedy(sel, hidden: torch.Tensor, unary: torch.Tensor, anchor: int) -> list[int]:
    out, prev = [], anchor
    for k in range(hidden.shape[0]):
        cand, s = hand_scores(sel, hidden[k], unary[k], prev)
        prev = int(cand[s.argmax()])
        out.append(prev)
    return out


def hand_q(sel, hidden: torch.Tensor, unary: torch.Tensor, anchor: int, tokens: list[int], t: float) -> torch.Tensor:
    """The q [B-1, V] of each slot given the token drawn before it (the anchor for slot 1), 0 off the candidates."""
    rows, prev = [], anchor
    for k in range(hidden.shape[0]):
        cand, s = hand_scores(sel, hidden[k], unary[k], prev)
        rows.append(torch.zeros(unary.shape[-1]).index_put_((cand,), torch.softmax(s / t, -1)))
        prev = tokens[k]
    return torch.stack(rows)


def eager_records(monkeypatch, dec, sampling: SamplingParams) -> list[tuple[list[int], list]]:
    """(prompt + answer, [(anchor position, tokens, q)] of every block the eager decoder proposed) per prompt."""
    from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder

    real, seen = DFlashSpeculativeDecoder.walk_proposals, []

    def recording(self, last_token, position, *args, **kwargs):
        tokens, q = real(self, last_token, position, *args, **kwargs)
        seen.append((int(position), tokens.tolist(), q))
        return tokens, q

    monkeypatch.setattr(DFlashSpeculativeDecoder, "walk_proposals", recording)
    out, g = [], torch.Generator().manual_seed(1)
    for p in PROMPTS:
        seen.clear()
        ans = dec.generate(torch.tensor([p]), max_new_tokens=16, sampling=sampling, generator=g)
        out.append((p + ans.output_ids, list(seen)))
    return out


def engine_records(monkeypatch, dec, sampling: SamplingParams) -> list[tuple[list[int], list]]:
    """The same for the engine's rows (one prompt at a time, one row): every block its draft steps proposed."""
    from nemo_dflash.engine.batched_static import BatchedStaticSpecRunner, batched_static_speculative_generate

    real, seen = BatchedStaticSpecRunner._propose, []

    def recording(self, logits, rows=slice(None), hidden=None):
        real(self, logits, rows, hidden)
        q = self.q[rows].clone() if self.sampled else None
        for j, (pos, blk) in enumerate(zip(self.pos[rows].tolist(), self.blk[rows].tolist())):
            seen.append((pos, blk[1:], None if q is None else q[j]))

    monkeypatch.setattr(BatchedStaticSpecRunner, "_propose", recording)
    out = []
    for i, p in enumerate(PROMPTS):
        seen.clear()
        ans = batched_static_speculative_generate(dec, [p], max_new_tokens=16, sampling=sampling, rows=1,
                                                  use_graphs=False, generator=torch.Generator().manual_seed(i))[0]
        out.append((p + ans.output_ids, list(seen)))
    return out


RECORDERS = {"eager": eager_records, "engine": engine_records}


@pytest.mark.parametrize("decoder", ["eager", "engine"])
def test_t0_proposals_are_the_walk_over_once_transformed_logits(case, decoder, monkeypatch):
    from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder

    target, d2 = case
    dec = DFlashSpeculativeDecoder(target, d2)
    blocks = 0
    for seq, seen in RECORDERS[decoder](monkeypatch, dec, GREEDY):
        assert seen
        hidden, unary = reference_blocks(target, d2, seq, [pos for pos, _, _ in seen])
        for i, (pos, tokens, _) in enumerate(seen):
            assert tokens == hand_greedy(d2.candidate_selector, hidden[i], unary[i], seq[pos]), (decoder, pos)
            blocks += 1
    assert blocks >= 8


@pytest.mark.parametrize("decoder", ["eager", "engine"])
def test_sampled_q_is_the_softmax_of_once_transformed_pair_scores(case, decoder, monkeypatch):
    from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder

    target, d2 = case
    dec = DFlashSpeculativeDecoder(target, d2)
    t, blocks = 0.7, 0
    for seq, seen in RECORDERS[decoder](monkeypatch, dec, SamplingParams(t)):
        hidden, unary = reference_blocks(target, d2, seq, [pos for pos, _, _ in seen])
        for i, (pos, tokens, q) in enumerate(seen):
            want = hand_q(d2.candidate_selector, hidden[i], unary[i], seq[pos], tokens, t)
            torch.testing.assert_close(q, want, atol=1e-5, rtol=1e-4, msg=f"{decoder} block at {pos}")
            assert all(float(q[k, tok]) > 0 for k, tok in enumerate(tokens))
            blocks += 1
    assert blocks >= 8


def test_replay_and_the_ceiling_see_once_transformed_logits(case):
    """Replay's drafted tokens from every anchor, and `ceiling.draft_block_logits` (the draft's figures), against
    the hand walk and the once-transformed logits."""
    from nemo_dflash.evaluation.ceiling import draft_block_logits
    from nemo_dflash.evaluation.replay import GreedyTurn, ReplayEvaluator

    target, d2 = case
    seq = PROMPTS[1] + [4, 2, 6, 1, 0, 3, 5, 2, 2, 6]
    prompt = PROMPTS[1]
    anchors = list(range(len(prompt), len(seq) - 1))  # replay's: every answer token but the last
    hidden, unary = reference_blocks(target, d2, seq, anchors)
    replay = ReplayEvaluator.__new__(ReplayEvaluator)  # draft_tokens reads only these
    replay.draft, replay.block_size, replay.anchor_tokens = d2, BLOCK, 8
    replay.target, replay.device = HFDFlashTargetModel(target, d2.config.target_layer_ids), torch.device("cpu")
    got = replay.draft_tokens(GreedyTurn(prompt, seq[len(prompt):], False, []))
    assert got == [hand_greedy(d2.candidate_selector, hidden[i], unary[i], seq[a]) for i, a in enumerate(anchors)]
    wrapper = HFDFlashTargetModel(target, d2.config.target_layer_ids)
    ids = torch.tensor([seq])
    with torch.no_grad():
        feats, _ = wrapper.forward_features(ids)
        logits = draft_block_logits(wrapper, d2, ids, feats, anchors, BLOCK)
    torch.testing.assert_close(logits, unary, atol=1e-5, rtol=1e-5)
