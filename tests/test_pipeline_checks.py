"""`recipes.pipeline`: every check before the first stage. A value no stage can run with (a range, a nan, a
count above what the model or the machine holds, a device mode the machine lacks, a dataset that is not there)
is refused in one line naming its key, exit 2, before any model loads and before anything is written (before,
several were accepted by the plan and refused by their stage after the earlier stages ran)."""

from __future__ import annotations

import pytest

from nemo_dflash.data.config import available_cpus
from nemo_dflash.recipes import pipeline

from test_pipeline import RECIPE, tiny  # noqa: F401 (tiny: the module's tiny target)

CPUS = available_cpus()
CASES = [  # (override, the key the line names); the tiny target's context is 2048, the recipe's block 4
    ("evaluate.decode=graphs", "evaluate.decode"),  # evaluate.device=cpu in the recipe
    ("evaluate.datasets=/nonexistent.jsonl", "evaluate.datasets"),
    ("export.parity_prompts=-1", "export.parity_prompts"),
    ("data.holdout_fraction=nan", "data.holdout_fraction"),
    ("data.pack_length=-1", "data.pack_length"),
    ("data.tokenize_workers=0", "data.tokenize_workers"),
    (f"data.tokenize_workers={CPUS + 1}", "data.tokenize_workers"),
    ("regenerate.max_minutes=nan", "regenerate.max_minutes"),
    ("regenerate.max_bad_lines=-1", "regenerate.max_bad_lines"),
    ("evaluate.max_minutes=nan", "evaluate.max_minutes"),
    ("evaluate.block_size=100000", "evaluate.block_size"),
    ("evaluate.block_size=5", "evaluate.block_size"),
    ("regenerate.max_new_tokens=1000000000", "regenerate.max_new_tokens"),
    ("evaluate.max_new_tokens=2049", "evaluate.max_new_tokens"),
    (f"regenerate.threads={CPUS + 1}", "regenerate.threads"),
    ("evaluate.threads=100000", "evaluate.threads"),
]


@pytest.mark.parametrize("override, key", CASES, ids=[c[0] for c in CASES])
def test_a_value_no_stage_can_run_with_is_refused_before_the_first_stage(tiny, tmp_path, monkeypatch, capsys,
                                                                        override, key):  # noqa: F811
    monkeypatch.setattr("nemo_dflash.target.loading.load_target", lambda *a, **k: pytest.fail("a model loaded"))
    run = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(RECIPE.format(run=run, target=tiny["target"], chat=tiny["chat"]))
    with pytest.raises(SystemExit) as e:
        pipeline.main(["--config", str(config), override])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert key in err[0], err[0]
    assert not run.exists()  # nothing written: no run directory, no recipe.yaml


def test_the_bounds_admit_the_values_at_them(tiny, tmp_path, monkeypatch):  # noqa: F811
    """At the bounds (the draft's block, the target's context, the CPUs) the plan is made: the checks refuse what
    exceeds them, not the values themselves."""
    run = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(RECIPE.format(run=run, target=tiny["target"], chat=tiny["chat"]))
    cfg = pipeline.load_recipe(str(config), ["evaluate.block_size=4", "evaluate.max_new_tokens=2048",
                                             f"regenerate.threads={CPUS}", f"data.tokenize_workers={CPUS}"],
                               data_optional=True)
    plan = pipeline.Pipeline(cfg, pipeline.STAGES, [])
    assert [s.action for s in plan.selected] == ["run"] * len(pipeline.STAGES)
    assert not run.exists()
