"""The pipeline's stages: the run directory's layout, each stage's command line built from its recipe section,
its settings, inputs, outputs and how a finished stage is recognised (`recipes/pipeline.py` plans and runs them).

Each `*_stage` function takes the `Pipeline` (its recipe, layout, rank and fingerprints) and returns the `Stage`
that calls the command of the same name in-process, so a stage runs exactly what the stand-alone command runs.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import logging
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from nemo_dflash.config import EvaluateConfig, ExportConfig, PromptJobConfig, RecipeConfig, RegenerateConfig, \
    output_settings
from nemo_dflash.files import Output, needs_overwrite
from nemo_dflash.recipes._cli import UsageError, resolve_device_dtype, section_argv, user_errors
from nemo_dflash.recipes.stage_graph import entry_path

logger = logging.getLogger("nemo_dflash.pipeline")

STAGES = ("prompts", "regenerate", "train", "export", "evaluate")
RANK0_STAGES = ("export", "evaluate")  # single-process commands: the other ranks wait
# Every rank waits at the end of every stage: rank 0 alone writes some outputs (regenerate's merge of the ranks'
# shards, the prompt files, the export) that the next stage reads on every rank.
STAGES_DIR = "stages"
# A stage's settings are its sections' WHAT fields (`config.what`/`how`: one rule for every command). Training's
# are the whole recipe's but the other stages' sections.
NOT_TRAINING = ("prompts", "regenerate", "export", "evaluate")


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


# Keys and values renamed since markers were first written, per section: an old marker's name means the new one.
RENAMED_SINCE_MARKERS: dict[type, tuple[dict[str, str], dict[str, dict[str, str]]]] = {
    ExportConfig: ({"engine": "serving_engine"}, {}),
    RegenerateConfig: ({}, {"engine": {"slots": "continuous"}, "backend": {"engine": "local"}}),
}


def _renamed(schema: type, values: Any) -> Any:
    """``values`` (a marker's section) under this version's names (`RENAMED_SINCE_MARKERS`)."""
    keys, named = RENAMED_SINCE_MARKERS.get(schema, ({}, {}))
    if not isinstance(values, dict) or not (keys or named):
        return values
    out = {keys.get(k, k): v for k, v in values.items()}
    for k, renamed in named.items():
        if isinstance(out.get(k), str):
            out[k] = renamed.get(out[k], out[k])
    return out


def _section_dict(schema: type, values: Any) -> Any:
    v = output_settings(schema, _renamed(schema, values))
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


def prompts_stage(pipe: Any) -> Optional[Stage]:
    jobs = pipe.cfg.prompts.jobs
    if not jobs:
        return None
    from nemo_dflash.recipes import prompts

    names = [j.name for j in jobs]
    for j in jobs:
        if not j.name or not j.name.replace("_", "").replace("-", "").isalnum() or names.count(j.name) > 1:
            raise UsageError(f"prompts.jobs name {j.name!r}: give each job a distinct name of letters, digits, "
                             "'_' or '-' (it names the file prompts/NAME.jsonl)")
    magpie = any(j.source is None for j in jobs)
    settings = {"jobs": [_section(j) for j in jobs], **({"target": pipe.cfg.target.path} if magpie else {})}

    def argv(j: Any, overwrite: bool) -> list[str]:
        return ["--out", str(pipe.lay.prompts(j.name)), *([] if j.source else ["--target", pipe.cfg.target.path]),
                *section_argv(prompts.build_parser(), j, ("name", "weight")),
                *(["--overwrite"] if overwrite else [])]

    for j in jobs if "prompts" in pipe.checked else ():
        args = _parser_check("prompts", prompts.build_parser(), argv(j, False))
        if j.source is None:
            prompts.parse_topics(args.topics)
        else:
            check_source_packages([j.source], f"prompts.jobs[{names.index(j.name)}].source")

    def run(overwrite: bool) -> dict[str, Any]:
        """Every rank: a Magpie job runs on all of them (rank 0 merges and writes), a --source job on rank 0."""
        out = {}
        for j in jobs:
            if j.source is None or pipe.rank == 0:
                out[j.name] = prompts.main(argv(j, overwrite))
        return out

    def left() -> list[str]:
        return [str(p) for p in (pipe.lay.prompts(j.name) for j in jobs) if needs_overwrite(Output(p, "--out"))]

    def outputs() -> dict[str, Optional[str]]:
        return {f"prompts/{j.name}.jsonl": pipe.fp.file(pipe.lay.prompts(j.name)) for j in jobs}

    inputs = (lambda: {"target": pipe.target_fp()}) if magpie else dict
    return Stage("prompts", settings, run=run, left=left, inputs=inputs, outputs=outputs,
                 schemas={"jobs": [PromptJobConfig]})

def regenerate_stage(pipe: Any) -> Stage:
    from nemo_dflash.data.journals import rank_files
    from nemo_dflash.data.selection import holdout_path
    from nemo_dflash.recipes import _regen_args, regenerate

    section = copy.deepcopy(pipe.cfg.regenerate)
    section.data = [*section.data, *_jobs_data(pipe.cfg, pipe.lay)]
    if not section.data and "regenerate" in pipe.checked:
        raise UsageError("regenerate.data is empty: name prompt sources (e.g. regenerate.data=[sharegpt]) or "
                         "prompts.jobs")
    argv = ["--target", pipe.cfg.target.path, "--out", str(pipe.lay.regen), "--summary-json",
            str(pipe.lay.regen_summary), *section_argv(regenerate.build_parser(), section)]
    if "regenerate" in pipe.checked:
        args = _parser_check("regenerate", regenerate.build_parser(), argv)
        _regen_args.validate(args)
        try:  # new tokens within the target's context, the KV cache within free memory
            _regen_args.check_fits_target(args, *resolve_device_dtype(args.device, args.dtype))
        except ValueError as e:
            raise UsageError(f"regenerate: {e}: fix the recipe's regenerate section") from None
        check_source_packages(pipe.cfg.regenerate.data, "regenerate.data")
    settings = {"target": pipe.cfg.target.path, "regenerate": _section(section)}

    def run(overwrite: bool) -> dict[str, Any]:
        return regenerate.main([*argv, *(["--overwrite"] if overwrite else [])])

    def left() -> list[str]:
        args = regenerate.build_parser().parse_args(argv)
        out = Path(args.out)
        places = _regen_args.output_places(args, rank_files(out, pipe.rank, pipe.world),
                                           holdout_path(out) if args.holdout else None, pipe.world)
        return [str(o.path) for o in places if needs_overwrite(o)]

    def inputs() -> dict[str, Optional[str]]:
        found: dict[str, Optional[str]] = {"target": pipe.target_fp()}
        for j in pipe.cfg.prompts.jobs:  # the prompts stage's outputs, there or not yet
            found[f"prompts/{j.name}.jsonl"] = pipe.fp.file(pipe.lay.prompts(j.name))
        for key, entries in (("regenerate.data", pipe.cfg.regenerate.data),
                             ("regenerate.eval_file", pipe.cfg.regenerate.eval_file)):
            for entry in entries:
                path = entry_path(entry)
                if path is not None:
                    found[f"{key}:{entry}"] = pipe.fp.file(path)
        return found

    def outputs() -> dict[str, Optional[str]]:
        return {str(p.relative_to(pipe.lay.run)): pipe.fp.file(p) for p in
                (pipe.lay.regen, holdout_path(pipe.lay.regen), pipe.lay.regen_summary) if p.is_file()}

    def finished(since: float) -> Optional[dict[str, Any]]:
        """regenerate writes --summary-json last: there, naming this --out and its line count, and newer
        than the stage's start, it says the stage completed."""
        summary_path = pipe.lay.regen_summary
        try:
            if summary_path.stat().st_mtime < since:
                return None
            summary = json.loads(summary_path.read_text().splitlines()[0])
            with open(pipe.lay.regen, encoding="utf-8") as f:
                lines = sum(1 for _ in f)
        except (OSError, ValueError, IndexError):
            return None
        ok = isinstance(summary, dict) and summary.get("out") == str(pipe.lay.regen) and summary.get(
            "written") == lines
        return summary if ok else None

    return Stage("regenerate", settings, upstream="prompts" if pipe.cfg.prompts.jobs else None, run=run,
                 left=left, inputs=inputs, outputs=outputs, schemas={"regenerate": RegenerateConfig},
                 finished=finished)

def train_stage(pipe: Any) -> Stage:
    from nemo_dflash.data.config import DataSourceConfig

    cfg = copy.deepcopy(pipe.cfg)
    regen = pipe.lay.regen.resolve()
    if not cfg.data.sources:  # the regenerated data, unless the recipe names its own
        cfg.data.sources = [DataSourceConfig(path=str(pipe.lay.regen))]
    reads_regen = any(Path(s.path).resolve() == regen for s in cfg.data.sources)
    settings = {k: v for k, v in output_settings(RecipeConfig, cfg).items() if k not in NOT_TRAINING}
    if "train" in pipe.checked:  # the target and the data that exist now (the regenerated data comes later)
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
        if _training_run_dir(out) == pipe.lay.run.resolve():
            return [str(out / e) for e in blocks_a_fresh_start(out, cfg.checkpoint.resume)]
        return [str(out / e) for e in held_run(out)]

    def inputs() -> dict[str, Optional[str]]:
        found = {"target": pipe.target_fp()}
        for i, s in enumerate(cfg.data.sources):  # the regenerated data among them, there or not yet
            found[f"data.sources[{i}]:{s.path}"] = pipe.fp.file(s.path)
        if cfg.draft.init_from:
            found["draft.init_from"] = pipe.fp.tree(cfg.draft.init_from)
        return found

    def outputs() -> dict[str, Optional[str]]:
        return {"final": pipe.fp.tree(Path(cfg.output_dir) / "final")}

    pipe.train_cfg = cfg
    return Stage("train", settings, upstream="regenerate" if reads_regen else None, run=run, left=left,
                 inputs=inputs, outputs=outputs,
                 schemas={k: t for k, t in typing.get_type_hints(RecipeConfig).items()
                          if k in settings and dataclasses.is_dataclass(t)})

def export_stage(pipe: Any) -> Stage:
    from nemo_dflash.recipes import export

    argv = ["--checkpoint", str(pipe.lay.output_dir), "--out", str(pipe.lay.export), "--target",
            pipe.cfg.target.path, *section_argv(export.build_parser(), pipe.cfg.export)]
    if "export" in pipe.checked:
        _parser_check("export", export.build_parser(), argv)

    def run(overwrite: bool) -> dict[str, Any]:
        export.main([*argv, *(["--overwrite"] if overwrite else [])])
        files = sorted(f for f in pipe.lay.export.iterdir() if f.is_file())
        return {"out": str(pipe.lay.export), "sha256": {f.name: pipe.fp.file(f).split(":", 1)[1] for f in files}}

    def left() -> list[str]:
        return [str(pipe.lay.export)] if needs_overwrite(Output(pipe.lay.export, "--out", kind="dir")) else []

    settings = {"target": pipe.cfg.target.path, "export": _section(pipe.cfg.export)}
    return Stage("export", settings, upstream="train", run=run, left=left, schemas={"export": ExportConfig},
                 inputs=lambda: {"train/final": pipe.fp.tree(pipe.lay.output_dir / "final"),
                                 "target": pipe.target_fp()},
                 outputs=lambda: {"export": pipe.fp.tree(pipe.lay.export)})

def evaluate_stage(pipe: Any) -> Stage:
    from nemo_dflash.recipes import evaluate

    argv = ["--draft", str(pipe.lay.export), "--target", pipe.cfg.target.path, "--out", str(pipe.lay.eval),
            *section_argv(evaluate.build_parser(), pipe.cfg.evaluate)]
    if "evaluate" in pipe.checked:
        args = _parser_check("evaluate", evaluate.build_parser(), argv)
        with user_errors(ValueError):
            evaluate.check_args(args)
            evaluate.resolve_protocol(args)

    def run(overwrite: bool) -> dict[str, Any]:
        evaluate.main([*argv, *(["--overwrite"] if overwrite else [])])
        results = json.loads((pipe.lay.eval / "results.json").read_text())
        measured = {k: results[k] for k in ("protocol", "acceptance", "results", "speedup", "complete",
                                            "not_measured") if k in results}
        if not results.get("complete", True):  # its cap: what it measured, and what it did not
            return {**measured, "incomplete": True, "stopped_by": "evaluate.max_minutes"}
        return measured

    def inputs() -> dict[str, Optional[str]]:
        found = {"export": pipe.fp.tree(pipe.lay.export), "target": pipe.target_fp()}
        for name in (pipe.cfg.evaluate.datasets or "").split(","):
            if name.strip() and Path(name.strip()).is_file():
                found[f"evaluate.datasets:{name.strip()}"] = pipe.fp.file(name.strip())
        return found

    settings = {"target": pipe.cfg.target.path, "evaluate": _section(pipe.cfg.evaluate)}
    return Stage("evaluate", settings, upstream="export", run=run, inputs=inputs, schemas={"evaluate": EvaluateConfig},
                 outputs=lambda: {"eval/results.json": pipe.fp.file(pipe.lay.eval / "results.json")})
