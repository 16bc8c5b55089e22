"""Which draft class serves which target family, keyed by the HF `architectures` string, and which
variants of the draft exist (`DRAFT_VARIANTS`, keyed by the recipe's `draft.kind`).

Adding a family is a one-line append to `DFLASH_DRAFT_REGISTRY` (see docs/families.md):

    DFLASH_DRAFT_REGISTRY["MistralForCausalLM"] = DraftSpec(draft_cls=DFlashDraftModel)

Adding a variant (a DSpark Markov head, Domino) is one module under `draft/model/` and one entry here:

    DRAFT_VARIANTS["dspark"] = DraftVariant(DSparkDraftModel, DSparkConfig, options="dspark")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from nemo_dflash.draft.model import DFlash2Config, DFlash2DraftModel, DFlashConfig, DFlashDraftModel
from nemo_dflash.target import build_target_layer_ids  # noqa: F401  (the target's layers; exported here too)


@dataclass(frozen=True)
class DraftSpec:
    """How to build the DFlash draft for one target family.

    `draft_cls` and `config_cls` are what `nemo_dflash.draft.build` builds a fresh draft with and loads a
    stored one into (`load_draft(..., architectures=...)`). They must subclass `DFlashDraftModel` /
    `DFlashConfig`: the serving engines load exactly that weight layout, so a class outside it could
    be trained but never exported or served.

    `default_mask_token_id` is the documented per-family mask token (the id the published
    drafts and serving engines use); None means "take the tokenizer's mask token, the first
    embedding row past the tokenizer, or an explicit id from the recipe".
    """

    draft_cls: type[DFlashDraftModel] = DFlashDraftModel
    config_cls: type[DFlashConfig] = DFlashConfig
    default_mask_token_id: Optional[int] = None

    def __post_init__(self) -> None:
        for name, cls, base in (("draft_cls", self.draft_cls, DFlashDraftModel),
                                ("config_cls", self.config_cls, DFlashConfig)):
            if not (isinstance(cls, type) and issubclass(cls, base)):
                raise TypeError(f"DraftSpec.{name} {cls!r} must subclass {base.__name__} (the serving contract's "
                                "layout, which export and the engines load)")


# Qwen3.5's mask id is the one z-lab's published Qwen3.5 drafts carry in `dflash_config`
# (docs/families.md cites where). Qwen3-Next uses the Qwen3 tokenizer and has no published id we
# could confirm: the resolver's rule (first row past the tokenizer) applies.
QWEN3_5_MASK_TOKEN_ID = 248070

DFLASH_DRAFT_REGISTRY: dict[str, DraftSpec] = {
    "Qwen3ForCausalLM": DraftSpec(default_mask_token_id=151669),
    "Qwen3MoeForCausalLM": DraftSpec(default_mask_token_id=151669),
    "Qwen2ForCausalLM": DraftSpec(),
    "LlamaForCausalLM": DraftSpec(default_mask_token_id=128002),
    # Hybrid Gated-DeltaNet + full attention: decoded with the recurrent-state rollback
    # (nemo_dflash.engine.recurrent_cache); decode="graphs" refuses them.
    "Qwen3_5ForCausalLM": DraftSpec(default_mask_token_id=QWEN3_5_MASK_TOKEN_ID),
    "Qwen3_5MoeForCausalLM": DraftSpec(default_mask_token_id=QWEN3_5_MASK_TOKEN_ID),
    "Qwen3_5ForConditionalGeneration": DraftSpec(default_mask_token_id=QWEN3_5_MASK_TOKEN_ID),  # text path
    "Qwen3_5MoeForConditionalGeneration": DraftSpec(default_mask_token_id=QWEN3_5_MASK_TOKEN_ID),  # text path
    "Qwen3NextForCausalLM": DraftSpec(),
    # Plain appends, each trained and decoded on a tiny target in tests/test_registry.py; mask by
    # the resolver's rule (no published id confirmed). Gemma scales its embeddings inside the
    # model, the draft reads the raw embedding row: the trained draft learns that scale.
    "MistralForCausalLM": DraftSpec(),
    "Phi3ForCausalLM": DraftSpec(),
    "Gemma2ForCausalLM": DraftSpec(),
    "Gemma3ForCausalLM": DraftSpec(),
    "GptOssForCausalLM": DraftSpec(),
    "DeepseekV3ForCausalLM": DraftSpec(),
    "Llama4ForCausalLM": DraftSpec(),
}


@dataclass(frozen=True)
class DraftVariant:
    """One draft design: its model and config classes (subclasses of DFlash's: same backbone, same serving
    contract plus the variant's fields) and the recipe section holding its sizes (`draft.<options>`, whose
    fields are the variant's `dflash_config` entries). The exported `architectures` is the model class's name."""

    draft_cls: type[DFlashDraftModel]
    config_cls: type[DFlashConfig]
    options: Optional[str] = None

    @property
    def architecture(self) -> str:
        return self.draft_cls.__name__


DRAFT_VARIANTS: dict[str, DraftVariant] = {
    "dflash": DraftVariant(DFlashDraftModel, DFlashConfig),
    "dflash2": DraftVariant(DFlash2DraftModel, DFlash2Config, options="dflash2"),
}


def resolve_draft_variant(kind: str) -> DraftVariant:
    """The variant `draft.kind` names."""
    if kind not in DRAFT_VARIANTS:
        raise ValueError(f"draft.kind={kind!r} is not a draft variant: use one of {', '.join(DRAFT_VARIANTS)}")
    return DRAFT_VARIANTS[kind]


def variant_of(architectures: Sequence[str] | str | None) -> str:
    """The `draft.kind` of a stored draft, from its config's `architectures` (DFlash-1 when none is a variant's)."""
    if isinstance(architectures, str):
        architectures = [architectures]
    for kind, variant in DRAFT_VARIANTS.items():
        if kind != "dflash" and variant.architecture in (architectures or ()):
            return kind
    return "dflash"


def draft_kind(config: DFlashConfig) -> str:
    """The `draft.kind` of a draft config (its class decides, whatever `architectures` it carries)."""
    for kind, variant in DRAFT_VARIANTS.items():
        if kind != "dflash" and isinstance(config, variant.config_cls):
            return kind
    return "dflash"


def resolve_dflash_draft_spec(architectures: Sequence[str] | str | None) -> DraftSpec:
    """Return the spec of the first registered architecture in `architectures`."""
    if isinstance(architectures, str):
        architectures = [architectures]
    for arch in architectures or ():
        if arch in DFLASH_DRAFT_REGISTRY:
            return DFLASH_DRAFT_REGISTRY[arch]
    supported = ", ".join(sorted(DFLASH_DRAFT_REGISTRY))
    raise ValueError(
        f"No DFlash draft is registered for target architectures {list(architectures or [])}. "
        f"Supported: {supported}. To add a family whose decoder is Qwen3/Llama-like, append one line: "
        f"`DFLASH_DRAFT_REGISTRY['<YourArch>ForCausalLM'] = DraftSpec()` "
        "(nemo_dflash.draft.registry; see docs/families.md)."
    )


__all__ = ["DRAFT_VARIANTS", "DraftSpec", "DraftVariant", "DFLASH_DRAFT_REGISTRY", "build_target_layer_ids",
           "draft_kind", "resolve_dflash_draft_spec", "resolve_draft_variant", "variant_of"]
