"""The pipeline's stages as a build graph: what a stage's outputs were made from, so nothing stale is served.

A stage's identity is its settings (the keys that change its outputs) and the fingerprints of what it reads: the
upstream stage's output files and the input files the recipe names (size + sha256, cached by size and mtime in
`stages/fingerprints.json`), and the target's weights fingerprint (`target.identity`). A complete stage whose
inputs changed is stale and runs again, and so is every stage after it; one whose own settings changed is refused
unless `redo=STAGE`. A stage writes `stages/STAGE.started.json` before it starts, so an incomplete stage is only
ever continued under the settings it started with.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Optional

logger = logging.getLogger("nemo_dflash.pipeline")

FINGERPRINTS = "fingerprints.json"
_CHUNK = 16 << 20


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class Fingerprints:
    """Content fingerprints of files and folders, `SIZE:SHA256`; a file's hash is reused while its size and
    mtime stay the same (an edit in place changes its mtime), so a second run hashes nothing again."""

    def __init__(self, cache: Optional[Path] = None) -> None:
        self.cache_path, self.changed = cache, False
        self.entries: dict[str, dict[str, Any]] = {}
        if cache is not None and cache.is_file():
            try:
                loaded = json.loads(cache.read_text())
                self.entries = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError):  # a damaged cache only costs the hashing again
                self.entries = {}

    def file(self, path: str | Path) -> Optional[str]:
        """`SIZE:SHA256` of a file, None when there is none."""
        p = Path(path)
        try:
            st = p.stat()
        except OSError:
            return None
        if not p.is_file():
            return None
        key = str(p.resolve())
        entry = self.entries.get(key)
        if entry and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
            return f"{st.st_size}:{entry['sha256']}"
        sha = _sha256(p)
        self.entries[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
        self.changed = True
        return f"{st.st_size}:{sha}"

    def tree(self, path: str | Path) -> Optional[str]:
        """A file's fingerprint, or one of every file under a folder (relative names and contents), or None."""
        p = Path(path)
        if p.is_file():
            return self.file(p)
        if not p.is_dir():
            return None
        parts = [(str(f.relative_to(p)), self.file(f)) for f in sorted(p.rglob("*")) if f.is_file()]
        return "tree:" + hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def save(self) -> None:
        """Atomically, when anything was hashed (written only by the run directory's owner)."""
        if self.cache_path is None or not self.changed:
            return
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_path.with_name(self.cache_path.name + ".tmp")
        tmp.write_text(json.dumps(self.entries, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.cache_path)
        self.changed = False


def entry_path(entry: str) -> Optional[Path]:
    """The file a `[NAME=]SOURCE[@WEIGHT]` source entry names, None for a built-in source (`sharegpt`, `code:2`)."""
    value = entry.split("=", 1)[1] if "=" in entry.split("@", 1)[0] else entry
    head, at, tail = value.rpartition("@")
    if at:
        try:
            float(tail)
            value = head
        except ValueError:
            pass
    p = Path(value)
    return p if p.is_file() else None


def target_fingerprint(target: str, random_init: bool = False) -> Optional[str]:
    """The target's weights fingerprint (`target.identity`: cheap on large targets), None when it cannot be read
    (the stage's own checks name the problem)."""
    from nemo_dflash.target.identity import weights_fingerprint
    from nemo_dflash.target.loading import resolve_target_path

    try:
        return weights_fingerprint(resolve_target_path(target), random_init=random_init)
    except (OSError, ValueError):
        return None


def input_diffs(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The inputs whose fingerprints differ (added, removed or other contents)."""
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def downstream(stages: Iterable[Any], name: str) -> list[str]:
    """Every stage that reads, directly or through others, what stage ``name`` writes (in stage order)."""
    found: set[str] = {name}
    out = []
    for s in stages:
        if s.upstream in found:
            found.add(s.name)
            out.append(s.name)
    return out


# ---- One owner per run directory

# The run directory's entries: the stages' outputs (which a command run by hand may have left, each stage's own
# check names them), and what only the pipeline writes once it owns the folder (stages/ first, then the rest).
STAGE_OUTPUTS = frozenset({"prompts", "data", "export", "eval"})
OWNED = frozenset({"stages", "recipe.yaml", "recipe.yaml.tmp", "summary.json", "summary.json.tmp"})
LOCK = "pipeline.lock"  # stages/pipeline.lock: held by the pipeline running there, for the whole run


def foreign_entries(run: Path, output_dir: Path) -> list[str]:
    """The entries of ``run`` the pipeline did not write (another run's files, a model, a user's files): all but
    the stages' outputs and the training's output_dir where the pipeline never ran (no stages/), and all but those
    and its own files where it did."""
    if not run.exists():
        return []
    if not run.is_dir():
        return [run.name]
    allowed = set(STAGE_OUTPUTS)
    try:
        allowed.add(output_dir.resolve().relative_to(run.resolve()).parts[0])
    except (ValueError, IndexError):
        pass
    names = sorted(p.name for p in run.iterdir())
    if "stages" in names and (run / "stages").is_dir():
        allowed |= OWNED
    return [n for n in names if n not in allowed]


def check_run_dir(run: Path, output_dir: Path) -> None:
    """Refuse (one line, before anything is written) a run directory holding what the pipeline did not write."""
    from nemo_dflash.recipes._cli import UsageError

    foreign = foreign_entries(run, output_dir)
    if foreign:
        raise UsageError(
            f"run.dir {run} holds {'files' if run.is_dir() else 'a file'} the pipeline did not write "
            f"({', '.join(foreign[:4])}{', ...' if len(foreign) > 4 else ''}): nothing there is replaced; choose a "
            "new or empty folder for run.dir")


# ---- Checks the plan makes before any stage runs (none loads a model)


def check_counts(cfg: Any, holdout: Path, stages: Iterable[str]) -> None:
    """Every count and time of the ``stages`` this run runs, in range and finite, and the counts that size memory
    or processes bounded by the model and the machine: one line naming the key, before any stage runs."""
    import math

    from nemo_dflash.data.config import available_cpus
    from nemo_dflash.recipes._cli import UsageError
    from nemo_dflash.target.loading import target_context

    cpus = available_cpus()
    context = target_context(cfg.target.path)

    checked = set(stages)

    def bad(key: str, why: str) -> None:
        if key.split(".")[0] in checked:
            raise UsageError(f"{key}: {why}")

    for key, value in (("regenerate.max_minutes", cfg.regenerate.max_minutes),
                       ("evaluate.max_minutes", cfg.evaluate.max_minutes)):
        if value is not None and not (math.isfinite(value) and value > 0):
            bad(key, f"give a number of minutes > 0, or null for no cap (got {value})")
    if cfg.regenerate.max_bad_lines < 0:
        bad("regenerate.max_bad_lines", f"give a count >= 0 (got {cfg.regenerate.max_bad_lines})")
    if cfg.export.parity_prompts < 0:
        bad("export.parity_prompts", f"give a count >= 0, 0 for no parity check (got {cfg.export.parity_prompts})")
    threads = [("regenerate.threads", cfg.regenerate.threads), ("evaluate.threads", cfg.evaluate.threads),
               *((f"prompts.jobs[{i}].threads", j.threads) for i, j in enumerate(cfg.prompts.jobs))]
    for key, value in threads:
        if value is not None and not 1 <= value <= cpus:
            bad(key, f"give 1 to {cpus} (this machine's CPUs), or null (got {value})")
    block = cfg.evaluate.block_size
    if block is not None and not 1 <= block <= cfg.draft.block_size:
        bad("evaluate.block_size", f"give 1 to draft.block_size ({cfg.draft.block_size}), the block the draft is "
            f"trained for, or null for it (got {block})")
    tokens = [("regenerate.max_new_tokens", cfg.regenerate.max_new_tokens),
              ("evaluate.max_new_tokens", cfg.evaluate.max_new_tokens),
              *((f"prompts.jobs[{i}].max_new_tokens", j.max_new_tokens) for i, j in enumerate(cfg.prompts.jobs))]
    for key, value in tokens:
        if value is not None and context is not None and value > context:
            bad(key, f"{value} new tokens exceed the target's context ({context} positions, its config.json's "
                "max_position_embeddings): give at most that")
    if cfg.evaluate.decode == "graphs" and "evaluate" in checked:
        from nemo_dflash.recipes._cli import resolve_device_dtype
        from nemo_dflash.evaluation.preflight import check_decode

        try:
            check_decode("graphs", resolve_device_dtype(cfg.evaluate.device, cfg.evaluate.dtype)[0])
        except ValueError as e:
            bad("evaluate.decode", f"{' '.join(str(e).split())} (set evaluate.decode=eager)")
    known = ("mtbench", "humaneval", "math500", "aime")
    for name in (cfg.evaluate.datasets or "").split(","):
        name = name.strip()
        if name and name.lower().replace("-", "").replace("_", "") not in known and \
                Path(name).resolve() != holdout.resolve() and not Path(name).is_file():
            bad("evaluate.datasets", f"{name} is no file and no built-in set (mtbench, humaneval, math500, aime): give "
                "an existing .jsonl chat file")
