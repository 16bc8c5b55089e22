"""Speculative decoding with a DFlash draft (one prompt at a time) and its AR baseline."""

from nemo_dflash.inference.spec_decode import (
    DFlashSpeculativeDecoder,
    GenerationOutput,
    autoregressive_generate,
    crop_dynamic_cache,
    select_tokens,
    speculative_generate,
    verify_block,
)

__all__ = [
    "DFlashSpeculativeDecoder",
    "GenerationOutput",
    "autoregressive_generate",
    "crop_dynamic_cache",
    "select_tokens",
    "speculative_generate",
    "verify_block",
]
