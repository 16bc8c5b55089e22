"""nemo_dflash: train DFlash block-diffusion draft models and ship them to vLLM/SGLang.

Data flows: data -> target hooks (`target`) -> `DFlashTargetBatch` -> trainer module
(`core`: anchors, block mask, draft, loss) -> optimizer -> checkpoint / export.
"""

from nemo_dflash.model import DFlashConfig, DFlashDraftModel
from nemo_dflash.registry import (
    DFLASH_DRAFT_REGISTRY,
    DraftSpec,
    build_target_layer_ids,
    resolve_dflash_draft_spec,
)
from nemo_dflash.target import DFlashTargetBatch, HFDFlashTargetModel

__all__ = [
    "DFLASH_DRAFT_REGISTRY",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashTargetBatch",
    "DraftSpec",
    "HFDFlashTargetModel",
    "build_target_layer_ids",
    "resolve_dflash_draft_spec",
]
__version__ = "0.1.0"
