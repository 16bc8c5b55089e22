"""The target side: the frozen model loaded (`loading.py`), then hooked (`hooks.py`).

`loading.load_target` reads a local HF directory or a GGUF file (nothing is downloaded);
`hooks.HFDFlashTargetModel` captures the layers the draft fuses (`build_target_layer_ids`,
checked by `check_target_layer_ids`) and stops the forward after the last one.

The names load on first use (PEP 562, `nemo_dflash.lazy_exports`): a target check need not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nemo_dflash import lazy_exports

if TYPE_CHECKING:
    from nemo_dflash.target.hooks import (
        DFlashTargetBatch,
        HFDFlashTargetModel,
        LayerIdsError,
        build_target_layer_ids,
        check_target_layer_ids,
        find_decoder_layers,
    )
    from nemo_dflash.target.loading import load_target, load_tokenizer, resolve_target_path

_EXPORTS = {  # module -> the names it gives this package
    "nemo_dflash.target.hooks": (
        "DFlashTargetBatch", "HFDFlashTargetModel", "LayerIdsError", "build_target_layer_ids",
        "check_target_layer_ids", "find_decoder_layers",
    ),
    "nemo_dflash.target.loading": ("load_target", "load_tokenizer", "resolve_target_path"),
}

__getattr__, __dir__, __all__ = lazy_exports(globals(), _EXPORTS)  # every lazily loaded name is public
