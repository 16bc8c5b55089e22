"""A mask token that cannot silently go wrong: the recipe's id for another target is not carried over,
placeholder rows are valid automatic choices, and an ordinary token seen in the data is refused."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from _tiny_target import make_tiny_target_dir, write_chat_jsonl

from nemo_dflash.draft.build import MaskTokenError, placeholder_token_id, resolve_mask_token_id


class _Tok:
    """A tokenizer that fills the whole table, GGUF-style, with [PADn] rows past its real tokens."""

    def __init__(self, real: int, vocab: int) -> None:
        self.vocab = {f"t{i}": i for i in range(real)} | {f"[PAD{i}]": i for i in range(real, vocab)}
        self.mask_token_id = None

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def __len__(self) -> int:
        return len(self.vocab)

    def convert_ids_to_tokens(self, i: int) -> str:
        return next(t for t, j in self.vocab.items() if j == i)


def _target(arch: str, vocab: int):
    emb = torch.nn.Embedding(vocab, 4)
    return SimpleNamespace(config=SimpleNamespace(architectures=[arch]), get_input_embeddings=lambda: emb)


def test_placeholder_rows_are_automatic_choices():
    tok = _Tok(real=90, vocab=100)  # len(tok) == vocab: no row "past the tokenizer"
    assert placeholder_token_id(tok, 100) == 90
    assert resolve_mask_token_id(_target("Qwen2ForCausalLM", 100), tok) == 90
    full = _Tok(real=100, vocab=100)
    with pytest.raises(MaskTokenError, match="draft.mask_token_id"):
        resolve_mask_token_id(_target("Qwen2ForCausalLM", 100), full)


def test_a_recipe_id_meant_for_another_target_is_not_carried_over():
    tok = _Tok(real=90, vocab=100)
    qwen = _target("Qwen2ForCausalLM", 100)
    # SmolLM2's recipe id (3, an ordinary token in Qwen) is ignored for a Qwen target ...
    assert resolve_mask_token_id(qwen, tok, 3, "LlamaForCausalLM/49152") == 90
    # ... and for a Llama target of another vocabulary, but kept for the target it names.
    assert resolve_mask_token_id(_target("LlamaForCausalLM", 100), tok, 3, "LlamaForCausalLM/49152") == 90
    assert resolve_mask_token_id(_target("LlamaForCausalLM", 49152), tok, 3, "LlamaForCausalLM/49152") == 3
    assert resolve_mask_token_id(qwen, tok, 3) == 3  # no "for": the explicit id wins, as before


def test_training_refuses_a_mask_token_seen_in_the_data(tmp_path, capsys):
    """One line, exit 2, before the first step; nothing written as the run's config or checkpoints."""
    from nemo_dflash.recipes.train import main

    target = make_tiny_target_dir(tmp_path)
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=12)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    common = tok(" alpha", add_special_tokens=False)["input_ids"][0]  # a word every conversation uses
    args = ["--config", "qwen3_8b.yaml", f"target.path={target}", "target.dtype=fp32", "draft.num_layers=1",
            "draft.block_size=4", f"data.sources=[{{path: {data}}}]", "data.max_length=64", "loss.num_anchors=4",
            "train.micro_batch_size=2", "train.max_steps=1", "distributed.strategy=none", "wandb.mode=disabled",
            f"output_dir={tmp_path / 'run'}", f"draft.mask_token_id={common}", "draft.mask_token_for=null"]
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "occurs" in err and "allow_mask_token_in_data" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists()
    summary = main(args + ["draft.allow_mask_token_in_data=true"])  # the user's explicit choice
    assert summary["steps"] == 1
    assert json.loads(json.dumps(summary))["steps"] == 1


@pytest.mark.parametrize("recipe", ["qwen3_8b.yaml", "qwen3_4b.yaml", "llama3_8b.yaml", "smollm2_135m.yaml",
                                    "smollm2_135m_gpu.yaml", "qwen3_5_27b.yaml", "qwen3_5_35b_a3b.yaml"])
def test_shipped_recipes_load(recipe):
    from nemo_dflash.config import load_recipe

    cfg = load_recipe(recipe, ["target.path=/x"])
    assert cfg.draft.block_size in (4, 8, 10, 16) and cfg.data.sources  # 4: the 2-core CPU demo
    if recipe.startswith("qwen3_5"):  # the family default applies; the MoE names its FFN width
        assert cfg.draft.mask_token_id is None and cfg.draft.num_layers == 5
        assert (cfg.draft.intermediate_size is not None) == ("a3b" in recipe)



def test_count_token_counts_only_the_datasets_own_samples():
    from nemo_dflash.data.dataset import ChatDataset, _TokenStore

    store = _TokenStore.from_samples([SimpleNamespace(input_ids=ids, loss_mask=[1] * len(ids))
                                      for ids in ([1, 5, 5], [5, 2], [3])])
    make = lambda idx: ChatDataset(store, None if idx is None else __import__("numpy").asarray(idx),  # noqa: E731
                                   pad_token_id=0, max_length=8)
    assert make(None).count_token(5) == 3 and make([0, 2]).count_token(5) == 2
    assert make([1]).count_token(5) == 1 and make([2]).count_token(5) == 0 and make(None).count_token(9) == 0
