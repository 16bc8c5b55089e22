"""Compatibility path: this module now lives at `nemo_dflash.data.regenerate` (regeneration makes training data).

Importing `nemo_dflash.regenerate` gives that very module object (not a copy), so every name, private ones
included, and a monkeypatch on either path are the same. New code imports `nemo_dflash.data.regenerate`.
"""

import sys

from nemo_dflash.data import regenerate as _module

sys.modules[__name__] = _module
