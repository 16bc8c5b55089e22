"""Config of the Qwen3-style DFlash draft.

It *is* a Qwen3 config (the serving engines load the draft as `model_type: qwen3`) plus the
DFlash fields of the serving contract: `block_size`, `num_target_layers` and
`dflash_config = {mask_token_id, target_layer_ids}`.
"""

from __future__ import annotations

from typing import Any, Optional

from transformers import Qwen3Config

# Keys of a target's RoPE that only make sense with 3-D (temporal, height, width) positions. The draft
# sees text positions only, where M-RoPE equals 1-D RoPE with the same frequencies, and the engines
# build an M-RoPE module (3-D positions required) when they see these keys: they are dropped.
MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def target_rope_parameters(target_config: Any) -> dict[str, Any]:
    """The target's RoPE as the draft must apply it (and the engines will, from config.json).

    theta, scaling type and its fields, and ``partial_rotary_factor`` (Qwen3.5/Qwen3-Next rotate a
    quarter of each head; a draft that rotates all of it serves at tau ~1, speculators #613), read from
    ``rope_parameters`` (transformers 5) or the legacy ``rope_theta`` / ``rope_scaling`` /
    ``partial_rotary_factor`` fields. Per-layer-type RoPE (Gemma 3) takes the full-attention entry:
    the draft's attention is full attention over the whole context.
    """
    tc = getattr(target_config, "text_config", None) or target_config
    rope = dict(getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {})
    if rope and all(isinstance(v, dict) for v in rope.values()):
        rope = dict(rope.get("full_attention") or next(iter(rope.values())))
    if "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type", "default")
    rope.pop("type", None)
    rope.setdefault("rope_theta", float(getattr(tc, "rope_theta", None) or 10000.0))
    factor = rope.get("partial_rotary_factor", getattr(tc, "partial_rotary_factor", None))
    rope.pop("partial_rotary_factor", None)
    if factor is not None and float(factor) != 1.0:
        rope["partial_rotary_factor"] = float(factor)
    for k in MROPE_KEYS:
        rope.pop(k, None)
    return rope


def rotary_dim(config: Any) -> int:
    """Head dimensions the draft rotates: ``int(head_dim * partial_rotary_factor)`` (vLLM's and HF's rule)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    return int(head_dim * float(factor))


class DFlashConfig(Qwen3Config):
    model_type = "qwen3"

    def __init__(
        self,
        block_size: int = 16,
        num_target_layers: int = 36,
        dflash_config: Optional[dict[str, Any]] = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("architectures", ["DFlashDraftModel"])
        super().__init__(**kwargs)
        self.block_size = int(block_size)
        self.num_target_layers = int(num_target_layers)
        dflash_config = dict(dflash_config or {})
        dflash_config.setdefault("mask_token_id", None)
        dflash_config.setdefault("target_layer_ids", [])
        self.dflash_config = dflash_config

    @property
    def mask_token_id(self) -> Optional[int]:
        return self.dflash_config.get("mask_token_id")

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.dflash_config.get("target_layer_ids") or [])

    @classmethod
    def from_target_config(
        cls,
        target_config: Any,
        *,
        num_hidden_layers: int,
        block_size: int,
        mask_token_id: int,
        target_layer_ids: list[int],
        dflash_extra: Optional[dict[str, Any]] = None,
        **overrides: Any,
    ) -> "DFlashConfig":
        """Shape the draft like its target: the draft reuses the target's embeddings and
        lm_head, so hidden size and vocab must match; heads/head_dim follow by default, and the
        RoPE is the target's (`target_rope_parameters`: theta, scaling, partial rotary factor).
        `dflash_extra`: a variant's own dflash_config fields (DFlash2's conv and selector sizes)."""
        tc = getattr(target_config, "text_config", None) or target_config
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        rope = target_rope_parameters(tc)
        # MoE targets without a dense FFN width (Qwen3.5-MoE) need `intermediate_size` in overrides.
        ffn = overrides.get("intermediate_size") or getattr(tc, "intermediate_size", None)
        if not ffn:
            raise ValueError(
                f"{type(tc).__name__} has no intermediate_size (an MoE target): set draft.intermediate_size in the recipe"
            )
        fields: dict[str, Any] = dict(
            hidden_size=tc.hidden_size,
            intermediate_size=ffn,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
            vocab_size=tc.vocab_size,
            hidden_act=getattr(tc, "hidden_act", "silu"),
            attention_bias=False,
            rope_parameters=dict(rope),
            tie_word_embeddings=False,
        )
        fields.update(overrides)
        return cls(
            num_hidden_layers=num_hidden_layers,
            block_size=block_size,
            num_target_layers=tc.num_hidden_layers,
            dflash_config={**dict(dflash_extra or {}), "mask_token_id": int(mask_token_id),
                           "target_layer_ids": list(target_layer_ids)},
            **fields,
        )
