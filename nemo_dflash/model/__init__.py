"""Compatibility path: the draft model now lives at `nemo_dflash.draft.model` (the draft side).

`nemo_dflash.model`, `nemo_dflash.model.modeling` and `nemo_dflash.model.configuration` are those
very module objects (not copies), so classes keep one identity whichever path imported them. New
code imports `nemo_dflash.draft.model`.
"""

import sys

from nemo_dflash.draft import model as _module
from nemo_dflash.draft.model import configuration as _configuration
from nemo_dflash.draft.model import modeling as _modeling

sys.modules[__name__] = _module
sys.modules[__name__ + ".configuration"] = _configuration
sys.modules[__name__ + ".modeling"] = _modeling
