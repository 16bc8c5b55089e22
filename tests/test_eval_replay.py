"""T=0 acceptance by replay equals the sequential speculative decoder's, answer by answer.

Reference: `ConversationDecoder` (one prompt at a time, the decoder the speedup is timed with) on
tiny random Llama- and Qwen3-shaped targets in fp32, with a draft trained for a few seconds on
the targets' own answers, so that blocks accept 1..B tokens; answers of different lengths, stops
inside an accepted block, the token cap inside a block, one and two turns. A perturbed walk must
be caught.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from nemo_dflash.engine.sampling import GREEDY, SamplingParams
from nemo_dflash.objective.anchors import sample_anchors
from nemo_dflash.objective.trainer_module import draft_block_hidden
from nemo_dflash.evaluation import replay
from nemo_dflash.evaluation.protocol import ConversationDecoder, EvalPrompt, EvalSettings, load_mtbench
from nemo_dflash.evaluation.replay import ReplayEvaluator, walk
from nemo_dflash.target import HFDFlashTargetModel

from _spec_fixtures import QWEN3_MASK_ID, make_draft, qwen_tokenizer_files, tiny_llama, tiny_qwen3
from _spec_fixtures import single_thread  # noqa: F401 (an autouse fixture, applied by importing it)

BLOCK = 4
MAX_NEW = 24


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    for f in qwen_tokenizer_files().iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)


def sharp(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    """Scaled random weights: varied greedy answers instead of one repeated token."""
    with torch.no_grad():
        for name, w in model.named_parameters():
            if "norm" not in name:
                w.mul_(scale)
    return model


def make_target(kind: str, tokenizer) -> torch.nn.Module:
    if kind == "qwen3":
        model = sharp(tiny_qwen3(num_layers=2, vocab=151936, hidden=32, seed=4), 10.0)
    else:
        model = sharp(tiny_llama(num_layers=2, vocab=151936, seed=4), 3.0)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return model


def train_draft(target, draft, sequences: list[tuple[list[int], list[int]]], steps: int = 120) -> float:
    """A few seconds of DFlash training on (prompt, answer) pairs: the training forward
    (`objective.trainer_module.draft_block_hidden`), the CE restricted to the tokens that occur (the 151936-row head
    would cost seconds per step). Returns the last step's accuracy."""
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    width = max(len(p) + len(a) for p, a in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    attn, loss_mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, a) in enumerate(sequences):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        attn[i, : len(p) + len(a)] = 1
        loss_mask[i, len(p): len(p) + len(a)] = 1
    feats = wrapper.generate_batch(ids, attn, loss_mask, right_padded=True).hidden_states
    cand = torch.unique(ids)
    head = wrapper.get_output_embeddings().weight[cand].detach()
    remap = torch.full((151936,), -100, dtype=torch.long)
    remap[cand] = torch.arange(len(cand))
    embed = wrapper.get_input_embeddings()
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    draft.train()
    acc = 0.0
    for _ in range(steps):
        anchors, valid = sample_anchors(loss_mask, attn, BLOCK, 16, g)
        hidden = draft_block_hidden(draft, embed, ids, feats, attn, anchors, valid, BLOCK, QWEN3_MASK_ID)
        pos = (anchors.unsqueeze(-1) + torch.arange(BLOCK)).clamp(max=width - 1)
        labels = remap[ids.gather(1, pos.flatten(1)).view_as(pos)]
        ok = valid.unsqueeze(-1) & loss_mask.gather(1, pos.flatten(1)).view_as(pos).bool()
        ok[..., 0] = False
        logits = hidden.view(*pos.shape, -1) @ head.T
        loss = torch.nn.functional.cross_entropy(logits[ok], labels[ok])
        loss.backward()
        opt.step()
        opt.zero_grad()
        acc = float((logits[ok].argmax(-1) == labels[ok]).float().mean())
    draft.eval()
    return acc


def prompts() -> list[EvalPrompt]:
    return load_mtbench(3) + [
        EvalPrompt(turns=["Name three rivers."], id="one-turn"),
        EvalPrompt(turns=[], id="messages", messages=[{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": "Count to five."}]),
    ]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def case(request, tokenizer):
    return build_case(request.param, tokenizer)


def build_case(kind: str, tokenizer):
    """(target, draft, settings): the draft trained on the target's greedy answers, and a second
    stop token that occurs inside answers (so some end mid-block)."""
    target = make_target(kind, tokenizer)
    draft = make_draft(target, num_layers=1, block_size=BLOCK, mask_token_id=QWEN3_MASK_ID, layer_ids=[0, 1])
    settings = EvalSettings(max_new_tokens=MAX_NEW, sampling=GREEDY, turns=2, warmup=False)
    greedy = ReplayEvaluator(target, tokenizer, draft, settings).greedy_answers(prompts())
    train_draft(target, draft, [(g.prompt_ids, g.output_ids + g.beyond) for g in greedy.values()])
    # a token that several answers hold mid-way becomes a stop token: those answers end early
    counts: dict[int, int] = {}
    for g in greedy.values():
        for tok in set(g.output_ids[6:18]):
            counts[tok] = counts.get(tok, 0) + 1
    stop = max(counts, key=lambda t: (counts[t], -t))
    target.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids("<|im_end|>"), stop]
    return target, draft, settings


def sequential(target, tokenizer, draft, settings, items):
    dec = ConversationDecoder(target, tokenizer, draft, settings)
    return [dec.run(p) for p in items]


@pytest.fixture(scope="module")
def reference(case, tokenizer):
    """The sequential decoder's answers to prompts() on the case (read only): decoded once for the tests that
    compare a replay of the same prompts with them."""
    target, draft, settings = case
    return sequential(target, tokenizer, draft, settings, prompts())


def replayed(target, tokenizer, draft, settings, items):
    return [answers for _, answers in ReplayEvaluator(target, tokenizer, draft, settings).run(items)]


def _fields(a):
    return (a.id, a.turn, a.output_ids, a.acceptance_lengths, a.stopped, a.loop_start, a.prompt_ids)


def test_replay_equals_sequential(case, tokenizer, reference):
    target, draft, settings = case
    items, ref = prompts(), reference
    got = replayed(target, tokenizer, draft, settings, items)
    assert [[_fields(a) for a in conv] for conv in got] == [[_fields(a) for a in conv] for conv in ref]
    answers = [a for conv in ref for a in conv]
    steps = [s for a in answers for s in a.acceptance_lengths]
    # the check can fail: blocks accept 1..B, answers differ in length, both turns are decoded,
    # a stop token and the cap each fall inside an accepted block (tokens cut after them)
    assert {1, BLOCK} <= set(steps), steps
    assert len({len(a.output_ids) for a in answers}) >= 3
    assert {1, 2} <= {a.turn for a in answers}
    cut = [a for a in answers if 1 + sum(a.acceptance_lengths) > len(a.output_ids)]
    assert any(a.stopped for a in cut) and any(not a.stopped and len(a.output_ids) == MAX_NEW for a in cut)


def test_smaller_block_than_trained(case, tokenizer):
    """--block-size below the draft's trained block: both decoders draft B-1 = 2 tokens."""
    target, draft, settings = case
    s = EvalSettings(max_new_tokens=17, sampling=GREEDY, turns=1, warmup=False, block_size=3)
    items = prompts()[:3]
    got = replayed(target, tokenizer, draft, s, items)
    assert [[_fields(a) for a in c] for c in got] == [[_fields(a) for a in c]
                                                       for c in sequential(target, tokenizer, draft, s, items)]
    assert max(x for c in got for a in c for x in a.acceptance_lengths) == 3


@pytest.mark.parametrize("how", ["anchor_shift", "kept_length", "no_continuation", "context_leak"])
def test_a_perturbed_replay_is_caught(case, tokenizer, reference, monkeypatch, how):
    """Each perturbation of the walk or the draft forward changes some answer's figures (or fails)."""
    target, draft, settings = case
    items, ref = prompts(), reference
    if how == "anchor_shift":  # the block drafted from the next anchor
        real = ReplayEvaluator.draft_tokens
        monkeypatch.setattr(ReplayEvaluator, "draft_tokens", lambda self, t: real(self, t)[1:] + [[]])
    elif how == "kept_length":  # record the tokens kept after a stop / the cap, not the step's length
        real_walk = replay.walk

        def kept(output_ids, beyond, drafts, stops, max_new_tokens):
            lens = real_walk(output_ids, beyond, drafts, stops, max_new_tokens)
            if lens:
                lens[-1] -= 1 + sum(lens) - len(output_ids)
            return lens

        monkeypatch.setattr(replay, "walk", kept)
    elif how == "no_continuation":  # the greedy tokens past the answer's end left out
        real_cont = ReplayEvaluator._continue

        def bare(self, raw):
            out = real_cont(self, raw)
            for g in out.values():
                g.beyond = []
            return out

        monkeypatch.setattr(ReplayEvaluator, "_continue", bare)
    else:  # context up to and including the anchor (the known leak)
        real_hidden = replay.draft_block_hidden

        def leak(draft_, embed, ids, feats, key_valid, anchors, *args, **kw):
            return real_hidden(draft_, embed, torch.cat([ids, ids[:, -1:]], 1), torch.cat([feats, feats[:, -1:]], 1),
                               torch.cat([key_valid, key_valid[:, -1:]], 1), anchors + 1, *args, **kw)

        monkeypatch.setattr(replay, "draft_block_hidden", leak)
    try:
        got = replayed(target, tokenizer, draft, settings, items)
    except (RuntimeError, IndexError):
        return  # the walk refused to rebuild the answer: caught
    assert [[_fields(a) for a in c] for c in got] != [[_fields(a) for a in c] for c in ref]


def test_walk_hand_computed():
    """Output [10, 11, 12, 2, ...]: 2 is a stop token; block 4 (3 drafted tokens per step)."""
    out, beyond = [10, 11, 12, 2], [13, 14, 15]
    drafts = [[11, 12, 2], [99, 99, 99], [2, 13, 99]]  # anchor 0: all three right
    # step from anchor 0 accepts 3 drafts + bonus 13 (past the stop): 4 tokens, 3 kept
    assert walk(out, beyond, drafts, {2}, 100) == [4]
    drafts = [[11, 99, 99], [99, 99, 99], [2, 13, 99]]
    # anchor 0: 11 right -> 2 tokens (11, 12); anchor 2: 2 and 13 right, bonus 14 -> 3 tokens, stop kept
    assert walk(out, beyond, drafts, {2}, 100) == [2, 3]
    # the cap: 3 tokens at most; anchor 0 yields 11, 12 (2 tokens) and the run ends at the cap
    assert walk(out[:3], [2, 13, 14], drafts, {2}, 3) == [2]
    assert walk([2], [5, 6], [], {2}, 100) == []  # the prefill's token is a stop token: no step
    with pytest.raises(RuntimeError):  # the last step needs greedy tokens past those given
        walk([10, 11, 5], [], [[11, 5, 9], [9, 9, 9]], {2}, 100)


# ----------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def saved(tokenizer_dir, tokenizer, tmp_path_factory):
    """The trained Qwen3-shaped case on disk: (target dir, exported draft dir)."""
    from nemo_dflash.serving.export import export_draft

    target, draft, _ = build_case("qwen3", tokenizer)
    out = tmp_path_factory.mktemp("saved")
    target_dir = out / "target"
    target.save_pretrained(target_dir)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, target_dir / f.name)
    return target_dir, export_draft(draft, out / "draft")


def _cli(saved, out, *extra):
    from nemo_dflash.recipes import evaluate as evaluate_cmd

    target_dir, draft_dir = saved
    return evaluate_cmd.main(["--draft", str(draft_dir), "--target", str(target_dir), "--out", str(out),
                              "--device", "cpu", "--dtype", "fp32", "--threads", "1", *extra])


ARGS = ["--protocol", "quick", "--datasets", "mtbench,humaneval", "--num-prompts", "3", "--max-new-tokens",
        str(MAX_NEW), "--turns", "2", "--temperatures", "0", "--no-speedup"]


def test_cli_replay_equals_sequential_and_resumes(saved, tmp_path, capsys):
    assert _cli(saved, tmp_path / "seq", *ARGS) == 0
    assert _cli(saved, tmp_path / "rep", *ARGS, "--method", "replay") == 0
    printed = capsys.readouterr().out
    assert "method replay" in printed and f"quick: {MAX_NEW} tok, 2 turns, T=0, B={BLOCK}, eager, replay" in printed
    seq = json.loads((tmp_path / "seq" / "results.json").read_text())
    rep = json.loads((tmp_path / "rep" / "results.json").read_text())
    assert rep["protocol"]["method"] == "replay" and seq["protocol"]["method"] == "sequential"
    assert rep["results"] == seq["results"]  # every figure, per answer included
    assert {1, BLOCK} <= {int(k) for k, v in rep["results"]["0"]["mtbench"]["acceptance_histogram"].items() if v}

    # resume: a cut journal line is redone, the rest kept
    journal = (tmp_path / "rep" / "answers.jsonl").read_text()
    lines = journal.split("\n")
    (tmp_path / "rep" / "answers.jsonl").write_text("\n".join(lines[:-3]) + "\n" + lines[-2][:40])
    assert _cli(saved, tmp_path / "rep", *ARGS, "--method", "replay") == 0
    assert (tmp_path / "rep" / "answers.jsonl").read_text() == journal
    # a sequential run's journal is not mixed with replay answers
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        _cli(saved, tmp_path / "seq", *ARGS, "--method", "replay")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "method" in err and "--overwrite" in err and err.count("\n") == 1


def test_cli_batched_equals_sequential_at_t0_and_samples_at_t1(saved, tmp_path, capsys):
    """`--method batched`: at T=0 every figure equals the sequential decoder's (turn 2 built on the
    batch's own turn-1 answers); at T=1 every conversation gets its answers, protocol recorded."""
    assert _cli(saved, tmp_path / "seq", *ARGS) == 0
    assert _cli(saved, tmp_path / "bat", *ARGS, "--method", "batched", "--batch-size", "4") == 0
    assert f"quick: {MAX_NEW} tok, 2 turns, T=0, B={BLOCK}, eager, batched" in capsys.readouterr().out
    seq = json.loads((tmp_path / "seq" / "results.json").read_text())
    bat = json.loads((tmp_path / "bat" / "results.json").read_text())
    assert bat["protocol"]["method"] == "batched" and bat["results"] == seq["results"]
    t1 = [*ARGS[:-3], "--temperatures", "1", "--no-speedup"]
    assert _cli(saved, tmp_path / "t1", *t1, "--method", "batched") == 0
    res = json.loads((tmp_path / "t1" / "results.json").read_text())
    mt = res["results"]["1"]["mtbench"]
    assert res["complete"] and mt["num_prompts"] == 3 and len(mt["per_answer"]) == 6 and mt["turns"] == 2


@pytest.mark.parametrize("extra, message", [
    (["--temperatures", "0,1"], "--temperatures 0"),
    (["--protocol", "paper"], "T=0 only"),
    (["--temperatures", "0", "--workers", "2"], "drop --workers"),
])
def test_replay_refusals_are_one_line_before_any_model(extra, message, tmp_path, capsys, monkeypatch):
    from nemo_dflash.evaluation import run as eval_run

    monkeypatch.setattr(eval_run, "load_models", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as e:
        _cli((tmp_path / "no-target", tmp_path / "no-draft"), tmp_path / "out", "--method", "replay", *extra)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err


def test_automatic_batch_halves_on_out_of_memory(saved, tmp_path, monkeypatch, caplog):
    """--batch-size auto: a batch that runs out of GPU memory runs again at half the rows, until it
    fits; every conversation is decoded once and the figures equal a run at the size that fits.
    With a fixed --batch-size the error is not swallowed."""
    import torch

    from nemo_dflash.evaluation import run as eval_run

    real = eval_run.ConversationDecoder.run_batch
    sizes = []

    def tight(self, prompts):
        sizes.append(len(prompts))
        if len(prompts) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, prompts)

    monkeypatch.setattr(eval_run.ConversationDecoder, "run_batch", tight)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    assert _cli(saved, tmp_path / "auto", *ARGS, "--method", "batched") == 0  # batch_size auto: 6 rows on a CPU
    assert sizes == [6, 3, 2, 2, 2]  # halved twice, then three batches of 2
    assert "6 conversations at once ran out of GPU memory: again at 3 a batch" in caplog.text
    monkeypatch.setattr(eval_run.ConversationDecoder, "run_batch", real)
    assert _cli(saved, tmp_path / "two", *ARGS, "--method", "batched", "--batch-size", "2") == 0
    auto = json.loads((tmp_path / "auto" / "results.json").read_text())
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert auto["complete"] and auto["results"] == two["results"]
    rows = [json.loads(x) for x in (tmp_path / "auto" / "answers.jsonl").read_text().splitlines()[1:]]
    assert len(rows) == len({(r["temperature"], r["dataset"], r["id"]) for r in rows}) == 6

    monkeypatch.setattr(eval_run.ConversationDecoder, "run_batch", tight)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _cli(saved, tmp_path / "fixed", *ARGS, "--method", "batched", "--batch-size", "4")


def test_batch_rows_default():
    from nemo_dflash.evaluation.run import batch_rows

    assert (batch_rows(244, "cuda"), batch_rows(300, "cuda:1"), batch_rows(244, "cpu"), batch_rows(5, "cpu")) == (
        244, 256, 32, 5)


@pytest.mark.parametrize("value", ["0", "many", "-3"])
def test_bad_batch_size_is_one_line(saved, tmp_path, capsys, value):
    with pytest.raises(SystemExit) as e:
        _cli(saved, tmp_path / "out", *ARGS, "--method", "batched", "--batch-size", value)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--batch-size must be a number >= 1 or auto (got '{value}')" in err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_per_prompt_speedup_spread(capsys):
    """Three prompts timed at 2x (two turns), 1x and 3x: min 1, median 2, max 3, and the mean over
    all tokens; the printed table shows the spread."""
    from nemo_dflash.evaluation.protocol import PROTOCOLS, Answer, format_table, speedup_metrics

    def ans(pid, turn, spec_s, ar_s, n=11):
        return Answer(id=pid, turn=turn, output_ids=[1] * n, acceptance_lengths=[2] * 5, stopped=False,
                      decode_time_s=spec_s, ar_decode_time_s=ar_s, ar_new_tokens=n, ar_match=True)

    answers = [ans("a", 1, 1.0, 1.5), ans("a", 2, 1.0, 2.5), ans("b", 1, 1.0, 1.0), ans("c", 1, 0.5, 1.5)]
    m = speedup_metrics(answers, GREEDY)
    assert m["per_prompt_speedup"] == {"prompts": 3, "min": 1.0, "median": 2.0, "max": 3.0}
    assert m["speedup"] == pytest.approx(6.5 / 3.5)  # total plain time / total speculative time, same tokens
    assert m["speedup_no_loop"] == pytest.approx(6.5 / 3.5) and m["answers_no_loop"] == 4
    text = format_table({}, PROTOCOLS["quick"], 4, {"0": {"mtbench": m}})
    assert ("mtbench T=0: mean 1.86x; per prompt min 1.00x, median 2.00x, max 3.00x (3 prompts); "
            "answers without loops 1.86x (4 of 4)") in text
    assert "slower than plain decoding" not in text
    # the same answers with the two sides' times swapped: 3.5 / 6.5 = 0.54x, said in words
    slow = speedup_metrics([ans(a.id, a.turn, a.ar_decode_time_s, a.decode_time_s) for a in answers], SamplingParams(1.0))
    assert slow["speedup"] == pytest.approx(3.5 / 6.5)
    text = format_table({}, PROTOCOLS["quick"], 4, {"1": {"humaneval": slow}})
    assert ("humaneval T=1: speculative decoding with this draft is slower than plain decoding; do not serve it at "
            "these sampling settings (a draft for sampling: docs/train.md, \"Which loss, and which data\")") in text
    text = format_table({}, PROTOCOLS["quick"], 4, {"0": {"humaneval": slow}})  # greedy: no training hint
    assert text.count("do not serve it at these sampling settings") == 1 and "docs/train.md" not in text


def test_speedup_without_looping_answers():
    """A looping answer timed at 8x beside two plain ones at 1.5x: the mean over all tokens is
    carried by the long loop; the no-loop figure is the other two's, computed by hand."""
    from nemo_dflash.evaluation.protocol import Answer, speedup_metrics

    def ans(pid, n, spec_s, ar_s, loop_start=None):
        return Answer(id=pid, turn=1, output_ids=[1] * (n + 1), acceptance_lengths=[2], stopped=False,
                      loop_start=loop_start, decode_time_s=spec_s, ar_decode_time_s=ar_s, ar_new_tokens=n + 1,
                      ar_match=True)

    answers = [ans("a", 100, 1.0, 1.5), ans("b", 300, 2.0, 3.0), ans("c", 2000, 1.0, 8.0, loop_start=50)]
    m = speedup_metrics(answers, GREEDY)
    assert m["speedup"] == pytest.approx((1.5 + 3.0 + 8.0) / (1.0 + 2.0 + 1.0))  # 3.125x, same tokens both sides
    assert m["speedup_no_loop"] == pytest.approx((1.5 + 3.0) / (1.0 + 2.0)) and m["answers_no_loop"] == 2
    assert speedup_metrics(answers[2:], GREEDY)["speedup_no_loop"] is None


def _bench(name: str, argv: list) -> "subprocess.CompletedProcess":
    """`python benchmarks/NAME.py ARGV` in a process of its own (one torch thread): exit status, stdout, stderr."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    return subprocess.run([sys.executable, str(script), *map(str, argv)], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _ok(res) -> str:
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout + res.stderr


def test_eval_speed_benchmark_on_cpu(saved, tmp_path):
    """benchmarks/eval_speed.py end to end on the tiny target: the row and its figures."""
    target_dir, draft_dir = saved
    rows = tmp_path / "rows.json"
    argv = ["--target", str(target_dir), "--draft", str(draft_dir), "--protocol", "quick", "--num-prompts", "3",
            "--max-new-tokens", str(MAX_NEW), "--turns", "2", "--sequential-prompts", "2", "--device", "cpu",
            "--dtype", "fp32", "--threads", "1", "--out", str(tmp_path / "runs"), "--json", str(rows)]
    # under a time limit nothing is started and no row is written; the same command continues
    assert "partial" in _ok(_bench("eval_speed", argv + ["--max-minutes", "1e-6"])) and not rows.exists()
    printed = _ok(_bench("eval_speed", argv))
    row = json.loads(rows.read_text())[-1]
    assert {"date", "commit", "device", "command", "protocol", "answers", "t0_seconds", "t1_seconds",
            "speedup_seconds", "max_abs_tau_diff_vs_sequential", "checked_answers"} <= set(row)
    assert row["protocol"]["method"] == "replay" and row["t1_seconds"] is None and row["device"] == "cpu"
    assert row["answers"] == 3 * 2 + 3  # MT-Bench 3 x 2 turns, HumanEval 3
    assert row["checked_answers"] == 2 * 2 + 2 and row["identical_answers"] == row["checked_answers"]
    assert row["max_abs_tau_diff_vs_sequential"] == 0.0
    for s in row["sets"].values():
        assert s["replay_tau_checked"] == s["sequential_tau_checked"] and s["speedup_prompts"] == 2
        assert s["speedup_min"] <= s["speedup_median"] <= s["speedup_max"]
    assert "replay vs sequential: 6/6 answers identical" in printed
    # a bad flag: one line, exit 2, no row
    res = _bench("eval_speed", argv[:-2] + ["--json", str(rows), "--num-prompts", "0"])
    assert res.returncode == 2 and len(json.loads(rows.read_text())) == 1
    # T=1 by the batched decoder: its time and tau per set in the row
    printed = _ok(_bench("eval_speed", argv + ["--t1", "--t1-method", "batched", "--batch-size", "2"]))
    row = json.loads(rows.read_text())[-1]
    assert row["t1_method"] == "batched" and row["t1_seconds"] > 0 and set(row["t1_tau"]) == {"mtbench", "humaneval"}
    assert row["t1_decode"] == "eager" and row["t1_side_by_side"] is False
    assert "T=1 (batched)" in printed
    # the T=1 phase in a child process beside the T=0 phases (on a CPU the child runs on the CPU): the same draws
    side = tmp_path / "side"
    argv_side = [a if a != str(tmp_path / "runs") else str(side) for a in argv]
    _ok(_bench("eval_speed", argv_side + ["--t1", "--t1-method", "batched", "--batch-size", "2", "--t1-gpu", "1"]))
    side_row = json.loads(rows.read_text())[-1]
    assert side_row["t1_side_by_side"] is True and side_row["t1_seconds"] > 0
    assert side_row["t1_tau"] == row["t1_tau"]
    for name, s in row["sets"].items():  # the T=0 phases as before (their times aside)
        for key in ("answers", "replay_tau", "replay_tau_checked", "sequential_tau_checked", "checked_answers"):
            assert side_row["sets"][name][key] == s[key], (name, key)
    assert (side / "t1_child.log").is_file()
    res = _bench("eval_speed", argv_side + ["--t1-gpu", "1"])  # without --t1 there is no T=1 phase to place
    assert res.returncode == 2 and "--t1" in res.stderr.strip().splitlines()[-1]
    if not torch.cuda.is_available():  # the CUDA-graph batched decoder: refused on a CPU in one line, no row
        n = len(json.loads(rows.read_text()))
        res = _bench("eval_speed", argv + ["--t1", "--t1-method", "batched", "--t1-decode", "graphs"])
        assert res.returncode == 2 and len(json.loads(rows.read_text())) == n
        assert "graphs" in res.stderr.strip().splitlines()[-1]


def test_rows_benchmark_on_cpu(tmp_path):
    """benchmarks/decode.py rows on the tiny shape, eagerly: a row a (row count, fold setting), the folded
    attention's logits those of HF's SDPA in fp32, tokens/s = rows / step time; bad flags: exit 2, nothing written."""
    out = tmp_path / "rows.json"
    argv = ["rows", "--shape", "tiny", "--rows", "1,3", "--view", "256", "--reps", "1", "--device", "cpu",
            "--profile-rows", "3", "--json", str(out)]
    printed = _ok(_bench("decode", argv))
    got = json.loads(out.read_text())
    assert [(r["rows"], r["fold_gqa"]) for r in got] == [(1, False), (1, True), (3, False), (3, True)]
    for r in got:
        assert r["max_abs_logit_diff"] < 1e-5 and r["same_argmax"] == 1.0
        assert r["plain_tokens_per_s"] == pytest.approx(r["rows"] / r["plain_step_ms"] * 1e3)
        assert r["verify_ms"] > 0 and r["draft_ms"] > 0 and r["decode"] == "eager" and r["commit"]
        assert r["filled_blocks"] is False  # a CPU keeps SDPA over the bucketed view
    assert "tiny, view 256, block 16" in printed
    assert "rows 3, fold 0: one eager plain step" in printed and "rows 3, fold 1: one eager plain step" in printed
    for bad in (["--view", "300"], ["--fold-gqa", "2"], ["--rows", "0"]):
        res = _bench("decode", [*argv[:-2], "--json", str(tmp_path / "bad.json"), *bad])
        assert res.returncode == 2 and not (tmp_path / "bad.json").exists(), bad


def test_concurrency_benchmark_on_cpu(saved, tmp_path):
    """benchmarks/decode.py concurrency on the tiny target: a row per concurrency, plain and speculative
    answers identical at T=0 in fp32; a bad flag is one line, exit 2, before any model."""
    target_dir, draft_dir = saved
    rows = tmp_path / "rows.json"
    argv = ["--target", str(target_dir), "--draft", str(draft_dir), "--prompts", "3", "--batches", "1,3",
            "--max-new-tokens", "10", "--device", "cpu", "--dtype", "fp32", "--threads", "1", "--json", str(rows)]
    printed = _ok(_bench("decode", ["concurrency", *argv, "--one-prompt-loop"]))
    got = json.loads(rows.read_text())
    assert [(r["concurrency"], r["loop"]) for r in got] == [(1, "batched"), (3, "batched"), (1, "one-prompt")]
    assert all(r["identical_answers"] == 3 for r in got)
    from nemo_dflash.draft.build import draft_weights_sha256
    assert {r["draft_sha256"] for r in got} == {draft_weights_sha256(draft_dir)}  # read from the draft's files
    assert all(r["plain_tokens_per_s"] > 0 and r["spec_tokens_per_s"] > 0 and r["tau"] >= 1 for r in got)
    assert got[2]["tau"] == got[0]["tau"]  # at T=0 a batched row's steps are the one-prompt decoder's
    for r in got:  # the answers that do not loop: their share, tau and the batches free of loops on both sides
        assert 0 <= r["loop_share"] <= 1 and 0 <= r["batches_no_loop"] <= -(-3 // r["concurrency"])
        assert (r["speedup_no_loop"] is None) == (r["batches_no_loop"] == 0)
    for r in got:  # the speedup is recomputed from each batch's seconds and tokens
        d = r["batches_detail"]
        assert len(d["plain_seconds"]) == len(d["spec_tokens"]) == -(-3 // r["concurrency"])
        assert r["speedup"] == pytest.approx((sum(d["spec_tokens"]) / sum(d["spec_seconds"]))
                                             / (sum(d["plain_tokens"]) / sum(d["plain_seconds"])))
    assert "eager on both sides" in printed
    cont = tmp_path / "continuous.json"  # 3 prompts through 2 rows: the third enters mid-run
    _ok(_bench("decode", ["concurrency", *argv[:-1], str(cont), "--batches", "2", "--schedule", "continuous"]))
    (c,) = json.loads(cont.read_text())
    assert (c["schedule"], c["identical_answers"], c["tau"]) == ("continuous", 3, got[0]["tau"])
    assert (c["fold_gqa"], c["filled_blocks"]) == (True, False)  # the defaults on a CPU
    d = c["batches_detail"]  # one call; its new tokens: every answer's tokens but the first rows' prefill tokens
    assert len(d["spec_seconds"]) == 1 and d["plain_tokens"][0] == sum(got[0]["batches_detail"]["plain_tokens"]) + 1
    # T=1 (on graphs the two loops at B=1 draw the same keyed samples; eager, the reference draws its own)
    sampled = tmp_path / "t1.json"
    printed = _ok(_bench("decode", ["concurrency", *argv[:-1], str(sampled), "--batches", "1", "--one-prompt-loop",
                                    "--temperature", "1", "--seed", "3"]))
    t1 = json.loads(sampled.read_text())
    assert [(r["temperature"], r["loop"]) for r in t1] == [(1.0, "batched"), (1.0, "one-prompt")]
    assert all(r["tau"] >= 1 and r["spec_tokens_per_s"] > 0 for r in t1)
    assert "T=1," in printed
    res = _bench("decode", ["concurrency", *argv, "--temperature", "-1"])
    assert res.returncode == 2 and "--temperature" in res.stderr
    res = _bench("decode", ["concurrency", *argv[:4], "--batches", "0"])
    assert res.returncode == 2 and "--batches" in res.stderr
    res = _bench("decode", ["concurrency", *argv, "--decode", "graphs"])  # CUDA graphs on a CPU: refused in one line
    assert res.returncode == 2 and "decode='eager'" in res.stderr


def test_flex_attention_replay_equals_sequential(case, tokenizer, monkeypatch):
    """The GPU's draft attention (flex_attention with a BlockMask), run eagerly on the CPU."""
    target, draft, settings = case
    monkeypatch.setitem(replay.DRAFT_ATTENTION, "cpu", "flex")
    items = prompts()[:3]
    got = replayed(target, tokenizer, draft, settings, items)
    assert [[_fields(a) for a in c] for c in got] == [[_fields(a) for a in c]
                                                       for c in sequential(target, tokenizer, draft, settings, items)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_replay_equals_sequential(case, tokenizer):
    """The GPU path (the engine's plain rows with flex decoding and CUDA graphs, the draft's compiled flex attention)
    in fp32, where near ties do not flip: the same answers and acceptance lengths as the sequential decoder."""
    import copy

    target, draft, settings = case
    target, draft = copy.deepcopy(target).cuda(), copy.deepcopy(draft).cuda()
    items = prompts()
    got = replayed(target, tokenizer, draft, settings, items)
    assert [[_fields(a) for a in c] for c in got] == [[_fields(a) for a in c]
                                                       for c in sequential(target, tokenizer, draft, settings, items)]


def test_replay_refuses_a_target_the_engine_cannot_run(tokenizer):
    target = tiny_qwen3(num_layers=2, seed=0)
    target.config.sliding_window, target.config.use_sliding_window = 4, True
    draft = make_draft(target, block_size=BLOCK, layer_ids=[0, 1])
    with pytest.raises(ValueError, match="sliding_window.*use --method sequential"):
        ReplayEvaluator(target, tokenizer, draft, EvalSettings(sampling=GREEDY))
    with pytest.raises(ValueError, match="T=0 only"):
        ReplayEvaluator(tiny_qwen3(num_layers=2), tokenizer, draft, EvalSettings(sampling=SamplingParams(1.0)))


def test_concurrency_no_loop_figures_by_hand():
    """`evaluation.loop_figures` (decode.py concurrency's no-loop figures) on three one-prompt batches, the second speculative answer a loop: tau
    over answers 1 and 3, the speedup over batches 1 and 3 only (tokens over seconds, each side)."""
    from types import SimpleNamespace as A

    from nemo_dflash.evaluation.loop_figures import no_loop_figures

    loop = [5, 6, 7, 8, 9, 10, 11] * 20
    plain = [A(output_ids=list(range(20)), acceptance_lengths=[1] * 19)] * 3
    spec = [A(output_ids=list(range(20)) + [2], acceptance_lengths=[4, 4]),
            A(output_ids=loop, acceptance_lengths=[8] * 10),
            A(output_ids=list(range(30, 50)), acceptance_lengths=[2, 3, 3])]
    got = no_loop_figures(plain, spec, 1, [1.0, 1.0, 3.0], [0.5, 0.1, 1.0], [19, 19, 19], [20, 139, 19], [2])
    assert got["loop_share"] == pytest.approx(1 / 3) and got["batches_no_loop"] == 2
    assert got["tau_no_loop"] == pytest.approx((4 + 4 + 2 + 3 + 3) / 5)
    assert got["speedup_no_loop"] == pytest.approx(((20 + 19) / 1.5) / ((19 + 19) / 4.0))
