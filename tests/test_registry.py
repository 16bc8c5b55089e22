import pytest

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
    monkeypatch.setitem(DFLASH_DRAFT_REGISTRY, "MistralForCausalLM", DraftSpec(draft_cls=DFlashDraftModel))
    assert resolve_dflash_draft_spec(["Foo", "MistralForCausalLM"]).draft_cls is DFlashDraftModel


def test_per_family_mask_defaults():
    assert resolve_dflash_draft_spec("Qwen3ForCausalLM").default_mask_token_id == 151669
    assert resolve_dflash_draft_spec("LlamaForCausalLM").default_mask_token_id == 128002


@pytest.mark.parametrize("arch", [
    "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
])
def test_qwen3_5_mask_default_is_the_published_drafts_id(arch):
    # z-lab's Qwen3.5 drafts carry dflash_config.mask_token_id 248070 (docs/registry.md gives sources).
    assert resolve_dflash_draft_spec(arch).default_mask_token_id == 248070


def test_qwen3_next_takes_the_resolver_rule():
    assert resolve_dflash_draft_spec("Qwen3NextForCausalLM").default_mask_token_id is None
