"""A target's identity: a fingerprint of its weight files, so a checkpoint or an evaluation made with one
target is never continued with another that has the same architecture and shapes.

The fingerprint is cheap on a 16 GB target (it reads about 64 MiB per weight file, not every byte) and
stable across copies and moves: each weight file's name and size, its first MiB (a safetensors or GGUF
header: names, dtypes, shapes, offsets) and 63 more MiB-long pieces spread evenly over the file. Two
models trained apart differ in every piece; a file changed in a few bytes only may not be caught (the
COMPLETE markers' CRC-32s catch damage to a run's own files).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

PIECE = 1 << 20  # bytes read per piece
PIECES = 64  # pieces read per file at most (the whole file when it is smaller)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _file_fingerprint(path: Path, h: "hashlib._Hash") -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        if size <= PIECE * PIECES:
            while chunk := f.read(16 << 20):
                h.update(chunk)
            return
        stride = (size - PIECE) // (PIECES - 1)
        for i in range(PIECES):
            f.seek(i * stride)
            h.update(f.read(PIECE))


def weights_fingerprint(target: str | Path, *, random_init: bool = False) -> str:
    """The fingerprint (sha256 hex) of a target: a local HF directory's weight files or a .gguf file.
    ``random_init`` targets (weights drawn from the seed) are fingerprinted by their config.json alone."""
    path = Path(target)
    h = hashlib.sha256()
    if random_init:
        config = path / "config.json" if path.is_dir() else path
        h.update(b"random_init\0" + (config.read_bytes() if config.is_file() else str(path).encode()))
        return h.hexdigest()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir()
                                                 if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    for f in files:
        _file_fingerprint(f, h)
    return h.hexdigest()


TRAINED_ON = "target_weights"  # a draft's safetensors header key: the fingerprint of the target it was trained with


def trained_on(weights_file: str | Path) -> str | None:
    """The target fingerprint a draft's weights file records (`TRAINED_ON`), None when it records none (a draft
    written before drafts recorded it, or by other tools)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights_file), framework="pt") as f:
            return (f.metadata() or {}).get(TRAINED_ON)
    except (OSError, SafetensorError):
        return None


def check_trained_on(weights_file: str | Path, target: str, *, flag: str, allow: bool) -> str | None:
    """Refuse (``ValueError``, one line) a draft recorded as trained on other target weights than ``target``'s,
    unless ``allow`` (the user's ``--any-target``); returns the recorded fingerprint."""
    from nemo_dflash.target.loading import resolve_target_path

    recorded = trained_on(weights_file)
    if recorded is None or allow:
        return recorded
    path = resolve_target_path(target)
    if Path(path).exists() and recorded not in (weights_fingerprint(path), weights_fingerprint(path, random_init=True)):
        raise ValueError(f"the draft ({weights_file}) was trained on other target weights than {flag} {target} "
                         f"holds (their fingerprints differ): give the target it was trained on, or pass "
                         f"--any-target to use it with this one")
    return recorded


__all__ = ["TRAINED_ON", "check_trained_on", "trained_on", "weights_fingerprint"]
