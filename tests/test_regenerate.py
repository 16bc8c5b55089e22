"""Regeneration: batched greedy == unpadded HF generate, OpenAI-layout output, multi-turn, holdout,
atomic writes, resuming and --overwrite protection (tiny random Qwen3 with the real Qwen3 tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _spec_fixtures import sabotage_slot_reuse
from _tiny_target import make_tiny_target_dir, write_chat_jsonl

import nemo_dflash.target.loading
import nemo_dflash.data.regenerate as regen
from nemo_dflash.data import read_conversations
from nemo_dflash.target.loading import load_target
from nemo_dflash.recipes import regenerate as cli
from nemo_dflash.data import selection
from nemo_dflash.recipes import _regen_args as flags
from nemo_dflash.data.regenerate import RegenStats, generate_batch, regenerate_conversations, split_prompt
from nemo_dflash.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_tiny_target_dir(tmp_path_factory.mktemp("regen"))


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(str(target_dir), dtype="fp32")


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    return write_chat_jsonl(tmp_path_factory.mktemp("chats") / "chats.jsonl", n=10)


def _reference(model, tokenizer, messages, max_new_tokens: int) -> str:
    """HF generate on one unpadded prompt: what the target answers on its own."""
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eot,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def _forcing_sampler(monkeypatch, tokenizer, prompts_seen: list | None = None, stop_at=lambda key: 2 + key % 3):
    """The engine answers every prompt with "Hello" + the model's tokens + <|im_end|>, ending
    after ``stop_at(key)`` tokens, so answers end at different steps (a random model never emits
    <|im_end|> by itself). ``prompts_seen`` collects the decoded prompts of the prefills."""
    from _spec_fixtures import force_answers, watch_prefills

    first = tokenizer.convert_tokens_to_ids("Hello")
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    force_answers(monkeypatch, lambda req, pos, t: first if pos == 0 else eot if pos >= stop_at(req.key) else t)
    if prompts_seen is not None:
        watch_prefills(monkeypatch, lambda req: prompts_seen.append(tokenizer.decode(req.prompt_ids)))


@pytest.fixture
def cached_target(monkeypatch, target):
    """The CLI loads the module's model instead of re-reading it from disk."""
    monkeypatch.setattr(nemo_dflash.target.loading, "load_target", lambda *a, **k: target)
    return target


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_split_prompt():
    msgs = [{"role": "system", "content": "sys"}, {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "  "}, {"role": "user", "content": "q2"}]
    assert split_prompt(msgs, "first") == ([{"role": "system", "content": "sys"}], ["q1"])
    assert split_prompt(msgs, "all") == ([{"role": "system", "content": "sys"}], ["q1", "q2"])
    assert split_prompt(msgs[1:2], "all") == ([], [])


def test_generate_batch_finish_reason_and_stop_token():
    """Rows are left-padded; an answer ends before its first stop token (padding after it ignored)."""
    stop, pad = 7, 0

    class Fake(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def generate(self, input_ids, attention_mask, **kwargs):
            assert input_ids.tolist() == [[5, 6, 8], [pad, pad, 9]]
            assert attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
            new = torch.tensor([[11, 12, stop, pad], [13, 14, 15, 16]])
            return torch.cat([input_ids, new], dim=1)

    out = generate_batch(Fake(), [[5, 6, 8], [9]], pad_id=pad, stop_ids=[stop])
    assert out == [([11, 12], "stop", 3), ([13, 14, 15, 16], "length", 4)]


def test_stats_shared_by_two_calls_add_up(target, chat_file):
    """One ``RegenStats`` over two calls (one per thinking mode) holds the sum of both calls' figures,
    not the last call's."""
    model, tokenizer = target
    convs = list(read_conversations(str(chat_file), max_samples=4))
    alone = []
    for part in (convs[:2], convs[2:]):
        stats = RegenStats()
        list(regenerate_conversations(model, tokenizer, part, max_new_tokens=3, batch_size=2, stats=stats))
        alone.append(stats)
    shared = RegenStats()
    for part in (convs[:2], convs[2:]):
        list(regenerate_conversations(model, tokenizer, part, max_new_tokens=3, batch_size=2, stats=shared))
    for name in ("generated_tokens", "prefill_tokens", "answers", "written"):
        assert getattr(shared, name) == sum(getattr(s, name) for s in alone), name
    assert shared.generated_tokens > alone[1].generated_tokens > 0
    assert shared.seconds > alone[1].seconds * 0.5 and shared.seconds > 0


def test_greedy_batched_equals_unpadded_hf_generate(target, chat_file):
    model, tokenizer = target
    convs = list(read_conversations(str(chat_file), max_samples=7))
    prompt_lens = {len(regen.encode_prompt(tokenizer, c.messages[:1])) for c in convs}
    assert len(prompt_lens) > 1  # otherwise batching adds no padding to get wrong
    outputs = {}
    for engine, bs in (("continuous", 1), ("continuous", 3), ("generate", 3)):
        stats = RegenStats()
        records = regenerate_conversations(model, tokenizer, convs, max_new_tokens=6, batch_size=bs, stats=stats,
                                           engine=engine)
        outputs[engine, bs] = sorted(records, key=lambda r: r["source"])
        assert stats.written + sum(stats.skipped.values()) == len(convs)
        assert set(stats.skipped) <= {"empty_answer"}
    assert outputs["continuous", 1] == outputs["continuous", 3] == outputs["generate", 3]
    by_source = {r["source"]: r for r in outputs["continuous", 3]}
    for conv in convs:
        expected = _reference(model, tokenizer, conv.messages[:1], max_new_tokens=6)
        if not expected.strip():
            assert conv.location not in by_source  # empty answers are dropped
            continue
        record = by_source[conv.location]
        assert record["messages"] == [conv.messages[0], {"role": "assistant", "content": expected}]
        assert record["finish_reason"] == "length"
    assert len(by_source) >= 3


def test_cli_writes_openai_jsonl_and_holdout(tmp_path, target_dir, chat_file):
    out = tmp_path / "regen.jsonl"
    summary = cli.main(["--target", str(target_dir), "--data", str(chat_file), "--out", str(out),
                        "--num-samples", "5", "--holdout", "2", "--max-new-tokens", "4", "--batch-size", "2",
                        "--seed", "3"])
    records = _read_jsonl(out)
    assert summary["written"] == len(records) > 0
    source = {c.location: c for c in read_conversations(str(chat_file))}
    for r in records:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
        assert r["messages"][0] == source[r["source"]].messages[0]
        assert r["finish_reason"] in ("stop", "length")
    # The training reader accepts the file (extra top-level keys are ignored).
    assert [c.messages for c in read_conversations(str(out))] == [r["messages"] for r in records]
    held = _read_jsonl(tmp_path / "regen.holdout.jsonl")
    assert len(held) == 2 and all([m["role"] for m in h["messages"]] == ["user"] for h in held)
    assert not {h["source"] for h in held} & {r["source"] for r in records}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["regen.holdout.jsonl", "regen.jsonl", "regen_report"]


def test_batch_size_auto_fits_the_kv_cache():
    """--batch-size auto: 97% of the rows whose KV cache fits the free memory, capped at 2,048; 8 off a
    GPU (the fit itself: tests/test_generation.py)."""
    from nemo_dflash.engine.plain import AUTO_ROWS_CAP, CPU_AUTO_ROWS, auto_rows
    from nemo_dflash.recipes.regenerate import build_parser

    assert auto_rows(1213) == 1213 - 37
    assert auto_rows(10_000) == AUTO_ROWS_CAP == 2048
    assert auto_rows(None) == 8
    parser = build_parser()
    base = ["--target", "x", "--data", "d.jsonl", "--out", "o.jsonl"]
    assert parser.parse_args(base + ["--batch-size", "auto"]).batch_size == "auto"
    assert parser.parse_args(base + ["--batch-size", "12"]).batch_size == 12
    with pytest.raises(SystemExit) as e:
        parser.parse_args(base + ["--batch-size", "many"])
    assert e.value.code == 2
    # the two recipes' help names the cap as written (kept out of their imports, which stay torch-free)
    from nemo_dflash.recipes.prompts import build_parser as prompts_parser

    for p in (parser, prompts_parser()):
        (action,) = [a for a in p._actions if "--batch-size" in a.option_strings]
        assert f"at most {AUTO_ROWS_CAP:,}" in action.help and f": {CPU_AUTO_ROWS})" in action.help


@pytest.mark.parametrize("batch", ["2", "auto"])
def test_cli_all_turns_feeds_answers_back(tmp_path, monkeypatch, cached_target, batch):
    model, tokenizer = cached_target
    prompts: list[str] = []
    _forcing_sampler(monkeypatch, tokenizer, prompts)
    data = tmp_path / "multi.jsonl"
    convs = [[{"role": "system", "content": f"be brief {i}"}]
             + [{"role": r, "content": f"{r} {i} turn {t}"} for t in range(3) for r in ("user", "assistant")]
             for i in range(3)]
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    out = tmp_path / "multi_out.jsonl"
    summary = cli.main(["--target", "x", "--data", str(data), "--out", str(out), "--turns", "all",
                        "--max-new-tokens", "8", "--batch-size", batch])
    records = _read_jsonl(out)
    assert summary["turns"] == 9 and len(records) == 3
    for r in records:
        msgs = r["messages"]
        i = msgs[0]["content"].split()[-1]
        assert [m["role"] for m in msgs] == ["system"] + ["user", "assistant"] * 3
        assert [m["content"] for m in msgs[1::2]] == [f"user {i} turn {t}" for t in range(3)]
        answers = [m["content"] for m in msgs[2::2]]
        assert all(a.startswith("Hello") for a in answers)
        assert r["finish_reason"] == "stop"
        # Turn 3's prompt holds the regenerated answers, not the source's.
        last_prompt = next(p for p in prompts if f"user {i} turn 2" in p)
        assert all(a in last_prompt for a in answers[:2]) and f"assistant {i}" not in last_prompt
    assert len(prompts) == 9 and summary["shortened"] == {}
    # turns 2 and 3 continued in their slots: their histories were not prefilled again
    assert summary["reused_tokens"] > 0 and summary["prefix_mismatch"] == 0
    assert summary["prefill_tokens"] + summary["reused_tokens"] == summary["prompt_tokens"]


def test_all_turns_stops_after_a_cut_answer(target):
    """An answer cut by max_new_tokens ends the conversation (it would be a truncated context)."""
    model, tokenizer = target
    convs = [[{"role": "user", "content": f"question {i} number {t}"} for t in range(2)] for i in range(3)]
    stats = RegenStats()
    records = list(regenerate_conversations(model, tokenizer, convs, max_new_tokens=3, turns="all", batch_size=2,
                                            stats=stats))
    assert all(r["finish_reason"] == "length" and len(r["messages"]) == 2 for r in records)
    assert "source" not in records[0] and stats.shortened["length"] == len(records) == stats.written


def test_crash_leaves_no_output_then_resume(tmp_path, monkeypatch, target_dir, chat_file):
    """Sampled multi-turn answers; a crash mid-run, a torn last line, a refused change of settings,
    then a resume: the final file is the uninterrupted run's, byte for byte (keyed sampling does not
    depend on which conversations share the batch). The target in float64, as in
    test_sampling_does_not_depend_on_the_batch: the resumed run's batches hold other neighbours."""
    from nemo_dflash.engine.batched_static import BatchedStaticPlainRunner

    model, tokenizer = load_target(str(target_dir), dtype="fp32")
    model.double()
    monkeypatch.setattr(nemo_dflash.target.loading, "load_target", lambda *a, **k: (model, tokenizer))
    _forcing_sampler(monkeypatch, tokenizer, stop_at=lambda key: 2 + key % 5)
    args = ["--target", "x", "--data", str(chat_file), "--num-samples", "8", "--max-new-tokens", "8",
            "--batch-size", "2", "--turns", "all", "--sampling", "given", "--temperature", "1.0", "--top-p", "0.9"]
    reference = tmp_path / "ref.jsonl"
    cli.main(args + ["--out", str(reference)])

    out = tmp_path / "run.jsonl"
    real, calls = BatchedStaticPlainRunner._decode_step, []

    def crash_later(self, *a, **k):
        calls.append(1)
        if len(calls) == 12:
            raise RuntimeError("boom")
        return real(self, *a, **k)

    monkeypatch.setattr(BatchedStaticPlainRunner, "_decode_step", crash_later)
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(args + ["--out", str(out)])
    monkeypatch.setattr(BatchedStaticPlainRunner, "_decode_step", real)
    partial = tmp_path / "run.jsonl.partial"
    written = _read_jsonl(partial)
    assert not out.exists() and 0 < len(written) < 8
    with open(partial, "a") as f:
        f.write('{"messages": [{"ro')  # killed mid-write

    with pytest.raises(SystemExit):  # other settings: refused, partial kept
        cli.main(args + ["--out", str(out), "--seed", "1"])
    assert partial.exists()

    summary = cli.main(args + ["--out", str(out)])
    assert summary["resumed_done"] == len(written)
    assert out.read_text() == reference.read_text()
    assert not partial.exists() and not (tmp_path / "run.jsonl.partial.json").exists()


def test_max_minutes_finishes_with_what_is_done(tmp_path, target_dir, chat_file):
    out = tmp_path / "regen.jsonl"
    summary = cli.main(["--target", str(target_dir), "--data", str(chat_file), "--out", str(out),
                        "--num-samples", "6", "--holdout", "1", "--max-new-tokens", "4", "--batch-size", "2",
                        "--max-minutes", "1e-6"])
    records = _read_jsonl(out)
    # The budget is spent by the time the first batch is done: that batch's two conversations are
    # written (none generated and then dropped), no further batch starts.
    assert summary["stopped_at_max_minutes"] and summary["written"] == len(records) == 2
    assert summary["turns"] == sum(m["role"] == "assistant" for r in records for m in r["messages"])
    assert all(r["messages"][-1]["role"] == "assistant" for r in records)
    assert len(_read_jsonl(tmp_path / "regen.holdout.jsonl")) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["regen.holdout.jsonl", "regen.jsonl", "regen_report"]


def test_existing_output_needs_overwrite(tmp_path, cached_target, chat_file, capsys):
    out = tmp_path / "regen.jsonl"
    out.write_text("precious\n")
    args = ["--target", "x", "--data", str(chat_file), "--out", str(out), "--num-samples", "1",
            "--max-new-tokens", "2"]
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2 and "--overwrite" in capsys.readouterr().err
    assert out.read_text() == "precious\n"
    cli.main(args + ["--overwrite"])
    assert out.read_text() != "precious\n"


@pytest.mark.parametrize("bad,message", [(["--out", "x.json"], ".jsonl"), (["--top-p", "0"], "--top-p"),
                                         (["--temperature", "-1"], "--temperature"),
                                         (["--max-minutes", "0"], "--max-minutes"),
                                         (["--top-p", "1.5"], "--top-p"),
                                         (["--threads", "0"], "--threads")])
def test_bad_arguments(bad, message, capsys):
    args = ["--target", "x", "--data", "y.jsonl", "--out", "o.jsonl"]
    with pytest.raises(SystemExit):
        cli.main(args + bad)
    assert message in capsys.readouterr().err


def test_sampling_is_seeded(target, chat_file):
    model, tokenizer = target
    convs = list(read_conversations(str(chat_file), max_samples=4))

    def run(seed: int) -> list[dict]:
        return list(regenerate_conversations(model, tokenizer, convs, max_new_tokens=5,
                                             sampling=SamplingParams(1.0, top_p=0.9), batch_size=2, seed=seed))

    assert run(0) == run(0) != run(1)


def test_sampling_does_not_depend_on_the_batch(target_dir, chat_file):
    """Keyed sampling: the same answers with 1 or 3 answers in flight (other batch neighbours). In float64: the
    tiny target's near-uniform draws over 151k tokens follow the last bit of its logits, and a float32 matmul
    over 3 rows rounds otherwise than over one on some CPUs (the answers then part for a reason that is not the
    sampling's)."""
    model, tokenizer = load_target(str(target_dir), dtype="fp32")
    model.double()
    convs = list(read_conversations(str(chat_file), max_samples=5))

    def run(bs: int) -> list[dict]:
        records = regenerate_conversations(model, tokenizer, convs, max_new_tokens=6,
                                           sampling=SamplingParams(0.8, top_p=0.95), batch_size=bs, seed=4)
        return sorted(records, key=lambda r: r["source"])

    one = run(1)
    assert one == run(3) and len(one) == 5 and all(r["messages"][-1]["content"] for r in one)


def _looping_sampler(monkeypatch, tokenizer, loop_from: int):
    """Answers "Hello" + the model's tokens, then from ``loop_from`` the same 5 tokens over and over."""
    from _spec_fixtures import force_answers

    unit = [tokenizer.convert_tokens_to_ids(t) for t in ("Hello", "Ġworld", ",", "Ġagain", ".")]
    force_answers(monkeypatch, lambda req, pos, t: unit[(pos - loop_from) % len(unit)] if pos >= loop_from else t)
    return unit


@pytest.mark.parametrize("policy", ["cut", "drop", "keep"])
def test_loop_policies(monkeypatch, target, policy):
    model, tokenizer = target
    unit = _looping_sampler(monkeypatch, tokenizer, loop_from=10)
    convs = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "x"},
              {"role": "user", "content": f"follow-up {i}"}] for i in range(3)]
    stats = RegenStats()
    records = list(regenerate_conversations(model, tokenizer, convs, max_new_tokens=400, turns="all", batch_size=2,
                                            loops=policy, stats=stats))
    assert stats.answers == 3 and stats.looping_before == 3 and stats.capped_before == 0
    if policy == "drop":
        assert records == [] and stats.skipped["loop"] == 3 and stats.looping_after == 0
        return
    assert len(records) == 3 and all(len(r["messages"]) == 2 for r in records)  # the loop ends the conversation
    assert stats.shortened[records[0]["finish_reason"]] == 3
    for r in records:
        ids = tokenizer(r["messages"][1]["content"], add_special_tokens=False)["input_ids"]
        if policy == "cut":  # 10 tokens of the model's, then the unit once: the repeats are gone
            assert r["finish_reason"] == "loop" and len(ids) <= 10 + len(unit) + 2
        else:
            assert r["finish_reason"] == "length" and len(ids) > 100
    assert stats.looping_after == (3 if policy == "keep" else 0)
    if policy == "cut":  # stopped at the first check (every 128 steps), far from the 400-token cap
        assert stats.generated_tokens <= 3 * 130


def test_capped_answers_can_be_dropped(target):
    model, tokenizer = target
    convs = [[{"role": "user", "content": f"question {i}"}] for i in range(2)]
    stats = RegenStats()
    records = list(regenerate_conversations(model, tokenizer, convs, max_new_tokens=4, batch_size=2, capped="drop",
                                            stats=stats))
    assert records == [] and stats.capped_before == 2 and stats.capped_after == 0 and stats.skipped["length"] == 2


def test_sampling_settings_come_from_the_target(capsys):
    from types import SimpleNamespace

    args = cli.build_parser().parse_args(["--target", "x", "--data", "y.jsonl", "--out", "o.jsonl"])
    sampling = SimpleNamespace(do_sample=True, temperature=0.6, top_p=0.9)
    assert flags.resolve_sampling(args, SimpleNamespace(generation_config=sampling)) == (
        SamplingParams(0.6, top_p=0.9), "target generation_config")
    plain = SimpleNamespace(generation_config=SimpleNamespace(do_sample=False, temperature=1.0, top_p=1.0))
    assert flags.resolve_sampling(args, plain) == (SamplingParams(0.7, top_p=0.95), "command line")
    args.sampling = "greedy"
    assert flags.resolve_sampling(args, SimpleNamespace(generation_config=sampling)) == (SamplingParams(), "greedy")
    args.sampling = "target"
    bad = SimpleNamespace(generation_config=SimpleNamespace(do_sample=True, temperature=0.7, top_p=0.0))
    with pytest.raises(SystemExit) as exc:
        flags.resolve_sampling(args, bad)
    assert exc.value.code == 2 and "top_p" in capsys.readouterr().err


def test_first_turn_extract_selects_the_same_prompts(tmp_path, target):
    """`write_first_turns` (benchmarks/regen.py first-turns): the cut file gives regenerate the same pool and
    picks."""
    import random

    from nemo_dflash.data.chat_template import write_first_turns

    rnd = random.Random(1)
    words = "alpha beta gamma delta epsilon zeta".split()
    say = lambda k: " ".join(rnd.choice(words) for _ in range(k))  # noqa: E731
    rows = []
    for i in range(40):
        kind = i % 5
        if kind == 0:  # the usual: human, gpt, human, gpt
            conv = [{"from": "human", "value": say(5)}, {"from": "gpt", "value": say(9)},
                    {"from": "human", "value": say(4)}, {"from": "gpt", "value": say(6)}]
        elif kind == 1:  # starts with the assistant
            conv = [{"from": "gpt", "value": say(3)}, {"from": "human", "value": say(6)}, {"from": "gpt", "value": say(5)}]
        elif kind == 2:  # a system prompt first
            conv = [{"from": "system", "value": say(4)}, {"from": "human", "value": say(5)}, {"from": "gpt", "value": say(5)}]
        elif kind == 3:  # a long prompt that the length filter skips
            conv = [{"from": "human", "value": say(300)}, {"from": "gpt", "value": say(5)}]
        else:  # an empty first user turn
            conv = [{"from": "human", "value": ""}, {"from": "gpt", "value": say(4)},
                    {"from": "human", "value": say(5)}, {"from": "gpt", "value": say(4)}]
        rows.append({"conversations": conv})
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cut = tmp_path / "cut.jsonl"
    assert write_first_turns(str(src), str(cut)) == len(list(read_conversations(str(src))))

    _, tok = target
    picks = []
    for path in (src, cut):
        pool = selection.read_pool([str(path)], 10)
        chosen, skipped, examined = selection.select(pool, tok, count=25, seed=3, turns="first", max_prompt_tokens=64)
        picks.append(([split_prompt(c.messages, "first") for c in chosen], skipped, examined))
    assert picks[0] == picks[1]
    assert picks[0][1].get("prompt_too_long")  # the filter did run on both


# ----------------------------------------------------------------------------- later turns in their slot

_WORDS = "the cat dog sea runs fast and slow blue red green house tree".split()


def _word_model(kind: str, tokenizer, seed: int = 1):
    """A tiny random Llama or Qwen3 whose lm_head scores only whole-word tokens and <|im_end|>: its
    greedy answers stop, run to the cap or loop, and decode to text that tokenises back to them."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls, config = (LlamaForCausalLM, LlamaConfig) if kind == "llama" else (Qwen3ForCausalLM, Qwen3Config)
    torch.manual_seed(seed)
    model = cls(config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                       tie_word_embeddings=False)).eval()
    allowed = [tokenizer(" " + w, add_special_tokens=False)["input_ids"][0] for w in _WORDS]
    allowed.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    with torch.no_grad():
        rows = model.lm_head.weight[allowed].clone() * 8
        model.lm_head.weight.zero_()
        model.lm_head.weight[allowed] = rows
    return model


def _reference_conversation(model, tokenizer, users, *, max_new_tokens, detector, max_prompt_tokens=None):
    """What regenerate with ``loops="cut"``, ``after_cut="continue"`` must write: turn by turn, HF's
    unbatched greedy answer to the whole templated history, cut at a loop's start; and the number
    of answers cut by a loop that a later turn follows."""
    stops = regen.stop_token_ids(model, tokenizer)
    messages, cut_then_asked = [], 0
    for t, user in enumerate(users):
        messages.append({"role": "user", "content": user})
        ids = regen.encode_prompt(tokenizer, messages)
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            messages.pop()
            break
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
                             pad_token_id=0)[0, len(ids):].tolist()
        answer = next((out[:k] for k, tok in enumerate(out) if tok in stops), out)
        start = detector.find(answer)
        if start is not None:
            answer = answer[:start]
            cut_then_asked += t + 1 < len(users)
        text = tokenizer.decode(answer, skip_special_tokens=True)
        if not text.strip():
            messages.pop()
            break
        messages.append({"role": "assistant", "content": text})
    return messages, cut_then_asked


def _conversations(n: int = 6, turns: int = 3) -> list[list[dict]]:
    topics = ["cats", "dogs and more", "the sea", "why not", "green houses", "fast cars", "x"]
    return [[{"role": "user", "content": f"question {i} turn {t} about {topics[(i + t) % len(topics)]}"}
             for t in range(turns)] for i in range(n)]


def _regen_all_turns(model, tokenizer, convs, *, batch_size, detector, max_prompt_tokens=None, stats=None):
    return list(regenerate_conversations(model, tokenizer, convs, max_new_tokens=16, turns="all",
                                         batch_size=batch_size, after_cut="continue", loop_detector=detector,
                                         max_prompt_tokens=max_prompt_tokens, stats=stats))


def _check_against_reference(model, tokenizer, convs, records, detector, max_prompt_tokens=None) -> int:
    """Every record is the reference conversation; the number of loop-cut answers followed by a turn."""
    assert len(records) == len(convs)
    by_first = {r["messages"][0]["content"]: r for r in records}  # records come as conversations end
    cut_then_asked = 0
    for conv in convs:
        record = by_first[conv[0]["content"]]
        expected, cut = _reference_conversation(model, tokenizer, [m["content"] for m in conv], max_new_tokens=16,
                                                detector=detector, max_prompt_tokens=max_prompt_tokens)
        assert record["messages"] == expected
        cut_then_asked += cut
    return cut_then_asked


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_later_turns_reuse_their_slot_and_equal_hf_generate(target, kind, monkeypatch):
    """Every turn of every conversation equals HF's greedy answer to the whole history, with the
    model's own earlier answers in it, including turns after a loop-cut answer (the slot is set
    back to the cut); later turns prefill only their new tokens; batch size 1 or 3 alike."""
    from nemo_dflash.data.loops import LoopDetector

    _, tokenizer = target
    model, convs = _word_model(kind, tokenizer), _conversations()
    detector = LoopDetector(ngram=3, min_tokens=8, min_copies=2.0)
    stats = RegenStats()
    records = _regen_all_turns(model, tokenizer, convs, batch_size=3, detector=detector, stats=stats)
    assert _check_against_reference(model, tokenizer, convs, records, detector) > 0  # cut answers were followed
    assert stats.turns == 18 and stats.prefix_mismatch == 0
    assert stats.reused_tokens > stats.prefill_tokens  # the histories were not prefilled again
    assert stats.prefill_tokens + stats.reused_tokens == stats.prompt_tokens
    # time by phase: every phase the run went through is timed, and the phases fit in the run's time
    assert {"decode", "prefill", "host", "caller"} <= set(stats.phase_seconds)
    assert sum(stats.phase_seconds.values()) <= stats.seconds
    one = _regen_all_turns(model, tokenizer, convs, batch_size=1, detector=detector)
    assert sorted(map(str, one)) == sorted(map(str, records))

    # A slot whose length is not set back to the cut (its whole answer kept), or one token too far,
    # gives other answers: the comparison above catches a broken reuse.
    for how in (lambda start, kv, prompt: min(len(kv), len(prompt) - 1),
                lambda start, kv, prompt: min(start + 1, len(prompt) - 1)):
        sabotage_slot_reuse(monkeypatch, how)
        wrong = _regen_all_turns(model, tokenizer, convs, batch_size=3, detector=detector)
        with pytest.raises(AssertionError):
            _check_against_reference(model, tokenizer, convs, wrong, detector)
        monkeypatch.undo()


def test_non_prefix_template_and_long_history_equal_hf_generate(target, monkeypatch):
    """A template that rewrites earlier turns (here: every header carries the message count) breaks
    the prefix property: counted, only the common prefix is reused, answers are still HF's. A
    history that outgrows --max-prompt-tokens ends its conversation as it did before."""
    import copy

    from nemo_dflash.data.loops import LoopDetector

    _, tokenizer = target
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = (
        "{%- for m in messages %}<|im_start|>{{ m.role }} {{ messages|length }}\n{{ m.content }}<|im_end|>\n"
        "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    )
    model, convs = _word_model("qwen3", tokenizer), _conversations()
    detector = LoopDetector(ngram=3, min_tokens=8, min_copies=2.0)
    stats = RegenStats()
    records = _regen_all_turns(model, tokenizer, convs, batch_size=3, detector=detector, stats=stats)
    _check_against_reference(model, tokenizer, convs, records, detector)
    assert stats.prefix_mismatch == stats.turns - len(records) > 0 and stats.reused_tokens > 0
    # The slot's tokens are not all a prefix here: keeping them all would be wrong, and is caught.
    sabotage_slot_reuse(monkeypatch, lambda start, kv, prompt: min(len(kv), len(prompt) - 1))
    with pytest.raises(AssertionError):
        _check_against_reference(model, tokenizer, convs,
                                 _regen_all_turns(model, tokenizer, convs, batch_size=3, detector=detector), detector)
    monkeypatch.undo()

    # Too long a history: the third turn's prompt does not fit --max-prompt-tokens.
    _, tokenizer = target
    model = _word_model("llama", tokenizer)
    first = max(len(regen.encode_prompt(tokenizer, c[:1])) for c in convs)
    stats = RegenStats()
    records = _regen_all_turns(model, tokenizer, convs, batch_size=3, detector=detector, max_prompt_tokens=first + 40,
                               stats=stats)
    _check_against_reference(model, tokenizer, convs, records, detector, max_prompt_tokens=first + 40)
    assert stats.shortened["prompt_too_long"] > 0 and stats.reused_tokens > 0


# ----------------------------------------------------------------------------- first turns prepared ahead

def _prepare_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name == regen.PREPARE_THREAD_NAME and t.is_alive()]


def _comparable(stats: RegenStats) -> dict:
    """Every RegenStats field but the timings (which differ from run to run)."""
    return {k: v for k, v in vars(stats).items() if k not in ("seconds", "phase_seconds")}


def _mixed_conversations() -> list:
    """Multi-turn conversations, some skipped at their first turn (too long, a forged template marker,
    no user turn) and some cut short later (a history over the prompt limit, loops, caps)."""
    convs: list = _conversations(n=8, turns=3)
    convs.insert(1, [{"role": "user", "content": " ".join(["word"] * 300)}])  # prompt_too_long
    convs.insert(3, [{"role": "user", "content": "hi <|im_end|> there"}])  # special_tokens_in_prompt
    convs.insert(5, [{"role": "assistant", "content": "no question here"}])  # no_user_turn
    convs.insert(7, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "question about cats"},
                     {"role": "assistant", "content": "x"}, {"role": "user", "content": "and <|im_start|> dogs"}])
    convs.append([{"role": "user", "content": "the last one"}, {"role": "user", "content": "long " * 80}])
    return convs


def test_prepare_ahead_equals_inline(target, monkeypatch):
    """Records (in order), every stats counter and the progress calls of a run whose first turns are
    prepared on the background thread equal those of the inline run; the thread encodes with its
    own copy of the tokenizer and the calling thread with the caller's only; no thread is left."""
    import threading

    from nemo_dflash.data.loops import LoopDetector

    _, tokenizer = target
    model, convs = _word_model("qwen3", tokenizer), _mixed_conversations()
    detector = LoopDetector(ngram=3, min_tokens=8, min_copies=2.0)
    limit = max(len(regen.encode_prompt(tokenizer, c[:1])) for c in _conversations(n=8, turns=3)) + 40
    real_encode, encoded = regen.encode_prompt_text, []

    def encode(tok, messages, previous=None):
        encoded.append((threading.current_thread().name, tok))
        return real_encode(tok, messages, previous)

    monkeypatch.setattr(regen, "encode_prompt_text", encode)
    runs = {}
    for ahead, bs in ((0, 2), (4, 2), (1, 1), (0, 1)):
        stats, calls = RegenStats(), []
        records = list(regenerate_conversations(
            model, tokenizer, iter(convs), max_new_tokens=16, turns="all", batch_size=bs, after_cut="continue",
            loop_detector=detector, max_prompt_tokens=limit, stats=stats,
            progress=lambda done, new: calls.append((done, new)), prepare_ahead=ahead))
        runs[ahead, bs] = records, _comparable(stats), calls
        assert not _prepare_threads()
    assert runs[4, 2] == runs[0, 2] and runs[1, 1] == runs[0, 1]
    records, stats, _ = runs[0, 2]
    # the mix covers what the comparison should: skips of each kind, conversations cut short, a capped
    # or looping answer, a conversation ended by its history growing too long
    assert stats["conversations"] == len(convs) and stats["written"] == len(records) >= 6
    assert set(stats["skipped"]) >= {"prompt_too_long", "special_tokens_in_prompt", "no_user_turn"}
    assert stats["shortened"]["prompt_too_long"] > 0 and stats["shortened"]["special_tokens_in_prompt"] == 1
    assert stats["turns"] > stats["written"] and stats["looping_before"] + stats["capped_before"] > 0
    producer = [tok for name, tok in encoded if name == regen.PREPARE_THREAD_NAME]
    caller = [tok for name, tok in encoded if name != regen.PREPARE_THREAD_NAME]
    assert producer and all(tok is not tokenizer for tok in producer)
    assert caller and all(tok is tokenizer for tok in caller)


def _source_failing_after(convs: list, n: int, error: BaseException):
    yield from convs[:n]
    raise error


@pytest.mark.parametrize("where", ["source", "conversation"])
def test_prepare_ahead_raises_what_inline_raises(target, where):
    """An exception from the conversations iterator, or from a malformed conversation, surfaces from
    the generator on the calling thread, after the same records and with the same stats as inline."""
    model, tokenizer = target
    convs = _conversations(n=6, turns=1)
    if where == "conversation":
        convs[4] = [{"role": "user"}]  # no content: KeyError in split_prompt

    def run(ahead: int):
        stats, records = RegenStats(), []
        source = _source_failing_after(convs, 5, ValueError("bad source at 5")) if where == "source" else iter(convs)
        with pytest.raises((ValueError, KeyError)) as info:
            for record in regenerate_conversations(model, tokenizer, source, max_new_tokens=3, batch_size=1,
                                                   stats=stats, prepare_ahead=ahead):
                records.append(record)
        return type(info.value), str(info.value), records, _comparable(stats)

    inline, ahead = run(0), run(3)
    assert ahead == inline
    assert inline[0] is (ValueError if where == "source" else KeyError)
    assert inline[3]["conversations"] == 5
    assert not _prepare_threads()


def test_prepare_ahead_thread_ends_when_closed_or_halted(target):
    """The thread is gone once the generator is closed after its first record, and once a run halted
    by should_stop ends (that run writes what the inline run writes)."""
    model, tokenizer = target
    convs = _conversations(n=40, turns=1)
    gen = regenerate_conversations(model, tokenizer, convs, max_new_tokens=3, batch_size=1, prepare_ahead=2)
    assert not _prepare_threads()  # nothing starts before the generator runs
    next(gen)
    assert _prepare_threads()  # waiting on its full queue
    gen.close()
    assert not _prepare_threads()

    def halted_run(ahead: int):
        stats, records = RegenStats(), []
        for record in regenerate_conversations(model, tokenizer, convs, max_new_tokens=3, batch_size=2,
                                               stats=stats, prepare_ahead=ahead, should_stop=lambda: bool(records)):
            records.append(record)
        return records, _comparable(stats)

    ahead, inline = halted_run(4), halted_run(0)
    assert not _prepare_threads()
    assert ahead == inline and inline[1]["halted"] and 0 < len(inline[0]) < len(convs)


def test_schedule_orders_by_user_turns_and_changes_no_record(target):
    """``most_turns_first`` starts conversations with more user turns first (stably; by their given
    position, which keys a conversation without a location, so the order changes no answer):
    records (as a set) and every stats counter but the prefill forwards equal those of the given order."""
    from nemo_dflash.data.loops import LoopDetector

    convs = [[{"role": "user", "content": f"c{i} t{t}"} for t in range(n)] for i, n in enumerate([1, 3, 2, 3, 0])]
    order = [i for i, _ in regen._scheduled(convs, "most_turns_first", "all")]
    assert order == [1, 3, 2, 0, 4]  # 3, 3, 2, 1, 0 user turns; ties keep the given order
    assert [i for i, _ in regen._scheduled(convs, "given", "all")] == [0, 1, 2, 3, 4]
    assert [i for i, _ in regen._scheduled(convs, "most_turns_first", "first")] == [0, 1, 2, 3, 4]

    _, tokenizer = target
    model, convs = _word_model("llama", tokenizer), _mixed_conversations()
    detector = LoopDetector(ngram=3, min_tokens=8, min_copies=2.0)
    limit = max(len(regen.encode_prompt(tokenizer, c[:1])) for c in _conversations(n=8, turns=3)) + 40
    runs = {}
    for schedule in regen.SCHEDULES:
        stats = RegenStats()
        records = list(regenerate_conversations(
            model, tokenizer, convs, max_new_tokens=16, turns="all", batch_size=2, after_cut="continue",
            loop_detector=detector, max_prompt_tokens=limit, stats=stats, schedule=schedule))
        runs[schedule] = records, _comparable(stats)
    (given, given_stats), (sched, sched_stats) = runs["given"], runs["most_turns_first"]
    key = lambda r: json.dumps(r, sort_keys=True)  # noqa: E731
    assert sorted(map(key, sched)) == sorted(map(key, given))
    assert given_stats == sched_stats
    assert [r["messages"][0] for r in sched] != [r["messages"][0] for r in given]  # the order did change
    with pytest.raises(ValueError, match="schedule must be one of"):
        regenerate_conversations(model, tokenizer, convs, turns="all", schedule="shortest")


class _CallSpy:
    """A tokenizer whose encodings are recorded (the text lengths it was asked to tokenise)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer, self.lengths = tokenizer, []

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self._tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.mark.parametrize("which", ["smollm2", "qwen3"])
def test_later_turns_reuse_the_previous_prompts_tokens_exactly(which):
    """A later turn's ids from the previous prompt's tokens (up to its last special token) plus the
    rest, tokenised alone, equal a whole encoding: answers starting or ending in whitespace and
    newlines, code, unicode, a reasoning block (which Qwen3's template drops from earlier turns).
    The reuse happens (the spy sees shorter texts); a previous prompt that the new one does not
    extend falls back to the whole encoding."""
    from _data_fixtures import qwen3_tokenizer, smollm2_tokenizer

    from nemo_dflash.data.chat_template import encode_prompt_text

    tokenizer = smollm2_tokenizer() if which == "smollm2" else qwen3_tokenizer()
    answers = ["\n\nSure:\n```py\ndef f(x):\n    return x  # ok\n```\n", "  leading spaces and trailing\n\n",
               "Ünïcödé — 日本語 ✓", "<think>\nreasoning here\n</think>\n\nThe answer is 4.", "ok"]
    users = ["first question?", "\nsecond, with a newline first", "third", "fourth: 2+2?", "fifth"]
    messages, previous, reused, whole_lengths = [], None, 0, []
    for user, answer in zip(users, answers):
        messages.append({"role": "user", "content": user})
        spy = _CallSpy(tokenizer)
        ids, text = encode_prompt_text(spy, messages, previous)
        whole, whole_text = encode_prompt_text(tokenizer, messages)
        assert ids == whole and text == whole_text
        reused += previous is not None and spy.lengths[-1] < len(text)
        whole_lengths.append(len(text))
        previous = (text, ids)
        messages.append({"role": "assistant", "content": answer})
    assert reused >= 3  # most later turns tokenised only their new part
    # a previous prompt that the new one does not extend (another conversation): the whole text
    spy = _CallSpy(tokenizer)
    other = [{"role": "user", "content": "unrelated"}]
    assert encode_prompt_text(spy, other, previous)[0] == encode_prompt_text(tokenizer, other)[0]
    assert spy.lengths == [len(encode_prompt_text(tokenizer, other)[1])]
