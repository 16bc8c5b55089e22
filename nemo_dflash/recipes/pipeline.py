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
import logging
from typing import Optional, Sequence

from nemo_dflash.config import ConfigError, load_recipe, to_yaml
from nemo_dflash.recipes._cli import UsageError, fail, setup_logging, user_errors
from nemo_dflash.recipes._pipeline_run import TIME_CAP, Pipeline, redo_capped_draft  # noqa: F401  (the plan and run)
from nemo_dflash.recipes._pipeline_stages import (  # noqa: F401  (Layout, _section, digest: tests import them here)
    STAGES, Layout, Stage, _section, digest,
)

logger = logging.getLogger("nemo_dflash.pipeline")


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
