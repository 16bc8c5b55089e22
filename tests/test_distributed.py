"""2-process training under torchrun (gloo, CPU), kills, SIGTERM and exact resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _tiny_target import make_tiny_target_dir, write_chat_jsonl
from _torchrun import SCALE_ENV, run_command, scaled, timeout_scale

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return make_tiny_target_dir(root), write_chat_jsonl(root / "chat.jsonl", n=24)


def _launcher(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def _args(target, data, extra, out) -> list[str]:
    return [
        "--config", "qwen3_8b.yaml", f"target.path={target}",
        "target.dtype=fp32", "draft.num_layers=2", "draft.block_size=4", f"data.sources=[{{path: {data}}}]",
        "data.max_length=96", "data.holdout_fraction=0.0", "loss.num_anchors=8", "train.log_every=1",
        "wandb.mode=disabled", "optim.lr=3e-3", f"output_dir={out}", *extra,
    ]


def _cmd(nproc: int, target, data, out, *extra):
    return [*_launcher(nproc), "-m", "nemo_dflash.recipes.train", *_args(target, data, extra, out)]


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO), "NEMO_DFLASH_NO_BAR": "1", "OMP_NUM_THREADS": "1"}


def _run(cmd, timeout=240):
    r = run_command(cmd, timeout, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _losses(out: Path) -> dict:
    """step -> loss; the last record of a step wins (a killed run may have logged it before)."""
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def _trainings(nproc: int, root: Path, target, data, runs: dict[str, tuple]) -> dict[str, Path]:
    """Each training of ``runs`` (name -> extra arguments, or (data file, extra arguments)) into ``root/NAME``,
    all in one launch of ``nproc`` processes (tests/_train_runs.py: one start-up of the ranks for them all)."""
    spec = root / "runs.json"
    spec.write_text(json.dumps([_args(target, *(run if isinstance(run[0], Path) else (data, run)), root / name)
                                for name, run in runs.items()]))
    _run([*_launcher(nproc), str(REPO / "tests" / "_train_runs.py"), str(spec)], timeout=600)
    return {name: root / name for name in runs}


# three steps: the losses of steps 2 and 3 follow one and two synchronised updates (the second uses the optimizer
# state the first left on each rank or shard)
COMMON = ("train.max_steps=3",)
FUSED = ("train.max_steps=3", "optim.fused=true")
# a DFlash2 draft (block convolution and candidate selector) on the tiny target (hidden 32)
DFLASH2 = ("draft.kind=dflash2", "draft.dflash2.selector_rank=16", "draft.dflash2.selector_top_k=8")


@pytest.fixture(scope="module")
def one_process(assets, tmp_path_factory) -> dict[str, Path]:
    """The single-process references, trained in one process."""
    return _trainings(1, tmp_path_factory.mktemp("one_process"), *assets, {
        "single": (*COMMON, "train.micro_batch_size=4", "distributed.strategy=none"),
        "accum": (*COMMON, "train.micro_batch_size=2", "train.grad_accum=2"),
        "single_v2": (*COMMON, *DFLASH2, "train.micro_batch_size=4", "distributed.strategy=none"),
    })


def _mixed_data(path: Path) -> Path:
    """One sample per rank per step: one has no room for a block."""
    long_answer = " ".join(["alpha beta gamma"] * 10)
    with open(path, "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "tell"}, {"role": "assistant", "content": long_answer}]}) + "\n")
    return path


@pytest.fixture(scope="module")
def two_ranks(assets, tmp_path_factory) -> dict[str, Path]:
    """The 2-rank trainings, in one torchrun launch."""
    root = tmp_path_factory.mktemp("two_ranks")
    return _trainings(2, root, *assets, {
        "no_anchor": (_mixed_data(root / "mixed.jsonl"), ("train.max_steps=3", "train.micro_batch_size=1",
                                                          "distributed.strategy=ddp", "draft.block_size=8")),
        "ddp": (*COMMON, "train.micro_batch_size=2", "distributed.strategy=ddp"),
        "fsdp2": (*COMMON, "train.micro_batch_size=2", "distributed.strategy=fsdp2"),
        "fsdp2_shard": (*COMMON, "train.micro_batch_size=2", "distributed.strategy=fsdp2",
                        "distributed.shard_target=true"),
        "ddp_fused": (*FUSED, "train.micro_batch_size=2", "distributed.strategy=ddp"),
        "ddp_fused_stopped": (*FUSED, "train.micro_batch_size=2", "distributed.strategy=ddp", "train.max_minutes=0.0"),
        "ddp_v2": (*COMMON, *DFLASH2, "train.micro_batch_size=2", "distributed.strategy=ddp"),
        "fsdp2_v2": (*COMMON, *DFLASH2, "train.micro_batch_size=2", "distributed.strategy=fsdp2"),
        "no_anchor_v2": (root / "mixed.jsonl", ("train.max_steps=3", "train.micro_batch_size=1", *DFLASH2,
                                                "distributed.strategy=ddp", "draft.block_size=8")),
    })


def test_ddp_and_fsdp2_match_single_process(one_process, two_ranks):
    single = _losses(one_process["single"])
    for name in ("ddp", "fsdp2", "fsdp2_shard"):
        got = _losses(two_ranks[name])
        assert sorted(got) == [1, 2, 3]
        for step, loss in single.items():
            assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), (name, step)
    # the global batch split over micro-steps instead of ranks gives the same losses too
    got = _losses(one_process["accum"])
    for step, loss in single.items():
        assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), ("grad_accum", step)


def test_rank_without_valid_anchor_does_not_hang(two_ranks):
    assert sorted(_losses(two_ranks["no_anchor"])) == [1, 2, 3]
    assert sorted(_losses(two_ranks["no_anchor_v2"])) == [1, 2, 3]  # the selector's parameters join too


def test_dflash2_ddp_and_fsdp2_match_single_process(one_process, two_ranks):
    """A DFlash2 draft (selector term in the loss) trains the same on two ranks as in one process."""
    single = _losses(one_process["single_v2"])
    assert single != _losses(one_process["single"])  # the variant is on: other losses than DFlash-1's
    for name in ("ddp_v2", "fsdp2_v2"):
        got = _losses(two_ranks[name])
        assert sorted(got) == [1, 2, 3]
        for step, loss in single.items():
            assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), (name, step)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    t0, limit = time.time(), scaled(timeout)
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else "process exited"
        if time.time() - t0 >= limit:
            proc.kill()
            pytest.fail(f"{path} never appeared in {limit:.0f} s ({SCALE_ENV}={timeout_scale():g})", pytrace=False)
        time.sleep(0.005)


KILL_ARGS = ("train.max_steps=8", "train.micro_batch_size=2", "checkpoint.every_steps=2", "checkpoint.keep_last=5")


@pytest.fixture(scope="module")
def uninterrupted(assets, tmp_path_factory) -> dict:
    """The losses of the run the killed ones are compared with (run once for both kill points)."""
    target, data = assets
    out = tmp_path_factory.mktemp("uninterrupted") / "full"
    _run(_cmd(1, target, data, out, *KILL_ARGS))
    return _losses(out)


@pytest.mark.parametrize("where", ["training", "checkpoint_write"])
def test_sigkill_then_resume_matches_uninterrupted(assets, uninterrupted, tmp_path, where):
    target, data = assets
    args, full = KILL_ARGS, uninterrupted

    out = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(1, target, data, out, *args), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    ckpts = out / "checkpoints"
    if where == "training":
        _wait_for(ckpts / "step_00000004" / "COMPLETE", proc)
    else:  # the moment the step-6 checkpoint starts being written
        _wait_for(ckpts / ".tmp-step_00000006", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    complete = sorted(p.name for p in ckpts.iterdir() if (p / "COMPLETE").exists())
    assert "step_00000004" in complete and "step_00000002" in complete  # earlier checkpoints intact
    _run(_cmd(1, target, data, out, *args))
    resumed = _losses(out)
    assert resumed == full  # bit-identical on CPU, no sample skipped or repeated
    assert not list(ckpts.glob(".tmp-*"))


def test_ddp_lagged_loop_matches_single_process_and_stops_together(one_process, two_ranks):
    """With a fused AdamW each rank launches step n+1 before reading step n. Two ranks give the losses of the
    single process that reads every step (the unfused AdamW's: the same figures on CPU), and a stop voted in step 1 (the time limit) ends both ranks after step
    2: no rank waits in a collective the other never joins."""
    single, got = _losses(one_process["single"]), _losses(two_ranks["ddp_fused"])
    assert sorted(got) == [1, 2, 3]
    for step, loss in single.items():
        assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    out = two_ranks["ddp_fused_stopped"]
    assert sorted(_losses(out)) == [1, 2]
    assert json.loads((out / "summary.json").read_text())["stopped_early"] == "train.max_minutes reached"


def test_sigterm_leaves_a_complete_checkpoint(assets, tmp_path):
    target, data = assets
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(1, target, data, out, "train.max_steps=400", "train.micro_batch_size=1",
                                 "checkpoint.every_steps=2"), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _wait_for(out / "checkpoints" / "step_00000002" / "COMPLETE", proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=scaled(120)) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_early"] == "SIGTERM" and summary["steps"] < 400
    last = out / "checkpoints" / f"step_{summary['steps']:08d}"
    assert (last / "COMPLETE").is_file() and (last / "draft" / "model.safetensors").is_file()
