"""The pipeline's plan and run: each stage skipped, run, redone or refused from its markers, then run in order
(rank 0 writing the markers, every rank agreeing before the next stage). `recipes.pipeline` is the command."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from nemo_dflash.config import RecipeConfig, to_yaml
from nemo_dflash.recipes._cli import UsageError, fail
from nemo_dflash.recipes._pipeline_stages import (
    RANK0_STAGES, STAGES, STAGES_DIR, Stage, _projected, _write_json, changed_keys, digest, evaluate_stage,
    export_stage, layout_of, prompts_stage, regenerate_stage, train_stage,
)
from nemo_dflash.recipes.stage_graph import FINGERPRINTS, LOCK, Fingerprints, check_counts, check_run_dir, \
    downstream, input_diffs, target_fingerprint

logger = logging.getLogger("nemo_dflash.pipeline")


class Pipeline:
    """The stages of one recipe, planned (settings, markers, refusals) before any of them runs."""

    def __init__(self, cfg: RecipeConfig, stages: Sequence[str], redo: Sequence[str]) -> None:
        self.cfg, self.lay = cfg, layout_of(cfg)
        check_run_dir(self.lay.run, self.lay.output_dir)  # another run's, a model's, a user's folder: refused now
        check_counts(cfg, self.lay.run / "data" / "regen.holdout.jsonl", stages)  # ranges, bounds of its stages
        self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.checked = set(stages)  # only the stages this run runs are checked (the others give their settings)
        self.fp = Fingerprints(self.lay.run / STAGES_DIR / FINGERPRINTS)  # saved only once the run owns the folder
        self._target_fp: Optional[str] = None
        built = {"prompts": self._prompts, "regenerate": self._regenerate, "train": self._train,
                 "export": self._export, "evaluate": self._evaluate}
        self.stages: list[Stage] = []
        for name in STAGES:
            stage = built[name]()
            if stage is not None:
                self.stages.append(stage)
        self.selected = [s for s in self.stages if s.name in stages]
        self.incomplete: dict[str, dict[str, Any]] = {}  # stages stopped early this run -> what they measured
        self.capped_draft: dict[str, Any] = {}  # the training a time cap stopped, when later stages go on
        self._plan(set(redo))
        if self.rank == 0 and any(s.name == "train" and s.action != "skip" for s in self.selected):
            from nemo_dflash.recipes.sizing_advice import warn_small_budget

            warn_small_budget(cfg, self.world)  # a budget below a paying draft's: one warning, never a refusal

    # ---- each stage: its settings (what its outputs depend on), its checks, how it runs ----

    def _prompts(self) -> Any:
        return prompts_stage(self)

    def _regenerate(self) -> Any:
        return regenerate_stage(self)

    def _train(self) -> Any:
        return train_stage(self)

    def _export(self) -> Any:
        return export_stage(self)

    def _evaluate(self) -> Any:
        return evaluate_stage(self)

    def target_fp(self) -> Optional[str]:
        if self._target_fp is None:
            self._target_fp = target_fingerprint(self.cfg.target.path, self.cfg.target.random_init)
        return self._target_fp

    # ---- the plan: skip, run, redo or refuse each selected stage ----

    def _read_marker(self, name: str, path: Optional[Path] = None) -> Optional[dict[str, Any]]:
        path = path or self.lay.marker(name)
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            raise UsageError(f"{path} cannot be read: pass redo={name} to run that stage again") from None

    def _plan(self, redo: set[str]) -> None:
        by_name = {s.name: s for s in self.stages}
        selected = {s.name for s in self.selected}
        for name in redo - selected:
            raise UsageError(f"redo={name} but stages leave {name} out: add it to stages=")
        runs: set[str] = set()  # stages that run now: the later stages reading their outputs are stale
        for stage in self.stages:
            if stage.name not in selected:
                continue
            up = by_name.get(stage.upstream) if stage.upstream else None
            marker = self._read_marker(stage.name)
            started = self._read_marker(stage.name, self.lay.started(stage.name))
            if stage.name in redo:
                stage.action, stage.why = "redo", f"redo={stage.name}"
            elif up is not None and up.name in runs and (marker is not None or started is not None):
                stage.action, stage.why = "redo", f"stale: {up.name}, whose outputs it reads, runs again"
            elif marker is not None or started is not None:
                self._check_recorded(stage, marker, started, selected)
            if stage.action != "skip":
                runs.add(stage.name)
            if stage.action == "run" and stage.left is not None and started is None:
                found = stage.left()
                if found:  # the command would refuse them naming --overwrite: here the fix is redo=
                    raise UsageError(
                        f"stage {stage.name} has no marker ({self.lay.marker(stage.name)}) but its outputs exist "
                        f"({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}), left by something else (its "
                        f"command run by hand, or the stage killed after writing them): pass redo={stage.name} to "
                        "replace them, or move them away")

    def _check_recorded(self, stage: Stage, marker: Optional[dict[str, Any]],
                        started: Optional[dict[str, Any]], selected: set[str]) -> None:
        """Skip, continue, rerun (stale) or refuse a stage from what its markers recorded: the complete one, else
        the one written when it started (an incomplete stage continues only under the settings it started with)."""
        record = marker if marker is not None else started
        assert record is not None
        path = self.lay.marker(stage.name) if marker is not None else self.lay.started(stage.name)
        if record.get("stale"):
            stage.action, stage.why = "redo", f"stale: {record['stale']} ran again after it"
            return
        recorded = _projected(record.get("settings", {}), stage.schemas)
        if digest(recorded) != digest(stage.settings):
            keys = changed_keys(recorded, stage.settings)
            what = "completed" if marker is not None else "was started, and is not complete,"
            raise UsageError(
                f"stage {stage.name} {what} with other settings ({', '.join(keys[:4]) or 'its inputs'} differ "
                f"from {path}): pass redo={stage.name} to run it again (its outputs are replaced), or restore the "
                "settings")
        diffs = input_diffs(record["inputs"], stage.inputs()) if "inputs" in record else []
        if diffs:
            stage.action, stage.why = "redo", f"stale: {', '.join(diffs[:3])} changed since it ran"
        elif marker is not None and redo_capped_draft(marker, stage, selected):
            stage.action, stage.why = "redo", "it measured a time-capped draft, and training continues now"
        elif marker is not None:
            stage.action = "skip"
        else:
            done = stage.finished(path.stat().st_mtime) if stage.finished is not None else None
            stage.action, stage.adopted = ("adopt", done) if done is not None else ("run", None)

    # ---- a budget ends with a draft ----

    def _capped_draft(self, stage: Stage, summary: dict[str, Any]) -> bool:
        """Whether a stage stopped early goes on to the later stages: a training stopped by `train.max_minutes`
        is exported and evaluated as a time-capped draft (its export and evaluate markers say so, and the same
        command continues the training, then exports and evaluates again). Anything else stops the run."""
        later = [s.name for s in self.selected if STAGES.index(s.name) > STAGES.index(stage.name)]
        if stage.name != "train" or summary.get("stopped_by") != TIME_CAP or not later:
            return False
        self.capped_draft = {"steps": summary.get("steps"), "total_steps": summary.get("total_steps"),
                             "tokens_seen": summary.get("tokens_seen"), "stopped_by": TIME_CAP,
                             "continue": "run the same command again: training continues, then export and "
                                         "evaluate run again"}
        logger.warning("stage train stopped by train.max_minutes at step %s of %s: exporting and evaluating that "
                       "draft (time-capped); run the same command again to continue training", summary.get("steps"),
                       summary.get("total_steps"))
        return True

    # ---- running ----

    def _agree(self, flag: bool) -> bool:
        """Every rank waits here; True when ``flag`` is True on any rank (a gloo group for this alone: each stage
        command makes its own)."""
        if self.world == 1 or "MASTER_ADDR" not in os.environ:
            return flag
        import datetime

        import torch
        import torch.distributed as dist

        from nemo_dflash.train.distributed import init_process_group

        init_process_group("gloo", datetime.timedelta(days=7))
        try:
            t = torch.tensor([int(flag)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return bool(t.item())
        finally:
            dist.destroy_process_group()

    def _complete(self, stage: Stage, inputs: dict[str, Optional[str]], summary: dict[str, Any],
                  seconds: float) -> None:
        """Rank 0: the stage's marker (its settings, inputs, outputs and summary), then its start record goes."""
        _write_json(self.lay.marker(stage.name), {
            "stage": stage.name, "digest": digest(stage.settings), "settings": stage.settings, "inputs": inputs,
            "outputs": stage.outputs(), "summary": summary, "seconds": round(seconds, 1),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **({"time_capped_draft": self.capped_draft} if self.capped_draft else {})})
        self.lay.started(stage.name).unlink(missing_ok=True)
        self.fp.save()

    def _start(self, stage: Stage, redo: bool) -> dict[str, Optional[str]]:
        """Before a stage runs (rank 0): its complete marker goes (a killed rerun is not complete), the settings
        and inputs it starts with are recorded, and every later stage's marker is marked stale (its inputs are
        about to be rewritten). Returns the inputs' fingerprints, which its marker records."""
        self.lay.marker(stage.name).unlink(missing_ok=True)
        inputs = stage.inputs()
        started = self._read_marker(stage.name, self.lay.started(stage.name))
        if redo or started is None:
            _write_json(self.lay.started(stage.name), {"stage": stage.name, "digest": digest(stage.settings),
                                                       "settings": stage.settings, "inputs": inputs})
        for later in downstream(self.stages, stage.name):
            for path in (self.lay.marker(later), self.lay.started(later)):
                record = self._read_marker(later, path)
                if record is not None and not record.get("stale"):
                    _write_json(path, {**record, "stale": stage.name})
        self.fp.save()
        return inputs

    def _claim(self) -> Any:
        """Rank 0: lock the run directory for the whole run (`stages/pipeline.lock`), before anything else is
        written; a second pipeline there is refused in one line."""
        from nemo_dflash.files import FileLock, LockBusyError

        self.lay.run.mkdir(parents=True, exist_ok=True)
        check_run_dir(self.lay.run, self.lay.output_dir)  # again: something may have come since the plan
        (self.lay.run / STAGES_DIR).mkdir(exist_ok=True)
        lock = FileLock(self.lay.run / STAGES_DIR / LOCK)
        try:
            lock.acquire()
        except LockBusyError as e:
            raise UsageError(f"run.dir {self.lay.run} is in use by another pipeline (pid {e.holder}): wait for it to "
                             "end, or choose another run.dir") from None
        except OSError as e:
            raise UsageError(f"run.dir {self.lay.run} cannot be locked ({e.strerror or e}): choose a run.dir on a "
                             "local or lock-capable filesystem") from None
        return lock

    def execute(self) -> dict[str, Any]:
        main, lock, refused = self.rank == 0, None, ""
        if main:
            try:
                lock = self._claim()
            except UsageError as e:
                refused = str(e)
        # every rank has planned from the same markers before any is written, and stops if rank 0 could not claim
        if self._agree(bool(refused)):
            fail(refused or f"run.dir {self.lay.run}: rank 0 could not claim it (its message says why)")
        try:
            return self._execute(main)
        finally:
            if lock is not None:
                lock.release(remove=True)

    def _execute(self, main: bool) -> dict[str, Any]:
        if main:
            tmp = self.lay.run / "recipe.yaml.tmp"
            tmp.write_text(to_yaml(self.cfg))
            os.replace(tmp, self.lay.run / "recipe.yaml")
        outcome: dict[str, str] = {}
        for stage in self.selected:
            if stage.action == "skip":
                logger.info("stage %s: complete with these settings (%s), skipped", stage.name,
                            self.lay.marker(stage.name))
                outcome[stage.name] = "skipped"
                continue
            if stage.action == "adopt":  # killed after its last output, before its marker: completed
                logger.info("stage %s: its outputs were complete (stopped before its marker): marker written",
                            stage.name)
                if main:
                    started = self._read_marker(stage.name, self.lay.started(stage.name)) or {}
                    self._complete(stage, started.get("inputs", stage.inputs()), stage.adopted or {}, 0.0)
                outcome[stage.name] = "done"
                continue
            redo = stage.action == "redo"
            inputs: dict[str, Optional[str]] = {}
            if main:
                inputs = self._start(stage, redo)
            logger.info("stage %s: %s%s", stage.name, "redo" if redo else "run", f" ({stage.why})" if stage.why else "")
            t0 = time.perf_counter()
            summary: dict[str, Any] = {}
            if main or stage.name not in RANK0_STAGES:
                summary = stage.run(redo) or {}  # type: ignore[misc]
            # every rank waits for rank 0's outputs; a stage stopped early on one rank stops the run on all
            if self._agree(bool(summary.get("incomplete"))):
                self.incomplete[stage.name] = summary  # no marker; summary.json keeps what it measured
                if self._capped_draft(stage, summary):  # the same command continues the training
                    outcome[stage.name] = "time-capped"
                    continue
                logger.warning("stage %s stopped before the end (%s): run the same command again to continue it",
                               stage.name, summary.get("stopped_by", "its time cap"))
                outcome[stage.name] = "incomplete"
                break
            if main:
                self._complete(stage, inputs, summary, time.perf_counter() - t0)
            outcome[stage.name] = "redone" if redo else "done"
        if main:
            self.fp.save()
            markers = {s.name: self._read_marker(s.name) for s in self.stages}
            _write_json(self.lay.run / "summary.json", {
                "stages": {k: {"seconds": m["seconds"], "finished": m["finished"], "summary": m["summary"],
                               **({"stale": m["stale"]} if m.get("stale") else {})}  # outdated by that stage's rerun
                           for k, m in markers.items() if m}, "last_invocation": outcome,
                **({"incomplete": self.incomplete} if self.incomplete else {}),
                **({"time_capped_draft": self.capped_draft} if self.capped_draft else {})})
            logger.info("pipeline: %s (run directory %s)", ", ".join(f"{k} {v}" for k, v in outcome.items()),
                        self.lay.run)
        return outcome


TIME_CAP = "train.max_minutes reached"  # the trainer's StopReason.TIME_LIMIT


def redo_capped_draft(marker: dict[str, Any], stage: Stage, selected: set[str]) -> bool:
    """An export or evaluation of a time-capped draft is redone when this run trains again (it continues the
    training, so the draft those outputs describe is replaced)."""
    return bool(marker.get("time_capped_draft")) and stage.name in ("export", "evaluate") and "train" in selected
