"""The trainer module against independent references: brute-force masks, per-block inference."""

import math

import pytest
import torch
import torch.nn.functional as F

from _tiny_models import MASK_ID, random_batch, train_draft, train_qwen3
from nemo_dflash.objective.anchors import build_block_input_ids, build_labels, loss_decay_weights, sample_anchors
from nemo_dflash.objective.block_mask import build_dense_block_mask, build_flex_block_mask
from nemo_dflash.objective.cross_entropy import chunked_lm_loss, teacher_expected_embedding
from nemo_dflash.objective.metrics import acceptance_lengths
from nemo_dflash.objective.trainer_module import DFlashTrainerModule
from nemo_dflash.target import HFDFlashTargetModel


def brute_force_mask(anchors, valid, key_valid, block):
    """Written from the rules, one (query, key) pair at a time."""
    bsz, n_blk = anchors.shape
    seq = key_valid.shape[1]
    q_len = n_blk * block
    out = torch.zeros(bsz, 1, q_len, seq + q_len, dtype=torch.bool)
    for b in range(bsz):
        for q in range(q_len):
            i = q // block
            if not valid[b, i]:
                continue
            a = int(anchors[b, i])
            for j in range(seq):
                out[b, 0, q, j] = j < a and bool(key_valid[b, j])
            for kk in range(q_len):
                out[b, 0, q, seq + kk] = kk // block == i
    return out


@pytest.mark.parametrize("seed", range(4))
def test_dense_mask_matches_brute_force(seed):
    block = 4
    ids, attn, lm = random_batch(bsz=3, seq=30, seed=seed, pad_last=8)
    anchors, valid = sample_anchors(lm, attn, block, num_anchors=5, generator=torch.Generator().manual_seed(seed))
    valid[0, -1] = False  # a padding block
    anchors[1, 0] = 0  # the j < anchor edge: nothing of the context visible
    mask = build_dense_block_mask(anchors, valid, attn, block)
    assert torch.equal(mask, brute_force_mask(anchors, valid, attn, block))


def test_mask_is_strict_at_the_anchor():
    anchors = torch.tensor([[5]])
    valid = torch.tensor([[True]])
    mask = build_dense_block_mask(anchors, valid, torch.ones(1, 10), 3)
    assert mask[0, 0, 0, :10].tolist() == [True] * 5 + [False] * 5  # key 5 == anchor is NOT visible


@pytest.mark.parametrize("seed", range(3))
def test_flex_block_mask_matches_dense(seed):
    block = 4
    ids, attn, lm = random_batch(bsz=2, seq=40, seed=seed)
    anchors, valid = sample_anchors(lm, attn, block, num_anchors=6, generator=torch.Generator().manual_seed(seed))
    valid[1, 2] = False
    dense = build_dense_block_mask(anchors, valid, attn, block)
    bm = build_flex_block_mask(anchors, valid, attn, block, compile_mask=False)
    q_len, kv_len = dense.shape[-2:]
    b, h, q, kv = torch.meshgrid(
        torch.arange(2), torch.zeros(1, dtype=torch.long), torch.arange(q_len), torch.arange(kv_len), indexing="ij"
    )
    from_flex = bm.mask_mod(b, h, q, kv)
    assert torch.equal(from_flex, dense)
    # The BlockMask must not drop tiles that hold visible entries.
    dense_from_bm = bm.to_dense()[..., :q_len, :kv_len].bool()  # tile-level coverage
    tile = bm.BLOCK_SIZE[0]
    for bb in range(2):
        for qi in range(0, q_len, tile):
            for ki in range(0, kv_len, bm.BLOCK_SIZE[1]):
                if dense[bb, 0, qi : qi + tile, ki : ki + bm.BLOCK_SIZE[1]].any():
                    assert dense_from_bm[bb, 0, qi // tile, ki // bm.BLOCK_SIZE[1]]


def test_anchor_sampling_rules():
    block = 4
    ids, attn, lm = random_batch(bsz=2, seq=40, pad_last=10, prompt_len=7)
    lengths = attn.sum(1)
    seen = set()
    for s in range(20):
        anchors, valid = sample_anchors(lm, attn, block, num_anchors=8, generator=torch.Generator().manual_seed(s))
        for b in range(2):
            a = anchors[b][valid[b]]
            assert len(set(a.tolist())) == len(a)  # without replacement
            assert torch.all(lm[b, a] == 1)
            assert torch.all(a + block <= lengths[b])
            assert torch.equal(a, a.sort().values)
            seen.update((b, int(x)) for x in a)
    # uniform over every candidate: all candidates get drawn eventually
    n_cand = sum(int(((lm[b] == 1) & (torch.arange(40) + block <= lengths[b])).sum()) for b in range(2))
    assert len(seen) == n_cand
    # more anchors requested than candidates: padded with invalid blocks
    anchors, valid = sample_anchors(lm, attn, block, num_anchors=100)
    assert valid.sum(1).tolist() == [40 - 7 - block + 1, 30 - 7 - block + 1]


def test_block_inputs_labels_and_decay():
    ids = torch.arange(10).unsqueeze(0) + 100
    attn = torch.ones(1, 10, dtype=torch.long)
    lm = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0, 1, 1]])
    anchors, valid = torch.tensor([[2, 7]]), torch.tensor([[True, True]])
    blocks = build_block_input_ids(ids, anchors, 4, MASK_ID)
    assert blocks.tolist() == [[[102, MASK_ID, MASK_ID, MASK_ID], [107, MASK_ID, MASK_ID, MASK_ID]]]
    labels, lv = build_labels(ids, lm, attn, anchors, valid, 4)
    assert labels[0, 0].tolist() == [102, 103, 104, 105]  # same-position labels
    assert lv[0, 0].tolist() == [False, True, True, True]  # slot 0 never in the loss
    assert lv[0, 1].tolist() == [False, True, True, False]  # pos 10 is past the end
    w = loss_decay_weights(4, 7.0)
    assert w.tolist() == pytest.approx([0.0, 1.0, math.exp(-1 / 7), math.exp(-2 / 7)])
    assert loss_decay_weights(3, None).tolist() == [0.0, 1.0, 1.0]


def test_acceptance_length_hand_computed():
    correct = torch.tensor([[[False, True, True, False, True], [True, False, True, True, True]]])
    lv = torch.tensor([[[False, True, True, True, True], [False, True, True, True, True]]])
    assert acceptance_lengths(correct, lv).tolist() == [[3, 1]]


def _trainer(target, draft, **kw):
    return DFlashTrainerModule(
        draft, target.get_input_embeddings(), target.get_output_embeddings(), loss_decay_gamma=kw.pop("gamma", 7.0),
        **kw,
    )


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_batched_loss_equals_per_block_inference(target_and_draft, backend):
    """Each block run alone, as inference runs it: context truncated before the anchor,
    positions anchor+k, no mask. Catches shifted labels and leaked context."""
    wrapper, draft = target_and_draft
    ids, attn, lm = random_batch(bsz=2, seq=40)
    batch = wrapper.generate_batch(ids, attn, lm)
    trainer = _trainer(wrapper, draft, num_anchors=6, attn_backend=backend)
    anchors, valid = sample_anchors(lm, attn, draft.block_size, 6, torch.Generator().manual_seed(3))
    valid[0, 1] = False  # an invalid block must not count
    out = trainer(batch, anchors=anchors, valid=valid)

    blk = draft.block_size
    w = [0.0] + [math.exp(-(k - 1) / 7.0) for k in range(1, blk)]
    ref_sum, ref_w = 0.0, 0.0
    embed, head = wrapper.get_input_embeddings(), wrapper.get_output_embeddings()
    with torch.no_grad():
        for b in range(2):
            for i in range(anchors.shape[1]):
                if not valid[b, i]:
                    continue
                a = int(anchors[b, i])
                block_ids = torch.tensor([[int(ids[b, a])] + [MASK_ID] * (blk - 1)])
                pos = torch.cat([torch.arange(a), a + torch.arange(blk)]).unsqueeze(0)
                h = draft(embed(block_ids), batch.hidden_states[b : b + 1, :a], pos, None, backend=backend)
                logits = head(h)[0]
                for k in range(1, blk):  # slot k predicts token a+k, if it exists and is supervised
                    if a + k < ids.shape[1] and lm[b, a + k] and attn[b, a + k]:
                        ref_sum += w[k] * float(F.cross_entropy(logits[k : k + 1], ids[b, a + k : a + k + 1]))
                        ref_w += w[k]
    assert float(out.weight_sum) == pytest.approx(ref_w, rel=1e-6)
    assert float(out.loss_sum.detach()) == pytest.approx(ref_sum, rel=1e-4)


def test_shifted_labels_would_be_caught(target_and_draft):
    """Sanity of the reference above: a context that includes the anchor changes the loss."""
    wrapper, draft = target_and_draft
    ids, attn, lm = random_batch(bsz=1, seq=30, pad_last=0)
    batch = wrapper.generate_batch(ids, attn, lm)
    anchors, valid = torch.tensor([[12]]), torch.tensor([[True]])
    good = build_dense_block_mask(anchors, valid, attn, draft.block_size)
    leaky = build_dense_block_mask(anchors + 1, valid, attn, draft.block_size)  # j <= anchor
    embed = wrapper.get_input_embeddings()
    noise = embed(build_block_input_ids(ids, anchors, draft.block_size, MASK_ID).flatten(1))
    pos = torch.cat([torch.arange(30), 12 + torch.arange(draft.block_size)]).unsqueeze(0)
    with torch.no_grad():
        assert not torch.allclose(draft(noise, batch.hidden_states, pos, good), draft(noise, batch.hidden_states, pos, leaky))


def test_gradients_reach_only_the_draft():
    target = train_qwen3()
    draft = train_draft(target)
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    trainer = _trainer(wrapper, draft, num_anchors=8)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
    assert {id(p) for p in trainer.parameters()} == {id(p) for p in draft.parameters()}
    ids, attn, lm = random_batch()
    for _ in range(2):
        out = trainer(wrapper.generate_batch(ids, attn, lm))
        out.loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in draft.parameters())
        assert all(p.grad is None for p in target.parameters())
        opt.step()
        opt.zero_grad()
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_no_valid_anchor_gives_zero_loss_that_touches_every_parameter():
    target = train_qwen3()
    draft = train_draft(target)
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    ids, attn, _ = random_batch()
    lm = torch.zeros_like(attn)  # nothing supervised
    out = _trainer(wrapper, draft, num_anchors=8)(wrapper.generate_batch(ids, attn, lm))
    assert float(out.loss_sum) == 0.0 and float(out.weight_sum) == 0.0
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for name, p in draft.named_parameters():
        assert p.grad is not None, name
        assert torch.all(p.grad == 0), name


def test_fully_masked_rows_give_no_nan(target_and_draft):
    wrapper, draft = target_and_draft
    ids, attn, lm = random_batch()
    batch = wrapper.generate_batch(ids, attn, lm)
    anchors = torch.tensor([[0, 10, 20], [0, 0, 0]])
    valid = torch.tensor([[True, True, False], [False, False, False]])  # padding blocks, anchor at 0
    for backend in ("sdpa", "eager"):
        out = _trainer(wrapper, draft, attn_backend=backend)(batch, anchors=anchors, valid=valid)
        assert torch.isfinite(out.loss_sum)
        out.loss_sum.backward()
        assert all(torch.isfinite(p.grad).all() for p in draft.parameters())
        draft.zero_grad()


def test_flex_forward_matches_dense_on_cpu(target_and_draft):
    wrapper, draft = target_and_draft
    ids, attn, lm = random_batch(seq=64)
    batch = wrapper.generate_batch(ids, attn, lm)
    anchors, valid = sample_anchors(lm, attn, draft.block_size, 8, torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = _trainer(wrapper, draft, attn_backend="sdpa")(batch, anchors=anchors, valid=valid)
        flex = _trainer(wrapper, draft, attn_backend="flex")(batch, anchors=anchors, valid=valid)
    assert float(flex.loss_sum) == pytest.approx(float(dense.loss_sum), rel=1e-5)


def test_distillation_loss_against_target_distribution():
    target = train_qwen3()
    draft = train_draft(target)
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    ids, attn, lm = random_batch(bsz=1, pad_last=0)
    batch = wrapper.generate_batch(ids, attn, lm, return_logits=True)
    anchors, valid = torch.tensor([[10]]), torch.tensor([[True]])
    trainer = _trainer(wrapper, draft, distill_weight=1.0, gamma=None)
    out = trainer(batch, anchors=anchors, valid=valid)
    # reference: soft CE against the target's softmax at position a+k-1 for slots k=1..3
    noise = wrapper.get_input_embeddings()(build_block_input_ids(ids, anchors, 4, MASK_ID).flatten(1))
    pos = torch.cat([torch.arange(10), 10 + torch.arange(4)]).unsqueeze(0)
    with torch.no_grad():
        logp = wrapper.get_output_embeddings()(draft(noise, batch.hidden_states[:, :10], pos)).log_softmax(-1)[0]
    ref = sum(-(batch.logits[0, 10 + k - 1].softmax(-1) * logp[k]).sum() for k in (1, 2, 3))
    assert float(out.loss_sum) == pytest.approx(float(ref), rel=1e-4)


@pytest.mark.parametrize("weight", [1.0, 0.4])
def test_distillation_from_final_hidden_equals_per_slot_teacher_logits(weight, monkeypatch):
    """The trainer's expected-embedding path (final hidden states -> one E_t per position) against the
    per-slot path that forms the teacher's full logits for every block slot: loss, weights and draft
    gradients agree (fp32, same anchors)."""
    target = train_qwen3()
    draft = train_draft(target)
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    ids, attn, lm = random_batch(bsz=2, seq=48)
    anchors, valid = sample_anchors(lm, attn, draft.block_size, 6, torch.Generator().manual_seed(2))
    import nemo_dflash.objective.trainer_module as trainer_module

    calls, real = [], trainer_module.teacher_expected_embedding
    monkeypatch.setattr(trainer_module, "teacher_expected_embedding",
                        lambda h, *a: calls.append(h.shape) or real(h, *a))
    results = []
    for kw in ({"return_final_hidden": True}, {"return_logits": True}):
        batch = wrapper.generate_batch(ids, attn, lm, **kw)
        assert (batch.final_hidden is not None) == ("return_final_hidden" in kw)
        draft.zero_grad(set_to_none=True)
        out = _trainer(wrapper, draft, distill_weight=weight)(batch, anchors=anchors, valid=valid)
        out.loss_sum.backward()
        results.append((out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    (e_out, e_grads), (l_out, l_grads) = results
    assert calls == [torch.Size([2, 48, target.config.hidden_size])]  # once, over every position
    assert float(e_out.loss_sum) == pytest.approx(float(l_out.loss_sum), rel=1e-5)
    assert float(e_out.weight_sum) == float(l_out.weight_sum)
    assert e_grads.keys() == l_grads.keys() and e_grads
    for n, g in l_grads.items():
        torch.testing.assert_close(e_grads[n], g, rtol=1e-4, atol=1e-6)


def test_teacher_expected_embedding_matches_float64_reference():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 16, generator=g)
    h = torch.randn(2, 7, 16, generator=g)
    ref = ((h.double() @ w.double().T).softmax(-1) @ w.double()).float()
    for chunk in (3, 64):
        out = teacher_expected_embedding(h, w, chunk)
        assert out.shape == h.shape and out.dtype == h.dtype
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    head = torch.nn.Linear(16, 300, bias=True).requires_grad_(False)
    with pytest.raises(ValueError, match="frozen, bias-free Linear"):
        chunked_lm_loss(h[0], torch.zeros(7, dtype=torch.long), head, 4, distill_weight=1.0, teacher_embedding=h[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention backward needs a GPU")
def test_flex_loss_and_grads_match_dense_on_gpu():
    target = train_qwen3().cuda()
    draft = train_draft(target).cuda()
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    ids, attn, lm = (t.cuda() for t in random_batch(seq=256))
    batch = wrapper.generate_batch(ids, attn, lm)
    anchors, valid = sample_anchors(lm, attn, draft.block_size, 32, torch.Generator("cuda").manual_seed(0))
    grads = {}
    for backend in ("sdpa", "flex"):
        draft.zero_grad()
        out = _trainer(wrapper, draft, attn_backend=backend)(batch, anchors=anchors, valid=valid)
        out.loss.backward()
        grads[backend] = (float(out.loss), {n: p.grad.clone() for n, p in draft.named_parameters()})
    assert grads["flex"][0] == pytest.approx(grads["sdpa"][0], rel=1e-4)
    for n, g in grads["sdpa"][1].items():
        torch.testing.assert_close(grads["flex"][1][n], g, rtol=1e-3, atol=1e-5)


# ----------------------------------------------------------------------------- fused lm_head loss


@pytest.mark.parametrize("chunk", [5, 64])
def test_fused_lm_loss_matches_naive_cross_entropy(chunk):
    """Loss, argmax and dL/dhidden of the fused path against full-logits float64 cross-entropy."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 23, 16, 50
    head = torch.nn.Linear(h, v, bias=False).requires_grad_(False)
    head.weight.copy_(torch.randn(v, h, generator=g))
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    w = torch.rand(n, generator=g)  # per-row upstream weights, like the decay

    loss, pred = chunked_lm_loss(hidden, labels, head, chunk, fused=True)
    (loss * w).sum().backward()

    h64 = hidden.detach().double().requires_grad_(True)
    logits = h64 @ head.weight.double().T
    ref = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    (ref * w.double()).sum().backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(pred, logits.argmax(-1))
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)


def test_fused_lm_loss_matches_checkpointed_path_under_bf16_autocast():
    g = torch.Generator().manual_seed(1)
    n, h, v = 40, 32, 70
    head = torch.nn.Linear(h, v, bias=False).requires_grad_(False)
    head.weight.copy_(torch.randn(v, h, generator=g) * 0.3)
    labels = torch.randint(0, v, (n,), generator=g)
    w = torch.rand(n, generator=g)
    grads, losses = [], []
    for fused in (True, False):
        hidden = torch.randn(n, h, generator=torch.Generator().manual_seed(2), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = chunked_lm_loss(hidden, labels, head, 16, fused=fused)
        (loss * w).sum().backward()
        grads.append(hidden.grad)
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(grads[0], grads[1], rtol=2e-2, atol=2e-3)


def test_fused_lm_loss_falls_back_when_lm_head_is_trainable():
    head = torch.nn.Linear(8, 11, bias=False)  # trainable: the fused path gives it no gradient
    hidden = torch.randn(6, 8, requires_grad=True)
    loss, _ = chunked_lm_loss(hidden, torch.arange(6), head, 4, fused=True)
    loss.sum().backward()
    assert head.weight.grad is not None and hidden.grad is not None


# ----------------------------------------------------------------------------- host-side plan, compiled loss chunk


def test_plan_built_on_the_cpu_gives_the_same_step_as_sampling_inside(target_and_draft):
    """The trainer plans anchors and label slots on the CPU batch; the module must then compute
    exactly what it computes when it samples the same row-seeded anchors itself."""
    from nemo_dflash.objective.anchors import plan_blocks

    wrapper, draft = target_and_draft
    ids, attn, lm = random_batch(bsz=3, seq=40)
    batch = wrapper.generate_batch(ids, attn, lm)
    trainer = _trainer(wrapper, draft, num_anchors=6)
    seeds = [11, 12, 13]
    inside = trainer(batch, row_seeds=seeds)
    plan = plan_blocks(ids, lm, attn, draft.block_size, 6, row_seeds=seeds)
    planned = trainer(batch, plan=plan)
    for f in ("loss_sum", "weight_sum", "correct", "num_labels", "accept_sum", "num_blocks"):
        assert torch.equal(getattr(planned, f), getattr(inside, f)), f
    # the plan against its definition: sel = the valid label slots, labels = token[a + k] there
    lab, lv = build_labels(ids, lm, attn, plan.anchors, plan.valid, draft.block_size)
    assert torch.equal(plan.sel, lv.flatten().nonzero().squeeze(-1))
    assert torch.equal(plan.labels, lab.flatten()[lv.flatten()])


@pytest.mark.parametrize("autocast", [False, True])
def test_compiled_loss_chunk_function_matches_the_eager_loop(autocast):
    """`_ce_chunk` (what the GPU compiles) against the in-place eager loop and float64 cross-entropy."""
    from nemo_dflash.objective.cross_entropy import _ce_chunk

    g = torch.Generator().manual_seed(3)
    n, h, v = 37, 16, 90
    head = torch.nn.Linear(h, v, bias=False).requires_grad_(False)
    head.weight.copy_(torch.randn(v, h, generator=g) * 0.5)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        loss_loop, pred_loop = chunked_lm_loss(hidden, labels, head, 16, fused=True)
    loss_loop.sum().backward()
    mm = torch.bfloat16 if autocast else torch.float32
    loss_c, pred_c, grad_c, no_cand, no_cand_logits = _ce_chunk(hidden.detach(), head.weight, labels, mm, True)
    assert no_cand is None and no_cand_logits is None
    torch.testing.assert_close(loss_c, loss_loop.detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(pred_c, pred_loop)
    torch.testing.assert_close(grad_c, hidden.grad, rtol=1e-6, atol=1e-6)
    if not autocast:  # and both against the definition
        h64 = hidden.detach().double().requires_grad_(True)
        ref = F.cross_entropy(h64 @ head.weight.double().T, labels, reduction="none")
        ref.sum().backward()
        torch.testing.assert_close(loss_c.double(), ref.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad_c.double(), h64.grad, rtol=1e-4, atol=1e-5)
    _, _, no_grad, _, _ = _ce_chunk(hidden.detach(), head.weight, labels, mm, False)
    assert no_grad is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled chunk runs on GPUs")
def test_compiled_loss_chunk_matches_eager_on_gpu():
    from nemo_dflash.objective.cross_entropy import _ce_chunk, _compiled_on_cuda, _expected_chunk

    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 300, 64, 5000
    w = (torch.randn(v, h, device="cuda", generator=g) * 0.3).bfloat16()
    hidden = torch.randn(n, h, device="cuda", generator=g)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    te = (torch.randn(n, h, device="cuda", generator=g) * 0.3).bfloat16()  # a teacher's expected embeddings
    for rows, teacher, sw in ((n, None, 0.0), (77, None, 0.0), (n, te, 0.5)):  # 77: a shorter last chunk
        t = teacher[:rows] if teacher is not None else None
        ref = _ce_chunk(hidden[:rows], w, labels[:rows], torch.bfloat16, True, t, sw)
        compiled = _compiled_on_cuda(_ce_chunk, hidden.device)
        got = compiled(hidden[:rows], w, labels[:rows], torch.bfloat16, True, t, sw)
        # Inductor may keep the bf16 matmul's logits in fp32 where the eager chunk rounds them to bf16: the two
        # losses differ by that rounding (one bf16 ulp of logits of magnitude <= 8 is 0.03), not by a wrong term
        ref32 = _ce_chunk(hidden[:rows].bfloat16().float(), w.float(), labels[:rows], torch.float32, True, t, sw)
        for loss in (got[0], ref[0]):
            torch.testing.assert_close(loss, ref32[0], rtol=0, atol=4e-2)
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=4e-2)
        assert torch.equal(got[1], ref[1])
        torch.testing.assert_close(got[2], ref[2], rtol=1e-2, atol=1e-4)  # bf16 matmul, same inputs
    fh = hidden.bfloat16()
    expected = _compiled_on_cuda(_expected_chunk, fh.device)(fh, w)
    torch.testing.assert_close(expected.float(), _expected_chunk(fh, w).float(), rtol=1e-2, atol=1e-3)


def test_target_without_padding_mask_on_right_padded_rows(target_and_draft):
    """Causal attention alone gives the same features at every real position of right-padded rows."""
    wrapper, _ = target_and_draft
    ids, attn, lm = random_batch(bsz=3, seq=30, pad_last=11)
    masked = wrapper.generate_batch(ids, attn, lm)
    causal = wrapper.generate_batch(ids, attn, lm, right_padded=True)
    real = attn.bool()
    torch.testing.assert_close(causal.hidden_states[real], masked.hidden_states[real], rtol=1e-5, atol=1e-5)
    assert causal.attention_mask is attn  # the draft still masks padded keys


def test_compiled_target_layers_keep_the_captured_features(target_and_draft):
    """`compile_layers` compiles each layer's forward only: the capture hooks and the early stop
    still run, and the features match the eager target (dynamo's eager backend: no C++ on CI)."""
    import copy

    wrapper, draft = target_and_draft
    ids, attn, lm = random_batch(bsz=2, seq=24, pad_last=5)
    ref = wrapper.generate_batch(ids, attn, lm, right_padded=True).hidden_states
    compiled = HFDFlashTargetModel(copy.deepcopy(wrapper.model), wrapper.target_layer_ids)
    compiled.compile_layers(backend="eager")
    for seq in (24, 17):  # a second shape, as every training batch has
        got = compiled.generate_batch(ids[:, :seq], attn[:, :seq], lm[:, :seq], right_padded=True).hidden_states
        torch.testing.assert_close(got, ref[:, :seq], rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
