"""The demo's CPU decisions, its held-out acceptance and its closing report (the pieces `main` composes).

The held-out acceptance (replay of the target's greedy answers, generated once) is checked against
the one-at-a-time speculative decoder on a tiny random fp32 target, before and after the draft learns.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import shutil

import pytest
import torch
from transformers import AutoTokenizer

from nemo_dflash.engine.sampling import GREEDY
from nemo_dflash.evaluation.protocol import evaluate_acceptance
from nemo_dflash.evaluation.replay import ReplayEvaluator
from nemo_dflash.recipes import demo
from nemo_dflash.train import device as train_device

from _spec_fixtures import make_draft, qwen_tokenizer_files
from test_eval_replay import BLOCK, QWEN3_MASK_ID, make_target, prompts, train_draft


def test_probe_picks_the_fastest_threads_and_dtype(monkeypatch):
    seconds = {(1, "bf16"): 0.015, (1, "fp32"): 0.012, (2, "bf16"): 0.140, (2, "fp32"): 0.139}
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(train_device, "_probe_seconds",
                        lambda threads, dtype: seconds[(threads, "bf16" if "bfloat16" in str(dtype) else "fp32")])
    threads, dtype, table = demo.pick_cpu_settings(None, "auto")
    assert (threads, dtype) == (1, "fp32")
    assert table == {"1 thread(s) bf16": 15.0, "1 thread(s) fp32": 12.0, "2 thread(s) bf16": 140.0,
                     "2 thread(s) fp32": 139.0}
    # an idle machine with fast bf16: two threads, bf16
    seconds.update({(2, "bf16"): 0.004})
    assert demo.pick_cpu_settings(None, "auto")[:2] == (2, "bf16")
    # given values are kept (only they are timed)
    assert demo.pick_cpu_settings(2, "fp32")[:2] == (2, "fp32")
    assert list(demo.pick_cpu_settings(1, "bf16")[2]) == ["1 thread(s) bf16"]


def test_the_real_probe_times_something():
    assert 0 < demo._probe_seconds(1, torch.float32, reps=1) < 10


def test_training_gets_the_budget_left_after_one_more_evaluation():
    # 11-minute budget, 4.0 spent (regeneration and the first evaluation), the first evaluation took 1.5
    assert demo.train_minutes_left(11.0, 4.0, 1.5) == pytest.approx(11.0 - 4.0 - 1.5 - demo.EVAL_RESERVE_MIN)


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--budget-minutes", "0"], ["--train-minutes", "-1"],
                                  ["--num-conversations", "0"]])
def test_bad_sizes_are_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        demo.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and argv[0] in err[0]


def test_cpu_sizes_fill_only_what_is_unset():
    args = demo.parse_args(["--device", "cpu", "--budget-minutes", "9", "--num-conversations", "64"])
    device, sizes = demo.resolve_sizes(args)
    assert device == "cpu" and sizes["budget_minutes"] == 9 and sizes["num_conversations"] == 64
    assert sizes["max_new_tokens"] == demo.QUICK.max_new_tokens  # answers as long as the evaluation decodes
    assert sizes["train_minutes"] is None  # fitted into the budget


def _metrics(run: Path) -> None:
    rows = [{"step": 0, "eval_accept_len": 1.0}, {"step": 5, "loss": 9.0, "tokens": 10, "accept_len": 1.0},
            {"step": 25, "eval_accept_len": 1.0625}, {"step": 40, "eval_accept_len": 1.25, "tokens": 99}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_names_existing_outputs_the_curve_and_the_table(tmp_path):
    run = tmp_path / "run"
    (run / "final" / "draft").mkdir(parents=True)
    _metrics(run)
    (run / "curves.png").write_bytes(b"png")
    result = {
        "device": "cpu", "cpu": {"threads": 1, "dtype": "fp32"},
        "acceptance_before": {"mt_bench": 1.0, "humaneval": 1.0},
        "acceptance_after": {"mt_bench": 1.1, "humaneval": 1.5},
        "timings": {"total_s": 600, "regenerate_s": 120, "train_s": 240, "eval_greedy_s": 30, "eval_before_s": 12,
                    "eval_after_s": 12},
        "train": {"steps": 40, "tokens_seen": 1000, "eval_accept_len": 1.25, "final_draft": str(run / "final" / "draft"),
                  "data": {"train_samples": 200, "supervised_tokens": 9000}},
    }
    cfg = SimpleNamespace(draft=SimpleNamespace(num_layers=2, block_size=4))
    text = demo.report(result, cfg, tmp_path, {"mt_bench": [0] * 8, "humaneval": [0] * 8}, 64)
    assert f"curves (PNG)      {run / 'curves.png'}" in text
    assert f"trained draft     {run / 'final' / 'draft'}" in text
    assert "run config" not in text and "regenerated data" not in text  # not written: not named
    assert "held-out simulated acceptance by step: 0:1.00 25:1.06 40:1.25" in text
    assert "humaneval      1.00    1.50  1.50x" in text
    assert text.splitlines()[-1].endswith("block 4): before 1.00 -> after 1.30 (1.30x)")
    assert "8 prompts per benchmark, up to 64 new tokens, 1 turn, T=0" in text.splitlines()[-1]
    assert "10.0 min on cpu, 1 thread(s), fp32 (regenerate 2.0, train 4.0, evaluate 0.9)" in text
    assert "(T=0 speculative decoding, by replay; 8 prompts per benchmark" in text.splitlines()[-1]


def test_threads_are_probed_again_before_a_phase_unless_given(monkeypatch):
    calls = []
    monkeypatch.setattr(train_device, "pick_cpu_settings", lambda threads, dtype: calls.append((threads, dtype)) or (1, dtype, {}))
    cpu = {"threads": 2, "dtype": "fp32"}
    demo.refresh_threads(cpu, "train", None)
    assert calls == [(None, "fp32")] and cpu["threads_by_phase"] == {"train": 1}  # the dtype is kept
    demo.refresh_threads(cpu, "eval_after", 2)  # --threads given: never re-probed
    demo.refresh_threads({}, "train", None)  # GPU run: nothing to probe
    assert len(calls) == 1


@pytest.fixture
def tokenizer(tmp_path):
    for f in qwen_tokenizer_files().iterdir():
        shutil.copy(f, tmp_path / f.name)
    return AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)


def test_held_out_acceptance_is_the_sequential_decoders_and_generates_once(tokenizer, monkeypatch):
    """Reference: `evaluate_acceptance` (the one-at-a-time speculative decoder the demo used before),
    in fp32, on the same prompts: equal before training (an untrained draft) and after (the same draft
    trained on the target's answers), while the target's greedy answers are generated only once."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _held_out_acceptance_case(tokenizer, monkeypatch)
    finally:
        torch.set_num_threads(threads)


def _held_out_acceptance_case(tokenizer, monkeypatch) -> None:
    target = make_target("llama", tokenizer)
    draft = make_draft(target, num_layers=1, block_size=BLOCK, mask_token_id=QWEN3_MASK_ID, layer_ids=[0, 1])
    items = prompts()
    sets = {"mt_bench": items[:3], "other": items[3:]}
    generated = []
    greedy_answers = ReplayEvaluator.greedy_answers
    monkeypatch.setattr(ReplayEvaluator, "greedy_answers",
                        lambda self, ps: generated.append(len(ps)) or greedy_answers(self, ps))
    acceptance = demo.HeldOutAcceptance(sets, max_new_tokens=24)

    def sequential() -> dict[str, float]:
        return {name: evaluate_acceptance(target, tokenizer, draft, ps, max_new_tokens=24, warmup=False)[
            "mean_acceptance_length"] for name, ps in sets.items()}

    draft.train()
    before = acceptance(target, tokenizer, draft)
    assert draft.training  # the draft's mode is given back, as a training loop expects
    assert before == sequential()
    assert generated == [len(items)] and acceptance.greedy_s > 0  # both sets in one batch
    # the draft learns the target's answers (as the demo's training does between the two evaluations)
    pairs = [(g.prompt_ids, g.output_ids + g.beyond) for name in sets for g in acceptance.greedy[name]]
    train_draft(target, draft, pairs)
    after = acceptance(target, tokenizer, draft)
    assert generated == [len(items)]  # the same greedy answers, replayed along the trained draft
    assert after == sequential()
    assert all(after[name] > before[name] for name in sets), (before, after)  # the check can fail


def test_gpu_report_gives_tau_and_speedup_with_the_protocol(tmp_path):
    result = {
        "device": "cuda", "cpu": {},
        "acceptance_before": {"mt_bench": 1.0, "humaneval": 1.0},
        "acceptance_after": {"mt_bench": 1.5, "humaneval": 1.5},
        "timings": {"total_s": 420, "regenerate_s": 80, "train_s": 220, "eval_greedy_s": 10, "eval_before_s": 5,
                    "eval_after_s": 3, "speedup_s": 42},
        "train": {"steps": 500, "tokens_seen": 10**7, "final_draft": str(tmp_path)},
        "speedup": {"mtbench": {"mean_acceptance_length": 1.45, "speedup": 0.9393,
                                "per_prompt_speedup": {"median": 0.95}}},
    }
    result["train"]["data"] = {"train_samples": 10, "supervised_tokens": 100}
    cfg = SimpleNamespace(draft=SimpleNamespace(num_layers=5, block_size=16))
    text = demo.report(result, cfg, tmp_path, {"mt_bench": [0] * 8, "humaneval": [0] * 8}, 64)
    assert ("mtbench     tau 1.45, speedup 0.94x (median prompt 0.95x; T=0, 1 turn, up to 64 new tokens, "
            "CUDA graphs on both sides, batch 1)") in text
    assert "7.0 min on cuda (regenerate 1.3, train 3.7, evaluate 1.0)" in text  # the timed decodes included


def test_timed_speedup_runs_evaluate_on_the_run_and_reads_its_results(tmp_path, monkeypatch):
    """The GPU demo's speedup is `evaluate`'s, on the demo's run dir, at the demo's protocol."""
    from nemo_dflash.recipes import evaluate

    seen = {}

    def fake_main(argv):
        seen["argv"] = argv
        out = tmp_path / "eval"
        out.mkdir()
        r = {"mean_acceptance_length": 1.5, "speedup": 1.1, "per_prompt_speedup": {"median": 1.0}, "ar": {}}
        (out / "results.json").write_text(json.dumps({"speedup": {"0": {"mtbench": r, "humaneval": r}}}))
        return 0

    monkeypatch.setattr(evaluate, "main", fake_main)
    speed = demo.timed_speedup(tmp_path, 8, 64)
    argv = seen["argv"]
    flag = lambda name: argv[argv.index(name) + 1]  # noqa: E731
    assert flag("--draft") == str(tmp_path / "run") and flag("--decode") == "graphs"
    assert flag("--temperatures") == "0" and flag("--num-prompts") == flag("--speedup-prompts") == "8"
    assert flag("--max-new-tokens") == "64" and "--overwrite" in argv
    assert speed == {n: {"mean_acceptance_length": 1.5, "speedup": 1.1, "per_prompt_speedup": {"median": 1.0}}
                     for n in ("mtbench", "humaneval")}


def test_replay_hands_the_cuda_graph_choice_to_its_engine(tokenizer):
    """The GPU demo replays with eager modules, whose uncompiled flex_attention a CUDA graph cannot
    capture: it asks for no graph rather than a failed capture and a warning."""
    from nemo_dflash.evaluation.protocol import EvalSettings

    target = make_target("llama", tokenizer)
    draft = make_draft(target, num_layers=1, block_size=BLOCK, mask_token_id=QWEN3_MASK_ID, layer_ids=[0, 1])
    settings = EvalSettings(max_new_tokens=8, sampling=GREEDY, turns=1, warmup=False)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):  # asked for, on a CPU: refused
        ReplayEvaluator(target, tokenizer, draft, settings, cuda_graph=True).greedy_answers(prompts()[:1])
    assert ReplayEvaluator(target, tokenizer, draft, settings, cuda_graph=False).greedy_answers(prompts()[:1])
    assert demo.HeldOutAcceptance({}, 8, eager=True).cuda_graph is False
    assert demo.HeldOutAcceptance({}, 8).cuda_graph is None
