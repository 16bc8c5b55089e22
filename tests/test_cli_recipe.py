"""`--config RECIPE [KEY=VALUE ...]` on the stand-alone commands: a recipe value reaches the command, a flag given
on the command line overrides it, and every flag's default is its recipe field's (one source of defaults)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import logging
from pathlib import Path

import pytest

from nemo_dflash.config import EvaluateConfig, ExportConfig, PromptJobConfig, RegenerateConfig
from nemo_dflash.recipes import _regen_args, _regen_server, evaluate, export, prompts, regenerate
from nemo_dflash.recipes._cli import parse_with_recipe

COMMANDS = [(regenerate, RegenerateConfig, ()), (evaluate, EvaluateConfig, ()), (export, ExportConfig, ()),
            (prompts, PromptJobConfig, ("name", "weight"))]
# The modules whose add_argument calls declare the commands' flags.
PARSER_SOURCES = [_regen_args, _regen_server, evaluate, export, prompts]


def _recipe(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text("target:\n  path: pkg:smollm2\ndata:\n  sources: []\n" + body)
    return path


@pytest.mark.parametrize("module,section,skip", COMMANDS, ids=lambda x: getattr(x, "__name__", ""))
def test_every_flag_default_is_its_dataclass_field_default(module, section, skip):
    """Change-detecting: each recipe field's flag defaults to the field's default, read from the dataclass."""
    parser = module.build_parser()
    fields = [f for f in dataclasses.fields(section) if f.name not in skip]
    assert fields
    for f in fields:
        assert parser.get_default(f.name) == getattr(section(), f.name), f.name


@pytest.mark.parametrize("module", PARSER_SOURCES, ids=lambda m: m.__name__)
def test_no_flag_writes_a_default_of_its_own_for_a_recipe_field(module):
    """One source of defaults: an add_argument whose dest is a recipe field declares no default= (the dataclass
    gives it), so the two can never drift."""
    names = {f.name for s in (RegenerateConfig, EvaluateConfig, ExportConfig, PromptJobConfig)
             for f in dataclasses.fields(s)}
    written = []
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
            kw = {k.arg: k.value for k in node.keywords}
            dest = kw["dest"].value if "dest" in kw else flags[0][2:].replace("-", "_") if flags else None
            if dest in names and "default" in kw:
                written.append(dest)
    assert not written


def test_regenerate_takes_its_section_and_target_from_the_recipe(tmp_path, monkeypatch):
    recipe = _recipe(tmp_path, "regenerate:\n  max_new_tokens: 33\n  data: [chitchat]\n  loops: drop\n")
    seen = []

    def stop(args):
        seen.append(args)
        raise SystemExit(0)

    monkeypatch.setattr(_regen_args, "validate", stop)
    with pytest.raises(SystemExit):
        regenerate.main(["--config", str(recipe), "--out", str(tmp_path / "o.jsonl")])
    args = seen[-1]
    assert (args.target, args.data, args.max_new_tokens, args.loops) == ("pkg:smollm2", ["chitchat"], 33, "drop")
    assert args.seed == RegenerateConfig().seed  # a key the recipe leaves: the dataclass default
    with pytest.raises(SystemExit):  # flags win; a repeatable flag replaces the recipe's list; KEY=VALUE applies
        regenerate.main(["--config", str(recipe), "--out", str(tmp_path / "o.jsonl"), "--max-new-tokens", "7",
                         "--data", "code", "--target", "other", "regenerate.seed=5", "regenerate.loops=keep"])
    args = seen[-1]
    assert (args.target, args.data, args.max_new_tokens, args.seed, args.loops) == ("other", ["code"], 7, 5, "keep")


def test_evaluate_takes_its_section_from_the_recipe(tmp_path, monkeypatch):
    recipe = _recipe(tmp_path, "evaluate:\n  protocol: quick\n  top_k: 5\n  num_prompts: 3\n")
    seen = []

    def stop(args):
        seen.append(args)
        raise SystemExit(0)

    monkeypatch.setattr(evaluate, "check_args", stop)
    common = ["--config", str(recipe), "--draft", "d", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit):
        evaluate.main(common)
    args = seen[-1]
    assert (args.target, args.protocol, args.top_k, args.num_prompts) == ("pkg:smollm2", "quick", 5, 3)
    with pytest.raises(SystemExit):
        evaluate.main([*common, "--top-k", "2", "evaluate.num_prompts=4"])
    assert (seen[-1].top_k, seen[-1].num_prompts, seen[-1].protocol) == (2, 4, "quick")


def test_export_takes_its_section_from_the_recipe_and_a_flag_overrides_it(tmp_path, capsys):
    """export.serving_engine: sglang from the recipe refuses a draft above SGLang's layer limit; --serving-engine
    vllm given on the command line exports it."""
    from test_engine_limits import _draft

    src = tmp_path / "draft"
    _draft(layer_ids=(1, 3)).save_pretrained(src)
    recipe = _recipe(tmp_path, "export:\n  serving_engine: sglang\n")
    argv = ["--config", str(recipe), "--checkpoint", str(src), "--out", str(tmp_path / "out")]
    capsys.readouterr()
    parsed = parse_with_recipe(export.build_parser(), argv)
    assert (parsed.serving_engine, parsed.target, parsed.parity_prompts) == ("sglang", "pkg:smollm2", 0)
    argv += ["--target", ""]  # a flag overrides the recipe's target.path: no target to check the draft against
    with pytest.raises(SystemExit) as e:
        export.main(argv)
    assert e.value.code == 2 and "SGLang cannot capture" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert export.main([*argv, "--serving-engine", "vllm"]) == 0


def test_overrides_without_a_recipe_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        parse_with_recipe(export.build_parser(), ["--checkpoint", "c", "--out", "o", "export.parity_prompts=1"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and "--config RECIPE" in err


def test_a_required_flag_the_recipe_does_not_set_is_still_required(tmp_path, capsys):
    recipe = _recipe(tmp_path, "")
    with pytest.raises(SystemExit) as e:
        parse_with_recipe(regenerate.build_parser(), ["--config", str(recipe), "--out", "o.jsonl"])
    assert e.value.code == 2 and "required: --data" in capsys.readouterr().err


def test_engine_slots_is_refused_naming_its_replacement(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        regenerate.main(["--target", "pkg:smollm2", "--data", "chitchat", "--out", str(tmp_path / "o.jsonl"),
                         "--engine", "slots"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and "--engine continuous" in err
    assert not list(tmp_path.iterdir())


def test_export_engine_is_a_deprecated_alias_of_serving_engine(caplog):
    with caplog.at_level(logging.WARNING):
        args = export.build_parser().parse_args(["--checkpoint", "c", "--out", "o", "--engine", "vllm"])
    assert args.serving_engine == "vllm"
    assert [r.getMessage() for r in caplog.records] == ["--engine is deprecated: pass --serving-engine"]
    assert "--engine " not in export.build_parser().format_help().replace("--serving-engine", "")


def test_regenerate_backend_engine_is_a_deprecated_name_of_local(caplog):
    args = regenerate.build_parser().parse_args(["--target", "t", "--data", "d", "--out", "o.jsonl",
                                                 "--backend", "engine"])
    with caplog.at_level(logging.WARNING):
        _regen_server.validate_server_args(args)
    assert args.backend == "local"
    assert [r.getMessage() for r in caplog.records] == ["--backend engine is deprecated: pass --backend local"]
    assert regenerate.build_parser().get_default("backend") == "local"


def test_a_journal_written_under_the_old_names_continues(tmp_path):
    """A partial output started with `--engine slots --backend engine` continues under their new names; another
    setting still refuses it."""
    import json

    from nemo_dflash.data.journals import RESUME_KEYS, JournalError, check_settings

    now = {k: None for k in RESUME_KEYS} | {"engine": "continuous", "backend": "local", "seed": 0}
    meta = tmp_path / "o.jsonl.partial.json"
    meta.write_text(json.dumps(now | {"engine": "slots", "backend": "engine"}))
    check_settings(tmp_path / "o.jsonl.partial", meta, now)
    with pytest.raises(JournalError, match=r"seed: 0 -> 1"):
        check_settings(tmp_path / "o.jsonl.partial", meta, now | {"seed": 1})
    with pytest.raises(JournalError, match=r"engine: 'continuous' -> 'generate'"):
        check_settings(tmp_path / "o.jsonl.partial", meta, now | {"engine": "generate"})


def test_a_pipeline_marker_written_under_the_old_names_reads_as_the_new_ones():
    """A stage completed before the renames (export.engine, regenerate.engine: slots, backend: engine) compares
    equal to the same settings under the new names, so a finished run is not refused."""
    from nemo_dflash.recipes._pipeline_stages import _projected, _section

    old = {"export": {**_section(ExportConfig()), "engine": "vllm"},
           "regenerate": {**_section(RegenerateConfig()), "engine": "slots", "backend": "engine"}}
    del old["export"]["serving_engine"]
    new = {"export": _section(ExportConfig(serving_engine="vllm")), "regenerate": _section(RegenerateConfig())}
    assert _projected(old, {"export": ExportConfig, "regenerate": RegenerateConfig}) == new
    other = {"regenerate": {**_section(RegenerateConfig()), "engine": "generate"}}
    assert _projected(other, {"regenerate": RegenerateConfig}) != {"regenerate": _section(RegenerateConfig())}


# ---- prompts --config RECIPE: the recipe's prompts.jobs item, as the pipeline's prompts stage runs it

MAGPIE_JOB = ("prompts:\n  jobs:\n    - name: magpie\n      topics: chat=3,code=2\n      turns: 2-3\n      seed: 4\n"
              "      max_new_tokens: 11\n      oversample: 2.0\n")


def _stop_at(monkeypatch, name):
    """Replace `prompts.<name>` (the Magpie run, or the built-in writer) with a stop that keeps what it was given."""
    seen = []

    def stop(*args, **kw):
        seen.append(args)
        raise SystemExit(0)

    monkeypatch.setattr(prompts, name, stop)
    monkeypatch.setattr("nemo_dflash.target.loading.load_target", lambda *a, **k: pytest.fail("a model loaded"))
    return seen


def test_prompts_takes_its_job_and_target_from_the_recipe(tmp_path, monkeypatch):
    seen = _stop_at(monkeypatch, "run_magpie")
    out = str(tmp_path / "o.jsonl")
    with pytest.raises(SystemExit):
        prompts.main(["--config", str(_recipe(tmp_path, MAGPIE_JOB)), "--out", out, "--device", "cpu"])
    args, _, counts, turns = seen[-1][:4]
    assert (args.target, args.topics, args.seed, args.max_new_tokens, args.oversample) == (
        "pkg:smollm2", "chat=3,code=2", 4, 11, 2.0)
    assert counts == {"chat": 3, "code": 2} and turns == (2, 3)
    assert args.temperature == PromptJobConfig().temperature  # a key the job leaves: the dataclass default


def test_prompts_flags_and_overrides_win_over_the_recipe(tmp_path, monkeypatch):
    seen = _stop_at(monkeypatch, "run_magpie")
    argv = ["--config", str(_recipe(tmp_path, MAGPIE_JOB)), "--out", str(tmp_path / "o.jsonl"), "--device", "cpu",
            "--seed", "9", "--topics", "math=1", "--target", "other"]
    with pytest.raises(SystemExit):
        prompts.main([*argv, "prompts.jobs.0.max_new_tokens=7"])
    args, _, counts, turns = seen[-1][:4]
    assert (args.target, args.seed, args.topics, args.max_new_tokens) == ("other", 9, "math=1", 7)
    assert counts == {"math": 1} and turns == (2, 3)  # turns: still the recipe's


def test_prompts_a_source_job_takes_no_target_and_a_flag_picks_magpie(tmp_path, monkeypatch):
    body = ("prompts:\n  jobs:\n    - name: magpie\n      topics: chat=3\n    - name: gsm\n"
            "      source: gsm_symbolic:5\n")
    recipe, out = str(_recipe(tmp_path, body)), str(tmp_path / "o.jsonl")
    written = _stop_at(monkeypatch, "write_builtin")
    with pytest.raises(SystemExit) as e:
        prompts.main(["--config", recipe, "--out", out, "--job", "gsm"])
    assert e.value.code == 0 and written[-1] == ("gsm_symbolic:5", Path(out))
    magpie = _stop_at(monkeypatch, "run_magpie")
    with pytest.raises(SystemExit):  # --target given: the gsm job's keys, written by Magpie
        prompts.main(["--config", recipe, "--out", out, "--job", "gsm", "--target", "t", "--device", "cpu",
                      "--topics", "code=1"])
    assert (magpie[-1][0].target, magpie[-1][0].source) == ("t", None)


@pytest.mark.parametrize("extra,needle", [
    (["prompts.bogus=1"], "bogus"),
    (["prompts.jobs.0.seeed=1"], "seeed"),
    (["--job", "nope"], "--job nope: the recipe's prompts.jobs are magpie"),
], ids=["unknown-section-key", "unknown-job-key", "unknown-job"])
def test_prompts_a_bad_recipe_key_or_job_is_one_line_before_any_model(extra, needle, tmp_path, monkeypatch, capsys):
    seen = _stop_at(monkeypatch, "run_magpie")
    with pytest.raises(SystemExit) as e:
        prompts.main(["--config", str(_recipe(tmp_path, MAGPIE_JOB)), "--out", str(tmp_path / "o.jsonl"), *extra])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and needle in err, err
    assert not seen and not (tmp_path / "o.jsonl").exists()


def test_prompts_a_recipe_of_several_jobs_needs_job_and_one_of_none_is_refused(tmp_path, monkeypatch, capsys):
    _stop_at(monkeypatch, "run_magpie")
    with pytest.raises(SystemExit) as e:  # --job without a recipe: nothing to pick from
        prompts.main(["--job", "magpie", "--target", "t", "--out", str(tmp_path / "o.jsonl")])
    assert e.value.code == 2 and "give --config RECIPE" in capsys.readouterr().err
    two = MAGPIE_JOB + "    - name: other\n      topics: math=1\n"
    for body, needle in ((two, "magpie, other: pick one with --job NAME"), ("", "has no prompts.jobs")):
        with pytest.raises(SystemExit) as e:
            prompts.main(["--config", str(_recipe(tmp_path, body)), "--out", str(tmp_path / "o.jsonl")])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.count("\n") == 0 and needle in err, err
