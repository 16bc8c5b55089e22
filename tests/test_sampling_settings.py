"""Sampling settings (top-p, top-k, draft proposals) in speculative decoding, and the held-out expected
acceptance under speculative sampling, against independent references: naive filters written token by
token, exact marginals from the target, Monte Carlo through the decoder's own accept rule."""

import math
from dataclasses import fields

import pytest
import torch

from _spec_fixtures import sampled_runner, sampled_step, second_token_case, single_thread  # noqa: F401  (autouse: one thread in this module)
from _tiny_models import MASK_ID, random_batch, train_draft, train_qwen3
from nemo_dflash.objective.anchors import sample_anchors
from nemo_dflash.objective.metrics import LossSums
from nemo_dflash.objective.trainer_module import DFlashTrainerModule
from nemo_dflash.engine.acceptance import expected_block_length
from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder
from nemo_dflash.engine.batched_static import batched_static_speculative_generate
from nemo_dflash.engine.spec_decode import DFlashContextCache
from nemo_dflash.engine.sampling import SamplingParams, as_sampling, filter_scores, propose_tokens, verify_block
from nemo_dflash.target import HFDFlashTargetModel


def naive_filtered_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """One row at a time, token by token: keep the k best, renormalise, keep the best until their mass
    reaches top_p (the token that crosses it included), renormalise."""
    out = torch.zeros(logits.shape, dtype=torch.float64)
    for r, row in enumerate(logits.double() / temperature):
        order = sorted(range(row.numel()), key=lambda i: (-float(row[i]), i))
        if top_k > 0:
            order = order[:top_k]
        z = sum(math.exp(float(row[i])) for i in order)
        kept, mass = [], 0.0
        for i in order:
            if mass >= top_p:
                break
            kept.append(i)
            mass += math.exp(float(row[i])) / z
        z = sum(math.exp(float(row[i])) for i in kept)
        for i in kept:
            out[r, i] = math.exp(float(row[i])) / z
    return out.float()


@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.7, 0), (1.0, 3), (0.6, 5), (0.95, 1)])
def test_filtered_distribution_matches_naive_filter(top_p, top_k):
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(1)) * 2
    s = SamplingParams(0.8, top_p, top_k)
    torch.testing.assert_close(s.probs(logits), naive_filtered_probs(logits, 0.8, top_p, top_k), rtol=1e-5, atol=1e-6)
    # the captured step reads top-p / top-k from 0-d buffers: the same filter
    as_tensors = filter_scores(logits / 0.8, torch.tensor(top_p), torch.tensor(top_k))
    torch.testing.assert_close(as_tensors.softmax(-1), s.probs(logits))


@pytest.mark.parametrize("bad", [dict(top_p=0.0), dict(top_p=1.5), dict(top_p=float("nan")), dict(top_k=-1),
                                 dict(temperature=-1.0), dict(temperature=float("inf")), dict(draft="beam")])
def test_bad_sampling_settings_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**{"temperature": 1.0, **bad})


def test_sampling_keys_round_trip_and_bare_temperatures_keep_their_keys():
    for s in (SamplingParams(0.2, 0.9), SamplingParams(1.0, 1.0, 20), SamplingParams(1.0, draft="greedy"),
              SamplingParams(0.0)):
        assert SamplingParams.from_key(s.key) == s
    assert f"{as_sampling(1.0):g}" == f"{1.0:g}" == "1" and f"{as_sampling(0.0):g}" == "0"
    assert SamplingParams(0.2, 0.9).label == "T=0.2, top-p 0.9"


@pytest.mark.parametrize("flag", [["--top-p", "0"], ["--top-p", "1.2"], ["--top-k", "-1"], ["--temperatures", "nan"]])
def test_evaluate_refuses_bad_sampling_flags_before_any_load(flag, tmp_path, capsys):
    from nemo_dflash.recipes import evaluate

    with pytest.raises(SystemExit) as e:
        evaluate.main(["--draft", str(tmp_path / "none"), "--target", str(tmp_path / "none"), "--out",
                       str(tmp_path / "out"), *flag])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("top" in err[0] or "temperature" in err[0])


def test_recommended_settings_come_from_generation_config_or_the_model_card(tmp_path):
    from nemo_dflash.target.loading import recommended_sampling

    (tmp_path / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.6, "top_p": 0.95, '
                                                     '"top_k": 20}')
    assert recommended_sampling(str(tmp_path))[0] == (0.6, 0.95, 20)
    (tmp_path / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.6}')
    assert recommended_sampling(str(tmp_path)) is None
    assert recommended_sampling("pkg:smollm2")[0] == (0.2, 0.9, 0)


# ----------------------------------------------------------------------------- decoders keep p filtered


def filtered_second_token(target, ids, s: SamplingParams) -> torch.Tensor:
    """The exact marginal of the 2nd generated token when every token is drawn from the filtered p."""
    vocab = target.config.vocab_size
    with torch.no_grad():
        p1 = s.probs(target(ids).logits[0, -1:])[0]
        nxt = torch.cat([ids.repeat(vocab, 1), torch.arange(vocab).view(vocab, 1)], 1)
        return (p1.unsqueeze(1) * s.probs(target(nxt).logits[:, -1])).sum(0)


def proposals_marginal(decoder, target, ids, s: SamplingParams) -> torch.Tensor:
    """The marginal of the draft's unverified slot-1 proposal: what a decoder that skipped verifying emits."""
    vocab = target.config.vocab_size
    with torch.no_grad():
        p1 = s.probs(target(ids).logits[0, -1:])[0]
        feats = decoder.target.forward_features(ids)[0]
        q = torch.stack([propose_tokens(decoder.draft_logits(torch.tensor([t]), ids.shape[1], feats,
                                                             DFlashContextCache(len(decoder.draft.layers)), 4)[:1],
                                        s)[1][0] for t in range(vocab)])
    return (p1.unsqueeze(1) * q).sum(0)


@pytest.mark.parametrize("draft_mode", ["sample", "greedy"])
def test_batched_decoder_keeps_the_filtered_target_distribution(draft_mode):
    """8,000 rows of one prompt: the second token (the draft's first proposal, verified) against the exact
    filtered marginal; the unverified proposals' marginal is more than twice the tolerance away from it."""
    target, draft, ids, unfiltered = second_token_case()
    s = SamplingParams(1.0, top_p=0.6, top_k=4, draft=draft_mode)
    want = filtered_second_token(target, ids, s)
    assert (want - unfiltered).abs().max() > 0.05  # the filter matters here
    decoder = DFlashSpeculativeDecoder(target, draft)
    n, tol = 8000, 0.02
    outs = batched_static_speculative_generate(decoder, [ids[0].tolist()] * n, max_new_tokens=2, sampling=s,
                                               use_graphs=False, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(torch.tensor([o.output_ids[1] for o in outs]), minlength=8).float()
    assert (counts / n - want).abs().max() < tol
    assert (proposals_marginal(decoder, target, ids, s) - want).abs().max() > 2 * tol


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_one_prompt_decoders_keep_the_filtered_target_distribution(decode):
    target, draft, ids, unfiltered = second_token_case()
    s = SamplingParams(1.0, top_p=0.6, top_k=4)
    want = filtered_second_token(target, ids, s)
    assert (want - unfiltered).abs().max() > 0.1
    decoder = DFlashSpeculativeDecoder(target, draft)
    g = torch.Generator().manual_seed(0)
    n, counts = 700, torch.zeros(8)
    for _ in range(n):
        if decode == "eager":
            out = decoder.generate(ids, max_new_tokens=2, sampling=s, generator=g)
        else:
            out = batched_static_speculative_generate(decoder, [ids[0].tolist()], max_new_tokens=2, sampling=s,
                                                      rows=1, use_graphs=False, generator=g)[0]
        counts[out.output_ids[1]] += 1
    assert (counts / n - want).abs().max() < 0.065


@pytest.mark.parametrize("draft_mode", ["sample", "greedy"])
def test_verify_block_with_filters_keeps_the_filtered_distribution(draft_mode):
    g = torch.Generator().manual_seed(0)
    vocab, n = 7, 8000
    p_logits = torch.randn(2, vocab, generator=g) * 1.5
    q_logits = torch.randn(1, vocab, generator=g) * 1.5
    s = SamplingParams(1.0, top_p=0.8, top_k=5, draft=draft_mode)
    counts = torch.zeros(vocab)
    for _ in range(n):
        d, q = propose_tokens(q_logits, s, g)
        n_acc, nxt = verify_block(d, p_logits, s, q, g)
        counts[int(d) if n_acc == 1 else nxt] += 1
    assert (counts / n - s.probs(p_logits[:1])[0]).abs().max() < 0.03


def test_static_step_with_filters_keeps_the_filtered_distribution():
    """The captured sampled step with top-p / top-k read from buffers, hand-set p and q."""
    p = torch.tensor([[0.50, 0.25, 0.15, 0.06, 0.04], [0.05, 0.05, 0.10, 0.10, 0.70], [0.2] * 5])
    q = torch.tensor([[0.05, 0.05, 0.10, 0.10, 0.70], [0.70, 0.10, 0.10, 0.05, 0.05]])
    r = sampled_runner(3, 5, filtered=True)
    r.state.top_p.fill_(0.8)
    want = torch.tensor([0.50, 0.25, 0.15, 0, 0]) / 0.9  # tokens 0, 1, 2 (0.5 + 0.25 < 0.8)
    n, first = 6000, torch.zeros(5)
    for key in range(n):
        r.state.key.fill_(key * 7919 + 11)
        n_acc, tokens = sampled_step(r, p, q)
        first[tokens[0]] += 1
    assert first[3:].sum() == 0
    assert (first / n - want).abs().max() < 0.02


# ----------------------------------------------------------------------------- the held-out metric


def test_expected_acceptance_against_brute_force_and_the_accept_rule():
    """eval's sampled acceptance per block: each block run alone as inference runs it, the target's p from
    its own logits, the filtered overlap computed token by token; and a Monte Carlo of the decoder's accept
    rule (`verify_block`, draft tokens drawn from q) along the same answer agrees within its error."""
    target = train_qwen3(num_layers=2)
    draft = train_draft(target)
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    ids, attn, lm = random_batch(bsz=2, seq=30, pad_last=0)
    batch = wrapper.generate_batch(ids, attn, lm, return_final_hidden=True)
    s = SamplingParams(1.0, top_p=0.9, top_k=12)
    module = DFlashTrainerModule(draft, wrapper.get_input_embeddings(), wrapper.get_output_embeddings(),
                                 num_anchors=3, accept_sampling=s)
    anchors, valid = sample_anchors(lm, attn, 4, 3, torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = module(batch, anchors=anchors, valid=valid)
        t_logits = target(ids).logits
    embed, head, blk = wrapper.get_input_embeddings(), wrapper.get_output_embeddings(), 4
    want_s, want_g, n_blocks, g = 0.0, 0.0, 0, torch.Generator().manual_seed(1)
    split = {"slot1": [0.0, 0.0, 0], "later": [0.0, 0.0, 0]}  # T=0 hits, accept probability, slots
    for b in range(2):
        for i in range(anchors.shape[1]):
            if not valid[b, i]:
                continue
            a = int(anchors[b, i])
            block_ids = torch.tensor([[int(ids[b, a])] + [MASK_ID] * (blk - 1)])
            pos = torch.cat([torch.arange(a), a + torch.arange(blk)]).unsqueeze(0)
            with torch.no_grad():
                q_logits = head(draft(embed(block_ids), batch.hidden_states[b : b + 1, :a], pos, None))[0, 1:]
            k_ok = [a + k < ids.shape[1] and bool(lm[b, a + k]) for k in range(1, blk)]
            p = naive_filtered_probs(t_logits[b, a : a + blk - 1], 1.0, 0.9, 12)
            q = naive_filtered_probs(q_logits, 1.0, 0.9, 12)
            alpha_s = [float(torch.minimum(p[k], q[k]).sum()) if k_ok[k] else 0.0 for k in range(blk - 1)]
            alpha_g = [float(p[k, q_logits[k].argmax()]) if k_ok[k] else 0.0 for k in range(blk - 1)]
            for k in range(blk - 1):  # label slot k + 1: the token at a + k + 1
                if k_ok[k]:
                    part = split["slot1" if k == 0 else "later"]
                    part[0] += int(q_logits[k].argmax()) == int(ids[b, a + k + 1])
                    part[1] += alpha_s[k]
                    part[2] += 1
            for alpha, acc in ((alpha_s, "s"), (alpha_g, "g")):
                run, length = 1.0, 1.0
                for x in alpha:
                    run *= x
                    length += run
                if acc == "s":
                    want_s += length
                else:
                    want_g += length
            n_blocks += 1
            if b == 0 and i == 0 and all(k_ok):  # Monte Carlo through the decoder's accept rule
                trials, total = 3000, 0
                for _ in range(trials):
                    d, dq = propose_tokens(q_logits, s, g)
                    n_acc, _ = verify_block(d, t_logits[b, a : a + blk], s, dq, g)
                    total += n_acc + 1
                assert total / trials == pytest.approx(
                    float(expected_block_length(torch.tensor(alpha_s))), abs=0.06)
    assert float(out.sampled_blocks) == n_blocks
    assert float(out.sampled_accept_sum) == pytest.approx(want_s, rel=1e-4)
    assert float(out.greedy_draft_accept_sum) == pytest.approx(want_g, rel=1e-4)
    assert float(out.sampled_accept_sum) < float(out.accept_sum) + n_blocks * (blk - 1)  # not trivially maximal
    # the split by slot: the first label slot against the later ones, at T=0 (hits) and under sampling
    for name in ("slot1", "later"):
        hits, accept, slots = split[name]
        assert slots > 0 and float(getattr(out, f"{name}_slots")) == slots
        assert float(getattr(out, f"{name}_greedy_sum")) == hits
        assert float(getattr(out, f"{name}_sampled_sum")) == pytest.approx(accept, rel=1e-4)
    rates = LossSums.from_vector(out.sums()).rates("eval_")
    assert rates["eval_sampled_slot1_accept"] == pytest.approx(split["slot1"][1] / split["slot1"][2], rel=1e-4)
    assert rates["eval_later_accept"] == pytest.approx(split["later"][0] / split["later"][2], rel=1e-6)


def test_training_steps_do_not_pay_for_the_metric():
    """With grad enabled (a training step) the metric is not computed, even with final hidden states."""
    target = train_qwen3(num_layers=2)
    draft = train_draft(target)
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    ids, attn, lm = random_batch(bsz=1, seq=30, pad_last=0)
    batch = wrapper.generate_batch(ids, attn, lm, return_final_hidden=True)
    module = DFlashTrainerModule(draft, wrapper.get_input_embeddings(), wrapper.get_output_embeddings(),
                                 num_anchors=3, accept_sampling=SamplingParams(1.0))
    out = module(batch, generator=torch.Generator().manual_seed(0))
    assert out.sampled_blocks is None and out.sums()[[f.name for f in fields(LossSums)].index("sampled_blocks")] == 0


def test_recipe_refuses_bad_eval_sampling(tmp_path):
    from nemo_dflash.config import ConfigError, load_recipe

    with pytest.raises(ConfigError, match="eval_top_p"):
        load_recipe("smollm2_135m.yaml", ["train.eval_top_p=0"])


def test_keyed_uniform_over_the_vocabulary_is_the_murmur_formula_row_by_row():
    """The whole-vocabulary path (column hashes read from a cache, so a compiled step never folds the
    hash constant into int32 index arithmetic) gives, bit for bit, the murmur3-mixed formula written out
    here, and the per-row candidate path on the same ids."""
    from nemo_dflash.engine.sampling import keyed_uniform

    def fmix(h):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    keys, positions, V = torch.tensor([3, 70000]), torch.tensor([0, 513]), 37
    u = keyed_uniform(11, keys, positions, torch.arange(V))
    for r in range(2):
        row = fmix((int(keys[r]) * 0x9E3779B1 + 11) & 0xFFFFFFFF)
        row = fmix((row ^ (int(positions[r]) * 0x85EBCA77)) & 0xFFFFFFFF)
        want = [(fmix((row + t * 0xC2B2AE3D) & 0xFFFFFFFF) + 0.5) / 2.0**32 for t in range(V)]
        assert torch.equal(u[r], torch.tensor(want, dtype=torch.float64).float())
    ids = torch.arange(V).expand(2, V)
    assert torch.equal(keyed_uniform(11, keys, positions, ids), u)


def test_keyed_draw_is_the_inverse_cdf_of_one_keyed_uniform_and_follows_the_weights():
    """`keyed_draw` against a hand-written inverse CDF of the row's keyed uniform (token 0's hash), row by
    row; unnormalised weights and zero-weight tokens (never drawn); over 20,000 keys its frequencies match
    the normalised weights within 0.012."""
    from nemo_dflash.engine.sampling import keyed_draw, keyed_uniform

    w = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0], [0.5, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    keys, positions = torch.tensor([5, 9, 123456789]), torch.tensor([0, 7, 4000])
    got = keyed_draw(3, keys, positions, w)
    for r in range(3):
        u = float(keyed_uniform(3, keys[r : r + 1], positions[r : r + 1], torch.zeros(1, 1, dtype=torch.long)))
        target, cum = u * float(w[r].sum()), 0.0
        want = next(t for t in range(5) if (cum := cum + float(w[r, t])) >= target)
        assert int(got[r]) == want
    n = 20000
    draws = keyed_draw(7, torch.arange(n), torch.full((n,), 11), w[0].expand(n, -1))
    freq = torch.bincount(draws, minlength=5).float() / n
    assert freq[0] == 0 and freq[2] == 0
    assert (freq - w[0] / w[0].sum()).abs().max() < 0.012


def test_compiled_sampling_steps_leave_every_scan_to_eager_cumsum():
    """Inductor's split scan failed to generate code for the T=1 verify step at 244 x 49,152 on an H200: the
    sampled steps' cumsums (top-p and the keyed draws) run eagerly between the compiled pieces. Checked on the
    graphs dynamo makes of `sampled_verify` and `sampled_next_tokens` with top-p on: no graph holds a cumsum, and
    the compiled functions draw what the eager ones draw."""
    import torch._dynamo

    from nemo_dflash.engine import sampling

    torch.manual_seed(0)
    R, K, V = 3, 4, 50
    inv_temp, top_p, top_k = torch.tensor(1.25), torch.tensor(0.9), torch.tensor(0)
    keys, first = torch.arange(R) * 7 + 1, torch.arange(R) + 10
    q = torch.softmax(torch.randn(R, K, V), dim=-1)
    proposals = torch.multinomial(q.view(-1, V), 1).view(R, K)
    cases = [(sampling.sampled_verify, (torch.randn(R, K + 1, V), inv_temp, top_p, top_k, q, proposals, keys, first,
                                        True)),
             (sampling.sampled_next_tokens, (torch.randn(R, V), inv_temp, top_p, top_k, keys, first, True))]
    for fn, args in cases:
        torch._dynamo.reset()
        explained = torch._dynamo.explain(fn)(*args)
        assert explained.graph_count >= 2, fn.__name__  # cut at each eager cumsum
        code = "\n".join(g.code for g in explained.graphs)
        assert "cumsum" not in code, fn.__name__
        torch._dynamo.reset()
        got, want = torch.compile(fn, dynamic=False)(*args), fn(*args)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert torch.equal(a, b), fn.__name__
    torch._dynamo.reset()


def test_compiled_nucleus_bisection_has_no_sort_and_keeps_what_eager_keeps(monkeypatch):
    """The sort-free nucleus (forced here on a short vocabulary) under torch.compile on a CPU: no graph sorts or
    scans, and the compiled plain step draws what the eager one draws, with the filter keeping the same tokens."""
    import torch._dynamo

    from nemo_dflash.engine import sampling

    monkeypatch.setattr(sampling, "SORT_BELOW", 0)
    g = torch.Generator().manual_seed(3)
    R, V = 4, 300
    logits, keys, pos = torch.randn(R, V, generator=g) * 3, torch.arange(R) * 5 + 2, torch.arange(R) + 7
    args = (logits, torch.tensor(1.0), torch.tensor(0.8), torch.tensor(0), keys, pos, True)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(sampling.sampled_next_tokens)(*args)
    code = "\n".join(gr.code for gr in explained.graphs)
    assert "sort" not in code and "cumsum" not in code and code.count(".sum(") >= 31
    torch._dynamo.reset()
    assert torch.equal(torch.compile(sampling.sampled_next_tokens, dynamic=False)(*args),
                       sampling.sampled_next_tokens(*args))
    keep = torch.compile(sampling.nucleus_keep, dynamic=False)(logits, torch.tensor(0.8))
    assert torch.equal(keep, sampling.nucleus_keep(logits, torch.tensor(0.8))) and 1 < keep.sum() < R * V
    torch._dynamo.reset()


def test_keyed_draw_is_never_a_compiled_frame_of_its_own():
    """A T=1 run on an H200 hit dynamo's recompile limit on `keyed_draw`: the part after its eager cumsum became a
    frame of its own, compiled again for each row count and grad mode. It runs eagerly: compiling the sampled
    verify step at three row counts, with and without grad, leaves no compiled code for `keyed_draw`."""
    import torch._dynamo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from nemo_dflash.engine import sampling

    torch._dynamo.reset()
    K, V = 4, 50
    step = torch.compile(sampling.sampled_verify, dynamic=False)
    for R, grad in ((1, False), (2, True), (3, False), (3, True)):
        q = torch.softmax(torch.randn(R, K, V), dim=-1)
        args = (torch.randn(R, K + 1, V), torch.tensor(1.0), torch.tensor(1.0), torch.tensor(0), q,
                torch.multinomial(q.view(-1, V), 1).view(R, K), torch.arange(R) + 1, torch.arange(R) + 10, True)
        with torch.set_grad_enabled(grad):
            got, want = step(*args), sampling.sampled_verify(*args)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    code = getattr(sampling.keyed_draw, "__wrapped__", sampling.keyed_draw).__code__
    assert _debug_get_cache_entry_list(code) == []
    torch._dynamo.reset()


def naive_nucleus(row: torch.Tensor, top_p: float) -> set[int]:
    """The top-p nucleus of one row of scores, token by token in float64: walk the tokens from the most probable,
    equal scores in token-id order (a stable sort's), each kept while the mass before it is below top_p."""
    finite = [(float(s), i) for i, s in enumerate(row.tolist()) if s != float("-inf")]
    top = max(s for s, _ in finite)
    z = sum(math.exp(s - top) for s, _ in finite)
    kept, mass = set(), 0.0
    for s, i in sorted(finite, key=lambda t: (-t[0], t[1])):
        if mass >= top_p:
            break
        kept.add(i)
        mass += math.exp(s - top) / z
    return kept


def sorted_nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """What `filter_scores` ran without a top-k before its threshold: a sort (stable here: ties in token order)
    and a cumulative sum (here of the same softmax, in float64: the softmax of a sorted row rounds its last bits
    otherwise)."""
    probs, order = scores.softmax(dim=-1).sort(dim=-1, descending=True, stable=True)
    probs = probs.double()
    top_p = float(torch.tensor(top_p, dtype=torch.float32))  # as a buffer holds it
    keep = torch.zeros(scores.shape, dtype=torch.bool).scatter(-1, order, ~(probs.cumsum(-1) - probs >= top_p))
    return scores.masked_fill(~keep, float("-inf"))


def nucleus_rows() -> torch.Tensor:
    """[8, 400] scores: random, random with ties (rounded), masked tokens at -inf, one finite token, a flat row
    (399 tokens)."""
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(8, 400, generator=g) * 2.5
    rows[2:4] = (rows[2:4] * 2).round() / 2  # a few dozen distinct values: ties wherever the boundary falls
    rows[4, torch.rand(400, generator=g) < 0.6] = float("-inf")
    rows[5, 1:] = float("-inf")
    rows[6] = 0.0
    rows[6, 0] = float("-inf")  # flat over 399 tokens: over 400, top-p k/400 is exactly a boundary (floats decide)
    return rows


@pytest.mark.parametrize("path", ["bisection", "sort"])
def test_nucleus_filter_against_a_naive_nucleus_that_breaks_ties_by_token_id(path, monkeypatch):
    """`filter_scores` without a top-k (the sort-free bisection on a vocabulary, a sort on short rows) keeps
    exactly the naive nucleus, ties at the boundary broken by token id, on rows with ties, masked tokens and a
    flat row, for top-p from tiny to 1, python or 0-d tensor, and on [..., V] scores."""
    from nemo_dflash.engine import sampling

    monkeypatch.setattr(sampling, "SORT_BELOW", 10**9 if path == "sort" else 0)
    rows = nucleus_rows()
    for top_p in (1e-6, 0.05, 0.3, 0.62, 0.9, 0.995, 1.0):
        want = torch.full(rows.shape, float("-inf"))
        for r in range(rows.shape[0]):
            ids = sorted(naive_nucleus(rows[r], top_p))
            want[r, ids] = rows[r, ids]
        for given in (top_p, torch.tensor(top_p)):
            assert torch.equal(filter_scores(rows, given), want), (top_p, given)
        assert torch.equal(filter_scores(rows.view(2, 4, 400), torch.tensor(top_p)), want.view(2, 4, 400))
    # a boundary inside a tie: p = (0.2, 0.4, 0.2, 0.1, 0.1) at top-p 0.5 keeps the 0.4 and the first 0.2;
    # (0.3, 0.175 x 4) at top-p 0.6 keeps two of the four tied tokens, the first two in token order
    tie = torch.tensor([[0.2, 0.4, 0.2, 0.1, 0.1], [0.175, 0.3, 0.175, 0.175, 0.175]]).log()
    for row, top_p, want in ((0, 0.5, [True, True, False, False, False]), (1, 0.6, [True, True, True, False, False])):
        for given in (top_p, torch.tensor(top_p)):
            assert (~torch.isinf(filter_scores(tie[row:row + 1], given))).tolist() == [want], (row, given)
        assert (~torch.isinf(sorted_nucleus(tie[row:row + 1], top_p))).tolist() == [want]


def test_nucleus_filter_equals_the_sort_it_replaced_without_ties():
    """Rows without ties, a vocabulary's length (the bisection): the same tokens as a sort and a cumulative sum."""
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(4, 20000, generator=g) * 4
    for top_p in (0.01, 0.5, 0.8, 0.95):
        assert torch.equal(filter_scores(scores, torch.tensor(top_p)), sorted_nucleus(scores, top_p)), top_p


def test_the_plain_step_draws_the_nucleus_law_ties_by_token_id(monkeypatch):
    """The engine's plain sampled step (`sampled_next_tokens`, top-p from a buffer, no top-k) over 20,000 keys,
    through the bisection: frequencies match the nucleus law written out by hand, of the boundary's tied tokens
    the first in token order kept (keeping both 0.2s would draw 0.5, 0.25, 0.25)."""
    from nemo_dflash.engine import sampling

    monkeypatch.setattr(sampling, "SORT_BELOW", 0)
    n = 20000
    cases = [([0.4, 0.2, 0.2, 0.1, 0.1], 0.5, [2 / 3, 1 / 3, 0, 0, 0]),
             ([0.5, 0.25, 0.15, 0.06, 0.04], 0.8, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0, 0])]
    for p, top_p, law in cases:
        logits = torch.tensor(p).log().expand(n, 5)
        draws = sampling.sampled_next_tokens(logits, torch.tensor(1.0), torch.tensor(top_p), torch.tensor(0),
                                             torch.arange(n) * 7919 + 11, torch.full((n,), 3), True)
        freq = torch.bincount(draws, minlength=5).float() / n
        law = torch.tensor(law)
        assert freq[law == 0].sum() == 0 and (freq - law).abs().max() < 0.015, (p, freq)


def test_filter_with_a_top_k_cap_equals_the_full_sort():
    """`filter_scores` ranking only the k_cap largest scores (a step made for one top-k, or a python top-k) keeps
    exactly the tokens the full sort keeps, for tensor and python settings and p from tight to off; a setting's
    top-k above the step's cap is refused when the step is configured."""
    from nemo_dflash.engine.static_decode import SampledStepState

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 5, 1000, generator=g) * 3
    ties = scores[0, 0].clone()
    ties[10:20] = ties.max() + 1  # ten equal scores at the top: either rule may keep any of them
    for top_k in (1, 7, 20):
        for top_p in (0.3, 0.9, 1.0):
            full = filter_scores(scores, torch.tensor(top_p), torch.tensor(top_k))  # tensors: the full sort
            capped = filter_scores(scores, torch.tensor(top_p), torch.tensor(top_k), k_cap=top_k)
            python = filter_scores(scores, top_p, top_k)  # a python top-k is its own cap
            for got in (capped, python):
                assert torch.equal(torch.isinf(got), torch.isinf(full)) and torch.equal(got[~torch.isinf(got)],
                                                                                        full[~torch.isinf(full)])
            assert (~torch.isinf(full)).sum(-1).max() <= top_k
            a = filter_scores(ties, torch.tensor(top_p), torch.tensor(top_k))
            b = filter_scores(ties, torch.tensor(top_p), torch.tensor(top_k), k_cap=top_k)
            assert torch.equal(a[~torch.isinf(a)].sort().values, b[~torch.isinf(b)].sort().values)
    state = SampledStepState(2, torch.device("cpu"), k_cap=20)
    state.configure(SamplingParams(0.7, top_p=0.8, top_k=20))
    with pytest.raises(ValueError, match="top-k <= 20"):
        state.configure(SamplingParams(0.7, top_k=50))
    with pytest.raises(ValueError, match="without top-k"):  # its steps filter by top-p alone
        SampledStepState(2, torch.device("cpu")).configure(SamplingParams(0.7, top_k=5))
