r"""One recipe, the whole run: prompts -> regenerate -> train -> export -> evaluate.

    torchrun --nproc-per-node 2 -m nemo_dflash.recipes.pipeline --config smollm2_135m_200m.yaml
    python -m nemo_dflash.recipes.pipeline --config smollm2_demo.yaml stages=regenerate,train regenerate.max_minutes=4
    python -m nemo_dflash.recipes.pipeline --config smollm2_demo.yaml redo=train train.max_steps=200

Each stage is the command of the same name, called in-process with the recipe's section of the same
name (`prompts.jobs`, `regenerate`, the training sections, `export`, `evaluate`). Outputs land in the
run directory (`run.dir`, default: the folder holding `output_dir`; training writes to `output_dir`):
    prompts/NAME.jsonl    data/regen.jsonl (+ .holdout.jsonl, regen_summary.json)    export/    eval/
    recipe.yaml (the resolved recipe)    stages/STAGE.json (completion markers)    summary.json
A stage's marker is written when it ends and holds its resolved settings and its summary. A stage whose
marker holds the settings asked for is skipped; one whose settings changed is refused in one line (exit 2)
unless `redo=STAGE` asks for it again (its outputs replaced, and the later stages that read them redone).
A stage killed before its marker resumes on the next run: regenerate continues its journal, train its
last checkpoint, evaluate its answers. Under torchrun, regenerate, train and the Magpie prompt jobs run on
every rank; file-source prompt jobs, export and evaluate run on rank 0 while the other ranks wait.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from nemo_dflash.config import ConfigError, RecipeConfig, load_recipe, to_yaml
from nemo_dflash.files import Output, needs_overwrite
from nemo_dflash.recipes._cli import UsageError, fail, section_argv, setup_logging, user_errors

logger = logging.getLogger("nemo_dflash.pipeline")

STAGES = ("prompts", "regenerate", "train", "export", "evaluate")
RANK0_STAGES = ("export", "evaluate")  # single-process commands: the other ranks wait
# Every rank waits at the end of every stage: rank 0 alone writes some outputs (regenerate's merge of the ranks'
# shards, the prompt files, the export) that the next stage reads on every rank.
STAGES_DIR = "stages"
# Keys that change how a stage runs, never what it writes (the commands' help says so): not settings.
HOW_NOT_WHAT = ("threads", "prepare_ahead", "schedule", "workers")
# Training keys that never change the trained draft: whole sections, and keys inside one (a job limit: a run it
# stops is incomplete, and resumes under another limit).
TRAIN_HOW_NOT_WHAT = ("wandb", "run", "prompts", "regenerate", "export", "evaluate")
TRAIN_KEYS_HOW_NOT_WHAT = {"train": ("max_minutes",)}


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[argparse.Namespace, list[str], list[str], list[str]]:
    """The command line: the recipe, `stages=`/`redo=` (which stages this invocation runs, not settings
    of the run) and the recipe overrides."""
    p = argparse.ArgumentParser(prog="python -m nemo_dflash.recipes.pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", "-c", required=True, help="recipe YAML (working dir first, then the repo's recipes/)")
    p.add_argument("overrides", nargs="*", help="stages=A,B (default: all), redo=A,B, then recipe overrides "
                   "in Hydra's grammar (e.g. regenerate.max_minutes=4)")
    p.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    args = p.parse_args(argv)
    stages, redo, overrides = list(STAGES), [], []
    for ov in args.overrides:
        key, eq, value = ov.partition("=")
        if eq and key in ("stages", "redo"):
            names = [s.strip() for s in value.split(",") if s.strip()]
            unknown = [s for s in names if s not in STAGES]
            if unknown or (key == "stages" and not names):
                fail(f"{key}={value}: give stage names from {','.join(STAGES)} (e.g. {key}=regenerate,train)")
            if key == "stages":
                stages = [s for s in STAGES if s in names]
            else:
                redo = names
        else:
            overrides.append(ov)
    return args, stages, redo, overrides


def digest(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    a, b = _flat(old), _flat(new)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _write_json(path: Path, data: Any) -> None:
    """Atomically: a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


@dataclass
class Layout:
    """Where each stage writes, under the run directory."""

    run: Path
    output_dir: Path

    def prompts(self, name: str) -> Path:
        return self.run / "prompts" / f"{name}.jsonl"

    @property
    def regen(self) -> Path:
        return self.run / "data" / "regen.jsonl"

    @property
    def regen_summary(self) -> Path:
        return self.run / "data" / "regen_summary.json"

    @property
    def export(self) -> Path:
        return self.run / "export"

    @property
    def eval(self) -> Path:
        return self.run / "eval"

    def marker(self, stage: str) -> Path:
        return self.run / STAGES_DIR / f"{stage}.json"


def layout_of(cfg: RecipeConfig) -> Layout:
    out = Path(cfg.output_dir)
    run = Path(cfg.run.dir) if cfg.run.dir else out.parent
    if not str(cfg.output_dir).strip():
        raise UsageError("output_dir is empty: set output_dir=PATH (training writes there)")
    if run.resolve() == out.resolve() or out.resolve() in run.resolve().parents:
        raise UsageError(f"run.dir {run} is, or lies inside, output_dir {out}, which training owns: set run.dir to "
                         f"the folder holding output_dir (e.g. run.dir={out.parent})")
    return Layout(run, out)


@dataclass
class Stage:
    name: str
    settings: dict[str, Any]
    upstream: Optional[str] = None  # the stage whose outputs this one reads
    action: str = "run"  # run | skip | redo
    run: Optional[Callable[[bool], dict[str, Any]]] = field(default=None, repr=False)  # (overwrite) -> summary
    # the outputs already on disk that its command would refuse to replace without --overwrite
    left: Optional[Callable[[], list[str]]] = field(default=None, repr=False)


def _jobs_data(cfg: RecipeConfig, lay: Layout) -> list[str]:
    return [f"{j.name}={lay.prompts(j.name)}@{j.weight:g}" for j in cfg.prompts.jobs]


# Keys added after stage markers were first written, with their defaults: a key at its default is left out
# of a stage's settings, so a stage completed before the key existed keeps its marker.
ADDED_SINCE_MARKERS: dict[str, Any] = {"user_max_new_tokens": None}


def _section(obj: Any, drop: Sequence[str] = HOW_NOT_WHAT) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(obj).items()
            if k not in drop and not (k in ADDED_SINCE_MARKERS and v == ADDED_SINCE_MARKERS[k])}


def _parser_check(name: str, parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse a stage's command line as its command will, a parser error naming the recipe key."""
    def error(message: str) -> None:
        for action in parser._actions:
            for flag in action.option_strings:
                message = message.replace(f"argument {flag}", f"{name}.{action.dest}")
        raise UsageError(f"{message}: fix the recipe's {name} section")

    parser.error = error  # type: ignore[method-assign]
    return parser.parse_args(argv)


def check_source_packages(entries: Sequence[str], key: str) -> None:
    from nemo_dflash.data import DataError
    from nemo_dflash.data.prompts import check_source_packages as check

    with user_errors(DataError):
        check(entries, key)


class Pipeline:
    """The stages of one recipe, planned (settings, markers, refusals) before any of them runs."""

    def __init__(self, cfg: RecipeConfig, stages: Sequence[str], redo: Sequence[str]) -> None:
        self.cfg, self.lay = cfg, layout_of(cfg)
        self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.checked = set(stages)  # only the stages this run runs are checked (the others give their settings)
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

    # ---- each stage: its settings (what its outputs depend on), its checks, how it runs ----

    def _prompts(self) -> Optional[Stage]:
        jobs = self.cfg.prompts.jobs
        if not jobs:
            return None
        from nemo_dflash.recipes import prompts

        names = [j.name for j in jobs]
        for j in jobs:
            if not j.name or not j.name.replace("_", "").replace("-", "").isalnum() or names.count(j.name) > 1:
                raise UsageError(f"prompts.jobs name {j.name!r}: give each job a distinct name of letters, digits, "
                                 "'_' or '-' (it names the file prompts/NAME.jsonl)")
        magpie = any(j.source is None for j in jobs)
        settings = {"jobs": [_section(j) for j in jobs], **({"target": self.cfg.target.path} if magpie else {})}

        def argv(j: Any, overwrite: bool) -> list[str]:
            return ["--out", str(self.lay.prompts(j.name)), *([] if j.source else ["--target", self.cfg.target.path]),
                    *section_argv(prompts.build_parser(), j, ("name", "weight")),
                    *(["--overwrite"] if overwrite else [])]

        for j in jobs if "prompts" in self.checked else ():
            args = _parser_check("prompts", prompts.build_parser(), argv(j, False))
            if j.source is None:
                prompts.parse_topics(args.topics)
            else:
                check_source_packages([j.source], f"prompts.jobs[{names.index(j.name)}].source")

        def run(overwrite: bool) -> dict[str, Any]:
            """Every rank: a Magpie job runs on all of them (rank 0 merges and writes), a --source job on rank 0."""
            out = {}
            for j in jobs:
                if j.source is None or self.rank == 0:
                    out[j.name] = prompts.main(argv(j, overwrite))
            return out

        def left() -> list[str]:
            return [str(p) for p in (self.lay.prompts(j.name) for j in jobs) if needs_overwrite(Output(p, "--out"))]

        return Stage("prompts", settings, run=run, left=left)

    def _regenerate(self) -> Stage:
        from nemo_dflash.recipes import regenerate

        section = copy.deepcopy(self.cfg.regenerate)
        section.data = [*section.data, *_jobs_data(self.cfg, self.lay)]
        if not section.data and "regenerate" in self.checked:
            raise UsageError("regenerate.data is empty: name prompt sources (e.g. regenerate.data=[sharegpt]) or "
                             "prompts.jobs")
        argv = ["--target", self.cfg.target.path, "--out", str(self.lay.regen), "--summary-json",
                str(self.lay.regen_summary), *section_argv(regenerate.build_parser(), section)]
        if "regenerate" in self.checked:
            args = _parser_check("regenerate", regenerate.build_parser(), argv)
            regenerate._validate(args)
            check_source_packages(self.cfg.regenerate.data, "regenerate.data")
        settings = {"target": self.cfg.target.path, "regenerate": _section(section)}

        def run(overwrite: bool) -> dict[str, Any]:
            return regenerate.main([*argv, *(["--overwrite"] if overwrite else [])])

        def left() -> list[str]:
            args = regenerate.build_parser().parse_args(argv)
            out = Path(args.out)
            places = regenerate.output_places(args, regenerate.rank_files(out, self.rank, self.world),
                                              regenerate.holdout_path(out) if args.holdout else None, self.world)
            return [str(o.path) for o in places if needs_overwrite(o)]

        return Stage("regenerate", settings, upstream="prompts" if self.cfg.prompts.jobs else None, run=run,
                     left=left)

    def _train(self) -> Stage:
        from nemo_dflash.data.config import DataSourceConfig

        cfg = copy.deepcopy(self.cfg)
        regen = self.lay.regen.resolve()
        if not cfg.data.sources:  # the regenerated data, unless the recipe names its own
            cfg.data.sources = [DataSourceConfig(path=str(self.lay.regen))]
        reads_regen = any(Path(s.path).resolve() == regen for s in cfg.data.sources)
        settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in TRAIN_HOW_NOT_WHAT}
        for section, keys in TRAIN_KEYS_HOW_NOT_WHAT.items():
            settings[section] = {k: v for k, v in settings[section].items() if k not in keys}
        if "train" in self.checked:  # the target and the data that exist now (the regenerated data comes later)
            from nemo_dflash.recipes.train import check_paths

            now = copy.deepcopy(cfg)
            now.data.sources = [s for s in now.data.sources if Path(s.path).resolve() != regen]
            check_paths(now)

        def run(overwrite: bool) -> dict[str, Any]:
            from nemo_dflash.device import release_device_memory
            from nemo_dflash.recipes.train import check_paths, user_error_types
            from nemo_dflash.train.trainer import train

            run_cfg = copy.deepcopy(cfg)
            if overwrite:  # redo: a fresh run replaces the one in output_dir
                run_cfg.checkpoint.resume = "none"
            check_paths(run_cfg)
            with user_errors(*user_error_types()):
                summary = train(run_cfg, overwrite=overwrite)
            release_device_memory()  # the GPUs are free for the evaluate stage's processes (evaluate.gpus)
            if summary.get("stopped_early"):  # the time cap or SIGTERM: not complete, the same command resumes it
                return {**summary, "incomplete": True, "stopped_by": summary["stopped_early"]}
            return summary

        def left() -> list[str]:
            from nemo_dflash.train.run_dir import blocks_a_fresh_start

            out = Path(cfg.output_dir).resolve()
            if cfg.checkpoint.resume not in ("auto", "none"):  # another run's checkpoint: train's own checks
                return []
            return [str(out / e) for e in blocks_a_fresh_start(out, cfg.checkpoint.resume)]

        self.train_cfg = cfg
        return Stage("train", settings, upstream="regenerate" if reads_regen else None, run=run, left=left)

    def _export(self) -> Stage:
        from nemo_dflash.recipes import export

        argv = ["--checkpoint", str(self.lay.output_dir), "--out", str(self.lay.export), "--target",
                self.cfg.target.path, *section_argv(export.build_parser(), self.cfg.export)]
        if "export" in self.checked:
            _parser_check("export", export.build_parser(), argv)

        def run(overwrite: bool) -> dict[str, Any]:
            export.main([*argv, *(["--overwrite"] if overwrite else [])])
            return {"out": str(self.lay.export)}

        def left() -> list[str]:
            return [str(self.lay.export)] if needs_overwrite(Output(self.lay.export, "--out", kind="dir")) else []

        settings = {"target": self.cfg.target.path, "export": _section(self.cfg.export)}
        return Stage("export", settings, upstream="train", run=run, left=left)

    def _evaluate(self) -> Stage:
        from nemo_dflash.recipes import evaluate

        argv = ["--draft", str(self.lay.export), "--target", self.cfg.target.path, "--out", str(self.lay.eval),
                *section_argv(evaluate.build_parser(), self.cfg.evaluate)]
        if "evaluate" in self.checked:
            args = _parser_check("evaluate", evaluate.build_parser(), argv)
            with user_errors(ValueError):
                evaluate.check_args(args)
                evaluate.resolve_protocol(args)

        def run(overwrite: bool) -> dict[str, Any]:
            evaluate.main([*argv, *(["--overwrite"] if overwrite else [])])
            results = json.loads((self.lay.eval / "results.json").read_text())
            measured = {k: results[k] for k in ("protocol", "acceptance", "results", "speedup", "complete",
                                                "not_measured") if k in results}
            if not results.get("complete", True):  # its cap: what it measured, and what it did not
                return {**measured, "incomplete": True, "stopped_by": "evaluate.max_minutes"}
            return measured

        settings = {"target": self.cfg.target.path, "evaluate": _section(self.cfg.evaluate)}
        return Stage("evaluate", settings, upstream="export", run=run)

    # ---- the plan: skip, run, redo or refuse each selected stage ----

    def _read_marker(self, name: str) -> Optional[dict[str, Any]]:
        path = self.lay.marker(name)
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
        redone: set[str] = set()  # stages redone now: the later stages reading their outputs are redone too
        for stage in self.stages:
            up = by_name.get(stage.upstream) if stage.upstream else None
            if up is not None:  # what the outputs it reads were made with: this run's, else the upstream's marker
                if up.name in selected:
                    stage.settings["after"] = {up.name: digest(up.settings)}
                else:
                    marker = self._read_marker(up.name)
                    stage.settings["after"] = {up.name: marker["digest"] if marker else None}
            if stage.name not in selected:
                continue
            marker = self._read_marker(stage.name)
            if stage.name in redo or (up is not None and up.name in redone):
                stage.action = "redo"
            elif marker is None:
                stage.action = "run"
            elif marker.get("digest") == digest(stage.settings):
                stage.action = "redo" if redo_capped_draft(marker, stage, selected) else "skip"
            else:
                keys = changed_keys(marker.get("settings", {}), stage.settings)
                raise UsageError(
                    f"stage {stage.name} completed with other settings ({', '.join(keys[:4]) or 'its inputs'} "
                    f"differ from {self.lay.marker(stage.name)}): pass redo={stage.name} to run it again (its outputs "
                    "are replaced), or restore the settings")
            if stage.action == "redo":
                redone.add(stage.name)
            elif stage.action == "run" and stage.left is not None:
                found = stage.left()
                if found:  # the command would refuse them naming --overwrite: here the fix is redo=
                    raise UsageError(
                        f"stage {stage.name} has no marker ({self.lay.marker(stage.name)}) but its outputs exist "
                        f"({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}), left by something else (its "
                        f"command run by hand, or the stage killed after writing them): pass redo={stage.name} to "
                        "replace them, or move them away")

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

    def execute(self) -> dict[str, Any]:
        main = self.rank == 0
        self._agree(False)  # every rank has planned from the same markers before any is written
        if main:
            self.lay.run.mkdir(parents=True, exist_ok=True)
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
            redo = stage.action == "redo"
            if redo and main:
                self.lay.marker(stage.name).unlink(missing_ok=True)  # a killed redo is not complete
            logger.info("stage %s: %s", stage.name, "redo" if redo else "run")
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
                _write_json(self.lay.marker(stage.name), {
                    "stage": stage.name, "digest": digest(stage.settings), "settings": stage.settings,
                    "summary": summary, "seconds": round(time.perf_counter() - t0, 1),
                    "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    **({"time_capped_draft": self.capped_draft} if self.capped_draft else {})})
            outcome[stage.name] = "redone" if redo else "done"
        if main:
            markers = {s.name: self._read_marker(s.name) for s in self.stages}
            _write_json(self.lay.run / "summary.json", {
                "stages": {k: {"seconds": m["seconds"], "finished": m["finished"], "summary": m["summary"]}
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


def main(argv: Optional[Sequence[str]] = None) -> dict[str, str]:
    args, stages, redo, overrides = parse_args(argv)
    setup_logging()
    with user_errors(ConfigError, FileNotFoundError):
        cfg = load_recipe(args.config, overrides, data_optional=True)
    if args.print_config:
        import sys

        sys.stdout.write(to_yaml(cfg))
        return {}
    with user_errors(UsageError):  # every stage's settings and markers: checked before anything loads
        pipeline = Pipeline(cfg, stages, redo)
    return pipeline.execute()


if __name__ == "__main__":
    main()
