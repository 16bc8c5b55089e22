"""The data mix under a time cap: a slow multi-turn source does not take the whole budget (SourceMix), the
achieved mix is reported against the asked one, and a source that cannot fill its share is refused
(tiny random Qwen3 with the real Qwen3 tokenizer; answers forced to known lengths)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from _spec_fixtures import force_answers
from _tiny_target import make_tiny_target_dir

import nemo_dflash.target.loading
from nemo_dflash.data.regenerate import SourceMix, regenerate_conversations
from nemo_dflash.data.sources import Conversation
from nemo_dflash.recipes import regenerate as cli
from nemo_dflash.target.loading import load_target

SLOW_TOKENS, FAST_TOKENS = 12, 3  # answer lengths forced per source (the end-of-turn token after them)
SLOW_TURNS = 3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_tiny_target_dir(tmp_path_factory.mktemp("mix"))


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(str(target_dir), dtype="fp32")


def _conversations(n_slow: int = 30, n_fast: int = 60) -> tuple[list[Conversation], dict[str, str]]:
    """Slow: ShareGPT-like, SLOW_TURNS user turns with long answers; fast: one code prompt, short answers.
    Shuffled together as a selection is."""
    import random

    convs, source_of = [], {}
    for i in range(n_slow):
        msgs = []
        for t in range(SLOW_TURNS):
            msgs += [{"role": "user", "content": f"chat {i} turn {t}"}, {"role": "assistant", "content": "x"}]
        convs.append(Conversation(msgs, f"chat.jsonl:{i + 1}"))
        source_of[convs[-1].location] = "chat"
    for i in range(n_fast):
        convs.append(Conversation([{"role": "user", "content": f"write code {i}"}], f"code.jsonl:{i + 1}"))
        source_of[convs[-1].location] = "code"
    random.Random(0).shuffle(convs)
    return convs, source_of


def _force_lengths(monkeypatch, tokenizer) -> None:
    word = tokenizer.convert_tokens_to_ids("Hello")
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def rule(req, pos, t):
        length = SLOW_TOKENS if req.tag.source.startswith("chat") else FAST_TOKENS
        return eot if pos >= length else word

    force_answers(monkeypatch, rule)


def _supervised(records: list[dict]) -> dict[str, int]:
    """Hand count: each written answer is its forced tokens plus the end-of-turn token."""
    out = {"chat": 0, "code": 0}
    for r in records:
        name = "chat" if r["source"].startswith("chat") else "code"
        answers = sum(m["role"] == "assistant" for m in r["messages"])
        out[name] += answers * ((SLOW_TOKENS if name == "chat" else FAST_TOKENS) + 1)
    return out


def _capped(model, tokenizer, convs, *, answers: int, mix=None, prepare_ahead: int = 0) -> list[dict]:
    """A run stopped after ``answers`` answers (a time cap, made deterministic)."""
    seen = {"n": 0}

    def should_stop() -> bool:
        seen["n"] += 1
        return seen["n"] >= answers

    return list(regenerate_conversations(
        model, tokenizer, convs, max_new_tokens=16, batch_size=4, turns="all", loops="keep",
        schedule="most_turns_first", should_stop=should_stop, mix=mix, prepare_ahead=prepare_ahead))


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 3.0)])
def test_capped_run_keeps_the_asked_mix(monkeypatch, target, weights):
    model, tokenizer = target
    _force_lengths(monkeypatch, tokenizer)
    convs, source_of = _conversations()
    # without the mix, the longest conversations start first and the cap is spent on them alone (the bug)
    plain = _supervised(_capped(model, tokenizer, convs, answers=60))
    assert plain["code"] == 0 and plain["chat"] > 0
    mix = SourceMix({"chat": weights[0], "code": weights[1]}, source_of, prior_tokens=8)
    got = _supervised(_capped(model, tokenizer, convs, answers=60, mix=mix))
    asked = weights[1] / sum(weights)
    achieved = got["code"] / (got["chat"] + got["code"])
    assert abs(achieved - asked) <= 0.1 * asked, (got, asked)


def test_mix_with_the_prepare_thread(monkeypatch, target):
    """The prepare-ahead thread takes conversations from the mix while answers are credited: still the mix."""
    model, tokenizer = target
    _force_lengths(monkeypatch, tokenizer)
    convs, source_of = _conversations()
    got = _supervised(_capped(model, tokenizer, convs, answers=60, prepare_ahead=4,
                              mix=SourceMix({"chat": 1.0, "code": 1.0}, source_of, prior_tokens=8)))
    assert abs(got["code"] / (got["chat"] + got["code"]) - 0.5) <= 0.1, got


def test_uncapped_mix_answers_everything(monkeypatch, target):
    """Without a cap the mix only orders the work: every conversation is written, as without it."""
    model, tokenizer = target
    _force_lengths(monkeypatch, tokenizer)
    convs, source_of = _conversations(n_slow=4, n_fast=6)
    kw = dict(max_new_tokens=16, batch_size=3, turns="all", loops="keep")
    plain = list(regenerate_conversations(model, tokenizer, convs, **kw))
    mixed = list(regenerate_conversations(model, tokenizer, convs, mix=SourceMix({"chat": 1, "code": 1}, source_of, 8),
                                          **kw))
    key = lambda r: r["source"]  # noqa: E731
    assert sorted(mixed, key=key) == sorted(plain, key=key) and len(plain) == 10


def _write(path: Path, n: int, turns: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            msgs = []
            for t in range(turns):
                msgs += [{"role": "user", "content": f"{path.stem} {i} question {t}"},
                         {"role": "assistant", "content": "old answer"}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def test_cli_refuses_a_source_that_cannot_fill_its_share(tmp_path, monkeypatch, capsys):
    chat, code = _write(tmp_path / "chat.jsonl", 20, 2), _write(tmp_path / "code.jsonl", 1, 1)
    loaded = []
    monkeypatch.setattr(nemo_dflash.target.loading, "load_target", lambda *a, **k: loaded.append(1))
    with pytest.raises(SystemExit) as exc:
        cli.main(["--target", "x", "--data", str(chat), "--data", str(code), "--out", str(tmp_path / "o.jsonl"),
                  "--batch-size", "8", "--max-minutes", "5", "--decontaminate", "off"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and not loaded  # before the target loads
    assert "code" in err[-1] and "cannot fill its share" in err[-1] and "lower its weight" in err[-1]
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_reports_the_achieved_mix(tmp_path, monkeypatch, target, caplog):
    """The summary's mix against the data report's tokens, and the one-line warning for a starved source."""
    model, tokenizer = target
    monkeypatch.setattr(nemo_dflash.target.loading, "load_target", lambda *a, **k: target)
    word, eot = tokenizer.convert_tokens_to_ids("Hello"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    force_answers(monkeypatch, lambda req, pos, t: eot if pos >= (6 if "chat" in req.tag.source else 1) else word)
    chat, code = _write(tmp_path / "chat.jsonl", 6, 2), _write(tmp_path / "code.jsonl", 2, 1)
    summary_json = tmp_path / "summary.json"
    with caplog.at_level(logging.WARNING, logger="nemo_dflash.regenerate"):
        summary = cli.main(["--target", "x", "--data", str(chat), "--data", str(code), "--out",
                            str(tmp_path / "o.jsonl"), "--batch-size", "2", "--turns", "all", "--loops", "keep",
                            "--max-new-tokens", "8", "--decontaminate", "off", "--summary-json", str(summary_json)])
    # hand count: chat 6 conversations x 2 answers x (6 + 1), code 2 x 1 x (1 + 1)
    rows = {m["name"]: m for m in summary["mix"]["sources"]}
    assert rows["chat"]["supervised_tokens"] == 84 and rows["code"]["supervised_tokens"] == 4
    assert rows["code"]["asked"] == 0.5 and rows["code"]["achieved"] == round(4 / 88, 4)
    assert rows["code"]["under_half"] and not rows["chat"]["under_half"]
    assert json.loads(summary_json.read_text())["mix"] == summary["mix"]
    lines = [r.getMessage() for r in caplog.records if "data mix" in r.getMessage()]
    assert len(lines) == 1 and "code" in lines[0] and "chat" not in lines[0].split(":")[1].split("(")[0]


def test_order_without_answers_interleaves_by_turns():
    """No answer credited (the ranks' shared queue is made ahead): the mix interleaves by user turns over weight,
    ties to the first source. Hand-computed: a has 2 turns a conversation, b one, weights 1:1."""
    a = [Conversation([{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"},
                       {"role": "user", "content": "q2"}], f"a:{i}") for i in range(3)]
    b = [Conversation([{"role": "user", "content": "q"}], f"b:{i}") for i in range(4)]
    mix = SourceMix({"a": 1.0, "b": 1.0}, {c.location: c.location[0] for c in a + b}, prior_tokens=1.0)
    order = [c.location for _, c in mix.order(a + b, "all")]
    assert order == ["a:0", "b:0", "b:1", "a:1", "b:2", "b:3", "a:2"]
    # with turns="first" every conversation is one turn: plain alternation
    mix = SourceMix({"a": 1.0, "b": 1.0}, {c.location: c.location[0] for c in a + b}, prior_tokens=1.0)
    assert [c.location for _, c in mix.order(a + b, "first")] == ["a:0", "b:0", "a:1", "b:1", "a:2", "b:2", "b:3"]
