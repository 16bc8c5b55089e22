"""The draft side: which class serves a target (`registry.py`), how a draft is built or loaded
for it (`build.py`), and what it is (`model/`: the DFlash block-diffusion draft and its config).
"""

from nemo_dflash.draft.model import DFlashConfig, DFlashContextCache, DFlashDraftModel
from nemo_dflash.draft.registry import DFLASH_DRAFT_REGISTRY, DraftSpec, resolve_dflash_draft_spec

__all__ = ["DFLASH_DRAFT_REGISTRY", "DFlashConfig", "DFlashContextCache", "DFlashDraftModel", "DraftSpec",
           "resolve_dflash_draft_spec"]
