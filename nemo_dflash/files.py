"""File permissions of what the tools write: the user's umask, as any other program's files.

safetensors writes its files 0600 and `tempfile.mkdtemp` makes 0700 directories, so a serving
engine running as another user could not read an exported draft. Files written through a temp
directory get the modes a plain `open()`/`mkdir()` would have given them.
"""

from __future__ import annotations

import os
from pathlib import Path


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
