"""The step FLOPs the trainer logs MFU with (train/flops.py): the counts against brute-force counts of the
attention masks, the linear FLOPs against torch's FLOP counter on a real forward."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.utils.flop_counter import FlopCounterMode

from nemo_dflash.objective.anchors import plan_blocks
from nemo_dflash.objective.block_mask import build_dense_block_mask
from nemo_dflash.objective.metrics import LossSums
from nemo_dflash.objective.trainer_module import _flop_counts
from nemo_dflash.train.flops import Shape, StepShapes


def _packed_batch(lengths_per_row: list[list[int]], seq: int):
    rows = len(lengths_per_row)
    doc = torch.full((rows, seq), -1, dtype=torch.long)
    pos = torch.zeros((rows, seq), dtype=torch.long)
    for r, lengths in enumerate(lengths_per_row):
        at = 0
        for d, n in enumerate(lengths):
            doc[r, at : at + n] = d
            pos[r, at : at + n] = torch.arange(n)
            at += n
    attn = (doc >= 0).long()
    ids = torch.randint(5, 100, (rows, seq)) * attn
    loss_mask = attn.clone()
    loss_mask[pos < 3] = 0  # a few prompt tokens per document
    return ids, attn, loss_mask, doc, pos


def test_packed_counts_equal_brute_force_counts_of_the_masks():
    block = 4
    ids, attn, loss_mask, doc, pos = _packed_batch([[30, 17, 9], [40, 22]], seq=64)
    plan = plan_blocks(ids, loss_mask, attn, block, 6, generator=torch.Generator().manual_seed(0),
                       doc_ids=doc, position_ids=pos)
    got = _flop_counts(SimpleNamespace(doc_ids=doc, position_ids=pos, attention_mask=attn), plan, block)
    mask = build_dense_block_mask(plan.anchors, plan.valid, attn, block, ctx_start=plan.ctx_start)
    assert int(got["visible_keys"]) == int(mask.sum()) > 0  # every (query, key) pair a valid block's query sees
    assert int(got["valid_blocks"]) == int(plan.valid.sum()) > 0
    causal = sum(int(((doc[r, :, None] == doc[r, None, :]) & (doc[r, :, None] >= 0)
                      & (torch.arange(64)[None, :] <= torch.arange(64)[:, None])).sum()) for r in range(2))
    assert int(got["context_pairs"]) == causal and int(got["context_tokens"]) == int(attn.sum())


def test_unpacked_rows_count_as_long_as_the_longest():
    attn = torch.zeros(3, 20, dtype=torch.long)
    for r, n in enumerate((12, 20, 7)):
        attn[r, :n] = 1
    ids = torch.randint(5, 100, (3, 20)) * attn
    plan = plan_blocks(ids, attn, attn, 4, 3, generator=torch.Generator().manual_seed(1))
    got = _flop_counts(SimpleNamespace(doc_ids=None, position_ids=None, attention_mask=attn), plan, 4)
    assert int(got["context_tokens"]) == 3 * 20 and int(got["context_pairs"]) == 3 * 20 * 21 // 2
    mask = build_dense_block_mask(plan.anchors, plan.valid, attn, 4)
    assert int(got["visible_keys"]) == int(mask.sum())


def test_linear_flops_equal_torch_flop_counter_on_a_real_forward():
    """The target's projections and MLP as counted here equal what torch counts running the layers (matmuls
    only: attention scores are counted separately, by the pairs above); the lm_head term likewise."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    model = Qwen3ForCausalLM(cfg).eval()
    tokens, labels = 21, 13
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        hidden = model.model(torch.randint(0, 97, (1, tokens))).last_hidden_state
    counts = fc.get_flop_counts()["Global"]
    linear = sum(v for op, v in counts.items() if "mm" in str(op) and "bmm" not in str(op))
    shapes = StepShapes(target=Shape.of(cfg), target_layers_run=3, draft_layers=0, context_layers=0, block=4)
    no_attention = shapes.flops(LossSums(context_tokens=tokens, context_pairs=0))
    assert no_attention["target"] == linear
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model.lm_head(hidden[0, :labels])
    head = sum(fc.get_flop_counts()["Global"].values())
    assert shapes.flops(LossSums(num_labels=labels))["lm_head"] == 2 * head  # forward + the backward through it
