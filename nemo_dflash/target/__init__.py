"""The target side: the frozen model loaded (`loading.py`), then hooked (`hooks.py`).

`loading.load_target` reads a local HF directory or a GGUF file (nothing is downloaded);
`hooks.HFDFlashTargetModel` captures the layers the draft fuses (`build_target_layer_ids`,
checked by `check_target_layer_ids`) and stops the forward after the last one.
"""

from nemo_dflash.target.hooks import (
    DFlashTargetBatch,
    HFDFlashTargetModel,
    LayerIdsError,
    build_target_layer_ids,
    check_target_layer_ids,
    find_decoder_layers,
)
from nemo_dflash.target.loading import load_target, load_tokenizer, resolve_target_path

__all__ = [
    "DFlashTargetBatch",
    "HFDFlashTargetModel",
    "LayerIdsError",
    "build_target_layer_ids",
    "check_target_layer_ids",
    "find_decoder_layers",
    "load_target",
    "load_tokenizer",
    "resolve_target_path",
]
