"""Shared fixtures: tiny random-weight targets (Qwen3 and Llama) and drafts built on them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from nemo_dflash import DFlashConfig, DFlashDraftModel, HFDFlashTargetModel, build_target_layer_ids

VOCAB = 256
MASK_ID = VOCAB - 1


def tiny_qwen3(num_layers: int = 6, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return Qwen3ForCausalLM(cfg).eval()


def tiny_llama(num_layers: int = 5, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


def make_draft(target: torch.nn.Module, num_layers: int = 2, block_size: int = 4, seed: int = 1) -> DFlashDraftModel:
    torch.manual_seed(seed)
    ids = build_target_layer_ids(target.config.num_hidden_layers, num_layers)
    cfg = DFlashConfig.from_target_config(
        target.config, num_hidden_layers=num_layers, block_size=block_size, mask_token_id=MASK_ID, target_layer_ids=ids
    )
    return DFlashDraftModel(cfg).float()


def random_batch(bsz: int = 2, seq: int = 48, seed: int = 0, pad_last: int = 9, prompt_len: int = 7):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB - 1, (bsz, seq), generator=g)
    attn = torch.ones(bsz, seq, dtype=torch.long)
    if bsz > 1 and pad_last:
        attn[-1, seq - pad_last:] = 0
    loss_mask = attn.clone()
    loss_mask[:, :prompt_len] = 0
    return input_ids, attn, loss_mask


@pytest.fixture(params=["qwen3", "llama"])
def target_and_draft(request):
    target = tiny_qwen3() if request.param == "qwen3" else tiny_llama()
    draft = make_draft(target)
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    return wrapper, draft


_SLOW = frozenset(line.strip() for line in Path(__file__).with_name("slow.txt").read_text().splitlines()
                  if line.strip() and not line.startswith("#"))


def pytest_collection_modifyitems(config, items):
    """Mark the tests tests/slow.txt lists `slow`: `make test-fast` (-m "not slow") leaves them to `make test`."""
    for item in items:
        if item.nodeid in _SLOW:
            item.add_marker(pytest.mark.slow)
