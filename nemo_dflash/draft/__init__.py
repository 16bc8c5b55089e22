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

_EXPORTS = {  # module -> the names it gives this package
    "nemo_dflash.draft.model": ("DFlashConfig", "DFlashContextCache", "DFlashDraftModel"),
    "nemo_dflash.draft.registry": ("DFLASH_DRAFT_REGISTRY", "DraftSpec", "resolve_dflash_draft_spec"),
}

__getattr__, __dir__, __all__ = lazy_exports(globals(), _EXPORTS)  # every lazily loaded name is public
