"""`regenerate` with several prompt sources: weights, the source name in each record,
--samples-per-prompt, decontamination, bad sources refused before the model loads, and the
torchrun shards merged into the single-process file (2 gloo processes on CPU)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import nemo_dflash.target.loading
from _tiny_target import make_tiny_target_dir, write_chat_jsonl
from _torchrun import run_command, torchrun as _torchrun
from nemo_dflash.recipes import regenerate as cli
from nemo_dflash.data import selection
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


def _whole_lines(path: Path) -> list[dict]:
    """The records of a journal, a torn last line (its writer was killed) left out."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_bytes().split(b"\n")[:-1]]


def test_two_ranks_merge_the_single_process_file_and_killed_ranks_resume(tmp_path, target_dir, monkeypatch):
    """Rank 1 alone (no process group: its static shard) is killed after 2 conversations; then 2 gloo
    ranks sharing the queue start, and rank 0 is SIGKILLed after 2 more of its own; the same command
    then finishes the bytes of the single-process run: nothing lost, nothing twice."""
    chats = write_chat_jsonl(tmp_path / "chats.jsonl", n=9, seed=2)
    args = ["--target", str(target_dir), "--data", str(chats), "--num-samples", "8", "--samples-per-prompt", "2",
            "--holdout", "1", "--prepare-ahead", "1", *BASE]
    ref = tmp_path / "ref" / "out.jsonl"
    cli.main([*args, "--out", str(ref)])

    out = tmp_path / "multi" / "out.jsonl"
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
    journal = {r: out.with_name(f"out.jsonl.rank{r}-of-2.partial") for r in (0, 1)}
    assert len(_read(journal[1])) == 2 and not out.exists()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key)

    proc = _torchrun([*args, "--out", str(out)], script=str(REPO / "tests" / "_regen_killed_rank.py"),
                     env={"REGEN_KILL_RANK": "0", "REGEN_KILL_AT": "2"})
    assert proc.returncode != 0 and not out.exists(), proc.stderr[-3000:]
    assert "continuing" in proc.stderr and "2 of 16" in proc.stderr  # the shared run saw rank 1's journal
    assert len(_whole_lines(journal[0])) == 2  # rank 0 died before its third
    rank1 = _whole_lines(journal[1]) + _whole_lines(out.with_name("out.jsonl.rank1-of-2.jsonl"))
    assert len(rank1) >= 2  # what rank 1 wrote is kept

    proc = _torchrun([*args, "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "continuing" in proc.stderr
    assert out.read_bytes() == ref.read_bytes()
    assert (out.parent / "out.holdout.jsonl").read_bytes() == (ref.parent / "out.holdout.jsonl").read_bytes()
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.holdout.jsonl", "out.jsonl", "out_report"]


def _chain_workload(path: Path, n: int, seed: int) -> Path:
    """``n`` conversations where those the seeded selection puts at even positions (rank 0's static
    shard under 2 ranks) have 5 user turns and the others one: a static split gives rank 0 five times
    the turns of rank 1."""
    import random

    order = list(range(n))
    random.Random(seed).shuffle(order)
    long = set(order[0::2])
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    rnd = random.Random(seed + 1)
    with open(path, "w") as f:
        for i in range(n):
            turns = []
            for _ in range(5 if i in long else 1):
                turns += [{"from": "human", "value": " ".join(rnd.choice(words) for _ in range(5))},
                          {"from": "gpt", "value": "ok"}]
            f.write(json.dumps({"conversations": turns}) + "\n")
    return path


CHAIN_ARGS = ["--turns", "all", "--after-cut", "continue", "--loops", "keep", "--prepare-ahead", "0", *BASE,
              "--max-new-tokens", "2", "--batch-size", "2"]


def test_ranks_share_an_unbalanced_workload_and_the_scaling_dry_run_rows_it(tmp_path, target_dir):
    """benchmarks/regen.py scaling --cpu runs one process and 2 gloo ranks on a workload where rank 0's
    static shard holds every 5-turn conversation. Through the shared queue both ranks answer a like number
    of turns (the static split: 5 to 1), the two runs write the same bytes, and the appended row's figures
    are those of the two summaries (the rows before it kept)."""
    data = _chain_workload(tmp_path / "chains.jsonl", n=16, seed=0)
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([{"date": "2026-01-01", "commit": "x", "device": "d", "command": "c"}]))
    runs = tmp_path / "runs"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = run_command([sys.executable, str(REPO / "benchmarks" / "regen.py"), "scaling", "--cpu", "--target",
                        str(target_dir), "--data", str(data), "--num-samples", "16", "--gpus", "1,2", "--work",
                        "strong", "--warmup", "2", "--out-dir", str(runs), "--json", str(rows), "--",
                        *CHAIN_ARGS], 600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = runs / "gpus2" / "regen.jsonl"
    assert merged.read_bytes() == (runs / "gpus1" / "regen.jsonl").read_bytes()

    turns = [sum(m["role"] == "assistant" for m in r["messages"]) for r in _read(merged)]  # in selection order
    static = [sum(turns[0::2]), sum(turns[1::2])]
    assert min(static) / max(static) < 0.3  # the workload is as unbalanced as meant
    one, two = (json.loads((runs / f"gpus{g}" / "summary.json").read_text()) for g in (1, 2))
    detail = two["ranks_detail"]
    assert [d["rank"] for d in detail] == [0, 1]
    assert sum(d["conversations"] for d in detail) == two["written"] == 16
    assert sum(d["turns"] for d in detail) == sum(turns) == two["turns"]
    assert sum(d["generated_tokens"] for d in detail) == two["generated_tokens"]
    assert all(d["conversations"] > 0 and d["idle_seconds"] is not None and d["idle_seconds"] >= 0 for d in detail)
    shared = [d["turns"] for d in detail]
    assert min(shared) / max(shared) > 0.5, (shared, static)
    seconds = [d["generate_seconds"] for d in detail]
    assert two["rank_imbalance"] == pytest.approx(max(seconds) / min(seconds), abs=1e-3)
    assert "rank 1: " in proc.stderr  # one line per rank
    assert one["ranks_detail"][0]["conversations"] == 16 and one["rank_imbalance"] == 1.0
    for summary in (one, two):  # no CUDA graph on CPU: nothing captured, the rate over the whole regeneration
        assert summary["capture_seconds"] == 0.0
        assert summary["tokens_per_s_after_capture"] == pytest.approx(
            summary["generated_tokens"] / summary["regenerate_seconds"], rel=1e-3)

    old, row = json.loads(rows.read_text())
    assert old == {"date": "2026-01-01", "commit": "x", "device": "d", "command": "c"}
    assert row["gpus"] == [1, 2] and row["work"] == "strong" and row["device"] == "cpu (dry run)"
    # untimed, not in runs: 2 a rank on the largest GPU count, so every device's compile cache is warm
    assert row["warmup_samples"] == 2 and len(_read(runs / "warmup" / "regen.jsonl")) == 4
    assert json.loads((runs / "warmup" / "summary.json").read_text())["ranks"] == 2
    assert "answered nothing in the warm-up" not in proc.stderr  # the first block is dealt: both ranks warmed
    assert row["scaling_vs_one_gpu"] == {
        "generation": {"1": 1.0, "2": round(two["tokens_per_s_after_capture"] / one["tokens_per_s_after_capture"], 3)},
        "end_to_end": {"1": 1.0, "2": round(two["end_to_end_tokens_per_s"] / one["end_to_end_tokens_per_s"], 3)}}
    assert row["rank_imbalance"] == {"1": one["rank_imbalance"], "2": two["rank_imbalance"]}
    assert [r["generated_tokens"] for r in row["runs"]] == [one["generated_tokens"], two["generated_tokens"]]
    assert [r["ranks_detail"] for r in row["runs"]] == [one["ranks_detail"], two["ranks_detail"]]
    assert row["commit"] and row["date"] and "regen.py scaling" in row["command"]
    assert "| 2 | 16 |" in proc.stdout  # the table


def test_scaling_launches_one_gpu_as_asked():
    """--launcher torchrun starts the one-GPU run as the others start (torchrun, one process); python as a user types it."""
    from nemo_dflash.evaluation.regen_rows import regenerate_command as command

    args = ("t", ["sharegpt"], 8, Path("o.jsonl"), Path("s.json"), ["--turns", "all"], False)
    plain = command(1, *args)
    assert plain[:3] == [sys.executable, "-m", "nemo_dflash.recipes.regenerate"] and plain[-2:] == ["--turns", "all"]
    same = command(1, *args, "torchrun")
    assert same[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node", "1"] and same[-2:] == ["--turns", "all"]
    assert command(2, *args)[4] == "2" == command(2, *args, "torchrun")[4]
    helped = run_command([sys.executable, str(REPO / "benchmarks" / "regen.py"), "scaling", "--help"], 240,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert helped.returncode == 0 and "--launcher {python,torchrun}" in helped.stdout  # the flag that picks it


def test_scaling_leaves_each_runs_compile_and_capture_out_of_generation():
    """Hand-made runs: one GPU spent 48 of its 90 s compiling (a cold cache), two GPUs 10 of 60 s. The
    generation ratio is over the seconds after capture, (2 x 84,000 / 50) / (84,000 / 42) = 1.68; end to end
    keeps the start-up: 2 x 84,000 / 70 over 84,000 / 100 = 2.857."""
    from nemo_dflash.evaluation.regen_rows import scaling

    runs = [{"gpus": 1, "tokens_per_s": 84_000 / 90, "tokens_per_s_after_capture": 84_000 / 42,
             "end_to_end_tokens_per_s": 84_000 / 100},
            {"gpus": 2, "tokens_per_s": 168_000 / 60, "tokens_per_s_after_capture": 168_000 / 50,
             "end_to_end_tokens_per_s": 168_000 / 70}]
    assert scaling(runs) == {"generation": {"1": 1.0, "2": 1.68}, "end_to_end": {"1": 1.0, "2": 2.857}}
    old = [{k: v for k, v in r.items() if k != "tokens_per_s_after_capture"} for r in runs]  # rows made before
    assert scaling(old)["generation"]["2"] == round((168_000 / 60) / (84_000 / 90), 3)


def test_a_resume_on_another_number_of_ranks_is_refused(tmp_path, no_model, monkeypatch, capsys):
    chats = write_chat_jsonl(tmp_path / "chats.jsonl", n=3, seed=2)
    out = tmp_path / "out.jsonl"
    out.with_name("out.jsonl.rank1-of-2.partial").write_text("")
    args = ["--target", "x", "--data", str(chats), "--out", str(out), "--decontaminate", "off"]
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "2 ranks (torchrun --nproc-per-node 2)" in err
    assert "--overwrite" in err

    for key, value in {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "not 3 ranks" in err

    out.with_name("out.jsonl.rank1-of-2.partial").unlink()
    out.with_name("out.jsonl.partial").write_text("")
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "one process (no torchrun)" in err


def test_overwrite_removes_the_journals_of_another_number_of_ranks(tmp_path, cached_target):
    chats = write_chat_jsonl(tmp_path / "chats.jsonl", n=3, seed=2)
    out = tmp_path / "out.jsonl"
    stale = [out.with_name(f"out.jsonl.rank{r}-of-2.{ext}") for r in (0, 1) for ext in ("partial", "jsonl")]
    for p in stale:
        p.write_text('{"source": "elsewhere"}\n')
    s = cli.main(["--target", "x", "--data", str(chats), "--out", str(out), "--overwrite", *BASE])
    assert s["written"] == 3 and not any(p.exists() for p in stale)
    assert s["ranks_detail"][0]["conversations"] == 3 and s["rank_imbalance"] == 1.0


class _CounterStore:
    """A store's atomic add, as the process group's store does it."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}

    def add(self, key: str, amount: int) -> int:
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]


@pytest.mark.parametrize("chunk", [1, 3, 50])
def test_shared_queue_hands_out_each_item_once_in_cross_section_chunks(chunk):
    from nemo_dflash.data.work_queue import SharedQueue

    store, items = _CounterStore(), list(range(10))
    a, b = iter(SharedQueue(store, "k", items, chunk, None, 0, 2)), iter(SharedQueue(store, "k", items, chunk, None, 1, 2))
    got: dict[str, list[int]] = {"a": [], "b": []}
    live = {"a": a, "b": b}
    while live:  # a takes two for each one b takes
        for name in ("a", "a", "b"):
            if name not in live:
                continue
            try:
                got[name].append(next(live[name]))
            except StopIteration:
                live.pop(name, None)
    assert sorted(got["a"] + got["b"]) == items
    n_chunks = -(-10 // chunk)  # chunk k: items k, k + n_chunks, ... (hand-made: 10 items, chunk 3 -> 4 chunks)
    want_chunks = [[i for i in items if i % n_chunks == k] for k in range(n_chunks)]
    if chunk == 3:
        assert want_chunks == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]
    for name in got:  # each rank's claims are whole chunks, taken in chunk order
        rest, mine = list(got[name]), []
        while rest:
            c = next(c for c in want_chunks if c[0] == rest[0])
            assert rest[:len(c)] == c
            mine.append(want_chunks.index(c))
            rest = rest[len(c):]
        assert mine == sorted(mine)
    assert got["a"] and (chunk >= 10 or got["b"])


@pytest.mark.parametrize("block", [None, 24])
def test_a_rank_that_starts_first_does_not_take_the_head_of_a_longest_first_queue(block):
    """A longest-first list (weights 1000 down to 1) and four ranks whose engines fill 96 items before
    asking again: rank 0 fills while the others are still loading, then all take turns. Each rank's first
    fill must hold about a quarter of the weight of all four fills (runs of the list give rank 0 the 96
    heaviest: 1.18x the mean). With blocks of all four fills (24 chunks of 16), the first fills are
    exactly the first block, so the list is still started longest first, block by block."""
    from nemo_dflash.data.work_queue import SharedQueue, queue_block

    weights = list(range(1000, 0, -1))
    store = _CounterStore()
    ranks = [iter(SharedQueue(store, "k", weights, 16, block, r, 4)) for r in range(4)]
    fills = [[next(r) for _ in range(96)] for r in ranks]  # rank 0 first, then 1, 2, 3
    mean = sum(map(sum, fills)) / 4
    assert all(abs(sum(f) - mean) / mean < 0.05 for f in fills), [sum(f) / mean for f in fills]
    assert max(fills[0]) == 1000  # the longest chain still starts first
    runs = [iter(SharedQueue(_CounterStore(), "k", weights, 16, 1))] * 4  # blocks of one chunk: runs of the list
    run_fills = [[next(runs[0]) for _ in range(96)] for _ in range(4)]
    run_mean = sum(map(sum, run_fills)) / 4
    assert run_fills[0] == weights[:96] and sum(run_fills[0]) / run_mean > 1.15  # the head to the first rank
    if block is not None:
        assert queue_block(4 * 96, 16) == block
        assert sorted(x for f in fills for x in f) == weights[:384][::-1]  # the first fills are the first block
        rest = [x for r in ranks for x in r]  # the others, all handed out once
        assert sorted(rest + [x for f in fills for x in f]) == sorted(weights)


@pytest.mark.parametrize("n", [256, 1000])
def test_the_first_block_is_dealt_to_every_rank_whoever_starts_first(n):
    """Two ranks, blocks of 2 x 1,366 items (the engine's first fills, chunks of 16): rank 0 drains the queue
    before rank 1 asks. Rank 1 still gets its half of the first block (chunks 1, 3, ...): a 256-item warm-up is
    split 128 / 128, where claims gave rank 0 all 256; past the first block rank 0 takes what it reaches first."""
    from nemo_dflash.data.work_queue import SharedQueue, queue_block

    store, items = _CounterStore(), list(range(n))
    block = queue_block(2 * 1366, 16)
    early = list(SharedQueue(store, "k", items, 16, block, 0, 2))  # rank 0 runs to the end first
    late = list(SharedQueue(store, "k", items, 16, block, 1, 2))
    assert sorted(early + late) == items
    first = min(n, block * 16)
    assert len(late) == len([x for x in range(first) if (x % -(-first // 16)) % 2 == 1])  # its chunks of block 0
    assert abs(len(late) - first / 2) <= 16
    claimed = SharedQueue(_CounterStore(), "k", items, 16, 1, 0, 2)  # a first block of one chunk: the rest claimed
    assert sorted(claimed) == items  # one rank alone drains every block it can claim


@pytest.mark.parametrize("n,chunk,block", [(10, 3, 2), (37, 4, 3), (5, 16, 1), (48, 4, 4)])
def test_blocked_cross_sections_by_hand(n, chunk, block):
    """chunk_items against a naive construction: cut the list into blocks of block x chunk items, deal
    each block's items round robin over its ceil(size / chunk) chunks."""
    from nemo_dflash.data.work_queue import SharedQueue

    items = list(range(n))
    want = []
    for start in range(0, n, block * chunk):
        part = items[start:start + block * chunk]
        g = -(-len(part) // chunk)
        dealt = [[] for _ in range(g)]
        for i, x in enumerate(part):
            dealt[i % g].append(x)
        want += dealt + [None] * (block - g)
    q = SharedQueue(_CounterStore(), "k", items, chunk, block)
    got = [q.chunk_items(k) for k in range(len(want))]
    assert got == want
    assert q.chunk_items(len(want)) is None
    assert all(c is None or len(c) <= chunk for c in got)
    if (n, chunk, block) == (10, 3, 2):  # by hand: blocks [0..5], [6..9]; 2 chunks each
        assert got == [[0, 2, 4], [1, 3, 5], [6, 8], [7, 9]]


def test_a_second_call_in_one_store_starts_its_queue_at_the_first_item():
    """torchrun's store outlives a process group: a later regenerate call (or an elastic restart) in the same
    launch gets a fresh prefix, so its queue hands out every item again, not only those past the old counter."""
    from nemo_dflash.data.work_queue import SharedQueue, call_prefix

    store, items = _CounterStore(), list(range(5))
    first = [call_prefix(store, 2) for _ in range(2)]  # both ranks of the first call
    assert first[0] == first[1] and sorted(SharedQueue(store, first[0] + "next", items, 2)) == items
    second = [call_prefix(store, 2) for _ in range(2)]
    assert second[0] == second[1] != first[0]
    assert sorted(SharedQueue(store, second[0] + "next", items, 2)) == items


def test_samples_of_a_thinking_mode_copy_keep_its_mode():
    from nemo_dflash.data import Conversation

    copies = selection.with_samples([Conversation([{"role": "user", "content": "hi"}], "f:1#reasoning=on", "on")], 3)
    assert [c.location for c in copies] == ["f:1#reasoning=on", "f:1#reasoning=on#1", "f:1#reasoning=on#2"]
    assert [c.reasoning for c in copies] == ["on", "on", "on"]


def test_decontamination_on_forked_workers_flags_the_one_process_conversations():
    """`contaminated` over 3 blocks of 4,096 on 2 forked workers: the flags of the plain loop, in order
    (planted prompts at the start, across a block boundary and at the end)."""
    from nemo_dflash.data import Conversation, decontaminate
    from nemo_dflash.data.selection import contaminated

    evals = ["Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
             "experiences and must-see attractions."]
    index = decontaminate.ContaminationIndex(evals, name="planted prompts")
    planted = {0, 4095, 4096, 9000, 10_239}
    convs = [Conversation([{"role": "user", "content": ("Hi! " + evals[0]) if i in planted else f"question {i} about cats"},
                           {"role": "assistant", "content": evals[0]}], f"f:{i}")  # answers are not checked
             for i in range(10_240)]
    want = [index.conversation_hits(c.messages, ("system", "user")) for c in convs]
    assert {i for i, hit in enumerate(want) if hit} == planted
    assert contaminated(convs, index, workers=2) == want
    assert contaminated(convs, index, workers=1) == want
