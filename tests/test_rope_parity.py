"""RoPE parity: the draft rotates its queries and keys exactly as its target's own rotary module
(HF's) does on the same positions, for every registered family, and the exported config.json
makes the serving engines' RoPE factory (`get_rope`: rope_parameters -> theta, type,
partial_rotary_factor, neox layout) build that same rotation.

References: the target's HF rotary module (cos/sin, or Llama 4's complex frequencies) and a naive
rotate-half rotation of the first rotary_dim dimensions written here."""

from __future__ import annotations

import json

import pytest
import torch

import transformers as T
from nemo_dflash.draft.model import DFlashDraftModel
from nemo_dflash.draft.model.modeling import apply_partial_rope
from nemo_dflash.draft.registry import DFLASH_DRAFT_REGISTRY

_C = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
_NO_FFN = {k: v for k, v in _C.items() if k != "intermediate_size"}
_HYBRID = dict(_C, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
               linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"] * 2)
# Qwen3.5 as its checkpoints ship it: a quarter of each head rotated, interleaved M-RoPE sections.
_QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                 "mrope_section": [2, 1, 1], "mrope_interleaved": True}
_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


def _vl(text_cls, cfg_cls, **text):
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    return cfg_cls(text_config=text_cls(**text).to_dict(), vision_config=vision)


CONFIGS = {
    "Qwen3ForCausalLM": lambda: T.Qwen3Config(**_C, head_dim=16, rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 1e6}),
    "Qwen3MoeForCausalLM": lambda: T.Qwen3MoeConfig(**_C, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=32),
    "Qwen2ForCausalLM": lambda: T.Qwen2Config(**_C),
    "LlamaForCausalLM": lambda: T.LlamaConfig(**_C, rope_parameters={  # Llama-3.1's scaled RoPE
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "Qwen3_5ForCausalLM": lambda: T.Qwen3_5TextConfig(**_HYBRID, rope_parameters=dict(_QWEN3_5_ROPE)),
    "Qwen3_5MoeForCausalLM": lambda: T.Qwen3_5MoeTextConfig(
        **{k: v for k, v in _HYBRID.items() if k != "intermediate_size"}, **_MOE, rope_parameters=dict(_QWEN3_5_ROPE)),
    "Qwen3_5ForConditionalGeneration": lambda: _vl(T.Qwen3_5TextConfig, T.Qwen3_5Config, **_HYBRID,
                                                   rope_parameters=dict(_QWEN3_5_ROPE)),
    "Qwen3_5MoeForConditionalGeneration": lambda: _vl(
        T.Qwen3_5MoeTextConfig, T.Qwen3_5MoeConfig, **{k: v for k, v in _HYBRID.items() if k != "intermediate_size"},
        **_MOE, rope_parameters=dict(_QWEN3_5_ROPE)),
    "Qwen3NextForCausalLM": lambda: T.Qwen3NextConfig(**_HYBRID, **_MOE),  # its default: partial 0.25
    "MistralForCausalLM": lambda: T.MistralConfig(**_C, head_dim=16),
    "Phi3ForCausalLM": lambda: T.Phi3Config(**_C, partial_rotary_factor=0.75, pad_token_id=0,  # Phi-4-mini's
                                            eos_token_id=1, bos_token_id=2),
    "Gemma2ForCausalLM": lambda: T.Gemma2Config(**_C, head_dim=16),
    "Gemma3ForCausalLM": lambda: T.Gemma3TextConfig(**dict(_C, num_hidden_layers=6), head_dim=16),  # 1e4 local / 1e6 global
    "GptOssForCausalLM": lambda: T.GptOssConfig(**_NO_FFN, intermediate_size=64, head_dim=16, num_local_experts=4,
                                                num_experts_per_tok=2),  # YaRN
    "DeepseekV3ForCausalLM": lambda: T.DeepseekV3Config(
        **dict(_C, num_key_value_heads=4), moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16),
    "Llama4ForCausalLM": lambda: T.Llama4TextConfig(**_C, intermediate_size_mlp=128, head_dim=16, num_local_experts=2,
                                                    num_experts_per_tok=1),
}


def test_every_registered_family_is_covered():
    assert sorted(CONFIGS) == sorted(DFLASH_DRAFT_REGISTRY)


def _target_rotary(arch: str, cfg):
    """The target's own rotary module, built by HF from the target's (text) config."""
    torch.manual_seed(0)
    model = getattr(T, arch)(cfg).float().eval()
    found = [m for n, m in model.named_modules() if type(m).__name__.endswith("RotaryEmbedding") and "visual" not in n]
    assert found, arch
    return found[0]


def _target_cos_sin(arch: str, rot, pos: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's cos/sin [B, P, rotary_dim] (rotate-half layout) at `pos`."""
    x = torch.zeros(1, pos.shape[-1], head_dim)
    kw = {"layer_type": "full_attention"} if arch == "Gemma3ForCausalLM" else {}
    out = rot(x, pos, **kw)
    if isinstance(out, torch.Tensor):  # Llama 4: complex frequencies, one per rotated pair
        return torch.cat((out.real, out.real), -1).float(), torch.cat((out.imag, out.imag), -1).float()
    cos, sin = out
    if arch == "GptOssForCausalLM":  # one entry per rotated pair (its apply chunks the head in halves)
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    return cos.float(), sin.float()


def _naive_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first cos.shape[-1] dims, element by element; the rest untouched."""
    out = x.clone()
    rd = cos.shape[-1]
    half = rd // 2
    for i in range(half):
        a, b = x[..., i], x[..., i + half]
        c, s = cos[:, None, :, i], sin[:, None, :, i]
        out[..., i] = a * c - b * s
        out[..., i + half] = b * c + a * s
    return out


def _draft(arch: str, cfg) -> DFlashDraftModel:
    """The draft the registry builds for ``arch`` (its config and model classes)."""
    spec = DFLASH_DRAFT_REGISTRY[arch]
    dcfg = spec.config_cls.from_target_config(cfg, num_hidden_layers=1, block_size=4, mask_token_id=255,
                                              target_layer_ids=[1, 2], intermediate_size=128)
    return spec.draft_cls(dcfg).float().eval()


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_draft_rotates_as_the_target(arch):
    cfg = CONFIGS[arch]()
    tc = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    draft = _draft(arch, cfg)
    head_dim = draft.config.head_dim
    pos = torch.tensor([[0, 1, 2, 7, 63, 200, 511]])
    want_cos, want_sin = _target_cos_sin(arch, _target_rotary(arch, cfg), pos, head_dim)
    cos, sin = draft.rotary_emb(pos, torch.float32)
    assert cos.shape == want_cos.shape, (arch, tuple(cos.shape), tuple(want_cos.shape))
    torch.testing.assert_close(cos, want_cos, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(sin, want_sin, atol=2e-5, rtol=1e-5)
    # The rotation applied to a head: the rotated part and the passed-through rest.
    x = torch.randn(1, 2, pos.shape[-1], head_dim, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(apply_partial_rope(x, cos, sin), _naive_rotate(x, want_cos, want_sin),
                               atol=1e-5, rtol=1e-5)
    assert getattr(tc, "num_hidden_layers")  # a text config was read


def _engine_rope(config_json: dict, head_dim: int, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How the engines build the draft's RoPE from config.json: the HF config's `rope_parameters`
    (theta, type, partial_rotary_factor; rotary_dim = int(head_dim * factor)), neox layout. Only the
    default type is rebuilt here (the scaled types go through transformers' own init functions)."""
    rope = T.Qwen3Config.from_dict(dict(config_json)).rope_parameters
    assert "mrope_section" not in rope, "an M-RoPE config makes the engines expect 3-D positions"
    assert rope.get("rope_type", "default") == "default"
    rd = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    f = pos[..., None].double() * inv
    emb = torch.cat((f, f), -1)
    return emb.cos().float(), emb.sin().float()


@pytest.mark.parametrize("arch", ["Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3NextForCausalLM",
                                  "Phi3ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"])
def test_exported_config_gives_the_engines_the_same_rope(arch, tmp_path):
    from nemo_dflash.serving.export import export_draft
    from nemo_dflash.draft.build import load_draft

    cfg = CONFIGS[arch]()
    draft = _draft(arch, cfg)
    out = export_draft(draft, tmp_path / "out")
    raw = json.loads((out / "config.json").read_text())
    pos = torch.tensor([[0, 3, 100, 500]])
    want = draft.rotary_emb(pos, torch.float32)
    got = _engine_rope(raw, raw["head_dim"], pos)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    again = load_draft(out).rotary_emb(pos, torch.float32)  # and our own loader reads it back
    torch.testing.assert_close(again[0], want[0])


def test_scaled_rope_round_trips_through_export(tmp_path):
    """Llama-3.1's scaled RoPE: written to config.json, read back, the same rotation."""
    from nemo_dflash.serving.export import export_draft
    from nemo_dflash.draft.build import load_draft

    draft = _draft("LlamaForCausalLM", CONFIGS["LlamaForCausalLM"]())
    out = export_draft(draft, tmp_path / "out")
    raw = json.loads((out / "config.json").read_text())
    assert T.Qwen3Config.from_dict(dict(raw)).rope_parameters["rope_type"] == "llama3"
    pos = torch.tensor([[0, 5, 300]])
    torch.testing.assert_close(load_draft(out).rotary_emb(pos, torch.float32)[0], draft.rotary_emb(pos, torch.float32)[0])
