"""Compatibility path: this module now lives at `nemo_dflash.draft.registry` (the draft side).

Importing `nemo_dflash.registry` gives that very module object (not a copy), so every name, private ones
included, and a monkeypatch on either path are the same. New code imports `nemo_dflash.draft.registry`.
"""

import sys

from nemo_dflash.draft import registry as _module

sys.modules[__name__] = _module
