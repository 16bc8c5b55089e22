"""Evaluation: prompt sets, evaluate_acceptance, and the CLI end to end on a tiny target."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from nemo_dflash.export import export_draft
from nemo_dflash.loading import load_target
from nemo_dflash.recipes.evaluate import (
    encode_chat,
    evaluate_acceptance,
    load_chat_file,
    load_humaneval,
    load_mtbench,
    load_prompt_set,
    main as evaluate_main,
)

from _spec_fixtures import make_draft, save_tiny_qwen3_target

QWEN3_MASK_ID = 151669


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Many tiny forwards: on a shared 2-core CPU extra threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    return save_tiny_qwen3_target(tmp_path_factory.mktemp("target"), num_layers=2, hidden=32)


@pytest.fixture(scope="module")
def target_and_tokenizer(tiny_target_dir):
    return load_target(str(tiny_target_dir), dtype="fp32")


@pytest.fixture(scope="module")
def exported_draft(target_and_tokenizer, tmp_path_factory):
    target, _ = target_and_tokenizer
    draft = make_draft(target, num_layers=1, block_size=4, mask_token_id=QWEN3_MASK_ID, layer_ids=[0, 1])
    return export_draft(draft, tmp_path_factory.mktemp("export") / "draft")


def test_builtin_prompt_sets():
    mt = load_mtbench()
    assert len(mt) == 80 and all(len(p.turns) == 2 for p in mt)
    he = load_humaneval()
    assert len(he) == 164 and "def " in he[0].turns[0] and he[0].id == "HumanEval/0"
    assert len(load_prompt_set("MT-Bench", 3)[1]) == 3
    with pytest.raises(ValueError, match="Unknown dataset"):
        load_prompt_set("gsm9k")


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
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"foo": 1}) + "\n")
    with pytest.raises(ValueError, match="No user turn"):
        load_chat_file(bad)
    with pytest.raises(FileNotFoundError):
        load_chat_file(tmp_path / "missing.jsonl")


def test_evaluate_acceptance(target_and_tokenizer, exported_draft):
    from nemo_dflash.export import load_draft

    target, tok = target_and_tokenizer
    draft = load_draft(exported_draft, dtype="fp32").train()  # as a training loop would pass it
    ids = encode_chat(tok, [{"role": "user", "content": "hello"}])
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    res = evaluate_acceptance(target, tok, draft, ["hello", [{"role": "user", "content": "hi"}]],
                              max_new_tokens=10, measure_speedup=True)
    assert res["num_prompts"] == 2 and res["greedy_match"] == 1.0
    assert sum(res["acceptance_histogram"].values()) == res["num_target_forwards"]
    assert list(res["acceptance_histogram"]) == ["1", "2", "3", "4"]
    taus = [p["acceptance_length"] for p in res["per_prompt"]]
    assert res["mean_acceptance_length"] == pytest.approx(sum(taus) / len(taus))
    assert res["speedup"] > 0 and res["spec"]["tokens_per_s"] > 0
    assert draft.training  # mode restored
    # Sampling and a smaller block run too.
    res = evaluate_acceptance(target, tok, draft, ["hello"], max_new_tokens=6, temperature=1.0, block_size=2,
                              warmup=False)
    assert list(res["acceptance_histogram"]) == ["1", "2"] and "speedup" not in res


def test_cli_end_to_end(tiny_target_dir, exported_draft, tmp_path, capsys):
    chat = tmp_path / "chats.jsonl"
    chat.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Say {i}"}]})
                              for i in range(3)) + "\n")
    out = tmp_path / "eval"
    rc = evaluate_main([
        "--draft", str(exported_draft), "--target", str(tiny_target_dir),
        "--datasets", f"mtbench,humaneval,{chat}", "--max-new-tokens", "8", "--temperature", "0",
        "--num-prompts", "2", "--multi-turn", "--out", str(out), "--device", "cpu",
    ])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "mtbench" in printed and "humaneval" in printed and "chats" in printed and "speedup" in printed
    res = json.loads((out / "results.json").read_text())
    assert set(res["datasets"]) == {"mtbench", "humaneval", "chats"}
    assert res["settings"]["block_size"] == 4 and res["settings"]["dtype"] == "fp32"
    mt = res["datasets"]["mtbench"]
    assert mt["num_prompts"] == 2 and mt["num_generations"] == 4  # two turns each
    for r in res["datasets"].values():
        assert r["greedy_match"] == 1.0
        assert 1.0 <= r["mean_acceptance_length"] <= 4.0
        assert sum(r["acceptance_histogram"].values()) == r["num_target_forwards"]
        assert r["speedup"] > 0 and r["ar"]["decode_tokens"] == r["spec"]["decode_tokens"]
    assert (out / "acceptance_histogram.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # --first-prompt splits a set across processes: prompts 1..2 of MT-Bench are the next two ids.
    rc = evaluate_main([
        "--draft", str(exported_draft), "--target", str(tiny_target_dir), "--datasets", "mtbench",
        "--max-new-tokens", "4", "--first-prompt", "1", "--num-prompts", "2", "--no-speedup",
        "--out", str(tmp_path / "eval2"), "--device", "cpu",
    ])
    assert rc == 0
    part = json.loads((tmp_path / "eval2" / "results.json").read_text())["datasets"]["mtbench"]["per_prompt"]
    assert [p["id"] for p in part] == [p.id for p in load_mtbench(3)[1:3]]

    # A draft that does not fit the target fails before any decoding, with a clear message.
    rc = evaluate_main(["--draft", str(exported_draft), "--target", str(tiny_target_dir), "--datasets", "nope",
                        "--out", str(tmp_path / "x")])
    assert rc == 1 and "Unknown dataset" in capsys.readouterr().err


def test_tokenizer_without_template(tiny_target_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir), local_files_only=True)
    tok.chat_template = None
    assert encode_chat(tok, [{"role": "user", "content": "plain"}]) == tok("plain")["input_ids"]
