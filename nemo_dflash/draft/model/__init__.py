from nemo_dflash.draft.model.configuration import DFlashConfig
from nemo_dflash.draft.model.dflash2 import DFlash2Config, DFlash2DraftModel
from nemo_dflash.draft.model.modeling import DFlashDraftModel, DFlashContextCache

__all__ = ["DFlash2Config", "DFlash2DraftModel", "DFlashConfig", "DFlashDraftModel", "DFlashContextCache"]
