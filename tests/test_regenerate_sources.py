"""`regenerate` with several prompt sources: weights, the source name in each record,
--samples-per-prompt, decontamination, bad sources refused before the model loads, and the
torchrun shards merged into the single-process file (2 gloo processes on CPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import nemo_dflash.target.loading
from _tiny_target import make_tiny_target_dir, write_chat_jsonl
from nemo_dflash.recipes import regenerate as cli
from nemo_dflash.target.loading import load_target

REPO = Path(__file__).resolve().parents[1]
BASE = ["--max-new-tokens", "4", "--batch-size", "3", "--sampling", "given", "--temperature", "1.0", "--top-p", "0.9",
        "--threads", "1", "--decontaminate", "off"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_tiny_target_dir(tmp_path_factory.mktemp("regen_src"))


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(str(target_dir), dtype="fp32")


@pytest.fixture
def cached_target(monkeypatch, target):
    monkeypatch.setattr(nemo_dflash.target.loading, "load_target", lambda *a, **k: target)
    return target


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the target was loaded before the user error was found")

    monkeypatch.setattr(nemo_dflash.target.loading, "load_target", refuse)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _prompt_file(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in prompts))
    return path


def test_sources_are_named_weighted_and_sampled(tmp_path, cached_target):
    a = write_chat_jsonl(tmp_path / "a.jsonl", n=4, seed=1)
    b = _prompt_file(tmp_path / "b.jsonl", ["tell me about cats please", "and dogs, what are they like"])
    out1 = tmp_path / "one.jsonl"
    s1 = cli.main(["--target", "x", "--data", str(a), "--data", f"more={b}@2", "--out", str(out1), *BASE])
    recs = _read(out1)
    # weight 2 puts each of b's prompts in twice, under its own key (~1): 4 + 2 * 2 conversations
    assert s1["written"] == len(recs) == 8
    by_name = {}
    for r in recs:
        by_name.setdefault(r["dataset"], []).append(r["source"])
    assert sorted(by_name["a"]) == sorted(f"a.jsonl:{i}" for i in range(1, 5))
    assert sorted(by_name["more"]) == ["b.jsonl:1", "b.jsonl:1~1", "b.jsonl:2", "b.jsonl:2~1"]
    assert [row["pool"] for row in s1["data_sources"]] == [4, 4]

    out3 = tmp_path / "three.jsonl"
    s3 = cli.main(["--target", "x", "--data", str(a), "--data", f"more={b}@2", "--out", str(out3),
                   "--samples-per-prompt", "3", "--summary-json", str(tmp_path / "sum.json"), *BASE])
    recs3 = _read(out3)
    assert s3["written"] == len(recs3) == 24
    # The first sample of each prompt is the one-sample run's answer; the others have their own keys.
    assert recs3[0::3] == recs
    for k in range(0, 24, 3):
        group = recs3[k:k + 3]
        assert [g["source"] for g in group] == [group[0]["source"], group[0]["source"] + "#1",
                                                group[0]["source"] + "#2"]
        assert len({g["dataset"] for g in group}) == 1
        assert len({g["messages"][-1]["content"] for g in group}) > 1  # distinct keyed samples
    summary = json.loads((tmp_path / "sum.json").read_text())
    rows = {r["name"]: r for r in summary["sources"]}
    assert rows["a"]["conversations"] == 12 and rows["more"]["conversations"] == 12
    assert rows["a"]["turns"] == 12 and rows["a"]["supervised_tokens"] >= 12


def test_decontamination_drops_planted_prompts(tmp_path, cached_target, monkeypatch):
    from nemo_dflash.data import decontaminate

    evals = ["Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
             "experiences and must-see attractions."]
    monkeypatch.setattr(decontaminate, "_DEFAULT", decontaminate.ContaminationIndex(evals, name="planted prompts"))
    clean = ["tell me about cats please", "and dogs, what are they like", "what is a prime number"]
    planted = ["Hi! " + evals[0] + " Thanks."]
    src = _prompt_file(tmp_path / "mixed.jsonl", clean + planted)
    out = tmp_path / "out.jsonl"
    base = [b for b in BASE if b not in ("--decontaminate", "off")]
    s = cli.main(["--target", "x", "--data", str(src), "--out", str(out), *base])
    assert s["decontamination"] == {"checked": 4, "dropped": 1}
    assert sorted(r["messages"][0]["content"] for r in _read(out)) == sorted(clean)


def test_a_source_left_empty_by_decontamination_is_refused(tmp_path, no_model, monkeypatch, capsys):
    from nemo_dflash.data import decontaminate

    evals = ["Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
             "experiences and must-see attractions."]
    monkeypatch.setattr(decontaminate, "_DEFAULT", decontaminate.ContaminationIndex(evals, name="planted prompts"))
    ok = _prompt_file(tmp_path / "ok.jsonl", ["tell me about cats please"])
    bad = _prompt_file(tmp_path / "leaky.jsonl", [evals[0], "Again: " + evals[0].lower()])
    with pytest.raises(SystemExit) as e:
        cli.main(["--target", "x", "--data", str(ok), "--data", str(bad), "--out", str(tmp_path / "o.jsonl"),
                  "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--data leaky" in err and "every one of its 2" in err


@pytest.mark.parametrize("make,message", [
    (lambda d: d / "missing.jsonl", "data source not found"),
    (lambda d: (d / "empty.jsonl").write_text("") and None or d / "empty.jsonl", "is empty"),
    (lambda d: (d / "chats.csv").write_text("a,b\n") and None or d / "chats.csv", "unsupported data file"),
    (lambda d: (d / "junk.jsonl").write_text("\n\n") and None or d / "junk.jsonl", "no usable conversations"),
    (lambda d: "nosuch_builtin:3", "data source not found"),
    (lambda d: "code@-1", "finite number > 0"),
])
def test_bad_sources_are_one_line_before_the_model(tmp_path, no_model, capsys, make, message):
    src = make(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(["--target", "x", "--data", str(src), "--out", str(tmp_path / "o.jsonl"), "--decontaminate", "off"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_merge_the_single_process_file_and_a_killed_rank_resumes(tmp_path, target_dir, monkeypatch):
    """2 gloo processes (torchrun) write the bytes of the single-process run; rank 1 was killed
    mid-shard beforehand and continues its journal (nothing lost, nothing twice)."""
    chats = write_chat_jsonl(tmp_path / "chats.jsonl", n=9, seed=2)
    args = ["--target", str(target_dir), "--data", str(chats), "--num-samples", "7", "--samples-per-prompt", "2",
            "--holdout", "1", *BASE]
    ref = tmp_path / "ref" / "out.jsonl"
    cli.main([*args, "--out", str(ref)])

    out = tmp_path / "multi" / "out.jsonl"
    # Rank 1 alone (no process group), killed after writing 2 records of its shard.
    from nemo_dflash.data import regenerate as regen_mod

    real = regen_mod.regenerate_conversations

    def killed_after_two(*a, **k):
        for i, rec in enumerate(real(*a, **k)):
            if i == 2:
                raise KeyboardInterrupt
            yield rec

    monkeypatch.setattr(regen_mod, "regenerate_conversations", killed_after_two)
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(KeyboardInterrupt):
        cli.main([*args, "--out", str(out)])
    journal = out.with_name("out.jsonl.rank1-of-2.partial")
    assert len(_read(journal)) == 2 and not out.exists()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key)

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "nemo_dflash.recipes.regenerate", *args, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "continuing" in proc.stderr and "2 of" in proc.stderr  # rank 1 resumed its journal
    assert out.read_bytes() == ref.read_bytes()
    assert (out.parent / "out.holdout.jsonl").read_bytes() == (ref.parent / "out.holdout.jsonl").read_bytes()
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.holdout.jsonl", "out.jsonl", "out_report"]
