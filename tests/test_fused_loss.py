"""`loss.impl` (chunked | cce | liger): the fused kernels' loss against independent references.

On CPU: the chunked path's lse / soft-CE identity against naive full logits in fp64, the formula that
turns a per-token CE into lse and the mixed loss (with a per-token CE computed naively standing in for
the kernel), the wiring through the trainer module, the fallback and the config error. On a GPU: each
installed kernel against the chunked path and against fp32 full logits, loss and gradients of h and W.
"""

import logging
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import nemo_dflash.objective.trainer_module as trainer_module
import nemo_dflash.objective.fused_loss as fl
from _torchrun import run_command
from _tiny_models import random_batch, train_draft, train_qwen3
from nemo_dflash.objective.anchors import sample_anchors
from nemo_dflash.objective.cross_entropy import chunked_lm_loss, teacher_expected_embedding
from nemo_dflash.objective.trainer_module import DFlashTrainerModule
from nemo_dflash.target import HFDFlashTargetModel

REPO = Path(__file__).resolve().parents[1]


def naive_loss(h, w, labels, teacher_hidden=None, d=0.0):
    """Per-row (1-d) * CE(h W^T, y) + d * soft CE against softmax(teacher_hidden W^T), from full logits."""
    logits = h @ w.T
    hard = F.cross_entropy(logits, labels, reduction="none")
    if teacher_hidden is None or d <= 0:
        return hard
    p_t = (teacher_hidden @ w.T).softmax(-1)
    soft = -(p_t * logits.log_softmax(-1)).sum(-1)
    return (1 - d) * hard + d * soft


def _problem(n=37, hid=16, vocab=300, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hid, generator=g, dtype=dtype) * 0.5
    h = torch.randn(n, hid, generator=g, dtype=dtype)
    th = torch.randn(n, hid, generator=g, dtype=dtype)
    y = torch.randint(0, vocab, (n,), generator=g)
    wts = torch.rand(n, generator=g, dtype=dtype)  # per-row decay weights
    return h, w, th, y, wts


@pytest.mark.parametrize("d", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("chunk", [5, 64])
def test_chunked_path_soft_ce_identity_matches_full_logits_fp64(d, chunk):
    """The chunked path's soft CE = lse - h . E_t (E_t = softmax(h_t W^T) W) against the soft CE
    written from full logits, loss and dL/dh, in fp64."""
    h, w, th, y, wts = _problem()
    head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.float64)
    head.weight.data.copy_(w)
    head.requires_grad_(False)
    h1 = h.clone().requires_grad_(True)
    loss, pred = chunked_lm_loss(h1, y, head, chunk, distill_weight=d, teacher_hidden=th if d else None)
    (loss * wts).sum().backward()
    h2 = h.clone().requires_grad_(True)
    ref = naive_loss(h2, w, y, th, d)
    (ref * wts).sum().backward()
    # fp64 in, the chunked path's per-row buffers are fp32: agreement to fp32 rounding
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(pred, (h @ w.T).argmax(-1))


def fake_kernel(hidden, weight, labels):
    """A per-token hard CE as the fused kernels return it (reduction none), here from full logits."""
    return F.cross_entropy(hidden @ weight.T, labels, reduction="none").float(), None  # fp32, as the kernels


def test_ce_to_lse_recovers_the_log_partition():
    h, w, _, y, _ = _problem()
    ce, _ = fake_kernel(h, w, y)
    lse = torch.logsumexp(h @ w.T, -1)
    torch.testing.assert_close(fl.ce_to_lse(ce, h, w, y).double(), lse, rtol=1e-6, atol=1e-6)  # h . W_y in fp32


@pytest.mark.parametrize("d", [0.0, 0.4, 1.0])
def test_mixed_loss_from_per_token_ce_matches_full_logits(d):
    """loss and gradients of h and W through the per-token CE, the lse gather and the soft term,
    against the soft CE written from full logits (fp64 in). W is trainable here; with distillation its
    reference gradient leaves out the target's E_t = sum_v p_v W_v (a constant to the fused path)."""
    h, w, th, y, wts = _problem(seed=1)
    te = ((th @ w.T).softmax(-1) @ w).detach()  # the target's expected embedding (a constant)
    h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ce, _ = fake_kernel(h1, w1, y)
    got = fl.mixed_loss(ce, h1, w1, y, te if d else None, d)
    (got * wts).sum().backward()
    h2, w2 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    logits = h2 @ w2.T
    hard = F.cross_entropy(logits, y, reduction="none")
    p_t = (th @ w.T).softmax(-1)  # the target's distribution: no gradient
    soft = torch.logsumexp(logits, -1) - (h2 * (p_t @ w)).sum(-1)  # = -(p_t * log_softmax).sum, E_t held fixed
    torch.testing.assert_close(soft.detach(), -(p_t * logits.detach().log_softmax(-1)).sum(-1))
    ref = (1 - d) * hard + d * soft
    (ref * wts).sum().backward()
    torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-6, atol=1e-6)  # the gathers run in fp32
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-6)


def test_fused_lm_loss_with_a_fake_kernel_matches_chunked(monkeypatch):
    """The fused entry point (dtype handling, argmax pass for a kernel that gives none, mixing) with a
    naive per-token CE in place of the kernel, against the chunked path (fp64, frozen head)."""
    monkeypatch.setattr(fl, "per_token_ce", lambda impl, h, w, y: fake_kernel(h, w, y))
    h, w, th, y, wts = _problem(seed=2)
    with pytest.raises(ValueError, match="frozen lm_head"):
        fl.fused_lm_loss("cce", h, w.clone().requires_grad_(True), y, 7, th, 0.5)
    head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.float64).requires_grad_(False)
    head.weight.data.copy_(w)
    te = teacher_expected_embedding(th, w, 7)
    for d, t in ((0.0, None), (0.5, te)):
        h1, h2 = h.clone().requires_grad_(True), h.clone().requires_grad_(True)
        got, pred = fl.fused_lm_loss("cce", h1, w, y, 7, t, d)
        ref, ref_pred = chunked_lm_loss(h2, y, head, 7, distill_weight=d, teacher_embedding=t)
        (got * wts).sum().backward()
        (ref * wts).sum().backward()
        torch.testing.assert_close(got, ref.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)
        assert torch.equal(pred, ref_pred)


@pytest.mark.parametrize("d", [0.0, 0.5])
def test_trainer_module_routes_the_loss_through_the_kernel(d, monkeypatch):
    """With a kernel chosen, the training step's loss goes through `fused_lm_loss` (a naive per-token
    CE standing in for the kernel) and equals the chunked step: loss, accuracy and draft gradients."""
    target = train_qwen3()
    draft = train_draft(target)
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    ids, attn, lm = random_batch(bsz=2, seq=40)
    anchors, valid = sample_anchors(lm, attn, draft.block_size, 5, torch.Generator().manual_seed(3))
    batch = wrapper.generate_batch(ids, attn, lm, return_final_hidden=d > 0)
    calls = []
    monkeypatch.setattr(fl, "per_token_ce", lambda impl, h, w, y: calls.append(impl) or fake_kernel(h, w, y))
    results = []
    for impl in ("chunked", "cce"):
        # as on a GPU with the package
        monkeypatch.setattr(trainer_module, "resolve_loss_impl", lambda name, device: name)
        module = DFlashTrainerModule(draft, wrapper.get_input_embeddings(), wrapper.get_output_embeddings(),
                                     loss_decay_gamma=7.0, distill_weight=d, loss_impl=impl)
        draft.zero_grad(set_to_none=True)
        out = module(batch, anchors=anchors, valid=valid)
        (out.loss_sum / out.weight_sum).backward()
        results.append((out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    assert calls == ["cce"]
    (ref, ref_g), (got, got_g) = results
    assert float(got.loss_sum) == pytest.approx(float(ref.loss_sum), rel=1e-5)
    assert int(got.correct) == int(ref.correct) and float(got.accept_sum) == float(ref.accept_sum)
    assert got_g.keys() == ref_g.keys() and ref_g
    for n, g in ref_g.items():
        torch.testing.assert_close(got_g[n], g, rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # held-out evaluation keeps the reference path
        module(batch, anchors=anchors, valid=valid)
    assert calls == ["cce"]


def test_named_kernel_on_cpu_falls_back_with_one_warning(caplog, monkeypatch):
    monkeypatch.setattr(fl, "_WARNED", set())
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="nemo_dflash.objective.fused_loss"):
        assert fl.resolve_loss_impl("cce", cpu) == "chunked"
        assert fl.resolve_loss_impl("cce", cpu) == "chunked"
        assert fl.resolve_loss_impl("liger", cpu) == "chunked"
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "loss.impl=cce cannot run" in warned[0] and "chunked" in warned[0]
    caplog.clear()
    assert fl.resolve_loss_impl("chunked", cpu) == "chunked" and not caplog.records
    with pytest.raises(ValueError, match="loss.impl must be one of"):
        fl.resolve_loss_impl("fast", cpu)


def test_missing_package_is_named(monkeypatch):
    monkeypatch.setattr(fl.importlib.util, "find_spec", lambda name: None if name == "liger_kernel" else object())
    assert fl.fused_unavailable("liger", torch.device("cuda")) == "liger-kernel is not installed"
    assert fl.fused_unavailable("cce", torch.device("cuda")) is None


def test_cpu_step_with_a_kernel_named_is_the_chunked_step(monkeypatch):
    """On CPU `loss.impl=liger` runs the chunked path itself: the same loss, bit for bit."""
    monkeypatch.setattr(fl, "_WARNED", set())
    target = train_qwen3()
    draft = train_draft(target)
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    ids, attn, lm = random_batch(bsz=2, seq=32)
    anchors, valid = sample_anchors(lm, attn, draft.block_size, 4, torch.Generator().manual_seed(0))
    batch = wrapper.generate_batch(ids, attn, lm)
    outs = [DFlashTrainerModule(draft, wrapper.get_input_embeddings(), wrapper.get_output_embeddings(),
                                loss_impl=impl)(batch, anchors=anchors, valid=valid).loss_sum for impl in ("chunked", "liger")]
    assert torch.equal(outs[0], outs[1])


def test_resolve_settings_picks_the_loss_impl(caplog):
    from nemo_dflash.config import RecipeConfig
    from nemo_dflash.train.trainer import resolve_settings

    cfg = RecipeConfig()
    cfg.train.device = "cpu"
    assert resolve_settings(cfg, world_size=1, local_rank=0).loss_impl == "chunked"
    cfg.loss.impl = "cce"
    assert resolve_settings(cfg, world_size=1, local_rank=0).loss_impl == "chunked"


def test_invalid_loss_impl_is_a_one_line_config_error(tmp_path):
    """Refused while the recipe is read: exit 2, one line, before the (8B) target could load."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = run_command([sys.executable, "-m", "nemo_dflash.recipes.train", "--config", "qwen3_8b.yaml",
                     "loss.impl=fast"], 120, env=env, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "'loss.impl' must be one of ['chunked', 'cce', 'liger'], got 'fast'" in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- GPU: the real kernels


def _kernels():
    return [pytest.param(name, marks=pytest.mark.skipif(
        not torch.cuda.is_available() or fl.fused_unavailable(name, torch.device("cuda")) is not None,
        reason=f"needs a GPU with {name}'s package")) for name in fl.FUSED_IMPLS]


# Relative error (norm) allowed on dL/dh against a reference whose matmuls are bf16 with fp32 accumulation:
# cut-cross-entropy adds its per-vocab-block contributions to dL/dh in bf16 (H200: ~2.4% from fp32 at
# 576 x 49152), liger-kernel and the chunked path in fp32 (~0.2%).
# relative error of the gradient of the draft's states; cce accumulates it in bf16: 2.4% (hard CE) and 4.8% (distillation
# 0.5) measured on an H200 (docs/train.md)
GRAD_H_TOL = {"cce": 6e-2, "liger": 1e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [0.0, 0.5])
@pytest.mark.parametrize("impl", _kernels())
def test_kernel_matches_chunked_path_on_gpu(impl, d):
    """SmolLM2's head shape (576 x 49152), bf16 head, fp32 draft states under bf16 autocast, decay
    weights: the kernel's loss, dL/dh and argmax against the chunked path (frozen head, as in training)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, hid, vocab, blk = 8192 + 37, 576, 49152, 16
    head = torch.nn.Linear(hid, vocab, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    head.weight.data.normal_(0, 0.05, generator=g)
    h = torch.randn(n, hid, device="cuda", generator=g)
    y = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    wts = torch.exp(-(torch.arange(n, device="cuda") % (blk - 1)) / 7.0)  # the decay weights of slots 1..15
    te = teacher_expected_embedding(torch.randn(n, hid, device="cuda", generator=g).bfloat16(), head.weight, 4096) \
        if d else None
    out = {}
    for name in ("chunked", impl):
        x = h.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if name == "chunked":
                loss, pred = chunked_lm_loss(x, y, head, 4096, distill_weight=d, teacher_embedding=te)
            else:
                loss, pred = fl.fused_lm_loss(name, x, head.weight, y, 4096, te, d)
        total = (loss * wts).sum() / wts.sum()
        total.backward()
        out[name] = (loss.detach(), total.detach(), pred, x.grad)
    (l_ref, t_ref, p_ref, g_ref), (l, t, p, gx) = out["chunked"], out[impl]
    assert l.dtype == torch.float32 and l.shape == (n,)
    torch.testing.assert_close(t, t_ref, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(l, l_ref, rtol=2e-2, atol=2e-2)
    assert _rel(gx, g_ref) < GRAD_H_TOL[impl]
    assert float((p == p_ref).float().mean()) > 0.95  # bf16 logits tie often at this vocabulary: either index


@pytest.mark.gpu
@pytest.mark.parametrize("d", [0.0, 0.5])
@pytest.mark.parametrize("impl", _kernels())
def test_kernel_grads_of_h_and_w_match_fp32_full_logits_on_gpu(impl, d):
    """Loss and gradients against full logits in fp32 (the soft CE written from the target's softmax),
    bf16 inputs: of h and W (a trainable head) for hard CE, of h (the frozen head) with distillation."""
    g = torch.Generator(device="cuda").manual_seed(1)
    n, hid, vocab = 2048, 256, 32000
    w = (torch.randn(vocab, hid, device="cuda", generator=g) * 0.05).bfloat16()
    h = torch.randn(n, hid, device="cuda", generator=g).bfloat16()
    th = torch.randn(n, hid, device="cuda", generator=g).bfloat16()
    y = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    wts = torch.rand(n, device="cuda", generator=g)
    te = ((th.float() @ w.float().T).softmax(-1) @ w.float()) if d else None
    train_w = d == 0
    h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(train_w)
    loss, _ = fl.fused_lm_loss(impl, h1, w1, y, 1024, te, d)
    (loss * wts).sum().backward()
    h2, w2 = h.float().requires_grad_(True), w.float().requires_grad_(train_w)
    ref = naive_loss(h2, w2, y, th.float() if d else None, d)
    (ref * wts).sum().backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=2e-2, atol=2e-2)
    assert _rel(h1.grad, h2.grad) < GRAD_H_TOL[impl]
    if train_w:
        assert _rel(w1.grad, w2.grad) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("impl", _kernels())
def test_trainer_step_with_kernel_matches_chunked_on_gpu(impl):
    """The trainer module's step on a tiny target: loss and draft gradients with the kernel against
    the chunked path (bf16 autocast, same anchors)."""
    target = train_qwen3().cuda()
    draft = train_draft(target).cuda()
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    ids, attn, lm = (t.cuda() for t in random_batch(bsz=2, seq=48))
    anchors, valid = sample_anchors(lm.cpu(), attn.cpu(), draft.block_size, 6, torch.Generator().manual_seed(2))
    anchors, valid = anchors.cuda(), valid.cuda()
    results = []
    for name in ("chunked", impl):
        module = DFlashTrainerModule(draft, wrapper.get_input_embeddings(), wrapper.get_output_embeddings(),
                                     loss_decay_gamma=7.0, attn_backend="sdpa", loss_impl=name)
        draft.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = module(wrapper.generate_batch(ids, attn, lm), anchors=anchors, valid=valid)
        (out.loss_sum / out.weight_sum).backward()
        results.append((float(out.loss), torch.cat([p.grad.flatten() for p in draft.parameters() if p.grad is not None])))
    (l_ref, g_ref), (l, gr) = results
    assert l == pytest.approx(l_ref, rel=1e-2)
    assert _rel(gr, g_ref) < 2 * GRAD_H_TOL[impl]
