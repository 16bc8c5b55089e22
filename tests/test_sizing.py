"""Sizing advice: the row `benchmarks/sizing.py` writes (`sizing_advice.target_row`) against one computed by hand
from a small fixture, the packaged copy of its rows equal to docs/bench's, and the pipeline's plan-time warning
for a budget below a paying draft's (and none above it), with the token estimate computed by hand."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from nemo_dflash.config import load_recipe
from nemo_dflash.recipes import pipeline, sizing_advice

from test_pipeline import RECIPE, tiny  # noqa: F401 (tiny: the module's tiny target)

REPO = Path(__file__).resolve().parent.parent


HEAD = {"date": "2026-01-01", "commit": "abc", "device": "NVIDIA H200", "command": "x"}
DRAFTS = [  # tokens -> speedups (MT-Bench, HumanEval): 10 M pays on one set only, 20 M on both, 40 M >= 1.5
    {**HEAD, "target": "T", "train_tokens": 10_000_000, "mtbench_t0_tau": 1.5, "humaneval_t0_tau": 1.6,
     "mtbench_t0_speedup": 0.9, "humaneval_t0_speedup": 1.2},
    {**HEAD, "target": "T", "train_tokens": 20_000_000, "mtbench_t0_tau": 2.0, "humaneval_t0_tau": 2.1,
     "mtbench_t0_speedup": 1.1, "humaneval_t0_speedup": 1.3},
    {**HEAD, "target": "T", "train_tokens": 40_000_000, "mtbench_t0_tau": 3.0, "humaneval_t0_tau": 3.2,
     "mtbench_t0_speedup": 1.6, "humaneval_t0_speedup": 2.0, "mtbench_t0_speedup_no_loop": 1.2,
     "humaneval_t0_speedup_no_loop": 1.4},
    {**HEAD, "target": "T", "train_tokens": 5_000_000, "variant": "dflash2", "mtbench_t0_speedup": 5.0,
     "humaneval_t0_speedup": 5.0},  # another architecture: not this table's
    {**HEAD, "target": "other", "train_tokens": 1_000_000, "mtbench_t0_speedup": 9.0, "humaneval_t0_speedup": 9.0},
]
TRAIN = [{**HEAD, "shape": "s", "world": 1, "tokens_per_s": 50_000.0},
         {**HEAD, "date": "2026-01-02", "shape": "s", "world": 1, "tokens_per_s": 100_000.0},  # the current one
         {**HEAD, "date": "2026-01-03", "shape": "s", "world": 2, "tokens_per_s": 1.0}]  # two GPUs: not it
REGEN = [{**HEAD, "target": "pkg:t", "world": 1, "prompts": 2048, "tokens_per_s": 80_000.0},
         {**HEAD, "target": "pkg:t", "world": 1, "prompts": 512, "tokens_per_s": 1.0}]  # fewer rows: not it
SPEC = {"target": "T", "names": ("T",), "shape": "s", "recipe": None, "regen_target": "pkg:t", "target_path": "pkg:t"}
PATHS = {"drafter": "d.json", "train": "t.json", "regen": "r.json"}


def test_the_scripts_row_is_the_hand_computed_one():
    row = sizing_advice.target_row(SPEC, DRAFTS, TRAIN, REGEN, {"num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 1000},
                            3, PATHS)
    assert [p["train_tokens"] for p in row["points"]] == [10_000_000, 20_000_000, 40_000_000]
    assert row["tokens_to_speedup_1"] == 20_000_000 and row["tokens_to_speedup_1_5"] == 40_000_000
    assert row["train_tokens_per_s"] == 100_000.0 and row["regen_tokens_per_s"] == 80_000.0
    # 20 M tokens: 200 s of training + 250 s of regeneration = 7.5 minutes; 40 M: 15 minutes
    assert row["minutes_per_gpu_to_speedup_1"] == pytest.approx(7.5)
    assert row["minutes_per_gpu_to_speedup_1_5"] == pytest.approx(15.0)
    lines = sizing_advice.table([row])
    assert row["tokens_to_speedup_1_no_loop"] == 40_000_000 and row["tokens_to_speedup_1_5_no_loop"] is None
    assert "| T | 1,000 | 3 x 64 | 20.0 M | 7.5 | 40.0 M | 15.0 | 40.0 M / > 40.0 M (no measured run pays) | " \
           "100.0k / 80.0k |" in lines
    assert "| T | main | 20.0 M | 2.00 / 2.10 | 1.10 / 1.30 | - | 2026-01-01, abc, NVIDIA H200 |" in lines
    assert "| T | main | 40.0 M | 3.00 / 3.20 | 1.60 / 2.00 | 1.20 / 1.40 | 2026-01-01, abc, NVIDIA H200 |" in lines


def test_a_target_no_measured_draft_pays_for_says_so():
    slow = [{**r, "mtbench_t0_speedup": 0.7} for r in DRAFTS[:3]]
    row = sizing_advice.target_row(SPEC, slow, TRAIN, REGEN, None, None, PATHS)
    assert row["tokens_to_speedup_1"] is None and row["minutes_per_gpu_to_speedup_1"] is None
    assert sizing_advice.pay_cell(row, "1") == "> 40.0 M (no measured run pays)"
    none = sizing_advice.target_row({**SPEC, "names": ()}, DRAFTS, TRAIN, REGEN, None, None, PATHS)
    assert sizing_advice.pay_cell(none, "1") == "no run recorded"


def test_the_packaged_rows_are_docs_bench_rows():
    packaged = sizing_advice.SIZING_FILE
    assert json.loads(packaged.read_text()) == json.loads((REPO / "docs/bench/sizing.json").read_text())
    rows = sizing_advice.load_rows()
    assert rows and all(r["tokens_to_speedup_1"] > 0 for r in rows)


ROW = {"target": "Measured", "target_path": "pkg:none", "num_hidden_layers": 4, "hidden_size": 32,
       "vocab_size": 151936, "tokens_to_speedup_1": 1000, "train_tokens_per_s": 10.0,
       "minutes_per_gpu_to_speedup_1": 3.0}


@pytest.mark.parametrize("overrides, tokens, warns", [
    # the recipe: micro batch 2 x max_length 64 x grad_accum 1 x 1 rank = 128 tokens a step
    (["train.max_steps=4"], 512, True),  # 4 x 128
    (["train.max_steps=4", "train.grad_accum=2", "data.pack_length=100"], 1600, False),  # 4 x 2 x 100 x 2
    (["train.max_steps=100"], 12800, False),
    (["train.max_steps=100", "train.max_minutes=1"], 600, True),  # 1 minute x 60 s x 10 tokens/s x 1 GPU
    (["train.max_steps=100", "train.max_minutes=0"], 128, True),  # a cap of 0 stops after the first step
])
def test_the_plan_warns_a_budget_below_a_paying_draft(tiny, tmp_path, monkeypatch, caplog, overrides,  # noqa: F811
                                                      tokens, warns):
    monkeypatch.setattr(sizing_advice, "load_rows", lambda *a: [ROW])
    monkeypatch.setattr("nemo_dflash.target.loading.load_target", lambda *a, **k: pytest.fail("a model loaded"))
    run = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(RECIPE.format(run=run, target=tiny["target"], chat=tiny["chat"]))
    cfg = load_recipe(str(config), overrides, data_optional=True)
    assert sizing_advice.planned_tokens(cfg, 1, ROW["train_tokens_per_s"])[0] == tokens
    with caplog.at_level(logging.WARNING, logger="nemo_dflash.recipes.sizing_advice"):
        pipeline.Pipeline(cfg, pipeline.STAGES, [])
    lines = [r.getMessage() for r in caplog.records if r.name == "nemo_dflash.recipes.sizing_advice"]
    if warns:
        assert len(lines) == 1, lines
        assert f"at most {tokens:,} tokens" in lines[0] and "Measured (4 layers x 32)" in lines[0]
        assert "1,000 training tokens" in lines[0] and "docs/train.md" in lines[0]
    else:
        assert lines == []


def test_the_closest_measured_target_is_the_nearest_in_size():
    small = {**ROW, "target": "small", "num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152}
    big = {**ROW, "target": "big", "num_hidden_layers": 36, "hidden_size": 4096, "vocab_size": 151936}
    half_b = {"num_hidden_layers": 24, "hidden_size": 896, "vocab_size": 151936}  # a 0.5B-class shape
    assert sizing_advice.closest([small, big], half_b)["target"] == "small"
    assert sizing_advice.closest([small, big], {"num_hidden_layers": 32, "hidden_size": 4096})["target"] == "big"


def test_the_warning_says_how_far_the_closest_measured_target_is():
    cfg = load_recipe("smollm2_135m_gpu.yaml", ["train.max_steps=10", "train.max_minutes=null"],
                      data_optional=True)
    far = {**ROW, "tokens_to_speedup_1": 10**9}  # above the recipe's 10 x 32,768 tokens
    same = sizing_advice.sizing_warning(cfg, 1, [far], dims={"num_hidden_layers": 4, "hidden_size": 32,
                                                             "vocab_size": 151936})
    assert "at most 0.3 M tokens (train.max_steps 10 x 32,768 tokens a step)" in same
    assert "Measured (4 layers x 32)," in same  # its own size: not named
    bigger = sizing_advice.sizing_warning(cfg, 1, [far], dims={"num_hidden_layers": 4, "hidden_size": 128,
                                                               "vocab_size": 151936})
    # 12 x 4 x 128^2 + 151936 x 128 = 20,234,240 parameters against 12 x 4 x 32^2 + 151936 x 32 = 4,911,104: 4.1x
    assert "Measured (4 layers x 32; this target is about 4.1x its size)," in bigger
