"""Regeneration's rows (`evaluation.regen_rows`, written by benchmarks/regen.py): the summary row's per-GPU rates
and the data report's per-source figures; `regen.py throughput`'s rows, the script run as a command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from nemo_dflash.evaluation.regen_rows import regen_summary_row as row

REGEN = Path(__file__).resolve().parent.parent / "benchmarks" / "regen.py"


def _throughput(argv: list[str]) -> None:
    """`python benchmarks/regen.py throughput ARGV`, in a process of its own (one torch thread)."""
    import os

    res = subprocess.run([sys.executable, str(REGEN), "throughput", *argv], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]


def test_row_per_gpu_rates_and_report_figures():
    summary = {"sources": [{"name": "a", "conversations": 3, "turns": 5, "supervised_tokens": 700},
                           {"name": "b", "conversations": 1, "turns": 1, "supervised_tokens": 50}],
               "decontamination": {"checked": 4, "dropped": 0}, "end_to_end_tokens_per_s": 4000.0, "ranks": 4,
               "written": 4, "generated_tokens": 740, "wall_seconds": 10.0, "regenerate_seconds": 8.0,
               "tokens_per_s": 6000.0, "samples_per_prompt": 2, "data_sources": [], "rank_imbalance": 1.1}
    extra = {"unique_13gram_share": 0.9, "loop_cut_share": 0.0, "answer_length_mean": 140.0,
             "answer_length_percentiles": {"p50": 120}}
    report = {"sources": [{"name": "a", **extra}],
              "all": {"conversations": 4, "turns": 6, "supervised_tokens": 750, **extra}}
    r = row(summary, "4x GPU", "cmd", report)
    assert (r["tokens_per_s"], r["end_to_end_tokens_per_s"], r["world"]) == (1500.0, 1000.0, 4)
    by = {s["name"]: s for s in r["sources"]}
    assert by["a"]["unique_13gram_share"] == 0.9 and by["a"]["supervised_tokens"] == 700
    assert "unique_13gram_share" not in by["b"]  # no report row for it: nothing invented
    assert by["all"]["supervised_tokens"] == 750
    assert row(summary, "4x GPU", "cmd")["sources"] == summary["sources"]


def test_throughput_engine_and_generate_rows(tmp_path):
    """regen.py throughput on random SmolLM2-shaped weights, CPU, T=0: the decoding engine (what `regenerate --engine
    continuous` runs) and batched model.generate answer the same prompts (the same new tokens), and each row says where
    it was measured. The engine's mode is asked for by its old name, `slots`, which the recorded commands use: it
    runs as `continuous`."""
    out = tmp_path / "t.json"
    _throughput(["--random-shape", "smollm2", "--num-prompts", "5", "--batch-size", "2",
                           "--max-new-tokens", "3", "--max-prompt-tokens", "24", "--temperature", "0",
                           "--modes", "slots,generate", "--fold-gqa", "1", "--filled-blocks", "0",
                           "--decode-window", "2", "--refill-fraction", "2", "--profile-engine", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["continuous", "generate"]
    assert rows[0]["tokens"] == rows[1]["tokens"] and rows[0]["fold_gqa"] is True and rows[0]["filled_blocks"] is False
    # --profile-engine: the first 2 prompts entering together, the other 3 entering freed rows (once 1 of the 2 rows
    # is free, those freed at one step together), one window of 2 steps a prompt after its prefill's token
    phases = rows[0]["phases"]
    assert rows[0]["refill_rows"] == 1 and rows[0]["window"] == 2
    assert 2 <= phases["engine.enter"]["count"] <= 4, phases
    assert 1 <= phases["engine.step"]["count"] <= 5, phases
    for r in rows:
        assert {"date", "commit", "device", "command"} <= set(r) and r["what"] == f"regen.py throughput {r['mode']}"
        assert r["tokens_per_s"] == r["tokens"] / r["seconds"] and r["world"] == 1  # one process, one device


def test_throughput_openai_mode_times_the_servers_answers(tmp_path):
    """regen.py throughput --modes openai: whole conversations answered by a real HTTP server on 127.0.0.1
    (tests/_openai_server.py); the warm-up asks conversations the timed run never asks, and the row's tokens are
    the server's usage.completion_tokens of the timed answers (each recomputed from its request)."""
    from _openai_server import OpenAIServer, echo_responder
    from _tiny_target import make_tiny_target_dir

    from nemo_dflash.target.loading import load_tokenizer

    target = make_tiny_target_dir(tmp_path / "target")
    chats = tmp_path / "chats.jsonl"
    with open(chats, "w") as f:
        for i in range(7):
            turns = [m for t in range(1 + i % 2) for m in ({"role": "user", "content": f"question {i}.{t}"},
                                                           {"role": "assistant", "content": "old"})]
            f.write(json.dumps({"messages": turns}) + "\n")
    respond = echo_responder(load_tokenizer(str(target)))
    out = tmp_path / "t.json"
    with OpenAIServer(respond) as server:
        _throughput(["--target", str(target), "--prompts", str(chats), "--turns", "all", "--num-prompts",
                               "3", "--batch-size", "2", "--max-new-tokens", "12", "--max-prompt-tokens", "64",
                               "--temperature", "0", "--threads", "1", "--endpoint", server.url, "--modes", "openai",
                               "--json", str(out)])
    (r,) = json.loads(out.read_text())["rows"]
    _, *asked = server.bodies  # the one-token check, then the warm-up's and the timed run's answers
    warm = [b for b in asked if b["max_tokens"] == 8]
    timed = [b for b in asked if b["max_tokens"] == 12]
    assert len(warm) + len(timed) == len(asked) and warm and timed
    first_user = lambda b: next(m["content"] for m in b["messages"] if m["role"] == "user")  # noqa: E731
    assert {first_user(b) for b in timed} == {"question 0.0", "question 1.0", "question 2.0"}
    assert not {first_user(b) for b in warm} & {first_user(b) for b in timed}
    assert r["mode"] == "openai" and r["turns"] == len(timed) == 1 + 2 + 1 and r["conversations"] == 3
    assert r["tokens"] == sum(respond(b)["completion_tokens"] for b in timed)
    assert r["server"]["server_token_ids"] == len(timed) and r["device"].endswith("CPU")
