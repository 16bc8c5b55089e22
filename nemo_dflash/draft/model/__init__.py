from nemo_dflash.draft.model.configuration import DFlashConfig
from nemo_dflash.draft.model.modeling import DFlashDraftModel, DFlashContextCache

__all__ = ["DFlashConfig", "DFlashDraftModel", "DFlashContextCache"]
