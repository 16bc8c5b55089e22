"""DFlash2: the block convolution and candidate selector against brute-force references, its training terms, the
walk in every decoder (T=0 exactness, the output law at T=1, a misreported q caught), export and bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from _spec_fixtures import second_token_case, single_thread, three_token_law  # noqa: F401  (fixture)
from _tiny_models import MASK_ID, random_batch, train_draft, train_qwen3

from nemo_dflash.engine.sampling import SamplingParams
from nemo_dflash import HFDFlashTargetModel
from nemo_dflash.objective.anchors import sample_anchors
from nemo_dflash.objective.metrics import LossSums
from nemo_dflash.objective.trainer_module import DFlashTrainerModule
from nemo_dflash.draft.build import DraftError, build_draft_for_target, check_variant_fits
from nemo_dflash.draft.model import DFlash2Config, DFlash2DraftModel
from nemo_dflash.draft.model.dflash2 import BlockConv, CandidateSelector, compose_maps, selector_walk
from nemo_dflash.objective.selector_loss import dpace_weights


def dflash2_like(draft, *, rank: int = 8, top_k: int = 4, conv: int = 2, group: int = 16, seed: int = 5,
                 random_modules: bool = True, **fields) -> DFlash2DraftModel:
    """A DFlash2 draft with `draft`'s backbone weights; its conv and selector random (or as initialised).
    `fields`: further `dflash_config` entries (e.g. output_multiplier, final_logit_softcapping)."""
    c = draft.config
    cfg = DFlash2Config(
        **{k: v for k, v in c.to_dict().items() if k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                        "num_key_value_heads", "head_dim", "rms_norm_eps",
                                                        "max_position_embeddings", "vocab_size", "hidden_act",
                                                        "rope_parameters", "num_hidden_layers")},
        block_size=c.block_size, num_target_layers=c.num_target_layers,
        dflash_config={"mask_token_id": c.mask_token_id, "target_layer_ids": c.target_layer_ids,
                       "conv_kernel_size": conv, "conv_group_size": group, "selector_rank": rank,
                       "selector_top_k": top_k, **fields},
    )
    d2 = DFlash2DraftModel(cfg).float().eval()
    missing, unexpected = d2.load_state_dict(draft.state_dict(), strict=False)
    assert not unexpected and all("conv" in k or "candidate_selector" in k for k in missing), missing
    if random_modules:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in d2.named_parameters():
                if "conv" in name or "candidate_selector" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "codebook" in name else 0.1))
    return d2


def _trainer(target, draft, **kw):
    return DFlashTrainerModule(draft, target.get_input_embeddings(), target.get_output_embeddings(),
                               loss_decay_gamma=kw.pop("gamma", 7.0), **kw)


# ----------------------------------------------------------------------------- the model


def test_identity_init_without_selector_computes_exactly_dflash():
    """Identity convs and no selector: the same hidden states, loss and metrics as the DFlash-1 draft, bit for bit;
    a fresh DFlash2 draft's convs are the identity."""
    target = train_qwen3()
    d1 = train_draft(target)
    d2 = dflash2_like(d1, rank=0, top_k=0, random_modules=False)
    assert not d2.has_selector
    for layer in d2.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            assert torch.equal(conv.base_kernel[:, 0], torch.ones_like(conv.base_kernel[:, 0]))
            assert not conv.base_kernel[:, 1:].any() and not conv.kernel_projection.weight.any()
    wrapper = HFDFlashTargetModel(target, d1.config.target_layer_ids)
    ids, attn, lm = random_batch()
    batch = wrapper.generate_batch(ids, attn, lm)
    anchors, valid = sample_anchors(lm, attn, 4, 6, torch.Generator().manual_seed(1))
    o1 = _trainer(wrapper, d1, num_anchors=6)(batch, anchors=anchors, valid=valid)
    o2 = _trainer(wrapper, d2, num_anchors=6)(batch, anchors=anchors, valid=valid)
    assert torch.equal(o1.sums(), o2.sums())
    # and a perturbed conv is seen: the equivalence is not vacuous
    with torch.no_grad():
        d2.layers[0].attention_conv.base_kernel[0, 1] += 0.5
    o3 = _trainer(wrapper, d2, num_anchors=6)(batch, anchors=anchors, valid=valid)
    assert not torch.equal(o1.loss_sum, o3.loss_sum)


def test_block_conv_matches_a_naive_loop():
    """y[i, c] = sum_t (base[s, t, c] + d_s[i, t, c // group]) z[i - t, c] within each block, per token and channel."""
    g = torch.Generator().manual_seed(0)
    conv = BlockConv(hidden_size=8, kernel_size=3, group_size=4)
    with torch.no_grad():
        conv.base_kernel.copy_(torch.randn(conv.base_kernel.shape, generator=g))
        conv.kernel_projection.weight.copy_(torch.randn(conv.kernel_projection.weight.shape, generator=g))
    block, n_blk = 4, 2
    z = torch.randn(2, n_blk * block, 8, generator=g)
    y = torch.randn(2, n_blk * block, 8, generator=g)
    got_in, delta = conv.prepare(z, block)
    got_out = conv.finish(y, delta, block)
    d = (z @ conv.kernel_projection.weight.T).view(2, n_blk * block, 2, 3, 2)
    for side, (x, got) in enumerate(((z, got_in), (y, got_out))):
        want = torch.zeros_like(x)
        for b in range(2):
            for i in range(n_blk * block):
                for c in range(8):
                    for t in range(3):
                        if i % block - t >= 0:
                            k = conv.base_kernel[side, t, c] + d[b, i, side, t, c // 4]
                            want[b, i, c] += k * x[b, i - t, c]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_walk_matches_a_naive_loop_and_q_lives_on_the_candidates():
    """The greedy walk against a loop over slots and candidates (pair scores written out); sampled, each slot's
    q is the softmax of the pair scores at T over C_k given the token drawn before, 0 elsewhere."""
    target = train_qwen3()
    d2 = dflash2_like(train_draft(target), top_k=5)
    sel = d2.candidate_selector
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 4, 64, generator=g)
    logits = torch.randn(3, 4, 256, generator=g) * 3
    anchors = torch.tensor([7, 100, 3])

    def naive_scores(h, u, prev):
        cand = u.topk(5).indices
        ph = sel.hidden_projection.weight @ h
        return cand, torch.stack([u[c] + (sel.predecessor_codebook[prev] * ph * sel.successor_codebook[c]).sum()
                                  for c in cand])

    with torch.no_grad():
        long_hidden, long_logits = torch.randn(2, 15, 64, generator=g), torch.randn(2, 15, 256, generator=g) * 3
        # 4 slots, and 15 (every doubling round of the greedy path)
        for h, u, a in ((hidden, logits, anchors), (long_hidden, long_logits, anchors[:2])):
            tokens, q = selector_walk(sel, h, u, a)
            assert q is None
            for r in range(h.shape[0]):
                prev = int(a[r])
                for k in range(h.shape[1]):
                    cand, s = naive_scores(h[r, k], u[r, k], prev)
                    prev = int(cand[s.argmax()])
                    assert int(tokens[r, k]) == prev
        picks = []
        tokens, q = selector_walk(sel, hidden, logits, anchors, 1 / 0.7,
                                  lambda k, qk: picks.append(qk) or torch.multinomial(qk, 1, generator=g).squeeze(-1))
        for r in range(3):
            prev = int(anchors[r])
            for k in range(4):
                cand, s = naive_scores(hidden[r, k], logits[r, k], prev)
                want = torch.zeros(256).index_put_((cand,), torch.softmax(s / 0.7, -1))
                torch.testing.assert_close(q[r, k], want, atol=1e-5, rtol=1e-5)
                assert q[r, k, int(tokens[r, k])] > 0
                prev = int(tokens[r, k])


@pytest.mark.parametrize("slots", [1, 2, 3, 5, 8, 9, 15])
def test_compose_maps_is_the_composition_applied_slot_by_slot(slots):
    g = torch.Generator().manual_seed(slots)
    maps = torch.randint(0, 6, (3, slots, 6), generator=g)
    out = compose_maps(maps)
    for r in range(3):
        for i in range(6):
            j = i
            for s in range(slots):
                j = int(maps[r, s, j])
                assert int(out[r, s, i]) == j



def _loop_walk(selector, hidden, unary, anchors, inv_temperature, draw):
    """The sampled walk as it was before `slot_distributions` (the reference): slot by slot, each q formed from
    the candidate drawn before, then drawn."""
    cand_logits, cand_ids = unary.topk(selector.top_k, dim=-1)
    scores = selector.pair_scores(hidden[:, 0], cand_logits[:, 0], cand_ids[:, 0], anchors)
    lattice = selector.lattice(hidden, cand_ids) if hidden.shape[1] > 1 else None
    rows, picks, qs = torch.arange(hidden.shape[0], device=hidden.device), [], []
    for k in range(hidden.shape[1]):
        if k > 0:
            scores = cand_logits[:, k].float() + lattice[rows, k - 1, picks[-1]]
        q = torch.softmax(scores * inv_temperature, dim=-1)
        qs.append(q)
        picks.append(draw(k, q))
    tokens = cand_ids.gather(-1, torch.stack(picks, 1).unsqueeze(-1)).squeeze(-1)
    return tokens, torch.zeros(unary.shape, device=unary.device).scatter_(-1, cand_ids, torch.stack(qs, 1))


def _random_selector(hidden_size, vocab, rank, top_k, g):
    sel = CandidateSelector(hidden_size, vocab, rank, top_k)
    with torch.no_grad():
        for p in sel.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return sel


@pytest.mark.parametrize("rows,slots,top_k", [(1, 15, 16), (2, 1, 4), (3, 2, 16), (5, 7, 1), (4, 15, 5)])
def test_sampled_walk_draws_the_slot_by_slot_loops_tokens_and_q(rows, slots, top_k):
    """The keyed walk (every slot's uniform hashed at once, each slot drawn given every candidate before it, the
    path through the composed maps) against the slot-by-slot loop with `keyed_draw` at each slot's position, as
    the engine drew before: the same tokens and the same q, bit for bit, over random inputs, keys, block
    positions and temperatures (1/T a buffer, as the engine's, or a float); a generator's draws (the eager
    decoder's multinomial) also take the same tokens from the same stream. And the draws are not vacuous: over
    the cases the sampled path leaves the greedy one."""
    from nemo_dflash.engine.sampling import DRAFT_STREAM, keyed_draw, keyed_slot_draws

    g = torch.Generator().manual_seed(100 * rows + slots)
    sel = _random_selector(24, 64, 6, top_k, g)
    off_greedy = 0
    with torch.no_grad():
        for trial, t in enumerate((0.2, 0.7, 1.0, 1.6)):
            hidden = torch.randn(rows, slots, 24, generator=g)
            unary = torch.randn(rows, slots, 64, generator=g) * 2
            anchors = torch.randint(0, 64, (rows,), generator=g)
            keys = torch.randint(0, 2**31, (rows,), generator=g)
            first = torch.randint(0, 5000, (rows,), generator=g)
            inv_t = torch.tensor(1.0 / t) if trial % 2 else 1.0 / t
            want = _loop_walk(sel, hidden, unary, anchors, inv_t,
                              lambda k, q: keyed_draw(DRAFT_STREAM, keys, first + 1 + k, q))
            got = selector_walk(sel, hidden, unary, anchors, inv_t, keyed_slot_draws(DRAFT_STREAM, keys, first, slots))
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            off_greedy += int((got[0] != selector_walk(sel, hidden, unary, anchors)[0]).any())
            draws = []
            for walk in (_loop_walk, selector_walk):
                gen = torch.Generator().manual_seed(trial)
                draws.append(walk(sel, hidden, unary, anchors, inv_t,
                                  lambda k, q: torch.multinomial(q, 1, generator=gen).squeeze(-1)))
            assert torch.equal(draws[0][0], draws[1][0]) and torch.equal(draws[0][1], draws[1][1])
    assert top_k == 1 or off_greedy > 0


def test_keyed_walk_is_a_few_ops_a_block_with_no_host_sync():
    """The engine's sampled walk, on the profiler: no op reads a value back to the host (a captured step could not
    hold it), and a 15-slot block runs only a few more ops than a 3-slot one (compose_maps' extra rounds), where the
    slot-by-slot loop ran ~60 more a slot."""
    from torch.profiler import ProfilerActivity, profile

    from nemo_dflash.engine.sampling import DRAFT_STREAM, keyed_slot_draws

    g = torch.Generator().manual_seed(0)
    sel = _random_selector(24, 64, 6, 16, g)

    def ops(slots):
        hidden, unary = torch.randn(1, slots, 24, generator=g), torch.randn(1, slots, 64, generator=g)
        args = (torch.tensor([3]), torch.tensor(1.0), torch.tensor([11]), torch.tensor([40]))
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            selector_walk(sel, hidden, unary, args[0], args[1], keyed_slot_draws(DRAFT_STREAM, args[2], args[3], slots))
        return [e.name for e in prof.events()
                if e.name.startswith("aten::") and not (e.cpu_parent and e.cpu_parent.name.startswith("aten::"))]

    short, long = ops(3), ops(15)
    for names in (short, long):
        assert not {"aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero"} & set(names)
    assert 0 <= len(long) - len(short) <= 12, (len(short), len(long))


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("grad,outside,multiplier", [(True, "inject", 1.0), (True, "skip", 1.0),
                                                     (False, "inject", 1.0), (False, "skip", 1.0),
                                                     (True, "inject", 0.5), (False, "skip", 0.5)])
def test_selector_loss_and_walk_metrics_match_a_per_block_loop(outside, grad, multiplier):
    """The trainer's selector term and the walk's simulated acceptance against each block run alone (as decoding
    runs it), the pair scores written out, the predecessor the true token (the anchor for slot 1). Under grad the
    candidates come from the fused cross-entropy's logits, without it from a pass of their own: both checked. An
    output multiplier scales the unary logits once (as the decoders' `slot_logits`)."""
    target = train_qwen3()
    d2 = dflash2_like(train_draft(target), top_k=4, output_multiplier=multiplier)
    wrapper = HFDFlashTargetModel(target, d2.config.target_layer_ids)
    ids, attn, lm = random_batch(bsz=2, seq=40)
    batch = wrapper.generate_batch(ids, attn, lm)
    anchors, valid = sample_anchors(lm, attn, 4, 6, torch.Generator().manual_seed(3))
    with torch.set_grad_enabled(grad):
        out = _trainer(wrapper, d2, num_anchors=6, selector_outside=outside)(batch, anchors=anchors, valid=valid)
    sums = LossSums.from_vector(out.sums())
    embed, head, sel = wrapper.get_input_embeddings(), wrapper.get_output_embeddings(), d2.candidate_selector
    ref_sel, ref_acc, ref_unary, ref_hits, blocks = 0.0, 0.0, 0.0, 0, 0
    with torch.no_grad():
        for b in range(2):
            for i in range(anchors.shape[1]):
                a = int(anchors[b, i])
                if not valid[b, i]:
                    continue
                block_ids = torch.tensor([[int(ids[b, a])] + [MASK_ID] * 3])
                pos = torch.cat([torch.arange(a), a + torch.arange(4)]).unsqueeze(0)
                h = d2(embed(block_ids), batch.hidden_states[b : b + 1, :a], pos, None)[0]
                logits = head(h) * multiplier
                walk_ok, unary_ok, labelled = True, True, False
                acc, unary_acc = 1, 1
                for k in range(1, 4):
                    if not (a + k < ids.shape[1] and lm[b, a + k] and attn[b, a + k]):
                        walk_ok = unary_ok = False
                        continue
                    labelled = True
                    y, prev = int(ids[b, a + k]), int(ids[b, a + k - 1])
                    cand = logits[k].topk(4).indices.tolist()
                    inside = y in cand
                    ref_hits += inside
                    if not inside and outside == "inject":
                        cand[-1] = y
                    ph = sel.hidden_projection.weight @ h[k]
                    s = torch.stack([logits[k, c] + (sel.predecessor_codebook[prev] * ph * sel.successor_codebook[c]
                                                     ).sum() for c in cand])
                    w = math.exp(-(k - 1) / 7.0)
                    if inside or outside == "inject":
                        ref_sel += w * float(F.cross_entropy(s[None], torch.tensor([cand.index(y)])))
                    walk_pick = logits[k].topk(4).indices.tolist()
                    s_walk = torch.stack([logits[k, c] + (sel.predecessor_codebook[prev] * ph
                                                          * sel.successor_codebook[c]).sum() for c in walk_pick])
                    walk_ok = walk_ok and walk_pick[int(s_walk.argmax())] == y
                    unary_ok = unary_ok and int(logits[k].argmax()) == y
                    acc += walk_ok
                    unary_acc += unary_ok
                if labelled:
                    blocks += 1
                    ref_acc += acc
                    ref_unary += unary_acc
    assert sums.selector_loss_sum == pytest.approx(ref_sel, rel=1e-4)
    assert sums.accept_sum == pytest.approx(ref_acc) and sums.unary_accept_sum == pytest.approx(ref_unary)
    assert sums.topk_hits == ref_hits and sums.num_blocks == blocks
    # the selector term enters the loss at its weight
    with torch.set_grad_enabled(grad):
        off = _trainer(wrapper, d2, num_anchors=6, selector_outside=outside, selector_weight=0.0)(
            batch, anchors=anchors, valid=valid)
    assert float(out.loss_sum - off.loss_sum) == pytest.approx(ref_sel, rel=1e-4)


@pytest.mark.parametrize("vocab", [49152, 151936, 1000, 96, 37])
def test_blockwise_topk_is_the_topk(vocab):
    """`topk_ids` (k blocks by their maxima, then the top-k of their values) against `torch.topk`: the same ids in
    the same order on continuous values; on a row of ties the same multiset of values (ties broken otherwise)."""
    from nemo_dflash.engine.sampling import topk_ids

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=g)
    logits[0, :] = -1e4
    logits[0, [3, vocab - 1]] = 5.0  # the largest two at the row's ends, in other blocks
    logits[1, : min(vocab, 300)] = 9.0  # the whole top-k inside one block
    k = min(16, vocab)
    want = logits.topk(k, dim=-1)
    got = topk_ids(logits, k)
    assert torch.equal(logits.gather(1, got), want.values)
    assert torch.equal(got[2:], want.indices[2:])
    ties = torch.randint(0, 4, (32, vocab), generator=g).float()  # many equal values
    assert torch.equal(ties.gather(1, topk_ids(ties, k)), ties.topk(k, dim=-1).values)


def test_selector_loss_trains_the_selector_and_the_backbone():
    """One backward: gradients reach the codebooks, the projection, the convs and the backbone."""
    target = train_qwen3()
    d2 = dflash2_like(train_draft(target))
    wrapper = HFDFlashTargetModel(target, d2.config.target_layer_ids)
    ids, attn, lm = random_batch()
    out = _trainer(wrapper, d2, num_anchors=8, gamma=None, selector_weight=1.0)(wrapper.generate_batch(ids, attn, lm))
    out.loss_sum.backward()
    for name, p in d2.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_dpace_weights_hand_computed():
    """w_k = sum_{m >= k} prod_{i <= m} q~_i, q~ = 0.5 exp(-CE) + 0.5, invalid slots 0 and ending the run."""
    ce = torch.tensor([[0.0, math.log(2.0), math.log(4.0), 1.0]])
    valid = torch.tensor([[True, True, True, False]])
    q = [1.0, 0.75, 0.625]  # 0.5 * exp(-ce) + 0.5
    p = [q[0], q[0] * q[1], q[0] * q[1] * q[2]]
    want = torch.tensor([[p[0] + p[1] + p[2], p[1] + p[2], p[2], 0.0]])
    torch.testing.assert_close(dpace_weights(ce, valid, 0.5), want)


def test_dpace_normalises_by_valid_slots_and_weighs_the_selector_alike():
    target = train_qwen3()
    d2 = dflash2_like(train_draft(target))
    wrapper = HFDFlashTargetModel(target, d2.config.target_layer_ids)
    ids, attn, lm = random_batch()
    batch = wrapper.generate_batch(ids, attn, lm)
    anchors, valid = sample_anchors(lm, attn, 4, 6, torch.Generator().manual_seed(1))
    dp = _trainer(wrapper, d2, num_anchors=6, position_weights="dpace")(batch, anchors=anchors, valid=valid)
    assert float(dp.weight_sum) == float(dp.num_labels)
    decay = _trainer(wrapper, d2, num_anchors=6)(batch, anchors=anchors, valid=valid)
    assert not torch.isclose(dp.selector_loss_sum, decay.selector_loss_sum)


# ----------------------------------------------------------------------------- decoding


def _dflash2_second_token_case(top_k: int = 4):
    target, draft, ids, p2 = second_token_case()
    return target, dflash2_like(draft, rank=4, top_k=top_k, group=8), ids, p2


@pytest.mark.parametrize("block_size", [2, 4])
def test_dflash2_greedy_decoding_is_the_targets_greedy_output(block_size):
    """T=0, eager decoder and the engine's rows: the target's greedy tokens, and the same acceptance lengths."""
    from _spec_fixtures import hf_greedy

    from nemo_dflash.engine.batched_static import batched_static_speculative_generate
    from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder

    target, d2, ids, _ = _dflash2_second_token_case()
    dec = DFlashSpeculativeDecoder(target, d2, block_size=block_size)
    prompts = [ids[0].tolist(), [3, 1, 4, 1, 5, 2], [7, 6]]
    eager = [dec.generate(torch.tensor([p]), max_new_tokens=20) for p in prompts]
    for p, out in zip(prompts, eager):
        assert out.output_ids == hf_greedy(target, torch.tensor([p]), 20)
    rows = batched_static_speculative_generate(dec, prompts, max_new_tokens=20, use_graphs=False)
    assert [r.output_ids for r in rows] == [e.output_ids for e in eager]
    assert [r.acceptance_lengths for r in rows] == [e.acceptance_lengths for e in eager]


def test_capture_fusion_of_the_block_conv_computes_the_same_and_is_undone():
    """While a step is captured each `BlockConv` runs `block_convolve` compiled: the draft's block logits are the
    eager ones, every conv (two a layer) is counted, and nothing of the swap is left afterwards."""
    from nemo_dflash.draft.model import DFlashContextCache
    from nemo_dflash.engine.graphs import fused_elementwise
    from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder

    target, d2, ids, _ = _dflash2_second_token_case()
    dec = DFlashSpeculativeDecoder(target, d2)
    g = torch.Generator().manual_seed(3)
    context = torch.randn(1, 9, target.config.hidden_size * len(d2.config.target_layer_ids), generator=g)
    with torch.no_grad():
        want = dec.draft_logits(ids[0, -1:], 9, context, DFlashContextCache(len(d2.layers)), 8)
        with fused_elementwise(d2) as counts:
            assert all("convolve" in c.__dict__ for layer in d2.layers for c in (layer.attention_conv, layer.mlp_conv))
            got = dec.draft_logits(ids[0, -1:], 9, context, DFlashContextCache(len(d2.layers)), 8)
    assert counts["BlockConv"] == 2 * len(d2.layers)
    assert not any("convolve" in m.__dict__ for m in d2.modules())
    assert not torch.equal(want, torch.zeros_like(want))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_dflash2_replay_equals_sequential_decoding():
    """Replay's walk at every answer position gives the eager decoder's acceptance lengths (T=0)."""
    from nemo_dflash.evaluation.replay import walk
    from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder

    target, d2, ids, _ = _dflash2_second_token_case()
    dec = DFlashSpeculativeDecoder(target, d2)
    out = dec.generate(ids, max_new_tokens=24)
    # the draft's walk from each position of the greedy answer, as replay forms it (one block at a time here)
    from nemo_dflash.objective.trainer_module import draft_block_hidden

    wrapper = HFDFlashTargetModel(target, d2.config.target_layer_ids)
    seq = torch.tensor([ids[0].tolist() + out.output_ids[:-1]])
    feats, _ = wrapper.forward_features(seq)
    anchors = torch.arange(ids.shape[1], seq.shape[1]).unsqueeze(0)
    with torch.no_grad():
        hidden = draft_block_hidden(d2, wrapper.get_input_embeddings(), seq, feats, torch.ones_like(seq), anchors,
                                    torch.ones_like(anchors, dtype=torch.bool), 4, MASK_ID_8, backend="sdpa")
        hidden = hidden.view(anchors.shape[1], 4, -1)[:, 1:]
        drafts = d2.propose_block(hidden, d2.slot_logits(hidden, wrapper.get_output_embeddings()),
                                  seq[0, anchors[0]])[0].tolist()
    lens = walk(out.output_ids, [], drafts, set(), 24)
    assert lens == out.acceptance_lengths


MASK_ID_8 = 7  # second_token_case's draft: the last row of its 8-token vocabulary


def test_dflash2_t1_keeps_the_targets_three_token_law_and_a_misreported_q_is_caught(monkeypatch):
    """T=1 through the engine's rows (6,000 conversations): the exact law of the first three tokens, with the
    selector's candidates a strict subset of the vocabulary (q is 0 outside them). Then q misreported leaves the
    law: uniform over the whole vocabulary while the tokens were drawn over the candidates (a one-hot q on the
    drawn token would be no sabotage: it is exact for any proposal)."""
    from nemo_dflash.draft.model import dflash2
    from nemo_dflash.engine.batched_static import batched_static_speculative_generate
    from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder

    target, d2, ids, _ = _dflash2_second_token_case(top_k=4)
    joint = three_token_law(target, ids)
    n = 6000

    def law_tv() -> float:
        dec = DFlashSpeculativeDecoder(target, d2)
        outs = batched_static_speculative_generate(dec, [ids[0].tolist()] * n, max_new_tokens=3, sampling=SamplingParams(1.0),
                                                   use_graphs=False, generator=torch.Generator().manual_seed(2))
        assert any(o.acceptance_lengths[0] >= 2 for o in outs)
        codes = torch.tensor([o.output_ids[0] * 64 + o.output_ids[1] * 8 + o.output_ids[2] for o in outs])
        freq = (torch.bincount(codes, minlength=512).float() / n).view(8, 8, 8)
        return float(0.5 * (freq.sum(0) - joint.sum(0)).abs().sum())

    good = law_tv()
    assert good < 0.07, good
    real = dflash2.selector_walk

    def misreported(selector, hidden, unary, anchors, inv_temperature=None, draw=None):
        tokens, q = real(selector, hidden, unary, anchors, inv_temperature, draw)
        if q is not None:  # not what the tokens were drawn from
            q = torch.full_like(q, 1.0 / q.shape[-1])
        return tokens, q

    monkeypatch.setattr(dflash2, "selector_walk", misreported)
    bad = law_tv()
    assert bad > 0.12 and bad > 2 * good, (good, bad)



def test_dflash2_engine_rows_at_t1_sample_what_the_slot_by_slot_walk_sampled(monkeypatch):
    """The engine's rows at T=1 and at T=0.7 with top-p 0.9 (rows entering mid-run, their first blocks drafted
    eagerly, later ones in the step): the same answers and acceptance lengths as with the runner's walk as it was,
    `keyed_draw` at each slot's position inside the slot-by-slot loop."""
    from nemo_dflash.engine import batched_static
    from nemo_dflash.engine.batched_static import batched_static_speculative_generate
    from nemo_dflash.engine.sampling import DRAFT_STREAM, keyed_draw
    from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder

    target, d2, ids, _ = _dflash2_second_token_case()
    prompts = [ids[0].tolist(), [3, 1, 4, 1, 5, 2], [7, 6], [2, 5, 5]]

    def old_walk(self, logits, rows, hidden):
        keys, first = self.state.key[rows], self.pos[rows]
        tok, q = _loop_walk(self.dec.draft.candidate_selector, hidden, logits,
                            self.blk[rows, 0], self.state.inv_temp,
                            lambda k, q: keyed_draw(DRAFT_STREAM, keys, first + 1 + k, q))
        self.q[rows].copy_(q)
        self.blk[rows, 1:].copy_(tok)

    def run(sampling):
        dec = DFlashSpeculativeDecoder(target, d2)
        outs = batched_static_speculative_generate(dec, prompts, max_new_tokens=24, sampling=sampling, rows=2,
                                                   use_graphs=False, generator=torch.Generator().manual_seed(4))
        return [(o.output_ids, o.acceptance_lengths) for o in outs]

    for sampling in (SamplingParams(1.0), SamplingParams(0.7, top_p=0.9)):
        new = run(sampling)
        with monkeypatch.context() as m:
            m.setattr(batched_static.BatchedStaticSpecRunner, "_walk", old_walk)
            assert run(sampling) == new
        assert any(max(lens) > 1 for _, lens in new)


@pytest.mark.parametrize("proposals", ["sample", "greedy"])
def test_dflash2_eager_t1_second_token_marginal(proposals):
    """The eager decoder at T=1 with the walk's q (or, `--draft-proposals greedy`, its argmax path with a one-hot
    q): the second token's marginal is the target's."""
    from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder
    from nemo_dflash.engine.sampling import SamplingParams

    target, d2, ids, p2 = _dflash2_second_token_case()
    dec = DFlashSpeculativeDecoder(target, d2)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(8)
    s = SamplingParams(1.0, draft=proposals)
    for _ in range(800):
        counts[dec.generate(ids, max_new_tokens=2, sampling=s, generator=g).output_ids[1]] += 1
    assert (counts / 800 - p2).abs().max() < 0.06


# ----------------------------------------------------------------------------- export and bad input


def test_export_round_trip_writes_the_engines_dflash2_format(tmp_path):
    from nemo_dflash.serving.export import export_draft, load_draft

    target = train_qwen3()
    d2 = dflash2_like(train_draft(target))
    out = export_draft(d2, tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    dc = cfg["dflash_config"]
    assert (dc["conv_kernel_size"], dc["conv_group_size"], dc["selector_rank"], dc["selector_top_k"]) == (2, 16, 8, 4)
    assert dc["output_multiplier"] == 1.0 and dc["final_logit_softcapping"] == 0.0 and dc["block_size"] == 4
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.attention_conv.base_kernel",
            "layers.1.mlp_conv.kernel_projection.weight"} <= names
    loaded = load_draft(out, dtype="fp32")
    assert isinstance(loaded, DFlash2DraftModel) and loaded.has_selector
    ref = d2.to(torch.bfloat16).float()
    g = torch.Generator().manual_seed(0)
    noise, feats = torch.randn(1, 4, 64, generator=g), torch.randn(1, 5, 128, generator=g)
    pos = torch.arange(9).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(loaded(noise, feats, pos), ref(noise, feats, pos), atol=0, rtol=0)


def test_bad_sizes_and_kind_mismatches_are_one_line(tmp_path):
    target = train_qwen3()  # hidden 64, vocab 256
    with pytest.raises(DraftError, match="conv_group_size=24 must divide the hidden size 64"):
        check_variant_fits("dflash2", {"conv_group_size": 24}, 64, 256, 4)
    with pytest.raises(DraftError, match="selector_top_k=300 is above the vocabulary"):
        build_draft_for_target(target, None, num_layers=2, block_size=4, mask_token_id=MASK_ID, kind="dflash2",
                               variant_options={"selector_top_k": 300, "selector_rank": 8})
    from nemo_dflash.draft.build import check_draft_kind
    from nemo_dflash.serving.export import export_draft

    out = export_draft(train_draft(target), tmp_path / "d1")
    with pytest.raises(DraftError, match="is a dflash draft but draft.kind=dflash2: set draft.kind=dflash"):
        check_draft_kind(out, "dflash2", "draft.init_from")
    d2 = build_draft_for_target(target, None, num_layers=2, block_size=4, mask_token_id=MASK_ID, kind="dflash2",
                                variant_options={"selector_top_k": 4, "selector_rank": 8})
    out2 = export_draft(d2, tmp_path / "d2")
    with pytest.raises(DraftError, match="is a dflash2 draft but draft.kind=dflash: set draft.kind=dflash2"):
        check_draft_kind(out2, "dflash", "draft.init_from")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_captured_walk_equals_eager_and_keeps_the_law():
    """On a GPU, the engine's captured steps (CUDA graphs, compiled flex over filled blocks) with the selector's
    walk inside them: T=0 answers and acceptance lengths equal the eager decoder's; T=1 keeps the target's
    three-token law (6,000 conversations through 500 rows)."""
    from nemo_dflash.engine.batched_static import batched_static_speculative_generate
    from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder

    target, d2, ids, _ = _dflash2_second_token_case()
    joint = three_token_law(target, ids)
    dev = torch.device("cuda")
    dec = DFlashSpeculativeDecoder(target.to(dev), d2.to(dev))
    prompts = [ids[0].tolist(), [3, 1, 4, 1, 5, 2], [7, 6]]
    eager = [dec.generate(torch.tensor([p], device=dev), max_new_tokens=20) for p in prompts]
    rows = batched_static_speculative_generate(dec, prompts, max_new_tokens=20, use_graphs=True)
    assert [r.output_ids for r in rows] == [e.output_ids for e in eager]
    assert [r.acceptance_lengths for r in rows] == [e.acceptance_lengths for e in eager]
    n = 6000
    outs = batched_static_speculative_generate(dec, [ids[0].tolist()] * n, max_new_tokens=3, sampling=SamplingParams(1.0),
                                               rows=500, use_graphs=True,
                                               generator=torch.Generator(device=dev).manual_seed(3))
    codes = torch.tensor([o.output_ids[0] * 64 + o.output_ids[1] * 8 + o.output_ids[2] for o in outs])
    freq = (torch.bincount(codes, minlength=512).float() / n).view(8, 8, 8)
    assert float(0.5 * (freq.sum(0) - joint.cpu().sum(0)).abs().sum()) < 0.07



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_keyed_walk_draws_the_slot_by_slot_loops_tokens():
    """On a GPU, the keyed walk against the slot-by-slot loop with `keyed_draw` (15 slots, 16 candidates): with
    several rows the same tokens and q bit for bit (each slot's CDF is the same row scan); with one row the loop's
    per-slot CDF was a one-row scan (another kernel, maybe another summation order), so a draw may differ where
    its uniform falls within rounding of a CDF step: at most 1 block in 300 differs."""
    from nemo_dflash.engine.sampling import DRAFT_STREAM, keyed_draw, keyed_slot_draws

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    sel = _random_selector(24, 512, 6, 16, torch.Generator().manual_seed(1)).to(dev)
    differ = 0
    with torch.no_grad():
        for rows, trials in ((1, 300), (3, 20), (8, 20)):
            for trial in range(trials):
                hidden = torch.randn(rows, 15, 24, generator=g, device=dev)
                unary = torch.randn(rows, 15, 512, generator=g, device=dev) * 2
                anchors = torch.randint(0, 512, (rows,), generator=g, device=dev)
                keys = torch.randint(0, 2**31, (rows,), generator=g, device=dev)
                first = torch.randint(0, 5000, (rows,), generator=g, device=dev)
                inv_t = torch.tensor(1.0 / (0.3 + trial % 4 * 0.4), device=dev)
                want = _loop_walk(sel, hidden, unary, anchors, inv_t,
                                  lambda k, q: keyed_draw(DRAFT_STREAM, keys, first + 1 + k, q))
                got = selector_walk(sel, hidden, unary, anchors, inv_t, keyed_slot_draws(DRAFT_STREAM, keys, first, 15))
                same = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                assert same or rows == 1, (rows, trial)
                differ += not same
    assert differ <= 1, differ


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_flex_training_loss_equals_the_dense_one():
    """The DFlash2 trainer module on a GPU with flex attention (the training path) against dense SDPA: the same
    loss, selector term and walk metrics."""
    target = train_qwen3().cuda()
    d2 = dflash2_like(train_draft(target)).cuda()
    wrapper = HFDFlashTargetModel(target, d2.config.target_layer_ids)
    ids, attn, lm = (t.cuda() for t in random_batch())
    batch = wrapper.generate_batch(ids, attn, lm)
    anchors, valid = sample_anchors(lm.cpu(), attn.cpu(), 4, 6, torch.Generator().manual_seed(1))
    outs = [_trainer(wrapper, d2, num_anchors=6, attn_backend=b)(batch, anchors=anchors.cuda(), valid=valid.cuda())
            for b in ("sdpa", "flex")]
    torch.testing.assert_close(outs[0].sums(), outs[1].sums(), atol=1e-3, rtol=1e-3)


def test_the_train_command_refuses_bad_dflash2_input_before_loading(tmp_path, monkeypatch, capsys):
    """`train` with sizes that cannot fit the target, a selector pair half set, or `draft.init_from` of the other
    kind: exit 2 and one line naming the key, before the target loads."""
    from _tiny_target import make_tiny_target_dir, write_chat_jsonl

    from nemo_dflash.serving.export import export_draft
    from nemo_dflash.recipes import train as recipe

    target_dir = make_tiny_target_dir(tmp_path)  # hidden 32
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=4)

    def no_load(*a, **k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr("nemo_dflash.train.trainer.load_target", no_load)  # the trainer first: it binds the name
    monkeypatch.setattr("nemo_dflash.target.loading.load_target", no_load)
    base = ["--config", "qwen3_8b.yaml", f"target.path={target_dir}", f"data.sources=[{{path: {data}}}]",
            f"output_dir={tmp_path / 'run'}", "distributed.strategy=none", "wandb.mode=disabled"]
    d2 = build_draft_for_target(train_qwen3(), None, num_layers=2, block_size=4, mask_token_id=MASK_ID,
                                kind="dflash2", variant_options={"selector_top_k": 4, "selector_rank": 8})
    export = export_draft(d2, tmp_path / "d2")
    capsys.readouterr()  # the export's own output
    cases = [
        (["draft.kind=dflash2", "draft.dflash2.conv_group_size=24"], "conv_group_size=24 must divide the hidden size 32"),
        (["draft.kind=dflash2", "draft.dflash2.selector_top_k=0"], "selector_rank and selector_top_k must both be"),
        ([f"draft.init_from={export}"], "is a dflash2 draft but draft.kind=dflash: set draft.kind=dflash2"),
    ]
    for extra, message in cases:
        with pytest.raises(SystemExit) as e:
            recipe.main([*base, *extra])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and message in err, (extra, err)
        assert err.count("\n") == 0 and "Traceback" not in err


def test_a_resume_of_the_other_kind_is_refused_before_loading(tmp_path):
    from nemo_dflash.train.checkpoint import ResumeMismatchError, check_inputs

    (tmp_path / "meta.json").write_text(json.dumps({"draft_kind": "dflash2"}))
    with pytest.raises(ResumeMismatchError, match="holds a dflash2 draft and draft.kind=dflash: set draft.kind=dflash2"):
        check_inputs(tmp_path, {}, "dflash")
    check_inputs(tmp_path, {}, "dflash2")  # the same kind resumes


@pytest.mark.parametrize("outside", ["inject", "skip"])
def test_candidate_logits_from_the_fused_ce_give_the_gathered_heads_gradients(outside):
    """With the fused cross-entropy the selector's unary scores are its logits (their gradient added in its
    backward); without it they are gathered from the head's rows in the selector's own checkpointed chunks. Same
    loss and the same gradient on every draft parameter, the soft-capped scores included."""
    target = train_qwen3()
    d2 = dflash2_like(train_draft(target), top_k=4)
    wrapper = HFDFlashTargetModel(target, d2.config.target_layer_ids)
    ids, attn, lm = random_batch(bsz=2, seq=40)
    batch = wrapper.generate_batch(ids, attn, lm)
    anchors, valid = sample_anchors(lm, attn, 4, 6, torch.Generator().manual_seed(5))
    grads, losses = [], []
    for fused in (True, False):
        d2.zero_grad(set_to_none=True)
        out = _trainer(wrapper, d2, num_anchors=6, selector_outside=outside, fused_ce=fused)(
            batch, anchors=anchors, valid=valid)
        out.loss_sum.backward()
        losses.append(float(out.loss_sum))
        grads.append({n: p.grad.clone() for n, p in d2.named_parameters() if p.grad is not None})
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 4
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-4, msg=name)


def test_fused_ce_candidate_logits_are_the_logits_and_carry_their_gradient():
    """`chunked_lm_loss(top_k=...)`: the returned candidate logits equal ``h @ W.T`` at the top-k ids and the label,
    and a loss on them back-propagates to h as autograd through the plain matmul does (hand reference)."""
    from nemo_dflash.objective.cross_entropy import chunked_lm_loss

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False).requires_grad_(False)
    h = torch.randn(13, 8, generator=g, requires_grad=True)
    y = torch.randint(0, 50, (13,), generator=g)
    loss, _, cand, cl = chunked_lm_loss(h, y, head, 4, top_k=3)
    full = h.detach() @ head.weight.T
    torch.testing.assert_close(cl, torch.cat([full.gather(1, cand), full.gather(1, y[:, None])], 1))
    assert torch.equal(cand, full.topk(3, dim=-1).indices)
    wts = torch.randn(13, 4, generator=g)
    (loss.sum() + (cl * wts).sum()).backward()
    h2 = h.detach().clone().requires_grad_(True)
    logits = h2 @ head.weight.T
    ref = F.cross_entropy(logits, y, reduction="sum") + (torch.cat(
        [logits.gather(1, cand), logits.gather(1, y[:, None])], 1) * wts).sum()
    ref.backward()
    torch.testing.assert_close(h.grad, h2.grad, atol=1e-5, rtol=1e-5)
