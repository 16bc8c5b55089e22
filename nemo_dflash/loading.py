"""Compatibility path: this module now lives at `nemo_dflash.target.loading` (the target side).

Importing `nemo_dflash.loading` gives that very module object (not a copy), so every name, private ones
included, and a monkeypatch on either path are the same. New code imports `nemo_dflash.target.loading`.
"""

import sys

from nemo_dflash.target import loading as _module

sys.modules[__name__] = _module
