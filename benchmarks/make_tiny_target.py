"""A random-weight Llama with a real tokenizer: a stand-in target to rehearse GPU scripts in seconds.

    python benchmarks/make_tiny_target.py OUT_DIR --tokenizer DIR [--layers 8 --hidden 128]

DIR holds the tokenizer files (tokenizer.json, tokenizer_config.json, chat template). The model
is SmolLM2's architecture at toy size; its answers are noise, which is all a rehearsal needs.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM


def make_tiny_target(out: Path, tokenizer: Path, layers: int = 8, hidden: int = 128) -> Path:
    """Save a random-weight Llama of ``layers`` x ``hidden`` with the tokenizer in ``tokenizer`` to ``out``."""
    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    out = Path(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    for extra in ("chat_template.jinja", "generation_config.json"):
        if (Path(tokenizer) / extra).exists() and not (out / extra).exists():
            shutil.copy(Path(tokenizer) / extra, out / extra)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    args = p.parse_args()
    make_tiny_target(Path(args.out), Path(args.tokenizer), args.layers, args.hidden)


if __name__ == "__main__":
    main()
