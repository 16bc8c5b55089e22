"""Compatibility path: this module now lives at `nemo_dflash.data.generation` (the slot engine regeneration runs on).

Importing `nemo_dflash.generation` gives that very module object (not a copy), so every name, private ones
included, and a monkeypatch on either path are the same. New code imports `nemo_dflash.data.generation`.
"""

import sys

from nemo_dflash.data import generation as _module

sys.modules[__name__] = _module
