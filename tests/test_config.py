"""Recipe composition through Hydra's Compose API: defaults list, config groups, override grammar.

The reference for the shipped recipes is their resolved config as the hand-written loader of commit
bb978e0 wrote it (tests/data/resolved_recipes/, recorded before composition moved to Hydra), for the
same overrides. Group overrides are checked against a naive merge of the YAML files by hand.
"""

from __future__ import annotations

import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from _torchrun import run_command
from omegaconf import OmegaConf

from nemo_dflash.config import REPO_CONFIGS, REPO_RECIPES, ConfigError, RecipeConfig, load_recipe

REPO = Path(__file__).resolve().parent.parent
RECORDED = Path(__file__).resolve().parent / "data" / "resolved_recipes"
# The overrides the records were written with (`plain`: only what a run must name; `overrides`: lists,
# a list of dicts, null, floats in two spellings).
OVERRIDES = {
    "plain": ["target.path=/models/t", "data.sources=[{path: a.jsonl}]"],
    "overrides": ["target.path=/models/t", "draft.target_layer_ids=[2,4]",
                  "data.sources=[{path: a.jsonl, weight: 2.0}, {path: b.parquet, max_samples: 10}]",
                  "loss.gamma=null", "optim.lr=1e-4", "optim.betas=[0.8,0.9]", "train.max_steps=7", "wandb.name=run1"],
}
SHIPPED = sorted(p.stem for p in REPO_RECIPES.glob("*.yaml"))


def resolved(cfg: RecipeConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def naive_merge(*layers: dict, overrides: tuple[str, ...] = ()) -> dict:
    """The reference: dataclass defaults, then each YAML layer, then dotlist overrides, merged by OmegaConf."""
    merged = OmegaConf.merge(OmegaConf.structured(RecipeConfig), *layers, OmegaConf.from_dotlist(list(overrides)))
    return OmegaConf.to_container(OmegaConf.structured(OmegaConf.to_object(merged)))


def body(recipe: str) -> dict:
    data = yaml.safe_load((REPO_RECIPES / f"{recipe}.yaml").read_text())
    data.pop("defaults", None)
    return data


def group(name: str, option: str) -> dict:
    return yaml.safe_load((REPO_CONFIGS / name / f"{option}.yaml").read_text())


def layers(recipe: str) -> list[dict]:
    """The YAML layers a recipe composes, in order: its defaults (a config group option, or another
    recipe next to it with that recipe's own layers), then its body."""
    out = []
    for entry in yaml.safe_load((REPO_RECIPES / f"{recipe}.yaml").read_text()).get("defaults", []):
        if isinstance(entry, dict):
            out.append(group(*next(iter(entry.items()))))
        elif entry != "_self_":
            out.extend(layers(entry))
    return [*out, body(recipe)]


# Recipes composed on another shipped recipe (no record of their own): compared with the naive merge.
BUILT_ON_A_RECIPE = {"smollm2_135m_200m",  # the 200 M-token run: smollm2_135m_gpu on two GPUs
                     "smollm2_demo",  # `make demo`: smollm2_135m with the pipeline's stages
                     "smollm2_135m_4gpu"}  # smollm2_135m_gpu on four GPUs, on the six-source data mix


def test_every_recorded_recipe_still_ships():
    assert {p.name.split(".")[0] for p in RECORDED.glob("*.yaml")} == set(SHIPPED) - BUILT_ON_A_RECIPE


# Schema fields added after the records were written, with their defaults (a record predates them).
ADDED_SINCE_RECORD = {"data": {"decontaminate": True, "pack_length": 0, "tokenize_workers": None},
                      "train": {"eval_temperature": 1.0, "eval_top_p": 1.0, "eval_top_k": 0},
                      "target": {"packed_attention": "flex"},
                      "loss": {"impl": "chunked", "accept_weight": 0.0, "accept_temperature": 1.0, "accept_form": "log",
                               "selector_weight": 1.0, "selector_outside": "skip", "position_weights": "decay",
                               "dpace_alpha": 0.5},
                      "draft": {"kind": "dflash", "dflash2": {"conv_kernel_size": 2, "conv_group_size": 16,
                                                              "selector_rank": 256, "selector_top_k": 16,
                                                              "output_multiplier": 1.0,
                                                              "final_logit_softcapping": 0.0}}}
SECTIONS_ADDED_SINCE_RECORD = ("run", "prompts", "regenerate", "export", "evaluate")
# Recipes whose values changed on purpose since the record: compared with the naive merge instead.
CHANGED_SINCE_RECORD = {
    "smollm2_135m_gpu",  # packed rows and the compiled step (docs/performance.md)
    "smollm2_135m",  # the 2-core demo's budget: block 4, answers <= 64 tokens, an anchor per answer position
}
# Single values changed on purpose since the record: (recorded, now), checked and then compared as recorded.
# configs/draft/paper_block16.yaml compiles the draft's layers, and the target's but on the hybrid Qwen3.5 targets
# (docs/performance.md).
VALUES_CHANGED_SINCE_RECORD = {r: {"train": {"compile": (False, True),
                                             **({} if r.startswith("qwen3_5") else {"compile_target": (False, True)})}}
                               for r in ("llama3_8b", "qwen3_4b", "qwen3_5_27b", "qwen3_5_35b_a3b", "qwen3_8b")}


@pytest.mark.parametrize("kind", sorted(OVERRIDES))
@pytest.mark.parametrize("recipe", SHIPPED)
def test_hydra_composition_equals_the_recorded_resolved_config(recipe, kind):
    got = resolved(load_recipe(f"{recipe}.yaml", OVERRIDES[kind]))
    if recipe in CHANGED_SINCE_RECORD | BUILT_ON_A_RECIPE:
        assert got == naive_merge(*layers(recipe), overrides=tuple(OVERRIDES[kind]))
        return
    want = yaml.safe_load((RECORDED / f"{recipe}.{kind}.yaml").read_text())
    for section, fields in ADDED_SINCE_RECORD.items():
        for key, default in fields.items():
            assert got[section].pop(key) == default, f"{section}.{key}: a recipe sets it, update the record"
    for section, fields in VALUES_CHANGED_SINCE_RECORD.get(recipe, {}).items():
        for key, (recorded, now) in fields.items():
            assert got[section][key] == now, f"{section}.{key}: expected {now!r}"
            got[section][key] = recorded
    merged = naive_merge(*layers(recipe), overrides=tuple(OVERRIDES[kind]))
    for section in SECTIONS_ADDED_SINCE_RECORD:  # the pipeline's stages: the defaults, then what the recipe sets
        assert got.pop(section) == merged[section]
    assert got == want


def test_composition_goes_through_hydra(monkeypatch):
    """The defaults list is Hydra's: composing with Hydra's `compose` broken must fail (no fallback merge)."""
    import hydra

    def broken(*a, **k):
        raise RuntimeError("compose called")

    monkeypatch.setattr(hydra, "compose", broken)
    with pytest.raises(RuntimeError, match="compose called"):
        load_recipe("qwen3_8b.yaml")


def test_group_files_live_in_their_groups():
    assert (REPO_CONFIGS / "draft" / "paper_block16.yaml").is_file()
    assert (REPO_CONFIGS / "cluster" / "fsdp2.yaml").is_file()
    assert not list(REPO_CONFIGS.glob("*.yaml"))  # every shared piece is a group option


# ---- the override grammar: key=value, +key=value, ++key=value, ~key, group=option, lists


def test_removing_a_group_drops_its_settings():
    got = resolved(load_recipe("qwen3_8b.yaml", ["~cluster"]))
    assert got == naive_merge(group("draft", "paper_block16"), body("qwen3_8b"))
    assert got["distributed"]["strategy"] == "auto" and got["checkpoint"]["every_steps"] is None


def test_adding_a_group_to_a_recipe_without_it():
    """`+group=option` appends the group after the recipe (Hydra's order), so its values win."""
    got = resolved(load_recipe("smollm2_135m.yaml", ["+cluster=fsdp2"]))
    assert got == naive_merge(body("smollm2_135m"), group("cluster", "fsdp2"))
    assert got["distributed"]["strategy"] == "fsdp2" and got["target"]["path"] == "pkg:smollm2"


def test_choosing_a_group_option_and_setting_keys_together():
    got = resolved(load_recipe("qwen3_8b.yaml", ["cluster=fsdp2", "distributed.strategy=ddp", "optim.betas=[0.5,0.6]"]))
    want = naive_merge(group("draft", "paper_block16"), group("cluster", "fsdp2"), body("qwen3_8b"),
                       overrides=("distributed.strategy=ddp", "optim.betas=[0.5,0.6]"))
    assert got == want and got["distributed"]["strategy"] == "ddp" and got["optim"]["betas"] == [0.5, 0.6]


def test_removing_a_key_restores_the_schema_default():
    assert load_recipe("smollm2_135m.yaml").optim.lr == 3e-3  # the recipe's own value ...
    assert load_recipe("smollm2_135m.yaml", ["~optim.lr"]).optim.lr == RecipeConfig().optim.lr  # ... dropped


def test_plus_adds_only_what_is_not_there():
    """Every schema key has a value (its default), so `+key=value` on one is refused with the fix in one line;
    `++key=value` sets it whether or not it is there."""
    with pytest.raises(ConfigError, match=r"optim\.lr=1e-4") as e:
        load_recipe("qwen3_8b.yaml", ["+optim.lr=1e-4"])
    assert "\n" not in str(e.value)
    assert load_recipe("qwen3_8b.yaml", ["++optim.lr=1e-4"]).optim.lr == 1e-4


# ---- typos: the nearest valid key or option, in one line


@pytest.mark.parametrize("override, suggestion", [
    ("optim.lrr=1e-4", "optim.lr"), ("+optim.lrr=1e-4", "optim.lr"), ("++optim.lrr=1e-4", "optim.lr"),
    ("~optim.lrr", "optim.lr"), ("trian.max_steps=3", "train"), ("cluster=fsdp3", "cluster=fsdp2"),
    ("draft=paper_block17", "draft=paper_block16"),
])
def test_typos_name_the_nearest_valid_key_or_option(override, suggestion):
    with pytest.raises(ConfigError, match=f"Did you mean '{suggestion}") as e:
        load_recipe("qwen3_8b.yaml", [override])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override", ["optim.lr", "+optim.lr", "=1e-4"])
def test_an_unparseable_override_names_the_grammar(override):
    with pytest.raises(ConfigError, match="key=value") as e:
        load_recipe("qwen3_8b.yaml", [override])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", ["runs/a,b", "a=b", "runs/my run (2)/x", "it's=1,2"])
def test_plain_string_values_hydra_would_refuse_stay_strings(value):
    """As before Hydra: `key=value` with a comma, `=` or parentheses in the value sets that string
    (Hydra alone reads `a,b` as a sweep and refuses the others)."""
    cfg = load_recipe("qwen3_8b.yaml", [f"output_dir={value}", f"wandb.name={value}"])
    assert (cfg.output_dir, cfg.wandb.name) == (value, value)


def test_quoted_values_keep_their_commas_and_equals():
    assert load_recipe("qwen3_8b.yaml", ["wandb.name='a=b,c'"]).wandb.name == "a=b,c"


def test_a_group_choice_is_not_taken_as_a_string():
    with pytest.raises(ConfigError, match="cluster"):
        load_recipe("qwen3_8b.yaml", ["cluster=fsdp2,x"])


def test_composition_leaves_the_working_directory_and_logging_alone(tmp_path, monkeypatch):
    """No `@hydra.main`: the caller (torchrun) keeps its working directory, logging and argv."""
    monkeypatch.chdir(tmp_path)
    root = logging.getLogger()
    handlers, level, argv = list(root.handlers), root.level, list(sys.argv)
    load_recipe("qwen3_8b.yaml", ["optim.lr=1e-4", "~cluster"])
    assert Path.cwd() == tmp_path and list(tmp_path.iterdir()) == []  # no outputs/ or .hydra/ written
    assert (list(root.handlers), root.level, sys.argv) == (handlers, level, argv)


def test_the_command_line_composes_groups_from_another_directory(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "nemo_dflash.recipes.train", "--config", "qwen3_8b.yaml", "--print-config"]
    # the two commands run at once (their imports overlap on the cores)
    with ThreadPoolExecutor(2) as pool:
        ok, r = pool.map(lambda ov: run_command([*cmd, *ov], 120, env=env, cwd=tmp_path),
                         (["~cluster", "optim.lr=1e-4"], ["cluster=fsdp3"]))
    assert ok.returncode == 0, ok.stderr[-2000:]
    printed = yaml.safe_load(ok.stdout)
    assert printed["distributed"]["strategy"] == "auto" and printed["optim"]["lr"] == 1e-4
    assert r.returncode == 2 and "Did you mean 'cluster=fsdp2'" in r.stderr
    assert len([line for line in r.stderr.splitlines() if line.strip()]) == 1, r.stderr


def test_one_item_of_a_list_is_overridden_by_its_index():
    """`prompts.jobs.3.source=...` changes that item's field alone (Hydra's list index); a field the recipe's
    item does not set takes `++`; a typo in the field, an index past the list: one line naming the fix."""
    base = load_recipe("smollm2_135m_4gpu.yaml", data_optional=True)
    cfg = load_recipe("smollm2_135m_4gpu.yaml", ["prompts.jobs.3.source=code_site+all:200000"], data_optional=True)
    assert [j.source for j in cfg.prompts.jobs] == [j.source for j in base.prompts.jobs[:3]] + ["code_site+all:200000",
                                                                                                None]
    assert cfg.prompts.jobs[4] == base.prompts.jobs[4] and base.prompts.jobs[3].source == "code_site+all"
    assert load_recipe("smollm2_135m_4gpu.yaml", ["++data.sources.0.weight=2"],
                       data_optional=True).data.sources[0].weight == 2.0
    refusals = {
        "data.sources.0.weight=2": "item 0 of 'data.sources' does not set 'weight' in this recipe: add it with "
                                   "'++data.sources.0.weight=...'",
        "prompts.jobs.9.source=x": "'prompts.jobs' has no item 9 in this recipe (items count from 0)",
        "prompts.jobs.3.sorce=x": "Did you mean 'prompts.jobs[3].source'?",
        "optim.lr.0=1": "Did you mean 'optim.lr'?",
    }
    for override, message in refusals.items():
        with pytest.raises(ConfigError, match=None) as err:
            load_recipe("smollm2_135m_4gpu.yaml", [override], data_optional=True)
        assert message in str(err.value) and "\n" not in str(err.value), (override, str(err.value))


# ---- One rule for identity: every key says whether it changes outputs (config.what / config.how)

# The keys that change how a stage runs, never what it writes: written out by hand, so a key moved from one side to
# the other is a visible change here.
HOW_KEYS = {
    "wandb", "wandb.mode", "wandb.project", "wandb.name", "run", "run.dir",
    "train.max_minutes", "train.log_every", "train.max_bad_steps", "checkpoint.every_steps", "checkpoint.keep_last",
    "distributed.backend", "distributed.timeout_minutes", "draft.allow_mask_token_in_data",
    "data.max_bad_lines", "data.num_workers", "data.tokenize_workers", "prompts.jobs[].threads",
    "regenerate.prepare_ahead", "regenerate.schedule", "regenerate.threads", "regenerate.max_bad_lines",
    "export.parity_prompts", "evaluate.workers", "evaluate.threads", "evaluate.max_minutes", "export.any_target",
    "evaluate.any_target", "evaluate.allow_nonfinite", "regenerate.endpoint", "regenerate.api_key_env",
    "regenerate.concurrency",
    "regenerate.request_timeout", "regenerate.retries", "regenerate.retry_backoff",
}


def test_every_recipe_key_says_whether_it_changes_outputs():
    from nemo_dflash.data.config import all_fields, changes_outputs

    keys = all_fields(RecipeConfig)
    assert len(keys) > 150 and "prompts.jobs[].topics" in keys and "data.sources[].path" in keys
    unclassified = sorted(k for k, f in keys.items() if changes_outputs(f) is None)
    assert not unclassified, f"mark these fields what(...) or how(...) in config.py: {unclassified}"
    assert {k for k, f in keys.items() if changes_outputs(f) is False} == HOW_KEYS


def test_output_settings_drop_how_keys_at_every_depth_of_a_dataclass_or_its_dict():
    import dataclasses

    from nemo_dflash.config import PromptJobConfig, output_settings

    cfg = RecipeConfig()
    cfg.prompts.jobs = [PromptJobConfig(name="a", threads=3)]
    got = output_settings(RecipeConfig, cfg)
    assert "wandb" not in got and "run" not in got and "log_every" not in got["train"]
    assert got["train"]["max_steps"] is None and got["optim"]["lr"] == 6e-4
    assert "threads" not in got["prompts"]["jobs"][0] and got["prompts"]["jobs"][0]["name"] == "a"
    as_dict = dataclasses.asdict(cfg)
    as_dict["train"]["unknown_later_key"] = 1  # a key this version does not know is kept (compared)
    assert output_settings(RecipeConfig, as_dict)["train"] == {**got["train"], "unknown_later_key": 1}
