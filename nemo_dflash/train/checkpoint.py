"""Checkpoints that never lose work: atomic, complete-marked, resumable exactly.

`Checkpointer` owns a run's directory: when to save, the on-disk layout, the run's identity
(what must match to resume) and the resume itself. The layout's names live in `nemo_dflash.files`
(re-exported here), so `draft/build.resolve_draft_dir` reads the same layout without importing `train/`.

Layout of `<output_dir>/`:
  checkpoints/step_00000100/   one checkpoint (below)
  final/draft/                 the draft at the end of the run (config.json + model.safetensors)

Layout of `<output_dir>/checkpoints/step_00000100/`:
  draft/            config.json + model.safetensors (full weights: usable by evaluate/export)
  state/            model + optimizer through torch.distributed.checkpoint (sharded under FSDP2)
  rank_<r>.json     dataloader position (StatefulDataLoader state), per rank
  rng_<r>.safetensors  torch RNG states, per rank (anchors are seeded per sample and step)
  meta.json         step and the run's identity (block size, mask token, layer ids, target arch)
  COMPLETE          written last, after every file above is flushed (fsync): their sizes and CRC-32s;
                    a directory without it is ignored (and cleaned up)

Everything is first written to `.tmp-step_...` and renamed into place once complete, so a
kill at any moment leaves the previous checkpoint intact and no half-written one visible.
`final/` is written the same way (`final/draft` + `final/COMPLETE`). Resume checks a checkpoint's
files against its COMPLETE before loading it; one that is damaged or fails to load is named in
one line and the next older complete checkpoint is used (`CheckpointError`, exit 2, if none is left).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.api import CheckpointException

from nemo_dflash.data import DataError
from nemo_dflash.draft.registry import draft_kind
from nemo_dflash.files import (  # the on-disk layout (build.resolve_draft_dir reads it too)
    CHECKPOINTS_DIR, COMPLETE, DRAFT_DIR, FINAL_DIR, STEP_PREFIX, apply_umask, checkpoint_root,
    final_draft_dir, fsync_path, verify_complete, write_complete_marker, write_error_reason,
)
from nemo_dflash.train.distributed import DistState, all_reduce_sum
from nemo_dflash.train import safe_dcp

logger = logging.getLogger(__name__)
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

_STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d+)$")
# Fields that must match between a checkpoint and the run resuming from it (see `run_identity`).
IDENTITY_KEYS = ("block_size", "mask_token_id", "target_layer_ids", "target_architecture", "num_draft_layers",
                 "draft_kind")
# The inputs a checkpoint was trained on (see `run_inputs`): checked before the target loads.
INPUT_KEYS = ("target_weights", "data_sha256")


# What a failed write raises: the OSError itself, or the libraries' wrappers of it.
_WRITE_FAILURES = (OSError, CheckpointException, SafetensorError)


def one_line_error(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


class ResumeMismatchError(ValueError):
    pass


class CheckpointError(ValueError):
    """No checkpoint that resume may use can be loaded (damaged, cut short, unreadable), or one cannot be written."""


class NonFiniteWeightsError(CheckpointError):
    """The draft's weights hold NaN or inf (a diverged run): no checkpoint or final draft is written from them."""


def _barrier(state: DistState) -> None:
    if state.enabled:
        dist.barrier()


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def run_identity(draft_config: Any, target_config: Any) -> dict[str, Any]:
    """The `IDENTITY_KEYS` of a run: what a checkpoint's weights only make sense with."""
    archs = getattr(target_config, "architectures", None) or [type(target_config).__name__]
    return {
        "block_size": int(draft_config.block_size),
        "mask_token_id": int(draft_config.mask_token_id),
        "target_layer_ids": list(draft_config.target_layer_ids),
        "target_architecture": archs[0],
        "num_draft_layers": int(draft_config.num_hidden_layers),
        "draft_kind": draft_kind(draft_config),
    }


def run_inputs(target: str, data_paths: list[str], *, random_init: bool = False) -> dict[str, Any]:
    """The `INPUT_KEYS` of a run: its target's weights fingerprint and each data file's sha256, in source order."""
    from nemo_dflash.data.sources import source_sha256
    from nemo_dflash.target.identity import weights_fingerprint
    from nemo_dflash.target.loading import resolve_target_path

    return {"target_weights": weights_fingerprint(resolve_target_path(target), random_init=random_init),
            "data_sha256": [source_sha256(p) for p in data_paths]}


def _input_diffs(saved: dict[str, Any], inputs: dict[str, Any]) -> list[str]:
    """What of the run's inputs differs from those a checkpoint recorded (an older checkpoint recorded none)."""
    diffs = []
    if "target_weights" in saved and "target_weights" in inputs and saved["target_weights"] != inputs["target_weights"]:
        diffs.append("target.path holds other weights than the checkpoint was trained with")
    old, new = saved.get("data_sha256"), inputs.get("data_sha256")
    if old is not None and new is not None:
        if len(old) != len(new):
            diffs.append(f"data.sources lists {len(new)} file(s), the checkpoint's run {len(old)}")
        else:
            changed = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
            if changed:
                diffs.append(f"data.sources[{', '.join(map(str, changed))}] hold(s) other contents (sha256) "
                             "than the checkpoint was trained on")
    return diffs


def check_inputs(ckpt: Path, inputs: dict[str, Any], draft_kind: Optional[str] = None) -> None:
    """Refuse (one line, before the target loads) a resume whose target weights or data files changed, or whose
    `draft.kind` is not the checkpoint's (a DFlash2 checkpoint resumed as DFlash-1, or the reverse)."""
    try:
        saved = json.loads((ckpt / "meta.json").read_text())
    except (OSError, json.JSONDecodeError):
        return  # a damaged meta.json is the load's to report (and fall back from)
    if draft_kind is not None and saved.get("draft_kind", draft_kind) != draft_kind:
        raise ResumeMismatchError(
            f"Refusing to resume from {ckpt}: it holds a {saved['draft_kind']} draft and draft.kind={draft_kind}: "
            f"set draft.kind={saved['draft_kind']}, or start a fresh run with a new output_dir")
    settings = settings_diffs(saved, inputs)
    if settings:
        raise ResumeMismatchError(
            f"Refusing to resume from {ckpt}: its run was trained with other settings ({'; '.join(settings)}), and a "
            "resume under these would mix two recipes in one draft: set them back to continue it, or start afresh "
            "with checkpoint.resume=none --overwrite (or another output_dir)")
    diffs = _input_diffs(saved, inputs)
    if diffs:
        raise ResumeMismatchError(
            f"Refusing to resume from {ckpt}: {'; '.join(diffs)}. Restore the target and data the run used, or "
            "start a fresh run with a new output_dir (or checkpoint.resume=none --overwrite)."
        )


def settings_diffs(saved: dict[str, Any], inputs: dict[str, Any], shown: int = 4) -> list[str]:
    """The settings (`config.resume_settings`: the keys that change outputs) whose values differ between a
    checkpoint and this run, as `key: checkpoint A vs this run B`; [] for a checkpoint that recorded none."""
    old, new = saved.get("settings"), inputs.get("settings")
    if not isinstance(old, dict) or not isinstance(new, dict):
        return []
    keys = sorted(k for k in {*old, *new} if k in old and k in new and old[k] != new[k])
    found = [f"{k}: checkpoint {old[k]!r} vs this run {new[k]!r}" for k in keys[:shown]]
    return found + ([f"{len(keys) - shown} more"] if len(keys) > shown else [])


def nonfinite_weights(module: torch.nn.Module, state: DistState) -> list[str]:
    """The names of ``module``'s floating-point tensors holding NaN or inf (this rank's shards), [] when every
    rank's are finite. A collective: every rank calls it."""
    named = [(n, t) for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_floating_point()]
    local = [(n, t.to_local() if hasattr(t, "to_local") else t) for n, t in named]
    local = [(n, t) for n, t in local if t.numel()]
    flags = torch.stack([~torch.isfinite(t.detach()).all() for _, t in local]) if local else torch.zeros(0, dtype=torch.bool)
    bad = [n for (n, _), f in zip(local, flags.cpu().tolist()) if f]
    total = all_reduce_sum(torch.tensor([float(len(bad))], device=state.device), state)
    if float(total[0]) > 0 and not bad:
        return ["(on another rank)"]
    return bad


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and (p / COMPLETE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def find_latest_checkpoint(output_dir: str | Path) -> Optional[Path]:
    ckpts = list_checkpoints(output_dir)
    return ckpts[-1] if ckpts else None


def full_draft_state_dict(draft: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded fp32 CPU weights (gathers FSDP2 shards; a no-op for plain modules)."""
    sd = get_model_state_dict(draft, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().float().cpu().contiguous() for k, v in sd.items()}


def save_draft_dir(draft: torch.nn.Module, out_dir: str | Path, state: DistState,
                   target_weights: Optional[str] = None) -> None:
    """config.json + model.safetensors (fp32) of the whole draft, written by rank 0; its header records the
    fingerprint of the target it was trained with (``target_weights``), which export and evaluate check."""
    sd = full_draft_state_dict(draft)  # collective under FSDP2: every rank calls it
    if state.is_main:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        draft.config.save_pretrained(out_dir)
        from nemo_dflash.target.identity import TRAINED_ON

        save_file(sd, str(out_dir / "model.safetensors"),
                  metadata={"format": "pt", **({TRAINED_ON: target_weights} if target_weights else {})})
        apply_umask(out_dir)  # safetensors writes 0600


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    draft: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dataloader: Any,
    meta: dict[str, Any],
    state: DistState,
    keep_last: int,
) -> Path:
    root = checkpoint_root(output_dir)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    if state.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier(state)

    save_draft_dir(draft, tmp / DRAFT_DIR, state, meta.get("target_weights"))
    model_sd, optim_sd = get_state_dict(draft, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "state"))
    (tmp / f"rank_{state.rank}.json").write_text(json.dumps({"dataloader": dataloader.state_dict()}))
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and state.device.type == "cuda":
        rng["torch_cuda"] = torch.cuda.get_rng_state(state.device)
    save_file(rng, str(tmp / f"rng_{state.rank}.safetensors"))
    _barrier(state)

    if state.is_main:
        (tmp / "meta.json").write_text(json.dumps({"step": step, "world_size": state.world_size, **meta}, indent=2))
        write_complete_marker(tmp)  # every file flushed, then the marker with their sizes and CRC-32s
        old = root / f".old-{step_dir_name(step)}"
        if final.exists():  # a checkpoint of the same step (a re-save, or a damaged one after a fallback)
            os.replace(final, old)  # set aside, not deleted, until the new one is in place
        os.replace(tmp, final)
        fsync_path(root)
        shutil.rmtree(old, ignore_errors=True)
        _prune(root, keep_last, final)
        logger.info("Saved checkpoint %s", final)
    _barrier(state)
    return final


def _prune(root: Path, keep_last: int, just_saved: Path) -> None:
    """Keep the newest `keep_last` checkpoints, and always the one just saved: after a resume that fell
    back past a damaged newer checkpoint, that one would otherwise count among the newest."""
    ckpts = list_checkpoints(root.parent)
    for old in ckpts[:-keep_last]:
        if old != just_saved:
            shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(f".tmp-{STEP_PREFIX}*"):  # leftovers of a run killed while writing
        shutil.rmtree(stale, ignore_errors=True)
    for aside in root.glob(f".old-{STEP_PREFIX}*"):  # killed while replacing: kept until its successor is whole
        if (root / aside.name[len(".old-"):] / COMPLETE).is_file():
            shutil.rmtree(aside, ignore_errors=True)


def check_identity(ckpt: Path, meta: dict[str, Any]) -> dict[str, Any]:
    saved = json.loads((ckpt / "meta.json").read_text())
    diffs = [
        f"{k}: checkpoint {saved.get(k)!r} vs this run {meta.get(k)!r}"
        for k in IDENTITY_KEYS
        if k in saved and saved.get(k) != meta.get(k)
    ] + settings_diffs(saved, meta) + _input_diffs(saved, meta)
    if diffs:
        raise ResumeMismatchError(
            f"Refusing to resume from {ckpt}: the run differs from the checkpoint ({'; '.join(diffs)}). "
            "Restore the recipe's values, or start a fresh run with a new output_dir (or checkpoint.resume=none)."
        )
    return saved


def load_checkpoint(
    ckpt: Path,
    draft: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dataloader: Any,
    meta: dict[str, Any],
    state: DistState,
) -> dict[str, Any]:
    """Restore everything saved by `save_checkpoint`; returns its meta (step, tokens_seen, ...)."""
    saved = check_identity(ckpt, meta)
    if saved.get("world_size", state.world_size) != state.world_size:
        raise ResumeMismatchError(
            f"{ckpt} was written by {saved['world_size']} processes; resume with the same number "
            f"(this run has {state.world_size}) so the data order stays exact."
        )
    model_sd, optim_sd = get_state_dict(draft, optimizer)
    sd = {"model": model_sd, "optim": optim_sd}
    safe_dcp.load(sd, ckpt / "state")  # unpickles nothing a file can craft (safe_dcp.py)
    set_state_dict(draft, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    dataloader.load_state_dict(json.loads((ckpt / f"rank_{state.rank}.json").read_text())["dataloader"])
    # StatefulDataLoader applies a loaded state only when its next iterator is made; make it now
    # (the loop's first `iter` reuses it), so a refused state (another batch size, data or world
    # size) is refused here, before the resume is reported.
    dataloader.state_dict()
    rng = load_file(str(ckpt / f"rng_{state.rank}.safetensors"))
    torch.set_rng_state(rng["torch_cpu"])
    if "torch_cuda" in rng and state.device.type == "cuda":
        torch.cuda.set_rng_state(rng["torch_cuda"], state.device)
    return saved


def _damaged_warning(path: Path, error: str, older: Optional[Path]) -> None:
    after = f"falling back to the next older, {older}" if older is not None else "no older complete checkpoint is left"
    logger.warning("Checkpoint %s cannot be loaded (%s): %s", path, error, after)


def _check_same_run(output_dir: Path, ckpt: Path) -> None:
    """`checkpoint.resume=PATH` of another run continues in an `output_dir` that holds no run of its own, never
    into one that does: the two runs' checkpoints and metrics would be mixed."""
    from nemo_dflash.train.run_dir import held_run

    own = checkpoint_root(output_dir).resolve()
    if ckpt.resolve().parent == own:
        return
    held = held_run(output_dir)
    if held:
        raise ResumeMismatchError(
            f"checkpoint.resume={ckpt} belongs to another run than output_dir {output_dir}, which holds its own "
            f"({', '.join(held)}): resuming would mix the two runs' checkpoints and metrics. Continue the run in "
            f"{output_dir} with checkpoint.resume=auto, or start from {ckpt} in a new output_dir"
        )


def plan_resume(output_dir: str | Path, mode: str, state: DistState) -> list[Path]:
    """The checkpoints a resume may try, newest first, decided before any model loads.

    Rank 0 checks the files of each (against its COMPLETE) from the newest down; a damaged one is named
    in one warning line and skipped. The list starts at the first whose files are intact (the older ones
    are checked when a fallback reaches them). [] for a fresh start; `CheckpointError` (one line) when
    checkpoints exist but none is intact, or an explicit `checkpoint.resume=PATH` is damaged.
    """
    if mode == "none":
        return []
    if mode == "auto":
        candidates = list_checkpoints(output_dir)[::-1]
        if not candidates:
            return []
    else:
        path = Path(mode)
        if not (path / COMPLETE).is_file():
            raise FileNotFoundError(f"checkpoint.resume={mode}: {path} is not a complete checkpoint")
        _check_same_run(Path(output_dir), path)
        candidates = [path]
    first, errors = len(candidates), []
    if state.is_main:
        for i, path in enumerate(candidates):
            try:
                verify_complete(path)
            except OSError as e:
                errors.append((path, str(e)))
                _damaged_warning(path, str(e), candidates[i + 1] if i + 1 < len(candidates) else None)
                continue
            first = i
            break
    # every rank takes rank 0's verdict (the others contribute 0)
    first = int(all_reduce_sum(torch.tensor([float(first if state.is_main else 0)], device=state.device), state)[0])
    if first == len(candidates):
        path, why = errors[0] if errors else (candidates[0], "damaged (found by rank 0)")
        older = f", nor can the {len(candidates) - 1} older one(s)" if len(candidates) > 1 else ""
        raise CheckpointError(
            f"cannot resume: checkpoint {path} cannot be loaded ({why}){older}; restore its files, or start afresh "
            "with checkpoint.resume=none --overwrite (or another output_dir)"
        )
    return candidates[first:]


class Checkpointer:
    """A run's checkpoints: when to save, where (the layout above), what must match, and resume.

    `maybe_save` after every step, `save_last` when the loop ends, `save_final` for the draft a
    finished run leaves, `resume` before the first step. Every rank calls them (collectives).
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        every_steps: Optional[int],
        keep_last: int,
        resume: str,
        draft: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataloader: Any,
        identity: dict[str, Any],
        state: DistState,
        resume_plan: Optional[list[Path]] = None,
    ) -> None:
        """`resume_plan`: `plan_resume`'s list, made before the model loaded (its first entry is verified)."""
        self.output_dir = Path(output_dir)
        self.resume_plan = resume_plan
        self.every_steps = every_steps
        self.keep_last = keep_last
        self.resume_mode = resume
        self.draft = draft
        self.optimizer = optimizer
        self.dataloader = dataloader
        self.identity = identity
        self.state = state

    @property
    def final_draft(self) -> Path:
        return final_draft_dir(self.output_dir)

    def require_finite(self, step: Optional[int], what: str) -> None:
        """Finite or nothing: `NonFiniteWeightsError` (one line) before ``what`` is written from weights holding
        NaN or inf, naming the last complete checkpoint, which stays as it is."""
        bad = nonfinite_weights(self.draft, self.state)
        if not bad:
            return
        latest = find_latest_checkpoint(self.output_dir)
        kept = f"the last complete checkpoint, {latest}, is kept" if latest else "no complete checkpoint was written"
        raise NonFiniteWeightsError(
            f"the draft's weights hold NaN or inf{'' if step is None else f' at step {step}'} ({len(bad)} tensor(s), e.g. {', '.join(bad[:2])}): the "
            f"run diverged, so {what} is not written; {kept}. Lower optim.lr (or optim.grad_clip) and resume "
            "(checkpoint.resume=auto), or start afresh with checkpoint.resume=none --overwrite"
        )

    def save(self, step: int, tokens_seen: int) -> Path:
        """A write that fails (a full disk, permissions changed mid-run) is one line, `CheckpointError`; its
        half-written `.tmp-step_N` is removed and the complete checkpoints before it stay as they were.
        Weights holding NaN or inf are never saved (`require_finite`)."""
        self.require_finite(step, f"the checkpoint of step {step}")
        try:
            return save_checkpoint(
                self.output_dir, step, self.draft, self.optimizer, self.dataloader,
                {**self.identity, "tokens_seen": tokens_seen}, self.state, self.keep_last,
            )
        except _WRITE_FAILURES as e:
            raise self._write_failed(e, checkpoint_root(self.output_dir) / f".tmp-{step_dir_name(step)}",
                                     f"the checkpoint of step {step} in {checkpoint_root(self.output_dir)}",
                                     "resume from the last complete checkpoint") from None

    def _write_failed(self, e: BaseException, tmp: Path, what: str, then: str) -> BaseException:
        """A write that failed (a full disk, a quota, permissions changed mid-run), wrapped or not by the
        library that wrote (safetensors, torch.distributed.checkpoint): its half-written ``tmp`` removed
        and a one-line `CheckpointError` to raise; any other error is returned as it was (a bug)."""
        reason = write_error_reason(e)
        if reason is None and not isinstance(e, OSError):
            return e
        if self.state.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        return CheckpointError(
            f"cannot write {what} ({reason or one_line_error(e)}): free space or fix the permissions, then run "
            f"the same command again to {then}"
        )

    def due(self, step: int) -> bool:
        """Whether the `every_steps` schedule saves after `step`."""
        return bool(self.every_steps and step % self.every_steps == 0)

    def maybe_save(self, step: int, tokens_seen: int) -> Optional[Path]:
        """Save on the `every_steps` schedule."""
        if self.due(step):
            return self.save(step, tokens_seen)
        return None

    def save_last(self, step: int, tokens_seen: int, *, always: bool = False) -> Optional[Path]:
        """At the end of the loop: save `step` unless it is already saved. Only runs that save
        periodically do so, unless `always` (a preemption: the next job resumes from it)."""
        if not (self.every_steps or always):
            return None
        latest = find_latest_checkpoint(self.output_dir)
        if latest is not None and latest.name == step_dir_name(step):
            return None
        return self.save(step, tokens_seen)

    def save_final(self, step: Optional[int] = None) -> Path:
        """`final/draft`, written into `.tmp-final` with its COMPLETE and renamed into place: a run killed
        while writing it keeps the previous one whole. Weights holding NaN or inf are never written."""
        self.require_finite(step, f"{FINAL_DIR}/{DRAFT_DIR}")
        final = self.final_draft.parent
        tmp = final.parent / f".tmp-{final.name}"
        try:
            if self.state.is_main and tmp.exists():
                shutil.rmtree(tmp)
            save_draft_dir(self.draft, tmp / self.final_draft.name, self.state, self.identity.get("target_weights"))
            if self.state.is_main:
                write_complete_marker(tmp)
        except _WRITE_FAILURES as e:
            raise self._write_failed(e, tmp, f"the final draft in {final}",
                                     "write it from the last complete checkpoint") from None
        if self.state.is_main:
            old = final.parent / f".old-{final.name}"
            if final.exists():
                os.replace(final, old)
            os.replace(tmp, final)
            fsync_path(final.parent)
            shutil.rmtree(old, ignore_errors=True)
        _barrier(self.state)
        return self.final_draft

    def resume(self) -> Optional[dict[str, Any]]:
        """Restore the checkpoint `resume` names ("auto": the newest complete one, "none": none).

        Returns its meta (step, tokens_seen, ...) or None for a fresh start. Every check (complete,
        identity, world size, data-loader state) passes before "Resumed from" is logged.
        """
        candidates = self.resume_plan
        if candidates is None:
            candidates = plan_resume(self.output_dir, self.resume_mode, self.state)
        if not candidates:
            return None
        failures: list[tuple[Path, str]] = []
        for i, path in enumerate(candidates):
            saved, error = self._try_load(path, verify=i > 0)  # the first was verified by plan_resume
            if saved is not None:
                log = logger.warning if failures else logger.info  # a fallback is said as loudly as its cause
                log("Resumed from %s (step %d)", path, saved["step"])
                return saved
            failures.append((path, error))
            _damaged_warning(path, error, candidates[i + 1] if i + 1 < len(candidates) else None)
        first, why = failures[0]
        older = f", nor can the {len(failures) - 1} older one(s)" if len(failures) > 1 else ""
        raise CheckpointError(
            f"cannot resume: checkpoint {first} cannot be loaded ({why}){older}; restore its files, or start "
            "afresh with checkpoint.resume=none --overwrite (or another output_dir)"
        )

    def _try_load(self, path: Path, verify: bool = True) -> tuple[Optional[dict[str, Any]], str]:
        """Check ``path``'s files against its COMPLETE (rank 0), then load it: (its meta, "") or (None, why
        not). Every rank agrees. A run that does not match the checkpoint is not damage: its error propagates."""
        error = ""
        if verify and self.state.is_main:
            try:
                verify_complete(path)
            except OSError as e:
                error = str(e)
        if not self._all_ok(not error):
            return None, error or "damaged (found by rank 0)"
        saved = None
        try:
            saved = load_checkpoint(path, self.draft, self.optimizer, self.dataloader, self.identity, self.state)
        except (ResumeMismatchError, DataError):
            raise
        except (OSError, RuntimeError, ValueError, KeyError, CheckpointException) as e:
            error = " ".join(str(e).split())[:300] or type(e).__name__
        if not self._all_ok(not error):
            return None, error or "failed to load on another rank"
        return saved, ""

    def _all_ok(self, ok: bool) -> bool:
        bad = all_reduce_sum(torch.tensor([0.0 if ok else 1.0], device=self.state.device), self.state)
        return float(bad[0]) == 0


__all__ = [
    "CHECKPOINTS_DIR", "COMPLETE", "CheckpointError", "Checkpointer", "DRAFT_DIR", "FINAL_DIR", "IDENTITY_KEYS",
    "INPUT_KEYS", "NonFiniteWeightsError", "STEP_PREFIX", "ResumeMismatchError", "check_identity", "check_inputs",
    "settings_diffs",
    "nonfinite_weights", "run_inputs", "checkpoint_root", "final_draft_dir",
    "find_latest_checkpoint", "full_draft_state_dict", "list_checkpoints", "load_checkpoint", "plan_resume",
    "run_identity", "save_checkpoint", "save_draft_dir", "step_dir_name",
]
