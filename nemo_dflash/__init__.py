"""nemo_dflash: train DFlash block-diffusion draft models and ship them to vLLM/SGLang.

Data flows through the folders: `data/` (chat files, regeneration, on `engine/`) -> `target/` (load,
hook) -> `DFlashTargetBatch` -> `draft/` (registry, build, model) and `objective/` (anchors, block mask,
losses, the trainer module) -> `train/` (loop, checkpoints) -> `serving/` (export) / `evaluation/`.

The names below load on first use (PEP 562): the draft model pulls in transformers (seconds), and a command
that only parses its config, prints `--help` or refuses a flag should not pay for it.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

if TYPE_CHECKING:
    from nemo_dflash.draft.model import DFlashConfig, DFlashDraftModel
    from nemo_dflash.draft.registry import DFLASH_DRAFT_REGISTRY, DraftSpec, resolve_dflash_draft_spec
    from nemo_dflash.target import DFlashTargetBatch, HFDFlashTargetModel, build_target_layer_ids


def lazy_exports(namespace: dict[str, Any], exports: Mapping[str, Sequence[str]]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """A package's `__getattr__`, `__dir__` and `__all__` (PEP 562; `namespace` is its `globals()`, `exports` maps a
    module to the names it gives the package): a name's module is imported on first use of the name, a submodule on
    first use of its name (as an eager `__init__` had it loaded). A facade then costs nothing until a name is used."""
    package = namespace["__name__"]
    module_of = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name in module_of:
            value = getattr(importlib.import_module(module_of[name]), name)
        elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value  # the next lookup is an ordinary attribute
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(module_of))

    return __getattr__, __dir__, sorted(module_of)


_EXPORTS = {  # module -> the names it gives this package
    "nemo_dflash.draft.model": ("DFlashConfig", "DFlashDraftModel"),
    "nemo_dflash.draft.registry": ("DFLASH_DRAFT_REGISTRY", "DraftSpec", "resolve_dflash_draft_spec"),
    "nemo_dflash.target": ("DFlashTargetBatch", "HFDFlashTargetModel", "build_target_layer_ids"),
}

__version__ = "0.1.0"
__getattr__, __dir__, __all__ = lazy_exports(globals(), _EXPORTS)  # every lazily loaded name is public
