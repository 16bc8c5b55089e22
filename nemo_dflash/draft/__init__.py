"""The draft side: which class serves a target (`registry.py`), how a draft is built or loaded
for it (`build.py`), and what it is (`model/`: the DFlash block-diffusion draft and its config).

The names load on first use (PEP 562, `nemo_dflash.lazy_exports`): the registry's names do not import the model until used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nemo_dflash import lazy_exports

if TYPE_CHECKING:
    from nemo_dflash.draft.model import DFlashConfig, DFlashContextCache, DFlashDraftModel
    from nemo_dflash.draft.registry import DFLASH_DRAFT_REGISTRY, DraftSpec, resolve_dflash_draft_spec

_EXPORTS = {
    "DFlashConfig": "nemo_dflash.draft.model",
    "DFlashContextCache": "nemo_dflash.draft.model",
    "DFlashDraftModel": "nemo_dflash.draft.model",
    "DFLASH_DRAFT_REGISTRY": "nemo_dflash.draft.registry",
    "DraftSpec": "nemo_dflash.draft.registry",
    "resolve_dflash_draft_spec": "nemo_dflash.draft.registry",
}

__all__ = sorted(_EXPORTS)  # every lazily loaded name is public
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
