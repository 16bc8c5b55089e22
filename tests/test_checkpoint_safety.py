"""No code from a checkpoint: a resume reads DCP's `state/.metadata` through a restricted unpickler and its
non-tensor entries through `torch.load(weights_only=True)` (`train/safe_dcp.py`). A crafted metadata file whose
unpickling would run code (its COMPLETE recomputed, as anyone can) runs nothing, on automatic resume and with
`checkpoint.resume=PATH`; a genuine checkpoint loads as DCP's own loader loads it."""

from __future__ import annotations

import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from nemo_dflash.files import write_complete_marker
from nemo_dflash.train import safe_dcp

from _fault_fixtures import assets, finished_run  # noqa: F401  (fixtures)
from _tiny_target import tiny_train_args as _args


class _RunsCode:
    """Unpickled, it writes ``sentinel``: what a crafted checkpoint could do instead."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return exec, (f"open({str(self.sentinel)!r}, 'w').write('ran')",)


def craft(ckpt: Path, sentinel: Path) -> None:
    (ckpt / "state" / ".metadata").write_bytes(pickle.dumps(_RunsCode(sentinel)))
    (ckpt / "COMPLETE").unlink()
    write_complete_marker(ckpt)  # the sizes and CRC-32s recomputed: the checkpoint looks intact


def test_the_crafted_payload_runs_code_through_plain_unpickling(tmp_path):
    """The payload is live: unpickled as DCP's own reader does, it writes the sentinel (what the old resume did)."""
    sentinel = tmp_path / "ran"
    pickle.loads(pickle.dumps(_RunsCode(sentinel)))
    assert sentinel.read_text() == "ran"


@pytest.mark.parametrize("how", ["auto", "path"])
def test_a_crafted_checkpoint_runs_no_code_on_resume(assets, finished_run, tmp_path, capsys, how):  # noqa: F811
    from nemo_dflash.recipes.train import main

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    sentinel = tmp_path / "ran"
    for ckpt in (run / "checkpoints").iterdir():
        craft(ckpt, sentinel)
    if how == "auto":
        argv = _args(*assets, run, "train.max_steps=6")
    else:  # another run's checkpoint, into a fresh directory
        newest = sorted((run / "checkpoints").iterdir())[-1]
        argv = _args(*assets, tmp_path / "fresh", "train.max_steps=6", f"checkpoint.resume={newest}")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert not sentinel.exists(), "the checkpoint's metadata ran code"
    assert e.value.code == 2 and "could run code" in err and err.count("error: ") == 1, err


def test_a_genuine_checkpoint_loads_as_dcps_own_loader_loads_it(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    m, o = get_state_dict(model, opt)
    dcp.save({"model": m, "optim": o}, checkpoint_id=str(tmp_path / "state"))

    def fresh() -> dict:
        other = torch.nn.Linear(3, 2)
        m2, o2 = get_state_dict(other, torch.optim.AdamW(other.parameters(), lr=5.0))
        return {"model": m2, "optim": o2}

    ours, reference = fresh(), fresh()
    safe_dcp.load(ours, tmp_path / "state")
    dcp.load(reference, checkpoint_id=str(tmp_path / "state"))
    assert ours["optim"]["param_groups"] == reference["optim"]["param_groups"]
    assert ours["optim"]["param_groups"][0]["lr"] == 1e-3 and tuple(ours["optim"]["param_groups"][0]["betas"]) == (0.8, 0.9)
    for k in ("weight", "bias"):
        assert ours["model"][k].equal(reference["model"][k]) and ours["model"][k].equal(model.state_dict()[k])
        for s in ("exp_avg", "exp_avg_sq", "step"):
            assert ours["optim"]["state"][k][s].equal(reference["optim"]["state"][k][s])


def test_a_draft_is_refused_with_another_target_than_it_was_trained_on_unless_any_target(
        assets, finished_run, tmp_path, capsys, monkeypatch):  # noqa: F811
    """The final draft's header records the fingerprint of the target it was trained with; export and evaluate
    against another target of the same shape are refused in one line naming --any-target, before any model loads
    (before, both went ahead without a word); --any-target allows it, and the export keeps the record."""
    from safetensors import safe_open

    from nemo_dflash.recipes import evaluate, export
    from nemo_dflash.target.identity import TRAINED_ON, weights_fingerprint

    from _tiny_target import make_tiny_target_dir

    target, _ = assets
    other = make_tiny_target_dir(tmp_path / "other", seed=1)  # same shapes, other weights
    assert weights_fingerprint(other) != weights_fingerprint(target)

    def recorded(weights: Path) -> str:
        with safe_open(str(weights), framework="pt") as f:
            return f.metadata()[TRAINED_ON]

    assert recorded(finished_run / "final" / "draft" / "model.safetensors") == weights_fingerprint(target)

    def refused(fn, argv):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            fn(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and "--any-target" in err[0] and str(other) in err[0], err

    out = tmp_path / "export"
    refused(export.main, ["--checkpoint", str(finished_run), "--out", str(out), "--target", str(other)])
    assert not out.exists()
    assert export.main(["--checkpoint", str(finished_run), "--out", str(out), "--target", str(target)]) == 0
    assert recorded(out / "model.safetensors") == weights_fingerprint(target)
    monkeypatch.setattr("nemo_dflash.target.loading.load_target", lambda *a, **k: pytest.fail("a model loaded"))
    ev = ["--draft", str(out), "--target", str(other), "--out", str(tmp_path / "eval"), "--protocol", "quick",
          "--num-prompts", "1", "--max-new-tokens", "4", "--temperatures", "0", "--no-speedup", "--device", "cpu"]
    refused(evaluate.main, ev)
    monkeypatch.undo()
    allowed = tmp_path / "export_any"
    assert export.main(["--checkpoint", str(finished_run), "--out", str(allowed), "--target", str(other),
                        "--any-target"]) == 0
    assert recorded(allowed / "model.safetensors") == weights_fingerprint(target)  # the record is kept
