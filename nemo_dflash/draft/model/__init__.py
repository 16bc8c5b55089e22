"""The DFlash block-diffusion draft (`modeling`), its config (`configuration`) and DFlash2 (`dflash2`).

The names load on first use (PEP 562, `nemo_dflash.lazy_exports`): the model and transformers only when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nemo_dflash import lazy_exports

if TYPE_CHECKING:
    from nemo_dflash.draft.model.configuration import DFlashConfig
    from nemo_dflash.draft.model.dflash2 import DFlash2Config, DFlash2DraftModel
    from nemo_dflash.draft.model.modeling import DFlashDraftModel, DFlashContextCache

_EXPORTS = {  # module -> the names it gives this package
    "nemo_dflash.draft.model.configuration": ("DFlashConfig",),
    "nemo_dflash.draft.model.dflash2": ("DFlash2Config", "DFlash2DraftModel"),
    "nemo_dflash.draft.model.modeling": ("DFlashDraftModel", "DFlashContextCache"),
}

__getattr__, __dir__, __all__ = lazy_exports(globals(), _EXPORTS)  # every lazily loaded name is public
