"""Packed rows against the same documents run unpacked: target features, loss, gradients,
anchor coverage, the loader's resume, and the chunked distillation loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _tiny_models import VOCAB, train_draft, train_llama, train_qwen3
from nemo_dflash.objective.anchors import anchor_quotas, document_bounds, plan_blocks, sample_anchors
from nemo_dflash.objective.cross_entropy import chunked_lm_loss
from nemo_dflash.objective.trainer_module import DFlashTrainerModule
from nemo_dflash.data.packing import PackedBatchSampler, PackedCollator, first_fit
from nemo_dflash.target import HFDFlashTargetModel

BLOCK = 4


def _docs(lengths, seed=0, prompt=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, VOCAB - 1, (n,), generator=g)
        lm = torch.ones(n, dtype=torch.long)
        lm[:prompt] = 0
        out.append({"input_ids": ids.tolist(), "loss_mask": lm.tolist()})
    return out


def _unpacked(docs):
    """The ordinary right-padded batch of the same documents."""
    seq = max(len(d["input_ids"]) for d in docs)
    ids = torch.zeros(len(docs), seq, dtype=torch.long)
    attn = torch.zeros_like(ids)
    lm = torch.zeros_like(ids)
    for i, d in enumerate(docs):
        n = len(d["input_ids"])
        ids[i, :n] = torch.tensor(d["input_ids"])
        lm[i, :n] = torch.tensor(d["loss_mask"])
        attn[i, :n] = 1
    return ids, attn, lm


@pytest.fixture(params=["qwen3", "llama"])
def wrapper_draft(request):
    target = train_qwen3() if request.param == "qwen3" else train_llama()
    target.config._attn_implementation = "sdpa"
    draft = train_draft(target, block_size=BLOCK)
    return HFDFlashTargetModel(target, draft.config.target_layer_ids), draft


def test_collator_packs_first_fit_with_restarting_positions():
    docs = _docs([10, 7, 12, 5])
    out = PackedCollator(pad_token_id=0, rows=2, pack_length=24)(docs)
    # first fit by hand: 10 -> row 0, 7 -> row 0 (17), 12 -> row 1, 5 -> row 0 (22)
    assert out["doc_ids"][0].tolist() == [0] * 10 + [1] * 7 + [2] * 5 + [-1] * 2
    assert out["doc_ids"][1].tolist() == [0] * 12 + [-1] * 12
    assert out["position_ids"][0, :22].tolist() == list(range(10)) + list(range(7)) + list(range(5))
    assert out["input_ids"][0, 10:17].tolist() == docs[1]["input_ids"]
    assert out["attention_mask"].sum().item() == 34
    start, end = document_bounds(out["doc_ids"])
    assert start[0, 12].item() == 10 and end[0, 12].item() == 17


def test_packed_target_features_equal_per_document_forwards(wrapper_draft):
    wrapper, _ = wrapper_draft
    docs = _docs([9, 14, 6, 11], seed=1)
    packed = PackedCollator(pad_token_id=0, rows=2, pack_length=32)(docs)
    tb = wrapper.generate_batch(packed["input_ids"], packed["attention_mask"], packed["loss_mask"],
                                position_ids=packed["position_ids"], doc_ids=packed["doc_ids"],
                                return_final_hidden=True)
    where, _ = first_fit([len(d["input_ids"]) for d in docs], 2, 32)
    fill = [0, 0]
    for d, r in zip(docs, where):
        n = len(d["input_ids"])
        alone = wrapper.generate_batch(torch.tensor([d["input_ids"]]), torch.ones(1, n, dtype=torch.long),
                                       torch.ones(1, n, dtype=torch.long), return_logits=True)
        got = tb.hidden_states[r, fill[r] : fill[r] + n]
        torch.testing.assert_close(got, alone.hidden_states[0], atol=1e-5, rtol=1e-4)
        # the final hidden state gives the target's own logits
        logits = wrapper.get_output_embeddings()(tb.final_hidden[r, fill[r] : fill[r] + n])
        torch.testing.assert_close(logits, alone.logits[0], atol=1e-4, rtol=1e-4)
        fill[r] += n


def test_document_spans_cut_rows_at_documents_and_row_starts():
    from nemo_dflash.target.packed_attention import document_spans

    doc = torch.tensor([[0, 0, 1, 1, 1, -1], [1, 1, 1, 1, -1, -1], [1, 2, 2, 2, 2, 2]])  # row 1 starts with row 0's id 1
    spans = document_spans(doc)
    assert spans.cu.tolist() == [0, 2, 5, 6, 10, 12, 13, 18] and spans.cu.dtype == torch.int32 and spans.max_len == 6


def test_varlen_target_attention_equals_per_document_forwards(wrapper_draft):
    """`target.packed_attention: varlen` (off CUDA, the varlen kernel's per-document SDPA reference): each packed
    document's features and final hidden state equal the document run alone; padding included; without the
    spans the attention refuses in one line."""
    from nemo_dflash.target.packed_attention import ATTN_NAME, document_varlen_attention

    wrapper, _ = wrapper_draft
    docs = _docs([9, 14, 6, 11, 3], seed=5)
    packed = PackedCollator(pad_token_id=0, rows=2, pack_length=32)(docs)
    alone = []
    for d in docs:
        n = len(d["input_ids"])
        alone.append(wrapper.generate_batch(torch.tensor([d["input_ids"]]), torch.ones(1, n, dtype=torch.long),
                                            torch.ones(1, n, dtype=torch.long), return_logits=True))
    wrapper.use_varlen_attention()
    assert wrapper.model.config._attn_implementation == ATTN_NAME
    tb = wrapper.generate_batch(packed["input_ids"], packed["attention_mask"], packed["loss_mask"],
                                position_ids=packed["position_ids"], doc_ids=packed["doc_ids"],
                                return_final_hidden=True)
    where, _ = first_fit([len(d["input_ids"]) for d in docs], 2, 32)
    assert (packed["doc_ids"][1] == -1).any()  # a padded row
    fill = [0, 0]
    for d, r, want in zip(docs, where, alone):
        n = len(d["input_ids"])
        torch.testing.assert_close(tb.hidden_states[r, fill[r] : fill[r] + n], want.hidden_states[0],
                                   atol=1e-5, rtol=1e-4)
        logits = wrapper.get_output_embeddings()(tb.final_hidden[r, fill[r] : fill[r] + n])
        torch.testing.assert_close(logits, want.logits[0], atol=1e-4, rtol=1e-4)
        fill[r] += n
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="doc_spans"):
        document_varlen_attention(None, q, q, q, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash varlen kernel runs on GPUs")
def test_gpu_varlen_target_attention_equals_the_flex_document_mask():
    """bf16 on a GPU: the packed target's features through the flash varlen kernel equal those through the flex
    document-causal BlockMask at every real position, within bf16 rounding."""
    target = train_qwen3().cuda().to(torch.bfloat16)
    wrapper = HFDFlashTargetModel(target, train_draft(target, block_size=BLOCK).config.target_layer_ids)
    docs = _docs([40, 90, 17, 60, 33, 7], seed=7)
    batch = {k: v.cuda() for k, v in PackedCollator(pad_token_id=0, rows=2, pack_length=128)(docs).items()}

    def features():
        return wrapper.generate_batch(batch["input_ids"], batch["attention_mask"], batch["loss_mask"],
                                      position_ids=batch["position_ids"], doc_ids=batch["doc_ids"]).hidden_states

    wrapper.use_flex_attention()
    flex = features()
    wrapper.use_varlen_attention()
    varlen = features()
    real = batch["doc_ids"] >= 0
    torch.testing.assert_close(varlen[real].float(), flex[real].float(), atol=5e-2, rtol=5e-2)


def test_packed_attention_is_a_recipe_key():
    from nemo_dflash.config import ConfigError, load_recipe

    assert load_recipe("smollm2_135m_gpu.yaml", []).target.packed_attention == "flex"
    assert load_recipe("smollm2_135m_gpu.yaml", ["target.packed_attention=varlen"]).target.packed_attention == "varlen"
    with pytest.raises(ConfigError) as e:
        load_recipe("smollm2_135m_gpu.yaml", ["target.packed_attention=flash"])
    assert "'target.packed_attention' must be one of ['flex', 'varlen'], got 'flash'" in str(e.value)


def test_document_mask_would_be_caught(wrapper_draft):
    """Without the document mask the second document sees the first: features differ."""
    wrapper, _ = wrapper_draft
    docs = _docs([9, 14], seed=2)
    packed = PackedCollator(pad_token_id=0, rows=1, pack_length=24)(docs)
    leaky = wrapper.generate_batch(packed["input_ids"], packed["attention_mask"], packed["loss_mask"],
                                   position_ids=packed["position_ids"])
    alone = wrapper.generate_batch(torch.tensor([docs[1]["input_ids"]]), torch.ones(1, 14, dtype=torch.long),
                                   torch.ones(1, 14, dtype=torch.long))
    assert not torch.allclose(leaky.hidden_states[0, 9:23], alone.hidden_states[0], atol=1e-3)


@pytest.mark.parametrize("distill", [0.0, 0.5])
def test_packed_loss_and_grads_equal_unpacked(wrapper_draft, distill):
    """Same documents, same anchors (in each layout's coordinates): same loss sum, weights and gradients."""
    wrapper, draft = wrapper_draft
    docs = _docs([13, 20, 9, 16], seed=3)
    rows, pack = 2, 40
    packed = PackedCollator(pad_token_id=0, rows=rows, pack_length=pack)(docs)
    ids, attn, lm = _unpacked(docs)
    # anchors per document, chosen by hand (some near the end: slots past the end carry no label)
    doc_anchors = [[3, 7, 9], [3, 10, 16], [5], [4, 12]]
    where, _ = first_fit([len(d["input_ids"]) for d in docs], rows, pack)
    n_a = 6
    pa = torch.zeros(rows, n_a, dtype=torch.long)
    pv = torch.zeros(rows, n_a, dtype=torch.bool)
    ua = torch.zeros(len(docs), n_a, dtype=torch.long)
    uv = torch.zeros(len(docs), n_a, dtype=torch.bool)
    fill, count = [0] * rows, [0] * rows
    for d, (r, anc) in enumerate(zip(where, doc_anchors)):
        for j, a in enumerate(anc):
            ua[d, j], uv[d, j] = a, True
            pa[r, count[r]], pv[r, count[r]] = fill[r] + a, True
            count[r] += 1
        fill[r] += len(docs[d]["input_ids"])
    pa, order = torch.where(pv, pa, torch.full_like(pa, 10**6)).sort(1)
    pv = pv.gather(1, order)
    pa = torch.where(pv, pa, torch.zeros_like(pa))

    def run(batch, plan):
        draft.zero_grad(set_to_none=True)
        module = DFlashTrainerModule(draft, wrapper.get_input_embeddings(), wrapper.get_output_embeddings(),
                                     num_anchors=n_a, loss_decay_gamma=7.0, attn_backend="sdpa",
                                     distill_weight=distill, ce_chunk_size=8)
        out = module(batch, plan=plan)
        out.loss_sum.backward()
        return out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}

    tb_u = wrapper.generate_batch(ids, attn, lm, return_final_hidden=distill > 0)
    plan_u = plan_blocks(ids, lm, attn, BLOCK, n_a, anchors=ua, valid=uv)
    out_u, g_u = run(tb_u, plan_u)
    tb_p = wrapper.generate_batch(packed["input_ids"], packed["attention_mask"], packed["loss_mask"],
                                  position_ids=packed["position_ids"], doc_ids=packed["doc_ids"],
                                  return_final_hidden=distill > 0)
    plan_p = plan_blocks(packed["input_ids"], packed["loss_mask"], packed["attention_mask"], BLOCK, n_a,
                         anchors=pa, valid=pv, doc_ids=packed["doc_ids"], position_ids=packed["position_ids"])
    assert plan_p.sel is None  # the packed plan keeps a fixed shape
    out_p, g_p = run(tb_p, plan_p)
    assert float(out_p.weight_sum) == pytest.approx(float(out_u.weight_sum), rel=1e-6)
    assert float(out_p.weight_sum) > 0
    assert float(out_p.loss_sum.detach()) == pytest.approx(float(out_u.loss_sum.detach()), rel=1e-4)
    for k in ("correct", "num_labels", "accept_sum", "num_blocks"):
        assert float(getattr(out_p, k)) == float(getattr(out_u, k)), k
    assert g_p.keys() == g_u.keys()
    for n in g_u:
        torch.testing.assert_close(g_p[n], g_u[n], atol=1e-5, rtol=1e-3, msg=n)


def test_anchor_quotas_hand_computed():
    # 10 anchors over candidates 50, 30, 20 -> 5, 3, 2 exactly, whatever the offset
    for off in (0, 37, 99):
        assert anchor_quotas(torch.tensor([50, 30, 20]), 10, off).tolist() == [5, 3, 2]
    # 4 anchors over 7, 2, 1: shares 2.8, 0.8, 0.4; cumulative 2.8, 3.6, 4.0 (+ offset / 10), floored
    assert anchor_quotas(torch.tensor([7, 2, 1]), 4, 0).tolist() == [2, 1, 1]
    assert anchor_quotas(torch.tensor([7, 2, 1]), 4, 5).tolist() == [3, 1, 0]
    # over all offsets the mean quota is the exact share
    mean = torch.stack([anchor_quotas(torch.tensor([7, 2, 1]), 4, o) for o in range(10)]).double().mean(0)
    torch.testing.assert_close(mean, torch.tensor([2.8, 0.8, 0.4], dtype=torch.float64))
    assert anchor_quotas(torch.tensor([3, 2]), 10).tolist() == [3, 2]  # fewer candidates than anchors: all


def test_packed_anchors_stay_inside_documents_and_cover_each_document_alike():
    """One long and many short documents per row: every document's supervised tokens are covered
    at the row's rate (counting anchors per row would starve the short ones only by chance;
    the reference here is the proportional share computed by hand per document)."""
    lengths = [400] + [24] * 12  # 688 tokens
    docs = _docs(lengths, seed=4, prompt=4)
    packed = PackedCollator(pad_token_id=0, rows=1, pack_length=704)(docs)
    doc = packed["doc_ids"]
    n_anchors = 96
    cover = torch.zeros(len(lengths))
    cands = torch.zeros(len(lengths))
    start, end = document_bounds(doc)
    pos = torch.arange(doc.shape[1])
    cand = packed["loss_mask"].bool() & (doc >= 0) & (pos + BLOCK <= end)
    for d in range(len(lengths)):
        cands[d] = cand[0][doc[0] == d].sum()
    for seed in range(40):
        anchors, valid = sample_anchors(packed["loss_mask"], packed["attention_mask"], BLOCK, n_anchors,
                                        row_seeds=[seed], doc_ids=doc)
        a = anchors[0][valid[0]]
        assert a.numel() == n_anchors
        assert bool((a + BLOCK <= end[0, a]).all()), "a block crosses its document's end"
        assert bool(cand[0, a].all()), "an anchor on an unsupervised or padding token"
        assert a.unique().numel() == a.numel()
        d_of = doc[0, a]
        for d in range(len(lengths)):
            got = int((d_of == d).sum())
            share = n_anchors * cands[d] / cands.sum()
            assert abs(got - float(share)) < 1.0 + 1e-9
            cover[d] += got
    rate = cover / (40 * cands)
    assert float(rate.max() - rate.min()) < 0.05, rate  # every document covered at the row's rate


def _loader_batches(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)], it


def test_packed_loader_resumes_exactly():
    from nemo_dflash.data import build_dataloader

    class DS(torch.utils.data.Dataset):
        pad_token_id = 0

        def __init__(self):
            self.items = _docs([int(x) for x in torch.randint(8, 60, (40,), generator=torch.Generator().manual_seed(5))])
            self.lengths = [len(d["input_ids"]) for d in self.items]

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            return self.items[i]

    ds = DS()
    make = lambda: build_dataloader(ds, 2, seed=7, pack_length=64)  # noqa: E731
    full = make()
    n_epoch = len(full)
    ref = []
    for _ in range(2):  # two epochs, so the resume crosses an epoch boundary
        ref += list(full)
    assert all(b["input_ids"].shape == (2, 64) for b in ref)
    # every conversation once per epoch, whole
    assert sum(int((b["doc_ids"].amax(1) + 1).sum()) for b in ref[:n_epoch]) == len(ds)
    first = make()
    it = iter(first)
    k = n_epoch - 2
    for _ in range(k):
        next(it)
    state = first.state_dict()
    second = make()
    second.load_state_dict(state)
    rest = list(second)
    rest += list(second)
    assert len(rest) >= len(ref) - k
    for a, b in zip(ref[k:], rest):
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_packed_sampler_plan_matches_collator():
    lengths = [int(x) for x in torch.randint(5, 50, (60,), generator=torch.Generator().manual_seed(9))]
    s = PackedBatchSampler(lengths, rows=3, pack_length=64, seed=1)
    seen = []
    for step in s.batches(0):
        _, placed = first_fit([lengths[i] for i in step], 3, 64)
        assert placed == len(step)
        seen += list(step)
    assert sorted(seen) == list(range(60))


@pytest.mark.parametrize("weight", [1.0, 0.3])
def test_chunked_soft_ce_matches_full_logits_reference(weight):
    """Distillation formed chunk by chunk from the teacher's final hidden states equals the naive
    loss over full [N, vocab] logits, in value and in gradient."""
    torch.manual_seed(0)
    n, h, v = 37, 16, 300
    head = torch.nn.Linear(h, v, bias=False).requires_grad_(False)
    hidden = torch.randn(n, h, requires_grad=True)
    teacher = torch.randn(n, h)
    labels = torch.randint(0, v, (n,))
    loss, pred = chunked_lm_loss(hidden, labels, head, 8, distill_weight=weight, teacher_hidden=teacher)
    (loss * torch.linspace(0.5, 1.5, n)).sum().backward()
    g = hidden.grad.clone()

    hidden.grad = None
    logits = hidden @ head.weight.T
    p_t = (teacher @ head.weight.T).softmax(-1)
    ref = (1 - weight) * F.cross_entropy(logits, labels, reduction="none") - weight * (
        p_t * logits.log_softmax(-1)).sum(-1)
    (ref * torch.linspace(0.5, 1.5, n)).sum().backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g, hidden.grad, atol=1e-5, rtol=1e-5)
    assert torch.equal(pred, logits.argmax(-1))


def _compiled_gpu_step(compile_mode: str, packed: bool, compile_target: bool = False):
    """A one-GPU TrainStep on a tiny Qwen3 target, the draft compiled by `compile_mode`; packed rows give the
    target flex attention with compiled layers, as the packed recipes run it; `compile_target` compiles the
    target's layers on unpacked rows (`train.compile_target`, the large-target recipes' default)."""
    from nemo_dflash.config import OptimConfig
    from nemo_dflash.train.distributed import DistState
    from nemo_dflash.train.optim import build_optimizer
    from nemo_dflash.train.trainer import TrainStep, apply_compile

    dev = torch.device("cuda")
    target = train_qwen3().to(dev)
    draft = train_draft(target, block_size=16).to(dev)
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    if packed:
        wrapper.use_flex_attention()
    if packed or compile_target:
        wrapper.compile_layers()
    module = DFlashTrainerModule(draft, wrapper.get_input_embeddings(), wrapper.get_output_embeddings(),
                                 num_anchors=16, loss_decay_gamma=7.0, attn_backend="flex")
    apply_compile(module, compile_mode)
    params = [p for p in draft.parameters() if p.requires_grad]
    return TrainStep(wrapper, module, params, build_optimizer(params, OptimConfig(lr=1e-4), dev),
                     DistState(rank=0, world_size=1, local_rank=0, device=dev), micro_batch_size=2, seed=0,
                     grad_clip=1.0, use_bf16=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex step needs a GPU")
def test_compiled_packed_step_does_not_recompile():
    """Fixed packed shapes: after warm-up, steps over new data trigger no recompilation."""
    import torch._dynamo.utils as dutils

    step = _compiled_gpu_step("draft", packed=True)
    collate = PackedCollator(pad_token_id=0, rows=2, pack_length=256)
    g = torch.Generator().manual_seed(0)

    def batch():
        lengths = torch.randint(20, 120, (40,), generator=g).tolist()
        docs = _docs(lengths, seed=int(torch.randint(0, 10**6, (1,), generator=g)))
        _, placed = first_fit(lengths, 2, 256)
        return collate(docs[:placed])

    for i in range(3):
        step(i, batch())
    before = dutils.counters["stats"]["unique_graphs"]
    for i in range(3, 8):
        res = step(i, batch()).result()
    assert dutils.counters["stats"]["unique_graphs"] == before
    assert res.status == "ok"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex step needs a GPU")
@pytest.mark.parametrize("compile_target", [False, True])
def test_compiled_unpacked_step_stops_recompiling_on_variable_lengths(compile_target):
    """Unpacked rows (the large-target recipes' batches): the draft layers compiled (`train.compile=true`), and the
    target's (`train.compile_target=true`), batch lengths changing every step (multiples of 64). After warm-up
    steps of three lengths the compiled graphs are dynamic in the length: steps of new lengths trigger no
    recompilation."""
    import torch._dynamo.utils as dutils

    from nemo_dflash.data.dataset import collate

    step = _compiled_gpu_step("layers", packed=False, compile_target=compile_target)

    def batch(longest: int, seed: int):
        docs = _docs([longest, max(longest // 2, 40)], seed=seed)
        return collate(docs, pad_token_id=0, pad_to_multiple_of=64)

    for i, n in enumerate((100, 230, 400)):  # 128, 256, 448 positions
        step(i, batch(n, i))
    before = dutils.counters["stats"]["unique_graphs"]
    for i, n in enumerate((170, 300, 520, 90, 610), start=3):  # 192, 320, 576, 128, 640 positions
        res = step(i, batch(n, i)).result()
    assert dutils.counters["stats"]["unique_graphs"] == before
    assert res.status == "ok"


def test_lookahead_packing_fills_rows_and_places_everything_once():
    """Conversations of 0.1k-3k tokens in 8k rows: stopping at the first misfit leaves gaps that
    the look-ahead fills (each step still replays exactly in the collator's first fit)."""
    import numpy as np

    from nemo_dflash.data.packing import plan_packed_steps

    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 3001, 600)
    order = rng.permutation(600)
    steps = plan_packed_steps(order, lengths, 1, 8192)
    seen = np.concatenate(steps)
    assert sorted(seen.tolist()) == list(range(600))
    for st in steps:
        assert first_fit(lengths[st].tolist(), 1, 8192)[1] == len(st)
    fill = lengths.sum() / (len(steps) * 8192)
    # reference: close a row at the first conversation that does not fit
    rows_closed, used = 1, 0
    for n in lengths[order]:
        if used + n > 8192:
            rows_closed, used = rows_closed + 1, 0
        used += n
    assert lengths.sum() / (rows_closed * 8192) < 0.9 < 0.97 < fill  # 88% vs 99% here


def test_packed_training_end_to_end_resumes_exactly(tmp_path):
    """The recipe with data.pack_length: trains, evaluates, and a stopped-then-resumed run logs the
    same losses as an uninterrupted one (packed loader state and anchors follow from the step)."""
    import json

    from _tiny_target import make_tiny_target_dir, write_chat_jsonl
    from nemo_dflash.recipes.train import main
    from test_train import _args

    target, data = make_tiny_target_dir(tmp_path), write_chat_jsonl(tmp_path / "chat.jsonl", n=24)
    pack = ("data.pack_length=128", "loss.num_anchors=16")

    def losses(out):
        rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        return [(r["step"], r["loss"]) for r in rows if "loss" in r]

    full, part = tmp_path / "full", tmp_path / "part"
    summary = main(_args(target, data, full, "train.max_steps=5", "train.eval_every=0", *pack))
    assert summary["steps"] == 5 and "eval_accept_len" in summary
    main(_args(target, data, part, "train.max_steps=5", "train.eval_every=0", "train.max_minutes=0.0",
               "checkpoint.every_steps=100", *pack))
    main(_args(target, data, part, "train.max_steps=5", "train.eval_every=0", *pack))
    assert losses(part) == losses(full)


def test_pack_length_refusals_name_the_fix():
    from nemo_dflash.data.config import DataConfig, DataSourceConfig, validate_data_config
    from nemo_dflash.data.sources import DataError

    src = [DataSourceConfig(path="chats.jsonl")]
    with pytest.raises(DataError, match="raise data.pack_length or lower data.max_length"):
        validate_data_config(DataConfig(sources=src, max_length=2048, pack_length=1024))
    with pytest.raises(DataError, match="0 turns packing off"):
        validate_data_config(DataConfig(sources=src, pack_length=-1))
    validate_data_config(DataConfig(sources=src, max_length=2048, pack_length=2048))


@pytest.mark.parametrize("seed", range(3))
def test_packed_flex_tile_lists_cover_every_visible_entry(seed):
    """The packed path's BlockMask (tile lists from the anchors, no per-element pass) against the
    dense mask: its mask_mod gives the dense mask, and no tile holding a visible entry is left out."""
    from nemo_dflash.objective.block_mask import FLEX_TILE, build_dense_block_mask, build_flex_block_mask

    block, pack = 16, 384
    lengths = torch.randint(20, 140, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    _, placed = first_fit(lengths, 2, pack)
    packed = PackedCollator(pad_token_id=0, rows=2, pack_length=pack)(_docs(lengths[:placed], seed=seed))
    plan = plan_blocks(packed["input_ids"], packed["loss_mask"], packed["attention_mask"], block, 16,
                       row_seeds=[seed, seed + 1], doc_ids=packed["doc_ids"], position_ids=packed["position_ids"])
    assert int(plan.valid.sum()) == 32  # 16 per row
    dense = build_dense_block_mask(plan.anchors, plan.valid, packed["attention_mask"], block, plan.ctx_start)
    bm = build_flex_block_mask(plan.anchors, plan.valid, packed["attention_mask"], block, ctx_start=plan.ctx_start)
    q_len, kv_len = dense.shape[-2:]
    assert q_len % FLEX_TILE == 0 and pack % FLEX_TILE == 0  # the tile-list path
    b, h, q, kv = torch.meshgrid(torch.arange(2), torch.zeros(1, dtype=torch.long), torch.arange(q_len),
                                 torch.arange(kv_len), indexing="ij")
    assert torch.equal(bm.mask_mod(b, h, q, kv), dense)
    listed = bm.to_dense()[..., : q_len // FLEX_TILE, : kv_len // FLEX_TILE].bool()
    for bb in range(2):
        for qi in range(q_len // FLEX_TILE):
            for ki in range(kv_len // FLEX_TILE):
                if dense[bb, 0, qi * FLEX_TILE : (qi + 1) * FLEX_TILE, ki * FLEX_TILE : (ki + 1) * FLEX_TILE].any():
                    assert listed[bb, 0, qi, ki], (bb, qi, ki)
    # and the tile lists are tight: a query tile lists at most its context span plus its own block tile
    assert int(bm.kv_num_blocks.max()) <= pack // FLEX_TILE + 1
