"""A second target family on CPU: a tiny random-weight Qwen2 (the Qwen2.5 instruct models' architecture: biased
q/k/v projections, tied embeddings, a 151,936-row vocabulary) with the real Qwen tokenizer. The decoding engine's
greedy answers equal HF generate's, and regenerate -> train -> export runs on it end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _tiny_target import qwen3_tokenizer_dir, write_chat_jsonl, tiny_train_args

from nemo_dflash.data import read_conversations
from nemo_dflash.data.regenerate import regenerate_conversations
from nemo_dflash.target.loading import load_target


def make_tiny_qwen2_dir(root: Path, seed: int = 0) -> Path:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = root / "tiny_qwen2"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      rope_theta=1e6, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # biases as trained models have them (random init leaves them zero: a bias bug would hide)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(qwen3_tokenizer_dir()).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen2_dir(tmp_path_factory.mktemp("qwen2"))


def test_engine_greedy_equals_hf_generate_on_qwen2(qwen2_dir, tmp_path):
    model, tokenizer = load_target(str(qwen2_dir), dtype="fp32")
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.model.layers[0].self_attn.q_proj.bias is not None
    convs = list(read_conversations(str(write_chat_jsonl(tmp_path / "chats.jsonl", n=5)), max_samples=5))
    records = {r["source"]: r for r in regenerate_conversations(model, tokenizer, convs, max_new_tokens=6,
                                                               batch_size=3, engine="continuous", loops="keep")}
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    checked = 0
    for conv in convs:
        enc = tokenizer.apply_chat_template(conv.messages[:1], add_generation_prompt=True, return_dict=True,
                                            return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=6, do_sample=False, eos_token_id=eot,
                             pad_token_id=tokenizer.pad_token_id)
        expected = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        if expected.strip():
            assert records[conv.location]["messages"][-1] == {"role": "assistant", "content": expected}
            checked += 1
    assert checked >= 3


def test_regenerate_train_export_on_qwen2(qwen2_dir, tmp_path):
    from nemo_dflash.recipes import export, regenerate, train

    regen = tmp_path / "regen.jsonl"
    regenerate.main(["--target", str(qwen2_dir), "--data", str(write_chat_jsonl(tmp_path / "c.jsonl", n=8)),
                     "--out", str(regen), "--max-new-tokens", "24", "--batch-size", "4", "--decontaminate", "off",
                     "--sampling", "greedy", "--loops", "keep", "--device", "cpu"])
    assert len(regen.read_text().splitlines()) >= 4
    run = tmp_path / "run"
    train.main(tiny_train_args(qwen2_dir, regen, run, "train.max_steps=2"))
    export.main(["--checkpoint", str(run), "--out", str(tmp_path / "export"), "--target", str(qwen2_dir)])
    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["vocab_size"] == 151936
    assert cfg["hidden_size"] == 32 and cfg["rope_theta"] == 1e6  # the target's: the draft shares its embedding
    assert cfg["dflash_config"]["mask_token_id"] is not None
