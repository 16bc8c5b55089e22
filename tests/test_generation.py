"""The engine's plain rows on a request queue (`engine.plain.PlainEngine`: regeneration, Magpie prompts, replay's
answers) against HF's own greedy generate, and their keyed samples against the softmax they sample."""

from __future__ import annotations

import collections

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from _spec_fixtures import force_answers, sabotage_slot_reuse

from nemo_dflash.engine import batched_static
from nemo_dflash.engine.plain import PlainEngine, Request, auto_rows, check_rows_fit
from nemo_dflash.engine.sampling import SamplingParams

STOP = 2


def _llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def _qwen3():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    return Qwen3ForCausalLM(cfg).eval()


def _prompts(n: int = 11) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 300, (int(k),), generator=g).tolist() for k in torch.randint(1, 40, (n,), generator=g)]


def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=STOP,
                         pad_token_id=0)[0, len(prompt):].tolist()
    return out[: out.index(STOP)] if STOP in out else out


def _answers(engine: PlainEngine, requests) -> dict:
    return {c.request.key: c for c in engine.generate(collections.deque(requests))}


@pytest.mark.parametrize("make", [_llama, _qwen3])
@pytest.mark.parametrize("window,refill", [(1, 1), (3, 2)])
def test_greedy_equals_one_at_a_time_hf_generate(make, window, refill):
    """4 rows for 11 prompts of 1-39 tokens: rows are refilled mid-run (alone or two at a time, prompts of
    different lengths prefilled together) and read back every step or every 3; every answer is HF's
    unbatched greedy answer, its finish and token count those of that answer."""
    model, prompts = make(), _prompts()
    engine = PlainEngine(model, rows=4, max_prompt_tokens=64, max_new_tokens=24, stop_ids=[STOP], window=window,
                         refill_rows=refill)
    done = _answers(engine, [Request(i, p) for i, p in enumerate(prompts)])
    assert sorted(done) == list(range(len(prompts)))
    for i, p in enumerate(prompts):
        want = _hf_greedy(model, p, 24)
        assert done[i].token_ids == want, i
        assert done[i].finish == ("stop" if len(want) < 24 else "length")
        assert done[i].generated == len(want) + (len(want) < 24)
    assert engine.generated_tokens == sum(c.generated for c in done.values())


def test_requests_added_while_running_are_answered():
    """The caller appends follow-up requests as completions arrive (multi-turn)."""
    model, prompts = _llama(), _prompts(4)
    engine = PlainEngine(model, rows=2, max_prompt_tokens=128, max_new_tokens=8, stop_ids=[STOP])
    pending = collections.deque(Request(i, p) for i, p in enumerate(prompts))
    answers = {}
    for c in engine.generate(pending):
        answers[c.request.key] = c.token_ids
        if c.request.key < 4:  # a second turn: the prompt, the answer, a new user token
            pending.append(Request(c.request.key + 100, c.request.prompt_ids + c.token_ids + [7]))
    assert len(answers) == 8
    for i, p in enumerate(prompts):
        assert answers[i + 100] == _hf_greedy(model, p + answers[i] + [7], 8)


def test_sampled_answers_are_a_function_of_their_key():
    """At T > 0 an answer depends on its prompt, its key and the seed only: not on the rows, the order the
    requests come in, or which prompts share the batch; another seed draws other answers."""
    model, prompts = _llama(), _prompts(8)

    def run(rows: int, order: list[int], seed: int = 5) -> dict[int, list[int]]:
        engine = PlainEngine(model, rows=rows, max_prompt_tokens=64, max_new_tokens=12, stop_ids=[STOP],
                             sampling=SamplingParams(1.0, top_p=0.9), seed=seed)
        return {k: c.token_ids for k, c in _answers(engine, [Request(i, prompts[i]) for i in order]).items()}

    base = run(3, list(range(8)))
    assert run(8, list(range(8))) == base
    assert run(2, list(reversed(range(8)))) == base
    assert run(1, [5, 2]) == {5: base[5], 2: base[2]}
    assert run(3, list(range(8)), seed=6) != base


def test_sampled_first_tokens_follow_the_filtered_softmax():
    """2,000 requests of one prompt, each its own key, one token each: the tokens' frequencies are the target's
    top-p filtered distribution at T (each row's keyed draw, `sampling.keyed_draw`)."""
    model, ids = _llama(), [3, 5, 7]
    s = SamplingParams(0.7, top_p=0.8)
    with torch.no_grad():
        want = s.probs(model(torch.tensor([ids])).logits[0, -1])
    n = 2000
    engine = PlainEngine(model, rows=500, max_prompt_tokens=8, max_new_tokens=1, stop_ids=[STOP], sampling=s, seed=1)
    got = _answers(engine, [Request(i, ids) for i in range(n)])
    tokens = torch.tensor([c.output.output_ids[0] for c in got.values()])
    freq = torch.bincount(tokens, minlength=want.numel()).float() / n
    assert (freq - want).abs().max() < 0.035
    assert freq[want == 0].sum() == 0  # nothing outside the nucleus


def test_unsupported_models_and_settings_are_refused_in_one_line():
    model = _llama()
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="full-attention targets only") as e:
        PlainEngine(model, rows=2, max_prompt_tokens=8, max_new_tokens=8, stop_ids=[STOP])
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        PlainEngine(_llama(), rows=2, max_prompt_tokens=8, max_new_tokens=8, stop_ids=[STOP], use_graphs=True)
    engine = PlainEngine(_llama(), rows=2, max_prompt_tokens=8, max_new_tokens=8, stop_ids=[STOP])
    with pytest.raises(ValueError, match="does not fit the rows' cache"):
        list(engine.generate(collections.deque([Request(0, list(range(3, 300)))])))
    with pytest.raises(ValueError, match="max_new_tokens 9"):
        list(engine.generate(collections.deque([Request(0, [3, 4], max_new_tokens=9)])))


def test_rows_that_do_not_fit_are_refused_before_the_cache_is_made():
    """The KV check of a GPU run (reachable on a CPU through its function): one line naming the --batch-size that
    fits; `--batch-size auto` takes 97% of what fits, at most 2,048 (8 off a GPU)."""
    check_rows_fit(10, 512, row_bytes=1000, free_bytes=100_000)  # 10 kB of 90 kB usable
    with pytest.raises(ValueError, match=r"--batch-size 90 or less") as e:
        check_rows_fit(91, 512, row_bytes=1000, free_bytes=100_000)
    assert "\n" not in str(e.value)
    assert auto_rows(1213) == 1213 - 37 and auto_rows(10_000) == 2048 and auto_rows(None) == 8


def _converse(model, *, rows: int, mode: str, turns: int = 3, convs: int = 5, max_new: int = 8,
              turns_of: list[int] | None = None, reuse: bool = True, refill: int | None = None):
    """Multi-turn on raw ids: turn t's prompt is the previous prompt + the kept answer + an end-of-turn token +
    the next user turn + a generation-prompt token. ``mode``: "prefix" (the whole answer kept), "cut" (only its
    first half: the row holds tokens the next prompt lacks), "rewrite" (the next prompt also changes its second
    token, as a template that rewrites earlier turns does). Every later turn continues in its conversation's row.
    Returns the engine and {(conversation, turn): (prompt, answer)}."""
    turns_of = turns_of or [turns] * convs
    g = torch.Generator().manual_seed(2)
    users = [[torch.randint(3, 300, (int(k),), generator=g).tolist()
              for k in torch.randint(2, 12, (turns,), generator=g)] for _ in range(convs)]
    engine = PlainEngine(model, rows=rows, max_prompt_tokens=160, max_new_tokens=max_new, stop_ids=[STOP],
                         reuse_rows=reuse, refill_rows=refill)
    pending = collections.deque(Request(c * 10, users[c][0] + [9], hold=turns_of[c] > 1) for c in range(convs))
    seen = {}
    for done in engine.generate(pending):
        c, t = divmod(done.request.key, 10)
        seen[c, t] = (done.request.prompt_ids, done.token_ids)
        if t + 1 < turns_of[c]:
            kept = done.token_ids[: len(done.token_ids) // 2] if mode == "cut" else done.token_ids
            prompt = done.request.prompt_ids + kept + [5] + users[c][t + 1] + [9]
            if mode == "rewrite":
                prompt = prompt[:1] + [4 + t % 2] + prompt[2:]
            pending.append(Request(c * 10 + t + 1, prompt, hold=t + 2 < turns_of[c], after=done))
    assert len(seen) == sum(turns_of)
    return engine, seen


@pytest.mark.parametrize("make", [_llama, _qwen3])
@pytest.mark.parametrize("mode", ["prefix", "cut", "rewrite"])
def test_later_turns_continue_in_their_row(make, mode, monkeypatch):
    """Each later turn prefills only what its prompt adds to its row's tokens (a cut answer: from the cut; a
    rewritten history: the common prefix only), and every answer is HF's unbatched greedy answer to the whole
    prompt; with 1 or 3 rows alike, and as with every prompt prefilled whole."""
    model = make()
    engine, seen = _converse(model, rows=3, mode=mode)
    for (c, t), (prompt, answer) in seen.items():
        assert answer == _hf_greedy(model, prompt, 8), (c, t)
    assert engine.continued == 10  # every later turn went on in its row
    assert engine.reused_tokens > 0 and engine.prefill_tokens + engine.reused_tokens == sum(
        len(p) for p, _ in seen.values())
    if mode == "rewrite":
        assert engine.prefix_short == 10 and engine.reused_tokens == 10  # only the first token is common
    elif mode == "cut":
        assert engine.prefix_short == 10
    else:
        assert engine.prefix_short == 0
    assert _converse(model, rows=1, mode=mode)[1] == seen
    whole, seen_whole = _converse(model, rows=3, mode=mode, reuse=False)
    assert seen_whole == seen and whole.reused_tokens == 0

    # A row kept too far (skipped tokens of the new prompt; for a cut answer, the tokens past the cut) must change
    # answers: the comparison above would catch it.
    if mode == "cut":
        sabotage_slot_reuse(monkeypatch, lambda start, kv, prompt: min(len(kv), len(prompt) - 1))
    else:
        sabotage_slot_reuse(monkeypatch, lambda start, kv, prompt: min(start + 2, len(prompt) - 1))
    wrong = _converse(model, rows=3, mode=mode)[1]
    assert any(wrong[k][1] != _hf_greedy(model, wrong[k][0], 8) for k in wrong if k[1] > 0)


def test_fresh_prompts_and_continuations_share_a_prefill(monkeypatch):
    """A refill that starts new conversations and continues others in one forward gives every answer HF's
    unbatched greedy answer; conversations of 1 to 3 turns make such refills happen."""
    mixed = []
    real = batched_static._Rows.prefill_rows

    def prefill_rows(self, rows, prompts, starts, view_len):
        mixed.append(any(starts) and not all(starts))
        return real(self, rows, prompts, starts, view_len)

    monkeypatch.setattr(batched_static._Rows, "prefill_rows", prefill_rows)
    model, turns_of = _qwen3(), [1, 3, 2, 1, 3, 2, 3]
    _, seen = _converse(model, rows=3, mode="prefix", convs=len(turns_of), turns_of=turns_of, refill=2)
    assert any(mixed)  # the case under test happened
    for (c, t), (prompt, answer) in seen.items():
        assert answer == _hf_greedy(model, prompt, 8), (c, t)


def test_loop_checks_follow_each_answer_not_the_batch(monkeypatch):
    """A looping answer is checked at its own lengths k, 2k, ... and stopped at the first one where the detector
    sees the loop: the cut, and the tokens spent, are those of a reference that runs the detector on prefixes of
    the full answer, whatever the rows, the window and the arrival order."""
    from nemo_dflash.data.loops import LoopDetector

    unit = [11, 12, 13, 14, 15]

    def rule(req, pos, tok):  # request `key` loops from answer position 9 + 7 * key
        start = 9 + 7 * req.key
        return unit[(pos - start) % len(unit)] if pos >= start else tok

    force_answers(monkeypatch, rule)
    model, prompts, every = _llama(), _prompts(6), 16
    detector = LoopDetector(ngram=3, min_tokens=20, min_copies=2.0)

    def run(rows: int, stop: bool, window: int = 1) -> dict[int, object]:
        engine = PlainEngine(model, rows=rows, max_prompt_tokens=64, max_new_tokens=120, stop_ids=[STOP],
                             loop_detector=detector, stop_on_loop=stop, loop_check_every=every, window=window)
        return _answers(engine, [Request(i, p) for i, p in enumerate(prompts)])

    full = run(6, stop=False)  # every answer to the cap (or its stop token), loops kept
    for rows, window in ((1, 1), (3, 5), (6, 1)):
        got = run(rows, stop=True, window=window)
        for key, ref in full.items():
            answer = ref.token_ids
            lengths = [n for n in range(every, len(answer) + 1, every) if detector.find(answer[:n]) is not None]
            if not lengths:  # not seen at a check: the answer ends as without checks, cut if it loops by then
                end = detector.find(answer)
                assert got[key].finish == ("loop" if end is not None else ref.finish)
                assert got[key].token_ids == (answer if end is None else answer[:end])
                continue
            n = lengths[0]
            assert got[key].finish == "loop" and got[key].generated == n, (rows, key)
            assert got[key].token_ids == answer[: detector.find(answer[:n])]
            assert got[key].loop_start == detector.find(answer[:n])
    assert sum(c.finish == "loop" for c in got.values()) >= 4  # the loops were there to be cut


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_windows_change_no_output(temperature):
    """Plain steps read back every step or every 5 (a row whose answer ends inside a window idles to its end):
    the same answers, greedy or sampled."""
    model, prompts = _qwen3(), _prompts(7)

    def run(window: int) -> dict:
        engine = PlainEngine(model, rows=3, max_prompt_tokens=64, max_new_tokens=20, stop_ids=[STOP],
                             sampling=SamplingParams(temperature, top_p=0.9), seed=3, window=window)
        return {k: (c.token_ids, c.finish) for k, c in _answers(engine, [Request(i, p) for i, p in
                                                                          enumerate(prompts)]).items()}

    assert run(5) == run(1)


@pytest.mark.parametrize("window", [1, 4])
def test_each_request_is_capped_at_its_own_max_new_tokens(window):
    """Requests of different caps share the rows; each answer is the one an engine of its own cap gives."""
    model, prompts = _llama(), _prompts(6)
    caps = [3, None, 1, 7, 12, 5]
    kw = dict(max_prompt_tokens=64, stop_ids=[STOP], sampling=SamplingParams(1.0, top_p=0.9), seed=3, window=window)
    got = _answers(PlainEngine(model, rows=2, max_new_tokens=12, **kw),
                   [Request(i, p, max_new_tokens=c) for i, (p, c) in enumerate(zip(prompts, caps))])
    for i, (p, c) in enumerate(zip(prompts, caps)):
        alone = _answers(PlainEngine(model, rows=1, max_new_tokens=c or 12, **kw), [Request(i, p)])[i]
        assert (got[i].token_ids, got[i].finish) == (alone.token_ids, alone.finish), i
        assert len(got[i].output.output_ids) <= (c or 12)


def test_answers_that_end_at_their_first_token(monkeypatch):
    """A stop token or a cap of 1 at the first token ends the answer at its prefill: empty ("stop") or one token
    ("length"), its row refilled; the other answers are unchanged."""
    force_answers(monkeypatch, lambda req, pos, tok: STOP if req.key % 3 == 0 and pos == 0 else tok)
    model, prompts = _llama(), _prompts(7)
    got = _answers(PlainEngine(model, rows=2, max_prompt_tokens=64, max_new_tokens=6, stop_ids=[STOP]),
                   [Request(i, p, max_new_tokens=1 if i % 3 == 1 else None) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        if i % 3 == 0:
            assert (got[i].token_ids, got[i].finish, got[i].generated) == ([], "stop", 1)
        elif i % 3 == 1:
            want = _hf_greedy(model, p, 1)
            assert (got[i].token_ids, got[i].finish) == ((want, "length") if want else ([], "stop"))
            assert got[i].generated == 1
        else:
            assert got[i].token_ids == _hf_greedy(model, p, 6), i
