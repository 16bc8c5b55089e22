"""The one set of tiny random-weight targets and drafts every test builds on (conftest.py's fixtures and
_spec_fixtures.py's helpers import them from here).

One builder per model, its shape given by its arguments. Two named shapes, each kept because tests rely on what it
covers:
- decoding (`tiny_qwen3`, `tiny_llama`, `make_draft`: the engine, evaluation, export and data tests): 4-layer
  targets, a tied Qwen3 and a grouped-query Llama, block-8 drafts on target layers [1, L - 2];
- training (`train_qwen3`, `train_llama`, `train_draft`: the objective, trainer, packing and hook tests): a
  6-layer untied Qwen3 (its lm_head apart from its embeddings), a 5-layer tied Llama with as many KV heads as
  heads (no grouping), block-4 drafts on `build_target_layer_ids`' layers, as the trainer builds them, left in
  training mode.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from nemo_dflash import build_target_layer_ids
from nemo_dflash.draft.model import DFlashConfig, DFlashDraftModel

VOCAB = 256
MASK_ID = VOCAB - 1  # the tiny vocabulary's last row
QWEN3_MASK_ID = 151669  # a spare row of the real Qwen3 vocabulary (151936 rows)


def tiny_qwen3(num_layers: int = 4, vocab: int = VOCAB, hidden: int = 64, seed: int = 0,
               tie: bool = True) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=tie,
    )
    return Qwen3ForCausalLM(cfg).float().eval()


def tiny_llama(num_layers: int = 4, vocab: int = VOCAB, seed: int = 0, kv_heads: int = 2,
               tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=1024, tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(cfg).float().eval()


def make_draft(
    target: torch.nn.Module,
    num_layers: int = 2,
    block_size: int = 8,
    mask_token_id: Optional[int] = None,
    layer_ids: Optional[list[int]] = None,
    seed: int = 1,
    train: bool = False,
) -> DFlashDraftModel:
    """A draft for `target`: `layer_ids` (default [1, L - 2]) its target layers, the vocabulary's last row its mask
    token unless given; in eval mode unless `train`."""
    torch.manual_seed(seed)
    tc = target.config
    cfg = DFlashConfig.from_target_config(
        tc, num_hidden_layers=num_layers, block_size=block_size,
        mask_token_id=tc.vocab_size - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=layer_ids or [1, tc.num_hidden_layers - 2],
    )
    draft = DFlashDraftModel(cfg).float()
    return draft if train else draft.eval()


# ---- the training shape


def train_qwen3(num_layers: int = 6, seed: int = 0) -> Qwen3ForCausalLM:
    return tiny_qwen3(num_layers=num_layers, seed=seed, tie=False)


def train_llama(num_layers: int = 5, seed: int = 0) -> LlamaForCausalLM:
    return tiny_llama(num_layers=num_layers, seed=seed, kv_heads=4, tie=True)


def train_draft(target: torch.nn.Module, num_layers: int = 2, block_size: int = 4, seed: int = 1) -> DFlashDraftModel:
    return make_draft(target, num_layers=num_layers, block_size=block_size, mask_token_id=MASK_ID, seed=seed,
                      layer_ids=build_target_layer_ids(target.config.num_hidden_layers, num_layers), train=True)


def random_batch(bsz: int = 2, seq: int = 48, seed: int = 0, pad_last: int = 9, prompt_len: int = 7):
    """(input_ids, attention_mask, loss_mask) of random tokens: the last row padded at its end, prompts unmasked."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB - 1, (bsz, seq), generator=g)
    attn = torch.ones(bsz, seq, dtype=torch.long)
    if bsz > 1 and pad_last:
        attn[-1, seq - pad_last:] = 0
    loss_mask = attn.clone()
    loss_mask[:, :prompt_len] = 0
    return input_ids, attn, loss_mask
