"""Batched fixed-shape decoding (the CUDA-graph path, run eagerly on CPU) against the one-prompt
decoders, answer for answer (fp32, T=0)."""

from __future__ import annotations

import pytest
import torch

from _spec_fixtures import make_draft, plain_answers_with_a_stop, random_prompts, single_thread, tiny_llama, tiny_qwen3  # noqa: F401
from nemo_dflash.inference.batched_static import (
    batched_static_autoregressive_generate, batched_static_speculative_generate,
)
from nemo_dflash.inference.spec_decode import DFlashSpeculativeDecoder


def _prompts(n: int) -> list[list[int]]:
    return random_prompts(n, seed=11, max_len=40)


@pytest.mark.parametrize("make_target", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
@pytest.mark.parametrize("block", [1, 4, 8])
def test_speculative_rows_equal_the_one_prompt_decoder(make_target, block):
    """The same tokens and acceptance lengths per row, for prompts of different lengths, a stop
    token that ends some answers early, the cap, and more rows than prompts (padding rows)."""
    target = make_target()
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=8), block_size=block)
    prompts = _prompts(5)
    free = [decoder.generate(torch.tensor([p]), max_new_tokens=30) for p in prompts]
    stop = free[0].output_ids[5]
    want = [decoder.generate(torch.tensor([p]), max_new_tokens=30, stop_token_ids=[stop]) for p in prompts]
    assert any(w.stopped for w in want) and any(not w.stopped for w in want)
    for rows in (5, 7):
        got = batched_static_speculative_generate(decoder, prompts, max_new_tokens=30, stop_token_ids=[stop],
                                                  rows=rows, use_graphs=False)
        assert [g.output_ids for g in got] == [w.output_ids for w in want]
        assert [g.acceptance_lengths for g in got] == [w.acceptance_lengths for w in want]
        assert [g.stopped for g in got] == [w.stopped for w in want]


def test_long_accepted_blocks_and_a_reused_runner():
    """A draft trained on the target's own answer accepts long prefixes (rows drift far apart);
    the second call reuses the first call's runner and caches (stale entries must stay hidden)."""
    from _spec_fixtures import trained_like_decoder

    prompts = _prompts(4)
    decoder = trained_like_decoder(tiny_qwen3(), prompts)
    want = [decoder.generate(torch.tensor([p]), max_new_tokens=40) for p in prompts]
    assert max(max(w.acceptance_lengths) for w in want) > 2
    for order in (prompts, prompts[::-1]):
        got = batched_static_speculative_generate(decoder, order, max_new_tokens=40, use_graphs=False)
        exp = want if order is prompts else want[::-1]
        assert [g.output_ids for g in got] == [w.output_ids for w in exp]
        assert [g.acceptance_lengths for g in got] == [w.acceptance_lengths for w in exp]


@pytest.mark.parametrize("make_target", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
def test_plain_rows_equal_plain_decoding(make_target):
    target = make_target()
    prompts = _prompts(4)
    want, stop = plain_answers_with_a_stop(target, prompts, 25, row=1, k=3)
    got = batched_static_autoregressive_generate(target, prompts, max_new_tokens=25, stop_token_ids=[stop],
                                                 rows=6, use_graphs=False)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    assert [g.stopped for g in got] == [w.stopped for w in want]


def test_refuses_sampling_and_too_few_rows():
    target = tiny_qwen3()
    decoder = DFlashSpeculativeDecoder(target, make_draft(target, block_size=4))
    with pytest.raises(ValueError, match="T=0 only"):
        batched_static_speculative_generate(decoder, [[1, 2]], temperature=1.0, use_graphs=False)
    with pytest.raises(ValueError, match="rows"):
        batched_static_autoregressive_generate(target, [[1, 2], [3]], rows=1, use_graphs=False)


def _record_draft(decoder) -> tuple[list[torch.Tensor], object]:
    """Every draft forward's block hidden states [rows, B, H], in call order."""
    calls: list[torch.Tensor] = []
    handle = decoder.draft.register_forward_hook(lambda m, a, out: calls.append(out.detach().clone()))
    return calls, handle


@pytest.mark.parametrize("make_target", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
def test_every_rows_draft_sees_what_the_one_prompt_draft_sees(make_target):
    """Stronger than equal answers (a random draft's proposals are mostly rejected either way): each
    row's draft output at every step equals the one-prompt decoder's, so each row's context, positions
    and masks are its own."""
    from _spec_fixtures import trained_like_decoder

    prompts = _prompts(4)
    decoder = trained_like_decoder(make_target(), prompts)
    want, lens = [], []
    for p in prompts:
        calls, handle = _record_draft(decoder)
        out = decoder.generate(torch.tensor([p]), max_new_tokens=30)
        handle.remove()
        want.append([c[0] for c in calls])
        lens.append(len(out.acceptance_lengths))
    calls, handle = _record_draft(decoder)
    got = batched_static_speculative_generate(decoder, prompts, max_new_tokens=30, rows=5, use_graphs=False)
    handle.remove()
    assert [len(g.acceptance_lengths) for g in got] == lens
    first, later = calls[: len(prompts)], calls[len(prompts):]  # step 1 row by row, then all rows a step
    for r in range(len(prompts)):
        rows = [first[r][0]] + [step[r] for step in later[: lens[r] - 1]]
        assert len(rows) == len(want[r])
        for k, (g, w) in enumerate(zip(rows, want[r])):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m: f"row {r} step {k}: {m}")
