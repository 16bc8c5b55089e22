"""nemo_dflash: train DFlash block-diffusion draft models and ship them to vLLM/SGLang.

Data flows through the folders: `data/` (chat files, regeneration, on `engine/`) -> `target/` (load,
hook) -> `DFlashTargetBatch` -> `draft/` (registry, build, model) and `objective/` (anchors, block mask,
losses, the trainer module) -> `train/` (loop, checkpoints) -> `serving/` (export) / `evaluation/`.
"""

from nemo_dflash.draft.model import DFlashConfig, DFlashDraftModel
from nemo_dflash.draft.registry import DFLASH_DRAFT_REGISTRY, DraftSpec, resolve_dflash_draft_spec
from nemo_dflash.target import DFlashTargetBatch, HFDFlashTargetModel, build_target_layer_ids

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
