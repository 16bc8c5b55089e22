import pytest
import torch

from nemo_dflash import DFLASH_DRAFT_REGISTRY, DFlashDraftModel, DraftSpec, build_target_layer_ids, resolve_dflash_draft_spec


def test_paper_layer_ids():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert build_target_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert build_target_layer_ids(36, 1) == [18]
    # round(1 + i * 26/4) for i in 0..4 with Python rounding (the formula as published)
    assert build_target_layer_ids(30, 5) == [round(1 + i * 26 / 4) for i in range(5)]


@pytest.mark.parametrize("L", range(1, 13))
def test_layer_ids_valid_and_distinct_for_shallow_targets(L):
    for n in range(1, L + 1):
        ids = build_target_layer_ids(L, n)
        assert len(ids) == n and len(set(ids)) == n, (L, n, ids)
        assert all(0 <= i < L for i in ids), (L, n, ids)
        assert ids == sorted(ids)


def test_too_many_draft_layers():
    with pytest.raises(ValueError, match="distinct"):
        build_target_layer_ids(3, 4)


@pytest.mark.parametrize("arch", sorted(DFLASH_DRAFT_REGISTRY))
def test_registered_families(arch):
    import transformers

    assert resolve_dflash_draft_spec([arch]).draft_cls is DFlashDraftModel
    # Every key is a real transformers class name: a typo would never match a checkpoint's `architectures`.
    assert hasattr(transformers, arch), arch


def test_unknown_architecture_lists_supported_and_fix():
    with pytest.raises(ValueError) as e:
        resolve_dflash_draft_spec(["GPTBigCodeForCausalLM"])
    msg = str(e.value)
    assert "Qwen3ForCausalLM" in msg and "LlamaForCausalLM" in msg and "DFLASH_DRAFT_REGISTRY" in msg


def test_adding_a_family_is_one_line(monkeypatch):
    monkeypatch.setitem(DFLASH_DRAFT_REGISTRY, "StarcoderForCausalLM", DraftSpec(draft_cls=DFlashDraftModel))
    assert resolve_dflash_draft_spec(["Foo", "StarcoderForCausalLM"]).draft_cls is DFlashDraftModel


def test_per_family_mask_defaults():
    assert resolve_dflash_draft_spec("Qwen3ForCausalLM").default_mask_token_id == 151669
    assert resolve_dflash_draft_spec("LlamaForCausalLM").default_mask_token_id == 128002


@pytest.mark.parametrize("arch", [
    "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
])
def test_qwen3_5_mask_default_is_the_published_drafts_id(arch):
    # z-lab's Qwen3.5 drafts carry dflash_config.mask_token_id 248070 (docs/families.md gives sources).
    assert resolve_dflash_draft_spec(arch).default_mask_token_id == 248070


def test_qwen3_next_takes_the_resolver_rule():
    assert resolve_dflash_draft_spec("Qwen3NextForCausalLM").default_mask_token_id is None


# ------------------------------------------------------------------ plain-append families, end to end

_C = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)


def _family_target(arch: str):
    """A tiny random target of `arch`, with windows (16) shorter than the 49-token test sequence."""
    import transformers as T

    no_ffn = {k: v for k, v in _C.items() if k != "intermediate_size"}
    builders = {
        "Qwen2ForCausalLM": lambda: T.Qwen2Config(**_C),
        "Qwen3MoeForCausalLM": lambda: T.Qwen3MoeConfig(
            **_C, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
        "MistralForCausalLM": lambda: T.MistralConfig(**_C, head_dim=16, sliding_window=16),
        "Phi3ForCausalLM": lambda: T.Phi3Config(**_C, pad_token_id=0, eos_token_id=1, bos_token_id=2),
        "Gemma2ForCausalLM": lambda: T.Gemma2Config(**_C, head_dim=16, sliding_window=16),
        "Gemma3ForCausalLM": lambda: T.Gemma3TextConfig(**_C, head_dim=16, sliding_window=16),
        "GptOssForCausalLM": lambda: T.GptOssConfig(
            **no_ffn, intermediate_size=64, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16),
        "DeepseekV3ForCausalLM": lambda: T.DeepseekV3Config(  # MLA
            **dict(_C, num_key_value_heads=4), moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16),
        "Llama4ForCausalLM": lambda: T.Llama4TextConfig(
            **_C, intermediate_size_mlp=128, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
            interleave_moe_layer_step=2, attention_chunk_size=16),
    }
    torch.manual_seed(0)
    return getattr(T, arch)(builders[arch]()).float().eval()


PLAIN_FAMILIES = ["Qwen2ForCausalLM", "Qwen3MoeForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                  "GptOssForCausalLM", "DeepseekV3ForCausalLM", "Llama4ForCausalLM"]


@pytest.mark.parametrize("arch", PLAIN_FAMILIES)
def test_plain_append_families_train_and_decode(arch, tmp_path):
    """Each registered plain-append family: a 1-layer draft trained on the target's own greedy
    continuation is accepted (tau > 1.5 at block 4), and decoding equals HF greedy, also past the
    sliding / chunked window (the verify must use the target's per-layer masks there)."""
    from _spec_fixtures import export_round_trip, prompt, train_on_greedy_answer
    from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder
    from nemo_dflash.draft.model import DFlashConfig

    assert arch in DFLASH_DRAFT_REGISTRY
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = _family_target(arch)
        assert target.config.architectures in (None, [arch]) and type(target).__name__ == arch
        torch.manual_seed(1)
        cfg = DFlashConfig.from_target_config(
            target.config, num_hidden_layers=1, block_size=4, mask_token_id=255, target_layer_ids=[1, 2],
            intermediate_size=128,
        )
        draft = resolve_dflash_draft_spec(arch).draft_cls(cfg).float().eval()
        ids = prompt(4)
        ref, sim_tau = train_on_greedy_answer(target, draft, ids)
        out = DFlashSpeculativeDecoder(target, draft).generate(ids, max_new_tokens=40)
        exported = export_round_trip(draft, tmp_path)
        again = DFlashSpeculativeDecoder(target, exported).generate(ids, max_new_tokens=40)
    finally:
        torch.set_num_threads(threads)
    assert out.output_ids == ref == again.output_ids
    assert out.mean_acceptance_length > 1.5 and sim_tau > 1.5
