"""What the tools write, where and with which modes: a run directory's layout and file permissions.

The layout names are plain strings kept here, below every package that reads them: the
training `Checkpointer` writes this layout and owns its meaning; `draft/build.resolve_draft_dir`
(drafts loaded for evaluation, export or `draft.init_from`) reads it without importing `train/`.

safetensors writes its files 0600 and `tempfile.mkdtemp` makes 0700 directories, so a serving
engine running as another user could not read an exported draft. Files written through a temp
directory get the modes a plain `open()`/`mkdir()` would have given them.
"""

from __future__ import annotations

import os
from pathlib import Path

# A run directory: <output_dir>/checkpoints/step_00000100/{draft,COMPLETE,...} and <output_dir>/final/draft.
CHECKPOINTS_DIR = "checkpoints"
STEP_PREFIX = "step_"
DRAFT_DIR = "draft"  # inside a checkpoint, and inside FINAL_DIR
FINAL_DIR = "final"
COMPLETE = "COMPLETE"  # written last: a checkpoint without it is ignored


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR


def final_draft_dir(output_dir: str | Path) -> Path:
    """Where a finished run leaves its draft."""
    return Path(output_dir) / FINAL_DIR / DRAFT_DIR


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def apply_umask(root: Path) -> None:
    """chmod ``root`` (a file or a directory tree) to 0666 / 0777 minus the umask."""
    mask = current_umask()
    root = Path(root)
    paths = [root] + (sorted(root.rglob("*")) if root.is_dir() else [])
    for p in paths:
        if p.is_symlink():
            continue
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)
