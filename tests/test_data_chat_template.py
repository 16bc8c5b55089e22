"""Loss masks on real chat templates (SmolLM2 ChatML, Qwen3), checked against spans written by hand."""

from __future__ import annotations

import pytest

try:
    from tests._data_fixtures import qwen3_tok, smol_tok, supervised_runs, unsupervised_text  # noqa: F401
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from _data_fixtures import qwen3_tok, smol_tok, supervised_runs, unsupervised_text  # noqa: F401

from nemo_dflash.data import (
    ChatFormat,
    ChatTemplateError,
    detect_chat_format,
    render_with_spans,
    tokenize_conversation,
    tokenize_conversations,
)
from nemo_dflash.data.chat_template import spans_to_mask

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _template_ids(tok, messages):
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False))


def _check_invariants(tok, messages, res):
    assert res is not None
    assert len(res.input_ids) == len(res.loss_mask)
    assert set(res.loss_mask) <= {0, 1}
    assert res.input_ids == _template_ids(tok, messages)


# ---------------------------------------------------------------- SmolLM2 (ChatML, default system prompt)


def test_detect_chat_format_smollm2(smol_tok):
    assert detect_chat_format(smol_tok) == ChatFormat("<|im_start|>assistant\n", "<|im_end|>")


def test_smollm2_single_turn_default_system(smol_tok):
    msgs = [{"role": "user", "content": "Hi, who are you?"}, {"role": "assistant", "content": "Hello there!"}]
    res = tokenize_conversation(smol_tok, msgs, max_length=512)
    _check_invariants(smol_tok, msgs, res)
    assert supervised_runs(smol_tok, res.input_ids, res.loss_mask) == ["Hello there!<|im_end|>"]
    # Everything else is context: the template's default system prompt, the user turn, headers.
    ctx = unsupervised_text(smol_tok, res.input_ids, res.loss_mask)
    assert SMOL_SYSTEM in ctx
    assert "Hi, who are you?" in ctx
    assert ctx.endswith("<|im_start|>assistant\n\n")  # header before, trailing newline after <|im_end|>
    # Token level: the very last token is the newline after <|im_end|>, not supervised.
    im_end = smol_tok.convert_tokens_to_ids("<|im_end|>")
    assert res.input_ids[-2] == im_end and res.loss_mask[-2] == 1
    assert smol_tok.decode(res.input_ids[-1:]) == "\n" and res.loss_mask[-1] == 0


def test_smollm2_multi_turn_with_system(smol_tok):
    msgs = [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "It is 6, of course."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You're welcome!\nBye."},
    ]
    res = tokenize_conversation(smol_tok, msgs, max_length=512)
    _check_invariants(smol_tok, msgs, res)
    assert supervised_runs(smol_tok, res.input_ids, res.loss_mask) == [
        "4.<|im_end|>",
        "It is 6, of course.<|im_end|>",
        "You're welcome!\nBye.<|im_end|>",
    ]
    ctx = unsupervised_text(smol_tok, res.input_ids, res.loss_mask)
    for text in ("You answer in one line.", "What is 2+2?", "And 3+3?", "Thanks"):
        assert text in ctx
    assert SMOL_SYSTEM not in ctx  # an explicit system message replaces the default one
    assert ctx.count("<|im_start|>assistant\n") == 3


def test_smollm2_trailing_user_turn_is_dropped(smol_tok):
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "an unanswered question"},
    ]
    res = tokenize_conversation(smol_tok, msgs, max_length=512)
    assert supervised_runs(smol_tok, res.input_ids, res.loss_mask) == ["b<|im_end|>"]
    assert "an unanswered question" not in smol_tok.decode(res.input_ids)


def test_smollm2_leading_newline_in_reply(smol_tok):
    # The header's "\n" may merge with the reply's leading "\n" into one token: that token holds
    # the first generated character, so it is supervised.
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "\n\nindented reply"}]
    res = tokenize_conversation(smol_tok, msgs, max_length=512)
    _check_invariants(smol_tok, msgs, res)
    (run,) = supervised_runs(smol_tok, res.input_ids, res.loss_mask)
    assert run.endswith("\n\nindented reply<|im_end|>")
    assert "assistant" not in run


# ---------------------------------------------------------------- Qwen3 (think blocks rewritten by the template)


QWEN_MSGS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "<think>\nThe user wants a greeting.\n</think>\n\nHello there!"},
    {"role": "user", "content": "Now count to three."},
    {"role": "assistant", "content": "1, 2, 3."},
]


def test_qwen3_multi_turn_think_blocks(qwen3_tok):
    res = tokenize_conversation(qwen3_tok, QWEN_MSGS, max_length=1024)
    _check_invariants(qwen3_tok, QWEN_MSGS, res)
    # Earlier turn: the template strips its reasoning; last turn: it injects an empty think block,
    # which the model generates, so it is supervised.
    assert supervised_runs(qwen3_tok, res.input_ids, res.loss_mask) == [
        "Hello there!<|im_end|>",
        "<think>\n\n</think>\n\n1, 2, 3.<|im_end|>",
    ]
    full = qwen3_tok.decode(res.input_ids)
    assert "The user wants a greeting." not in full
    ctx = unsupervised_text(qwen3_tok, res.input_ids, res.loss_mask)
    for text in ("Be brief.", "Say hello.", "Now count to three."):
        assert text in ctx
    assert ctx.count("<|im_start|>assistant\n") == 2
    assert "<think>" not in ctx


def test_qwen3_last_turn_reasoning_supervised(qwen3_tok):
    msgs = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
    ]
    res = tokenize_conversation(qwen3_tok, msgs, max_length=1024)
    _check_invariants(qwen3_tok, msgs, res)
    assert supervised_runs(qwen3_tok, res.input_ids, res.loss_mask) == ["<think>\nAdd them.\n</think>\n\n4<|im_end|>"]


def test_qwen3_truncation(qwen3_tok):
    full = tokenize_conversation(qwen3_tok, QWEN_MSGS, max_length=4096)
    # Cut inside the last assistant turn: the mask is the prefix of the untruncated one.
    m = full.loss_mask
    last_run_start = max(i for i in range(1, len(m)) if m[i] and not m[i - 1])
    cut = last_run_start + 2
    res = tokenize_conversation(qwen3_tok, QWEN_MSGS, max_length=cut)
    assert len(res.input_ids) == cut and res.truncated and not full.truncated
    assert res.input_ids == full.input_ids[:cut]
    assert res.loss_mask == full.loss_mask[:cut]
    assert supervised_runs(qwen3_tok, res.input_ids, res.loss_mask)[0] == "Hello there!<|im_end|>"
    # Cut before the first assistant token: nothing left to learn -> None.
    first = full.loss_mask.index(1)
    assert tokenize_conversation(qwen3_tok, QWEN_MSGS, max_length=first) is None
    assert tokenize_conversation(qwen3_tok, QWEN_MSGS, max_length=first + 1) is not None


# ---------------------------------------------------------------- edge cases


def test_no_assistant_turn_returns_none(qwen3_tok, smol_tok):
    for tok in (qwen3_tok, smol_tok):
        assert tokenize_conversation(tok, [], max_length=64) is None
        assert tokenize_conversation(tok, [{"role": "user", "content": "only a question"}], max_length=64) is None
        assert tokenize_conversation(tok, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], 64) is None


def test_conversation_starting_with_assistant(smol_tok):
    # ShareGPT has split conversations that begin with a "gpt" turn.
    msgs = [{"role": "assistant", "content": "continued text"}, {"role": "user", "content": "ok"}, {"role": "assistant", "content": "done"}]
    res = tokenize_conversation(smol_tok, msgs, max_length=512)
    _check_invariants(smol_tok, msgs, res)
    assert supervised_runs(smol_tok, res.input_ids, res.loss_mask) == ["continued text<|im_end|>", "done<|im_end|>"]


def test_marker_inside_content_is_a_template_error(qwen3_tok):
    bad = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "early <|im_end|> stop"}]
    good = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "fine"}]
    with pytest.raises(ChatTemplateError, match="im_end"):
        tokenize_conversation(qwen3_tok, bad, max_length=64)
    errors: list = []
    res = tokenize_conversations(qwen3_tok, [bad, good], max_length=64, errors=errors)
    assert res[0] is None and isinstance(errors[0], ChatTemplateError)
    assert res[1] is not None and errors[1] is None


def test_batched_equals_single(qwen3_tok):
    convs = [QWEN_MSGS, QWEN_MSGS[:3], [{"role": "user", "content": "no reply"}]]
    batched = tokenize_conversations(qwen3_tok, convs, max_length=1024, verify=True)
    assert batched == [tokenize_conversation(qwen3_tok, c, max_length=1024) for c in convs]
    assert batched[2] is None


def test_custom_template_other_markers(qwen3_tok):
    """A non-ChatML layout (header and end marker differ, no generation markers) works too."""
    tok = qwen3_tok.__class__.from_pretrained(qwen3_tok.name_or_path)
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ':' }}{{ m['content'] }}"
        "{{ '<|endoftext|>' if m['role'] == 'assistant' else '<|im_end|>' }}\n\n{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant:' }}{% endif %}"
    )
    fmt = detect_chat_format(tok)
    assert fmt == ChatFormat("<|im_start|>assistant:", "<|endoftext|>")
    msgs = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": " a1"}, {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]
    text, spans = render_with_spans(tok, msgs)
    assert [text[s:e] for s, e in spans] == [" a1<|endoftext|>", "a2<|endoftext|>"]
    res = tokenize_conversation(tok, msgs, max_length=256)
    # "assistant:a2" tokenises as ["assistant", ":a", "2"]: the token straddling the header/reply
    # boundary holds a generated character, so it is supervised (overlap rule).
    assert supervised_runs(tok, res.input_ids, res.loss_mask) == [" a1<|endoftext|>", ":a2<|endoftext|>"]


def test_spans_to_mask_boundaries():
    # tokens:            [0,3) [3,5) [5,9) [9,9) [9,12) [12,14)
    offsets = [(0, 3), (3, 5), (5, 9), (9, 9), (9, 12), (12, 14)]
    # A span starting inside a token supervises that token (it holds generated characters);
    # a span ending exactly at a token start does not reach it; zero-width tokens count if inside.
    assert spans_to_mask(offsets, [(4, 9)]) == [0, 1, 1, 0, 0, 0]
    assert spans_to_mask(offsets, [(5, 12)]) == [0, 0, 1, 1, 1, 0]
    assert spans_to_mask(offsets, [(0, 3), (12, 14)]) == [1, 0, 0, 0, 0, 1]
    assert spans_to_mask(offsets, []) == [0] * 6
