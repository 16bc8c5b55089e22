from nemo_dflash.model.configuration import DFlashConfig
from nemo_dflash.model.modeling import DFlashDraftModel, DFlashContextCache

__all__ = ["DFlashConfig", "DFlashDraftModel", "DFlashContextCache"]
