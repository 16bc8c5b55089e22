r"""One recipe, the whole run: prompts -> regenerate -> train -> export -> evaluate.

    torchrun --nproc-per-node 2 -m nemo_dflash.recipes.pipeline --config smollm2_135m_200m.yaml
    python -m nemo_dflash.recipes.pipeline --config smollm2_demo.yaml stages=regenerate,train regenerate.max_minutes=4
    python -m nemo_dflash.recipes.pipeline --config smollm2_demo.yaml redo=train train.max_steps=200

Each stage is the command of the same name, called in-process with the recipe's section of the same
name (`prompts.jobs`, `regenerate`, the training sections, `export`, `evaluate`). Outputs land in the
run directory (`run.dir`, default: the folder holding `output_dir`; training writes to `output_dir`):
    prompts/NAME.jsonl    data/regen.jsonl (+ .holdout.jsonl, regen_summary.json)    export/    eval/
    recipe.yaml (the resolved recipe)    stages/STAGE.json (completion markers)    summary.json
A stage's marker is written when it ends and holds its resolved settings, the fingerprints of what it read
(`stage_graph`: the upstream stage's outputs, the input files, the target) and its summary. A stage whose
marker holds the settings and inputs asked for is skipped; one whose inputs changed (a file edited in place, an
upstream stage run again) is stale and runs again, with every stage after it; one whose settings changed is
refused in one line (exit 2) unless `redo=STAGE` asks for it again (its outputs replaced, the later stages
stale). A stage killed before its marker resumes on the next run under the settings it started with
(`stages/STAGE.started.json`; other settings are refused naming redo=STAGE): regenerate continues its journal,
train its last checkpoint, evaluate its answers. Under torchrun, regenerate, train and the Magpie prompt jobs run on
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
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from nemo_dflash.config import ConfigError, EvaluateConfig, ExportConfig, PromptJobConfig, RecipeConfig, \
    RegenerateConfig, load_recipe, output_settings, to_yaml
from nemo_dflash.files import Output, needs_overwrite
from nemo_dflash.recipes._cli import UsageError, fail, resolve_device_dtype, section_argv, setup_logging, user_errors
from nemo_dflash.recipes.stage_graph import FINGERPRINTS, LOCK, Fingerprints, check_counts, check_run_dir, \
    downstream, entry_path, input_diffs, target_fingerprint

logger = logging.getLogger("nemo_dflash.pipeline")

STAGES = ("prompts", "regenerate", "train", "export", "evaluate")
RANK0_STAGES = ("export", "evaluate")  # single-process commands: the other ranks wait
# Every rank waits at the end of every stage: rank 0 alone writes some outputs (regenerate's merge of the ranks'
# shards, the prompt files, the export) that the next stage reads on every rank.
STAGES_DIR = "stages"
# A stage's settings are its sections' WHAT fields (`config.what`/`how`: one rule for every command). Training's
# are the whole recipe's but the other stages' sections.
NOT_TRAINING = ("prompts", "regenerate", "export", "evaluate")


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

    def started(self, stage: str) -> Path:
        """Written when a stage starts: the settings an incomplete stage may only be continued under."""
        return self.run / STAGES_DIR / f"{stage}.started.json"


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
    # the fingerprints of what it reads (the upstream's outputs, the recipe's input files, the target)
    inputs: Callable[[], dict[str, Optional[str]]] = field(default=dict, repr=False)
    outputs: Callable[[], dict[str, Optional[str]]] = field(default=dict, repr=False)  # of what it writes
    why: str = ""  # why it runs again when it does (redo=, stale inputs)
    schemas: dict[str, Any] = field(default_factory=dict, repr=False)  # its settings' dataclasses (`_projected`)
    # (the time it started) -> its summary when its outputs are complete and written since then: a kill after
    # its last output and before its marker leaves a complete stage, whose marker the next run writes
    finished: Optional[Callable[[float], Optional[dict[str, Any]]]] = field(default=None, repr=False)
    adopted: Optional[dict[str, Any]] = None
    action: str = "run"  # run | skip | redo
    run: Optional[Callable[[bool], dict[str, Any]]] = field(default=None, repr=False)  # (overwrite) -> summary
    # the outputs already on disk that its command would refuse to replace without --overwrite
    left: Optional[Callable[[], list[str]]] = field(default=None, repr=False)


def _jobs_data(cfg: RecipeConfig, lay: Layout) -> list[str]:
    return [f"{j.name}={lay.prompts(j.name)}@{j.weight:g}" for j in cfg.prompts.jobs]


# Keys added after stage markers were first written, with their defaults: a key at its default is left out
# of a stage's settings, so a stage completed before the key existed keeps its marker.
ADDED_SINCE_MARKERS: dict[str, Any] = {"user_max_new_tokens": None}


def _section(obj: Any) -> dict[str, Any]:
    """A section's settings: its WHAT fields, less the keys added since markers were first written, at their
    defaults."""
    return {k: v for k, v in output_settings(type(obj), obj).items()
            if not (k in ADDED_SINCE_MARKERS and v == ADDED_SINCE_MARKERS[k])}


def _projected(settings: dict[str, Any], schemas: dict[str, Any]) -> dict[str, Any]:
    """A marker's settings as this version compares them: without the upstream digest older markers held (the
    inputs' fingerprints now) and without the HOW fields older markers recorded (`schemas`: a settings key's
    dataclass, or a one-item list of it for a list of sections)."""
    out = {}
    for k, v in settings.items():
        if k == "after":
            continue
        schema = schemas.get(k)
        if isinstance(schema, list) and isinstance(v, list):
            v = [_section_dict(schema[0], x) for x in v]
        elif schema is not None:
            v = _section_dict(schema, v)
        out[k] = v
    return out


def _section_dict(schema: type, values: Any) -> Any:
    v = output_settings(schema, values)
    return {k: x for k, x in v.items() if not (k in ADDED_SINCE_MARKERS and x == ADDED_SINCE_MARKERS[k])} \
        if isinstance(v, dict) else v


def _parser_check(name: str, parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse a stage's command line as its command will, a parser error naming the recipe key."""
    def error(message: str) -> None:
        for action in parser._actions:
            for flag in action.option_strings:
                message = message.replace(f"argument {flag}", f"{name}.{action.dest}")
        raise UsageError(f"{message}: fix the recipe's {name} section")

    parser.error = error  # type: ignore[method-assign]
    return parser.parse_args(argv)


def _training_run_dir(output_dir: Path) -> Optional[Path]:
    """The run directory a training in ``output_dir`` was started from, as its config.yaml records it (`run.dir`,
    else the folder holding output_dir); None when it records no pipeline's recipe."""
    import yaml

    try:
        saved = yaml.safe_load((output_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(saved, dict) or not isinstance(saved.get("run"), dict):
        return None
    run_dir = saved["run"].get("dir")
    return (Path(run_dir) if run_dir else output_dir.parent).resolve()


def check_source_packages(entries: Sequence[str], key: str) -> None:
    from nemo_dflash.data import DataError
    from nemo_dflash.data.prompts import check_source_packages as check

    with user_errors(DataError):
        check(entries, key)


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

        def outputs() -> dict[str, Optional[str]]:
            return {f"prompts/{j.name}.jsonl": self.fp.file(self.lay.prompts(j.name)) for j in jobs}

        inputs = (lambda: {"target": self.target_fp()}) if magpie else dict
        return Stage("prompts", settings, run=run, left=left, inputs=inputs, outputs=outputs,
                     schemas={"jobs": [PromptJobConfig]})

    def _regenerate(self) -> Stage:
        from nemo_dflash.data.journals import rank_files
        from nemo_dflash.data.selection import holdout_path
        from nemo_dflash.recipes import _regen_args, regenerate

        section = copy.deepcopy(self.cfg.regenerate)
        section.data = [*section.data, *_jobs_data(self.cfg, self.lay)]
        if not section.data and "regenerate" in self.checked:
            raise UsageError("regenerate.data is empty: name prompt sources (e.g. regenerate.data=[sharegpt]) or "
                             "prompts.jobs")
        argv = ["--target", self.cfg.target.path, "--out", str(self.lay.regen), "--summary-json",
                str(self.lay.regen_summary), *section_argv(regenerate.build_parser(), section)]
        if "regenerate" in self.checked:
            args = _parser_check("regenerate", regenerate.build_parser(), argv)
            _regen_args.validate(args)
            try:  # new tokens within the target's context, the KV cache within free memory
                _regen_args.check_fits_target(args, *resolve_device_dtype(args.device, args.dtype))
            except ValueError as e:
                raise UsageError(f"regenerate: {e}: fix the recipe's regenerate section") from None
            check_source_packages(self.cfg.regenerate.data, "regenerate.data")
        settings = {"target": self.cfg.target.path, "regenerate": _section(section)}

        def run(overwrite: bool) -> dict[str, Any]:
            return regenerate.main([*argv, *(["--overwrite"] if overwrite else [])])

        def left() -> list[str]:
            args = regenerate.build_parser().parse_args(argv)
            out = Path(args.out)
            places = _regen_args.output_places(args, rank_files(out, self.rank, self.world),
                                               holdout_path(out) if args.holdout else None, self.world)
            return [str(o.path) for o in places if needs_overwrite(o)]

        def inputs() -> dict[str, Optional[str]]:
            found: dict[str, Optional[str]] = {"target": self.target_fp()}
            for j in self.cfg.prompts.jobs:  # the prompts stage's outputs, there or not yet
                found[f"prompts/{j.name}.jsonl"] = self.fp.file(self.lay.prompts(j.name))
            for key, entries in (("regenerate.data", self.cfg.regenerate.data),
                                 ("regenerate.eval_file", self.cfg.regenerate.eval_file)):
                for entry in entries:
                    path = entry_path(entry)
                    if path is not None:
                        found[f"{key}:{entry}"] = self.fp.file(path)
            return found

        def outputs() -> dict[str, Optional[str]]:
            return {str(p.relative_to(self.lay.run)): self.fp.file(p) for p in
                    (self.lay.regen, holdout_path(self.lay.regen), self.lay.regen_summary) if p.is_file()}

        def finished(since: float) -> Optional[dict[str, Any]]:
            """regenerate writes --summary-json last: there, naming this --out and its line count, and newer
            than the stage's start, it says the stage completed."""
            summary_path = self.lay.regen_summary
            try:
                if summary_path.stat().st_mtime < since:
                    return None
                summary = json.loads(summary_path.read_text().splitlines()[0])
                with open(self.lay.regen, encoding="utf-8") as f:
                    lines = sum(1 for _ in f)
            except (OSError, ValueError, IndexError):
                return None
            ok = isinstance(summary, dict) and summary.get("out") == str(self.lay.regen) and summary.get(
                "written") == lines
            return summary if ok else None

        return Stage("regenerate", settings, upstream="prompts" if self.cfg.prompts.jobs else None, run=run,
                     left=left, inputs=inputs, outputs=outputs, schemas={"regenerate": RegenerateConfig},
                     finished=finished)

    def _train(self) -> Stage:
        from nemo_dflash.data.config import DataSourceConfig

        cfg = copy.deepcopy(self.cfg)
        regen = self.lay.regen.resolve()
        if not cfg.data.sources:  # the regenerated data, unless the recipe names its own
            cfg.data.sources = [DataSourceConfig(path=str(self.lay.regen))]
        reads_regen = any(Path(s.path).resolve() == regen for s in cfg.data.sources)
        settings = {k: v for k, v in output_settings(RecipeConfig, cfg).items() if k not in NOT_TRAINING}
        if "train" in self.checked:  # the target and the data that exist now (the regenerated data comes later)
            from nemo_dflash.recipes.train import check_paths

            from nemo_dflash.data import DataError
            from nemo_dflash.data.config import validate_data_config

            with user_errors(DataError):  # every data.* range, the regenerated data counted in (it comes later)
                validate_data_config(cfg.data)
            now = copy.deepcopy(cfg)
            now.data.sources = [s for s in now.data.sources if Path(s.path).resolve() != regen]
            check_paths(now)

        def run(overwrite: bool) -> dict[str, Any]:
            from nemo_dflash.train.device import release_device_memory
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
            """Called when this run directory has no record of starting its training: a run in output_dir is
            another's (resumed, it would be adopted as this run's and its config.yaml rewritten) unless its
            config.yaml names this run directory (a training started before stages recorded their starts)."""
            from nemo_dflash.train.run_dir import blocks_a_fresh_start, held_run

            out = Path(cfg.output_dir).resolve()
            if cfg.checkpoint.resume not in ("auto", "none"):  # another run's checkpoint: train's own checks
                return []
            if not out.is_dir():
                return []
            if _training_run_dir(out) == self.lay.run.resolve():
                return [str(out / e) for e in blocks_a_fresh_start(out, cfg.checkpoint.resume)]
            return [str(out / e) for e in held_run(out)]

        def inputs() -> dict[str, Optional[str]]:
            found = {"target": self.target_fp()}
            for i, s in enumerate(cfg.data.sources):  # the regenerated data among them, there or not yet
                found[f"data.sources[{i}]:{s.path}"] = self.fp.file(s.path)
            if cfg.draft.init_from:
                found["draft.init_from"] = self.fp.tree(cfg.draft.init_from)
            return found

        def outputs() -> dict[str, Optional[str]]:
            return {"final": self.fp.tree(Path(cfg.output_dir) / "final")}

        self.train_cfg = cfg
        return Stage("train", settings, upstream="regenerate" if reads_regen else None, run=run, left=left,
                     inputs=inputs, outputs=outputs,
                     schemas={k: t for k, t in typing.get_type_hints(RecipeConfig).items()
                              if k in settings and dataclasses.is_dataclass(t)})

    def _export(self) -> Stage:
        from nemo_dflash.recipes import export

        argv = ["--checkpoint", str(self.lay.output_dir), "--out", str(self.lay.export), "--target",
                self.cfg.target.path, *section_argv(export.build_parser(), self.cfg.export)]
        if "export" in self.checked:
            _parser_check("export", export.build_parser(), argv)

        def run(overwrite: bool) -> dict[str, Any]:
            export.main([*argv, *(["--overwrite"] if overwrite else [])])
            files = sorted(f for f in self.lay.export.iterdir() if f.is_file())
            return {"out": str(self.lay.export), "sha256": {f.name: self.fp.file(f).split(":", 1)[1] for f in files}}

        def left() -> list[str]:
            return [str(self.lay.export)] if needs_overwrite(Output(self.lay.export, "--out", kind="dir")) else []

        settings = {"target": self.cfg.target.path, "export": _section(self.cfg.export)}
        return Stage("export", settings, upstream="train", run=run, left=left, schemas={"export": ExportConfig},
                     inputs=lambda: {"train/final": self.fp.tree(self.lay.output_dir / "final"),
                                     "target": self.target_fp()},
                     outputs=lambda: {"export": self.fp.tree(self.lay.export)})

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

        def inputs() -> dict[str, Optional[str]]:
            found = {"export": self.fp.tree(self.lay.export), "target": self.target_fp()}
            for name in (self.cfg.evaluate.datasets or "").split(","):
                if name.strip() and Path(name.strip()).is_file():
                    found[f"evaluate.datasets:{name.strip()}"] = self.fp.file(name.strip())
            return found

        settings = {"target": self.cfg.target.path, "evaluate": _section(self.cfg.evaluate)}
        return Stage("evaluate", settings, upstream="export", run=run, inputs=inputs, schemas={"evaluate": EvaluateConfig},
                     outputs=lambda: {"eval/results.json": self.fp.file(self.lay.eval / "results.json")})

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
