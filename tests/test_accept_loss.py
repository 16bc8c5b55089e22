"""The acceptance loss term (`loss.accept_weight`, nemo_dflash/objective/accept_loss.py) against brute force.

The chunked term and its gradient against full softmaxes, a naive sum of min(p, q) and torch autograd (fp64
in); the trainer module's whole loss, (1 - d - w) hard CE + d soft CE + w term with the decay weights, against
the same written from full logits per block slot, padded and packed, invalid labels included; weight 0 is
today's loss; a few optimizer steps on the term raise the accept probability; the config errors.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import nemo_dflash.objective.trainer_module as trainer_module
import nemo_dflash.objective.fused_loss as fl
from _torchrun import run_command
from _tiny_models import VOCAB, random_batch, train_draft, train_qwen3
from nemo_dflash.objective.accept_loss import accept_lm_loss
from nemo_dflash.config import ConfigError, load_recipe
from nemo_dflash.objective.anchors import block_positions, loss_decay_weights, plan_blocks, sample_anchors
from nemo_dflash.objective.metrics import LossSums
from nemo_dflash.objective.trainer_module import DFlashTrainerModule, draft_block_hidden
from nemo_dflash.data.packing import PackedCollator
from nemo_dflash.target import HFDFlashTargetModel

REPO = Path(__file__).resolve().parents[1]


def naive_accept(h, w, teacher, temperature=1.0, form="log", teacher_is_logits=False):
    """Per-row term and a from full softmaxes: a = sum_x min(p_T(x), q(x)); log: -log a, tv: 1 - a."""
    q = (h @ w.T).softmax(-1)
    t = teacher if teacher_is_logits else teacher @ w.T
    p = (t / temperature).softmax(-1)
    a = torch.minimum(p, q).sum(-1)
    return (-a.log() if form == "log" else 1 - a), a


def _problem(n=29, hid=12, vocab=200, m=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hid, generator=g, dtype=torch.float64) * 0.6
    h = torch.randn(n, hid, generator=g, dtype=torch.float64)
    th = torch.randn(m, hid, generator=g, dtype=torch.float64)
    index = torch.randint(0, m, (n,), generator=g)  # rows share target positions, as block slots do
    wts = torch.rand(n, generator=g, dtype=torch.float64)
    return h, w, th, index, wts


@pytest.mark.parametrize("form", ["log", "tv"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_term_and_gradient_match_brute_force(form, temperature, chunk):
    h, w, th, index, wts = _problem()
    h1 = h.clone().requires_grad_(True)
    loss, a = accept_lm_loss(h1, w, th, chunk, index=index, temperature=temperature, form=form)
    (loss * wts).sum().backward()
    h2 = h.clone().requires_grad_(True)
    ref, ref_a = naive_accept(h2, w, th[index], temperature, form)
    (ref * wts).sum().backward()
    assert loss.dtype == a.dtype == torch.float32 and h1.grad.dtype == torch.float64
    # fp64 in, the per-row buffers are fp32: agreement to fp32 rounding
    torch.testing.assert_close(a.double(), ref_a.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-7)
    assert float(a.min()) > 0 and float(a.max()) <= 1


def test_target_logits_give_the_term_of_its_hidden_states_and_no_grad_the_same_values():
    h, w, th, index, _ = _problem(seed=1)
    by_hidden, a1 = accept_lm_loss(h, w, th, 4, index=index, temperature=0.8)
    by_logits, a2 = accept_lm_loss(h, w, th @ w.T, 4, index=index, temperature=0.8, teacher_is_logits=True)
    torch.testing.assert_close(by_logits, by_hidden)
    torch.testing.assert_close(a2, a1)
    with torch.no_grad():  # held-out evaluation: values only
        plain, a3 = accept_lm_loss(h.clone().requires_grad_(True), w, th[index], 7)
    torch.testing.assert_close(a3.double(), naive_accept(h, w, th[index])[1], rtol=1e-6, atol=1e-7)
    assert not plain.requires_grad


def test_log_form_is_hard_ce_of_a_one_hot_target():
    """With the target's p one-hot (T -> 0), a = q(y) and -log a is the hard CE of y."""
    h, w, th, index, _ = _problem(seed=2)
    logits = th[index] @ w.T
    loss, a = accept_lm_loss(h, w, logits, 3, temperature=1e-6, teacher_is_logits=True)
    ce = F.cross_entropy(h @ w.T, logits.argmax(-1), reduction="none")
    torch.testing.assert_close(loss.double(), ce, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_refused():
    h, w, th, index, _ = _problem()
    with pytest.raises(ValueError, match="frozen lm_head"):
        accept_lm_loss(h, w.clone().requires_grad_(True), th, 4, index=index)
    with pytest.raises(ValueError, match="accept_temperature"):
        accept_lm_loss(h, w, th, 4, index=index, temperature=0.0)
    with pytest.raises(ValueError, match="accept_form"):
        accept_lm_loss(h, w, th, 4, index=index, form="kl")


# ----------------------------------------------------------------------------- the trainer module


def _tiny(block=4):
    target = train_qwen3()
    target.config._attn_implementation = "sdpa"
    draft = train_draft(target, block_size=block)
    return HFDFlashTargetModel(target, draft.config.target_layer_ids), draft


def _module(wrapper, draft, **kw):
    return DFlashTrainerModule(draft, wrapper.get_input_embeddings(), wrapper.get_output_embeddings(),
                               loss_decay_gamma=kw.pop("gamma", 7.0), attn_backend="sdpa", **kw)


def _batches(wrapper, packed: bool):
    """(target batch, plan): right-padded rows with prompts (invalid labels) and an invalid block, or packed
    rows of several documents (slots past a document's end and padding carry no label)."""
    if not packed:
        ids, attn, lm = random_batch(bsz=2, seq=40, pad_last=9, prompt_len=7)
        anchors, valid = sample_anchors(lm, attn, 4, 6, torch.Generator().manual_seed(4))
        valid[0, -1] = False  # a padding block
        tb = wrapper.generate_batch(ids, attn, lm, return_final_hidden=True)
        return tb, plan_blocks(ids, lm, attn, 4, 6, anchors=anchors, valid=valid)
    g = torch.Generator().manual_seed(5)
    docs = []
    for n in (13, 20, 9, 16):
        lm = [0] * 3 + [1] * (n - 3)
        docs.append({"input_ids": torch.randint(0, VOCAB - 1, (n,), generator=g).tolist(), "loss_mask": lm})
    pk = PackedCollator(pad_token_id=0, rows=2, pack_length=40)(docs)
    tb = wrapper.generate_batch(pk["input_ids"], pk["attention_mask"], pk["loss_mask"],
                                position_ids=pk["position_ids"], doc_ids=pk["doc_ids"], return_final_hidden=True)
    # rows: documents 13 + 20 and 9 + 16 tokens (first fit); blocks running past their document's end (11, 6)
    # or into padding (23), and an invalid block
    anchors = torch.tensor([[5, 9, 11, 18, 22, 0], [3, 6, 12, 16, 20, 23]])
    valid = torch.tensor([[True] * 5 + [False], [True] * 6])
    plan = plan_blocks(pk["input_ids"], pk["loss_mask"], pk["attention_mask"], 4, 6, anchors=anchors, valid=valid,
                       doc_ids=pk["doc_ids"], position_ids=pk["position_ids"])
    assert plan.sel is None and bool((~plan.label_valid[..., 1:]).any())
    return tb, plan


def brute_force_loss(wrapper, draft, tb, plan, d, w_acc, temperature, form, gamma=7.0):
    """(1 - d - w) hard CE + d soft CE + w term summed with the decay weights, one block slot at a time from
    full logits (slot k of the block at a: label token[a + k], the target's distribution at a + k - 1);
    also (weight sum, sum of a over valid slots, valid slots)."""
    blk = draft.block_size
    seq = tb.input_ids.shape[1]
    hidden = draft_block_hidden(draft, wrapper.get_input_embeddings(), tb.input_ids, tb.hidden_states,
                                tb.attention_mask, plan.anchors, plan.valid, blk, draft.config.mask_token_id,
                                ctx_pos=tb.position_ids, anchor_pos=plan.anchor_pos, ctx_start=plan.ctx_start)
    head = wrapper.get_output_embeddings()
    decay = loss_decay_weights(blk, gamma)
    pos = block_positions(plan.anchors, blk)
    total = hidden.new_zeros(())
    wsum = a_sum = slots = 0.0
    for b in range(hidden.shape[0]):
        for i in range(plan.anchors.shape[1]):
            for k in range(1, blk):
                if not plan.label_valid[b, i, k]:
                    continue
                logits = head(hidden[b, i * blk + k]).double()
                t_logits = head(tb.final_hidden[b, int(pos[b, i, k]) - 1]).double()
                y = tb.input_ids[b, min(int(pos[b, i, k]), seq - 1)]
                hard = -logits.log_softmax(-1)[y]
                soft = -(t_logits.softmax(-1) * logits.log_softmax(-1)).sum()
                a = torch.minimum((t_logits / temperature).softmax(-1), logits.softmax(-1)).sum()
                term = -a.log() if form == "log" else 1 - a
                total = total + float(decay[k]) * ((1 - d - w_acc) * hard + d * soft + w_acc * term)
                wsum += float(decay[k])
                a_sum += float(a.detach())
                slots += 1
    return total, wsum, a_sum, slots


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("d, w_acc, temperature, form, chunk", [
    (0.0, 0.5, 1.0, "log", 4096), (0.3, 0.4, 0.7, "log", 3), (0.0, 1.0, 1.0, "tv", 5), (0.5, 0.5, 1.3, "tv", 7),
])
def test_module_loss_and_grads_match_brute_force(packed, d, w_acc, temperature, form, chunk):
    wrapper, draft = _tiny()
    tb, plan = _batches(wrapper, packed)
    module = _module(wrapper, draft, distill_weight=d, accept_weight=w_acc, accept_temperature=temperature,
                     accept_form=form, ce_chunk_size=chunk)
    draft.zero_grad(set_to_none=True)
    out = module(tb, plan=plan)
    out.loss_sum.backward()
    got = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad(set_to_none=True)
    ref, wsum, a_sum, slots = brute_force_loss(wrapper, draft, tb, plan, d, w_acc, temperature, form)
    ref.backward()
    want = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    assert slots > 0
    assert float(out.loss_sum.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    assert float(out.weight_sum) == pytest.approx(wsum, rel=1e-6)
    assert float(out.accept_prob_slots) == slots == float(out.num_labels)
    assert float(out.accept_prob_sum) == pytest.approx(a_sum, rel=1e-5)
    assert got.keys() == want.keys() and want
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, rtol=1e-3, atol=1e-6, msg=n)
    rates = LossSums.from_vector(out.sums()).rates()
    assert rates["accept_prob"] == pytest.approx(a_sum / slots, rel=1e-5)


def test_target_logits_batch_gives_the_final_hidden_loss():
    wrapper, draft = _tiny()
    ids, attn, lm = random_batch(bsz=2, seq=40)
    anchors, valid = sample_anchors(lm, attn, 4, 5, torch.Generator().manual_seed(6))
    module = _module(wrapper, draft, accept_weight=0.6, accept_temperature=0.8, ce_chunk_size=6)
    outs = [module(wrapper.generate_batch(ids, attn, lm, **kw), anchors=anchors, valid=valid)
            for kw in ({"return_final_hidden": True}, {"return_logits": True})]
    assert float(outs[1].loss_sum.detach()) == pytest.approx(float(outs[0].loss_sum.detach()), rel=1e-5)
    with pytest.raises(ValueError, match="accept_weight > 0 needs the target's distribution"):
        module(wrapper.generate_batch(ids, attn, lm), anchors=anchors, valid=valid)


@pytest.mark.parametrize("d", [0.0, 0.5])
def test_accept_weight_zero_is_todays_loss_bit_for_bit(d):
    """Off (the default), the step's loss, sums and gradients are exactly those of a module built without the
    keys, and no accept figure is logged."""
    wrapper, draft = _tiny()
    ids, attn, lm = random_batch(bsz=2, seq=40)
    anchors, valid = sample_anchors(lm, attn, 4, 5, torch.Generator().manual_seed(7))
    tb = wrapper.generate_batch(ids, attn, lm, return_final_hidden=True)
    results = []
    for kw in ({}, {"accept_weight": 0.0, "accept_temperature": 0.5, "accept_form": "tv"}):
        draft.zero_grad(set_to_none=True)
        out = _module(wrapper, draft, distill_weight=d, ce_chunk_size=9, **kw)(tb, anchors=anchors, valid=valid)
        out.loss_sum.backward()
        results.append((out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    (ref, ref_g), (got, got_g) = results
    assert torch.equal(got.loss_sum, ref.loss_sum) and torch.equal(got.sums(), ref.sums())
    assert got.accept_prob_slots is None and "accept_prob" not in LossSums.from_vector(got.sums()).rates()
    assert got_g.keys() == ref_g.keys() and all(torch.equal(got_g[n], g) for n, g in ref_g.items())


def test_the_fused_kernel_path_adds_the_same_term(monkeypatch):
    """With a kernel chosen (a naive per-token CE standing in for liger / cce), the step's loss and gradients
    with the acceptance term on equal the chunked step's."""
    wrapper, draft = _tiny()
    ids, attn, lm = random_batch(bsz=2, seq=40)
    anchors, valid = sample_anchors(lm, attn, 4, 5, torch.Generator().manual_seed(8))
    tb = wrapper.generate_batch(ids, attn, lm, return_final_hidden=True)
    calls = []
    monkeypatch.setattr(fl, "per_token_ce", lambda impl, h, w, y: calls.append(impl) or (
        F.cross_entropy(h @ w.T, y, reduction="none").float(), None))
    monkeypatch.setattr(trainer_module, "resolve_loss_impl", lambda name, device: name)
    results = []
    for impl in ("chunked", "liger"):
        draft.zero_grad(set_to_none=True)
        out = _module(wrapper, draft, distill_weight=0.3, accept_weight=0.4, loss_impl=impl)(
            tb, anchors=anchors, valid=valid)
        out.loss_sum.backward()
        results.append((out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    assert calls == ["liger"]
    (ref, ref_g), (got, got_g) = results
    assert float(got.loss_sum.detach()) == pytest.approx(float(ref.loss_sum.detach()), rel=1e-5)
    assert float(got.accept_prob_sum) == float(ref.accept_prob_sum)
    for n, g in ref_g.items():
        torch.testing.assert_close(got_g[n], g, rtol=1e-4, atol=1e-6)


def test_module_refuses_bad_weights():
    wrapper, draft = _tiny()
    for kw, msg in (({"accept_weight": 1.5}, "accept_weight must be in"),
                    ({"accept_temperature": float("inf"), "accept_weight": 0.5}, "accept_temperature"),
                    ({"accept_weight": 0.6, "distill_weight": 0.6}, "distill_weight \\+ accept_weight")):
        with pytest.raises(ValueError, match=msg):
            _module(wrapper, draft, **kw)


def test_training_on_the_term_raises_the_accept_probability():
    """A toy problem: a few AdamW steps with the term alone (weight 1) on one batch raise the mean accept
    probability the step logs, and the term falls (T = 0.2 sharpens the tiny random target's flat distribution:
    at T = 1 the untrained draft already keeps 95%)."""
    wrapper, draft = _tiny()
    ids, attn, lm = random_batch(bsz=2, seq=40)
    anchors, valid = sample_anchors(lm, attn, 4, 8, torch.Generator().manual_seed(9))
    tb = wrapper.generate_batch(ids, attn, lm, return_final_hidden=True)
    module = _module(wrapper, draft, accept_weight=1.0, accept_temperature=0.2, gamma=None)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    accepts, terms = [], []
    for _ in range(8):
        opt.zero_grad(set_to_none=True)
        out = module(tb, anchors=anchors, valid=valid)
        out.loss.backward()
        opt.step()
        rates = LossSums.from_vector(out.sums()).rates()
        accepts.append(rates["accept_prob"])
        terms.append(rates["loss"])
    assert all(torch.isfinite(torch.tensor(terms)))
    assert accepts[-1] > accepts[0] + 0.03 and terms[-1] < terms[0], (accepts, terms)
    assert all(0 < x <= 1 for x in accepts)


def test_train_command_with_the_term_on_logs_its_accept_probability(tmp_path):
    """The `train` command end to end on the tiny target with `loss.accept_weight` on: every logged step and
    held-out evaluation carries `accept_prob` / `eval_accept_prob` (two steps, one held-out batch an evaluation)."""
    from _tiny_target import make_tiny_target_dir, tiny_train_args, write_chat_jsonl
    from nemo_dflash.recipes.train import main

    target, data = make_tiny_target_dir(tmp_path / "assets"), write_chat_jsonl(tmp_path / "chat.jsonl", n=24)
    out = tmp_path / "run"
    main(tiny_train_args(target, data, out, "train.max_steps=2", "train.eval_every=2", "train.eval_batches=1",
                         "loss.accept_weight=0.5", "loss.distill_weight=0.25", "loss.accept_temperature=0.7"))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    assert len(steps) == 2 and all(0 < r["accept_prob"] <= 1 and math.isfinite(r["loss"]) for r in steps)
    assert [r["step"] for r in evals] == [0, 2] and all(0 < r["eval_accept_prob"] <= 1 for r in evals)


# ----------------------------------------------------------------------------- the recipe keys


@pytest.mark.parametrize("override, msg", [
    ("loss.accept_weight=1.5", "loss.accept_weight must be in [0, 1]"),
    ("loss.accept_weight=-0.1", "loss.accept_weight must be in [0, 1]"),
    ("loss.accept_weight=nan", "loss.accept_weight must be in [0, 1]"),
    ("loss.accept_temperature=0", "loss.accept_temperature must be a finite number > 0"),
    ("loss.accept_temperature=-1.0", "loss.accept_temperature must be a finite number > 0"),
    ("loss.accept_temperature=inf", "loss.accept_temperature must be a finite number > 0"),
    ("loss.accept_form=kl", "'loss.accept_form' must be one of ['log', 'tv'], got 'kl'"),
], ids=lambda v: v if "=" in v else "")
def test_bad_values_are_one_line_config_errors(override, msg):
    with pytest.raises(ConfigError) as e:
        load_recipe("qwen3_8b.yaml", [override])
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_weights_over_one_are_refused_and_good_values_load():
    with pytest.raises(ConfigError, match=r"loss\.distill_weight \+ loss\.accept_weight must be <= 1"):
        load_recipe("qwen3_8b.yaml", ["loss.distill_weight=0.7", "loss.accept_weight=0.4"])
    cfg = load_recipe("qwen3_8b.yaml", ["loss.distill_weight=0.7", "loss.accept_weight=0.3",
                                        "loss.accept_temperature=0.8", "loss.accept_form=tv"])
    assert (cfg.loss.accept_weight, cfg.loss.accept_temperature, cfg.loss.accept_form) == (0.3, 0.8, "tv")
    assert load_recipe("qwen3_8b.yaml").loss.accept_weight == 0.0  # off by default


def test_the_train_command_refuses_a_bad_weight_in_one_line(tmp_path):
    """Refused while the recipe is read: exit 2, one line, before the (8B) target could load."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = run_command([sys.executable, "-m", "nemo_dflash.recipes.train", "--config", "qwen3_8b.yaml",
                     "loss.accept_weight=2"], 120, env=env, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "loss.accept_weight must be in [0, 1]" in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
