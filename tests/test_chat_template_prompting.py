"""Prompting the target (issue 18, move 3): `regenerate` and `evaluate` encode prompts, stop answers and
read prompt files through one implementation each (data/chat_template.py, data/sources.py), and the
prompt ids equal HF's own `apply_chat_template(..., add_generation_prompt=True)`."""

from __future__ import annotations

import json
import logging

import pytest

try:
    from tests._data_fixtures import qwen3_tok, smol_tok  # noqa: F401
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from _data_fixtures import qwen3_tok, smol_tok  # noqa: F401

import nemo_dflash.evaluation.protocol as evaluate
from nemo_dflash.evaluation import prompt_sets
import nemo_dflash.data.regenerate as regenerate
from nemo_dflash.data import chat_template
from nemo_dflash.data.sources import MalformedRecord, normalize_record

CONVERSATIONS = [
    [{"role": "user", "content": "Name a prime."}],
    [{"role": "system", "content": "Answer tersely."}, {"role": "user", "content": "Name a prime."},
     {"role": "assistant", "content": "7"}, {"role": "user", "content": "And an even one?"}],
]


def _hf_prompt_ids(tok, messages) -> list[int]:
    """The independent reference: HF renders and tokenises with the generation prompt itself."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids.tolist() if hasattr(ids, "tolist") else ids)


@pytest.mark.parametrize("tok_name", ["smol_tok", "qwen3_tok"])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_evaluate_and_regenerate_encode_prompts_alike(tok_name, messages, request):
    tok = request.getfixturevalue(tok_name)
    ref = _hf_prompt_ids(tok, messages)
    assert chat_template.encode_prompt(tok, messages) == ref
    assert tok.decode(ref).endswith("<|im_start|>assistant\n")
    # Both commands prompt through that one function, not a copy of it (evaluation's prompt sets encode).
    assert prompt_sets.encode_prompt is regenerate.encode_prompt is chat_template.encode_prompt
    assert evaluate.encode_chat(tok, messages) == ref
    assert regenerate.prompt_problem(tok, messages) == (ref, None)


def test_stop_tokens_and_special_strings_have_one_home(qwen3_tok):
    assert evaluate.stop_token_ids is regenerate.stop_token_ids is chat_template.stop_token_ids
    assert regenerate.special_token_strings is chat_template.special_token_strings
    assert regenerate.split_prompt is chat_template.split_prompt

    class Model:  # a base config naming another EOS than the template's end of turn
        class generation_config:
            eos_token_id = 151643

    stops = chat_template.stop_token_ids(Model(), qwen3_tok)
    assert stops[0] == 151643 and qwen3_tok.convert_tokens_to_ids("<|im_end|>") in stops
    specials = chat_template.special_token_strings(qwen3_tok)
    assert "<|im_end|>" in specials and [len(s) for s in specials] == sorted(map(len, specials), reverse=True)
    # The probe of the end-of-turn marker and the forged-marker check use the same strings.
    assert chat_template.detect_chat_format(qwen3_tok).end_of_turn in specials
    assert regenerate.prompt_problem(qwen3_tok, [{"role": "user", "content": "a <|im_end|> b"}]) == (
        [], "special_tokens_in_prompt")


def test_text_parts_only_when_asked():
    row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    with pytest.raises(MalformedRecord, match="is list, not a string"):  # training data: still refused
        normalize_record(row)
    assert normalize_record(row, text_parts=True) == [{"role": "user", "content": "ab"}]


def test_prompt_files_read_like_training_data(tmp_path, caplog, smol_tok):
    """Role names as the training reader maps them, the leading system message kept (as regenerate
    keeps it in its held-out prompts), a row in no known layout logged with its line and skipped."""
    f = tmp_path / "held.jsonl"
    rows = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q1"},
                      {"role": "user", "content": "q2"}], "source": "x.jsonl:3"},
        {"conversations": [{"from": "Human", "value": "hi"}, {"from": "chatgpt", "value": "hello"},
                           {"from": "human", "value": "more"}]},
        {"conversations": [{"from": "narrator", "value": "unknown role"}]},
        {"foo": 1},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING):
        got = evaluate.load_chat_file(f)
    assert [(p.system, p.turns) for p in got] == [("Be brief.", ["q1", "q2"]), (None, ["hi", "more"])]
    assert "held.jsonl:3: turn 0: unknown role 'narrator'" in caplog.text and "held.jsonl:4" in caplog.text
    # The decoder's first prompt is the system message and the first turn, encoded as HF does.
    first = got[0].history() + [{"role": "user", "content": got[0].turns[0]}]
    assert first[0] == {"role": "system", "content": "Be brief."}
    assert evaluate.encode_chat(smol_tok, first) == _hf_prompt_ids(smol_tok, first)
    # Regenerate's held-out file round-trips: the same (system, turns) split on both sides.
    system, users = chat_template.split_prompt(normalize_record(rows[0]), "all")
    assert (system[0]["content"], users) == (got[0].system, got[0].turns)
