"""Speculative decoding with a DFlash draft (one prompt at a time) and its AR baseline.

Two decode modes: "eager" (HF DynamicCache) and "graphs" (static cache + CUDA graphs, as
serving engines run); `check_decode_mode` validates one before any model is loaded.
"""

from nemo_dflash.engine.graphs import DECODE_MODES, check_decode_mode
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
    "DECODE_MODES",
    "DFlashSpeculativeDecoder",
    "GenerationOutput",
    "autoregressive_generate",
    "check_decode_mode",
    "crop_dynamic_cache",
    "select_tokens",
    "speculative_generate",
    "verify_block",
]
