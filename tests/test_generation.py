"""The slot engine against HF's own greedy generate, and keyed sampling against the softmax it samples."""

from __future__ import annotations

import collections
import itertools
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from _spec_fixtures import sabotage_slot_reuse

from nemo_dflash.data.generation import EngineConfig, Request, SlotEngine
from nemo_dflash.sampling import keyed_sample

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


def _layout(layout: str) -> EngineConfig:
    """``packed`` (a packed prefill's attention by groups) or ``varlen`` (one varlen call per layer:
    on CPU its per-row reference)."""
    return EngineConfig(prefill_attention="varlen" if layout == "varlen" else "groups")


def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=STOP,
                         pad_token_id=0)[0, len(prompt):].tolist()
    return out[: out.index(STOP)] if STOP in out else out


@pytest.mark.parametrize("make", [_llama, _qwen3])
@pytest.mark.parametrize("use_flex,layout", [(False, "packed"), (True, "packed"), (False, "varlen")])
def test_greedy_equals_one_at_a_time_hf_generate(make, use_flex, layout):
    """4 slots for 11 prompts of 1-39 tokens: slots are refilled mid-run, prefills are chunked and
    packed into one row; every answer must be HF's unbatched greedy answer (flex: its CPU reference path)."""
    model, prompts = make(), _prompts()
    engine = SlotEngine(model, num_slots=4, max_prompt_tokens=64, max_new_tokens=24, stop_ids=[STOP],
                        use_flex=use_flex, max_prefill_tokens=80, config=_layout(layout))
    done = {c.request.key: c for c in engine.generate(collections.deque(Request(i, p) for i, p in enumerate(prompts)))}
    assert sorted(done) == list(range(len(prompts)))
    for i, p in enumerate(prompts):
        assert done[i].token_ids == _hf_greedy(model, p, 24), i
        assert done[i].finish == ("stop" if len(done[i].token_ids) < 24 else "length")
    assert engine.steps < len(prompts) * 24  # answers overlapped in the batch


def test_requests_added_while_running_are_answered():
    """The caller appends follow-up requests as completions arrive (multi-turn)."""
    model, prompts = _llama(), _prompts(4)
    engine = SlotEngine(model, num_slots=2, max_prompt_tokens=128, max_new_tokens=8, stop_ids=[STOP])
    pending = collections.deque(Request(i, p) for i, p in enumerate(prompts))
    answers = {}
    for c in engine.generate(pending):
        answers[c.request.key] = c.token_ids
        if c.request.key < 4:  # a second turn: the prompt, the answer, a new user token
            pending.append(Request(c.request.key + 100, c.request.prompt_ids + c.token_ids + [7]))
    assert len(answers) == 8
    for i, p in enumerate(prompts):
        assert answers[i + 100] == _hf_greedy(model, p + answers[i] + [7], 8)


def test_keyed_sampling_follows_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 40000
    rows = logits.expand(n, 6)
    keys, pos = torch.arange(n), torch.zeros(n, dtype=torch.long)
    freq = torch.bincount(keyed_sample(rows, keys, pos, seed=1, temperature=1.0, top_p=1.0), minlength=6) / n
    assert torch.allclose(freq, logits.softmax(0), atol=0.01)
    # top-p 0.8 keeps the 3 most likely tokens (cumulative 0.56, 0.77, 0.89), renormalised
    freq = torch.bincount(keyed_sample(rows, keys, pos, seed=1, temperature=1.0, top_p=0.8, candidates=3),
                          minlength=6) / n
    p = logits.softmax(0)[:3]
    assert torch.allclose(freq[:3], p / p.sum(), atol=0.01) and freq[3:].sum() == 0
    # temperature 0.5 sharpens as softmax(logits / 0.5)
    freq = torch.bincount(keyed_sample(rows, keys, pos, seed=2, temperature=0.5, top_p=1.0), minlength=6) / n
    assert torch.allclose(freq, (logits / 0.5).softmax(0), atol=0.01)


def test_keyed_sampling_is_a_function_of_its_key():
    torch.manual_seed(0)
    logits = torch.randn(64, 500) * 3
    logits[:8] = torch.randn(8, 500) * 0.01  # flat rows: the nucleus is wider than the candidates
    keys, pos = torch.arange(64), torch.arange(64) * 7
    fast = keyed_sample(logits, keys, pos, seed=3, temperature=0.8, top_p=0.9, candidates=32)
    full = keyed_sample(logits, keys, pos, seed=3, temperature=0.8, top_p=0.9, candidates=500)
    assert torch.equal(fast, full)
    # a row's token does not depend on the other rows, their order, or the batch size
    perm = torch.randperm(64)
    assert torch.equal(keyed_sample(logits[perm], keys[perm], pos[perm], seed=3, temperature=0.8, top_p=0.9)[:5],
                       fast[perm][:5])
    assert not torch.equal(fast, keyed_sample(logits, keys, pos, seed=4, temperature=0.8, top_p=0.9))
    assert torch.equal(keyed_sample(logits, keys, pos, seed=3, temperature=0.0, top_p=0.9), logits.argmax(-1))


def test_unsupported_models_are_refused_in_one_line():
    model = _llama()
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="--engine generate"):
        SlotEngine(model, num_slots=2, max_prompt_tokens=8, max_new_tokens=8, stop_ids=[STOP])
    with pytest.raises(ValueError, match="cuda"):
        SlotEngine(_llama(), num_slots=2, max_prompt_tokens=8, max_new_tokens=8, stop_ids=[STOP], cuda_graph=True)


def _converse(model, *, num_slots: int, mode: str, turns: int = 3, convs: int = 5, max_new: int = 8,
              turns_of: list[int] | None = None, config: EngineConfig | None = None):
    """Multi-turn on raw ids: turn t's prompt is the previous prompt + the kept answer + an
    end-of-turn token + the next user turn + a generation-prompt token. ``mode``: "prefix" (the
    whole answer kept), "cut" (only its first half: the slot holds tokens the next prompt lacks),
    "rewrite" (the next prompt also changes its second token, as a template that rewrites earlier
    turns does). Every later turn continues in its conversation's slot. ``turns_of``: each
    conversation's number of turns (default ``turns`` for all). Returns the engine and
    {(conversation, turn): (prompt, answer)}."""
    turns_of = turns_of or [turns] * convs
    g = torch.Generator().manual_seed(2)
    users = [[torch.randint(3, 300, (int(k),), generator=g).tolist()
              for k in torch.randint(2, 12, (turns,), generator=g)] for _ in range(convs)]
    engine = SlotEngine(model, num_slots=num_slots, max_prompt_tokens=160, max_new_tokens=max_new, stop_ids=[STOP],
                        max_prefill_tokens=64, config=config)
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
@pytest.mark.parametrize("layout", ["packed", "varlen"])
def test_later_turns_continue_in_their_slot(make, mode, layout, monkeypatch):
    """Each later turn prefills only what its prompt adds to its slot's tokens (a cut answer: the
    slot is set back to the cut; a rewritten history: the common prefix only), and every answer is
    HF's unbatched greedy answer to the whole prompt; with 1 or 3 slots alike, fresh prompts and
    continuations packed in one forward (attention by groups, or one varlen call)."""
    config = _layout(layout)
    model = make()
    engine, seen = _converse(model, num_slots=3, mode=mode, config=config)
    for (c, t), (prompt, answer) in seen.items():
        assert answer == _hf_greedy(model, prompt, 8), (c, t)
    assert engine.continued == 10  # every later turn went on in its slot
    assert engine.reused_tokens > 0 and engine.prefill_tokens + engine.reused_tokens == sum(
        len(p) for p, _ in seen.values())
    if mode == "rewrite":
        assert engine.prefix_short == 10 and engine.reused_tokens == 10  # only the first token is common
    elif mode == "cut":
        assert engine.prefix_short == 10
    else:
        assert engine.prefix_short == 0
    assert _converse(model, num_slots=1, mode=mode, config=config)[1] == seen

    # A slot filled too far (skipped tokens of the new prompt; for a cut answer, the length not set
    # back to the cut) must change answers: the comparison above would catch it. Two tokens: the
    # steps that run a stopped slot for the rest of its decode window write the K/V of its last
    # token, so a skip of one can go unnoticed.
    if mode == "cut":
        sabotage_slot_reuse(monkeypatch, lambda start, kv, prompt: min(len(kv), len(prompt) - 1))
    else:
        sabotage_slot_reuse(monkeypatch, lambda start, kv, prompt: min(start + 2, len(prompt) - 1))
    wrong = _converse(model, num_slots=3, mode=mode, config=config)[1]
    assert any(wrong[k][1] != _hf_greedy(model, wrong[k][0], 8) for k in wrong if k[1] > 0)


@pytest.mark.parametrize("make", [_llama, _qwen3])
@pytest.mark.parametrize("layout", ["packed", "varlen"])
def test_fresh_prompts_and_continuations_share_a_prefill(make, layout):
    """A packed refill that starts new conversations and continues others in one forward gives
    every answer HF's unbatched greedy answer; conversations of 1 to 3 turns make such refills happen."""
    model, turns_of = make(), [1, 3, 2, 1, 3, 2, 3]
    engine, seen = _converse(model, num_slots=3, mode="prefix", convs=len(turns_of), turns_of=turns_of,
                             config=_layout(layout))
    assert engine.prefills["prefill_mixed"] >= 1  # the case under test happened
    for (c, t), (prompt, answer) in seen.items():
        assert answer == _hf_greedy(model, prompt, 8), (c, t)


def test_loop_checks_follow_each_answer_not_the_batch(monkeypatch):
    """A looping answer is checked at its own lengths k, 2k, ... and stopped at the first one where
    the detector sees the loop: the cut, and the tokens spent, are those of a reference that runs
    the detector on prefixes of the full answer, whatever the batch size and arrival order."""
    from nemo_dflash.data.loops import LoopDetector

    unit = [11, 12, 13, 14, 15]
    real = SlotEngine._pick

    def pick(self, logits, keys, positions):  # request `key` loops from answer position 9 + 7 * key
        out, _ = real(self, logits, keys, positions)
        for row, (key, pos) in enumerate(zip(keys.tolist(), positions.tolist())):
            start = 9 + 7 * key
            if pos >= start:
                out[row] = unit[(pos - start) % len(unit)]
        return out, None

    monkeypatch.setattr(SlotEngine, "_pick", pick)
    model, prompts, every = _llama(), _prompts(6), 16
    detector = LoopDetector(ngram=3, min_tokens=20, min_copies=2.0)

    def run(num_slots: int, stop: bool) -> dict[int, object]:
        engine = SlotEngine(model, num_slots=num_slots, max_prompt_tokens=64, max_new_tokens=120, stop_ids=[STOP],
                            loop_detector=detector, stop_on_loop=stop, loop_check_every=every)
        return {c.request.key: c for c in engine.generate(collections.deque(Request(i, p) for i, p in enumerate(prompts)))}

    full = run(6, stop=False)  # every answer to the cap (or its stop token), loops kept
    for num_slots in (1, 3, 6):
        got = run(num_slots, stop=True)
        for key, ref in full.items():
            answer = ref.token_ids
            lengths = [n for n in range(every, len(answer) + 1, every) if detector.find(answer[:n]) is not None]
            if not lengths:  # not seen at a check: the answer ends as without checks, cut if it loops by then
                end = detector.find(answer)
                assert got[key].finish == ("loop" if end is not None else ref.finish)
                assert got[key].token_ids == (answer if end is None else answer[:end])
                continue
            n = lengths[0]
            assert got[key].finish == "loop" and got[key].generated == n, (num_slots, key)
            assert got[key].token_ids == answer[: detector.find(answer[:n])]
    assert sum(c.finish == "loop" for c in got.values()) >= 4  # the loops were there to be cut


def _compositions(n: int):
    """Every split of rows 0..n-1 into contiguous groups, as [i, j) bounds (the reference)."""
    if n == 0:
        yield []
        return
    for first in range(1, n + 1):
        for rest in _compositions(n - first):
            yield [(0, first)] + [(i + first, j + first) for i, j in rest]


@pytest.mark.parametrize("seed", range(6))
def test_min_cost_attention_plan_is_the_cheapest_contiguous_split(seed):
    """The attention groups of a packed prefill: the dynamic program's split of rows sorted by span
    costs what the cheapest of all contiguous splits costs (brute force), for random queries,
    spans, group costs and key-read weights."""
    from nemo_dflash.data.prefill_plan import min_cost_attention_plan

    g = torch.Generator().manual_seed(seed)
    spans = sorted(torch.randint(1, 60, (8,), generator=g).tolist())
    queries = [int(torch.randint(1, s + 1, (1,), generator=g)) for s in spans]
    group_cost, kv_read = float(torch.randint(0, 3000, (1,), generator=g)), float(torch.randint(0, 20, (1,), generator=g))

    def cost(bounds):
        return sum(group_cost + (j - i) * spans[j - 1] * (max(queries[i:j]) + kv_read) for i, j in bounds)

    bounds = min_cost_attention_plan(queries, spans, group_cost, kv_read)
    assert [r for b in bounds for r in range(*b)] == list(range(len(spans)))
    assert cost(bounds) == pytest.approx(min(cost(b) for b in _compositions(len(spans))))


def test_min_cost_attention_plan_on_a_hand_case():
    """Fresh rows (queries == span) 2, 2, 50: at a group cost of 100 pairs, 2 2 | 50 costs
    100 + 2x2x2 + 100 + 50x50 = 2708, and one group 100 + 3x50x50 = 7600; at 10^5 one group wins."""
    from nemo_dflash.data.prefill_plan import min_cost_attention_plan

    assert min_cost_attention_plan([2, 2, 50], [2, 2, 50], 100.0) == [(0, 2), (2, 3)]
    assert min_cost_attention_plan([2, 2, 50], [2, 2, 50], 1e5) == [(0, 3)]
    assert min_cost_attention_plan([], [], 1.0) == []


@pytest.mark.parametrize("group_cost", [0.0, 4096.0, 1e12])
def test_packed_prefill_runs_one_forward_per_refill(group_cost, monkeypatch):
    """A refill whose prompts fit ``max_prefill_tokens`` is one forward, and every answer is still
    HF's unbatched greedy answer, whether attention runs one group per prompt length (cost 0), a
    few, or all rows in one group."""
    from nemo_dflash.data import slot_attention

    model, prompts = _llama(), _prompts()
    total = sum(map(len, prompts))
    groups = []
    real = slot_attention.packed_attention
    monkeypatch.setattr(slot_attention, "packed_attention", lambda ck, cv, packed, *a: groups.append(len(packed.groups))
                        or real(ck, cv, packed, *a))
    engine = SlotEngine(model, num_slots=len(prompts), max_prompt_tokens=64, max_new_tokens=6, stop_ids=[STOP],
                        max_prefill_tokens=total, config=EngineConfig(attention_group_cost=group_cost))
    done = {c.request.key: c for c in engine.generate(collections.deque(Request(i, p) for i, p in enumerate(prompts)))}
    assert all(done[i].token_ids == _hf_greedy(model, p, 6) for i, p in enumerate(prompts))
    assert engine.prefill_tokens == total
    assert sum(engine.prefills.values()) == 1
    per_forward = groups[0]  # the layers of the one forward share its plan
    assert groups == [per_forward] * 2  # the tiny model's 2 layers
    # at no cost per group only rows of equal length share one (no padding); at a huge cost, one group
    assert per_forward == {0.0: len(set(map(len, prompts))), 1e12: 1}.get(group_cost, per_forward)
    assert 1 < per_forward < len(prompts) or group_cost != 4096.0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decode_windows_change_no_output(temperature, monkeypatch):
    """Decode windows of 1, 4 and 7 steps per host round trip, with 2 or 3 slots: multi-turn
    conversations (held slots), answers cut at loops (forced from a per-request position, some
    one token before the cap) and, at temperature 1 over the tiny model's flat logits, samples
    redone over the whole vocabulary (a slot stops mid-window for it) give the same completions
    and the same count of generated tokens."""
    from nemo_dflash.data.loops import LoopDetector

    unit = [11, 12, 13, 14, 15]
    real = SlotEngine._pick

    def pick(self, logits, keys, positions):  # conversation c loops from answer position 20 + 9 * (c % 4)
        out, wide = real(self, logits, keys, positions)
        start = 20 + 9 * ((keys // 10) % 4)
        loop = torch.tensor(unit, device=out.device)[(positions - start).clamp(min=0) % len(unit)]
        return torch.where(positions >= start, loop, out), None if wide is None else wide & (positions < start)

    monkeypatch.setattr(SlotEngine, "_pick", pick)
    model = _llama()
    g = torch.Generator().manual_seed(3)
    users = [[torch.randint(3, 300, (int(k),), generator=g).tolist() for k in torch.randint(2, 12, (3,), generator=g)]
             for _ in range(6)]

    def run(window: int, num_slots: int):
        engine = SlotEngine(model, num_slots=num_slots, max_prompt_tokens=200, max_new_tokens=47, stop_ids=[STOP],
                            temperature=temperature, top_p=0.9, seed=5,
                            config=EngineConfig(decode_window=window),
                            loop_detector=LoopDetector(ngram=3, min_tokens=20, min_copies=2.0), stop_on_loop=True,
                            loop_check_every=16)
        pending = collections.deque(Request(c * 10, users[c][0] + [9], hold=True) for c in range(6))
        got = {}
        for c in engine.generate(pending):
            conv, turn = divmod(c.request.key, 10)
            got[c.request.key] = (c.token_ids, c.finish, c.generated, c.loop_start)
            if turn < 2:
                prompt = c.request.prompt_ids + c.token_ids + [5] + users[conv][turn + 1] + [9]
                pending.append(Request(c.request.key + 1, prompt, hold=turn < 1, after=c))
        return got, engine

    ref, ref_engine = run(1, 3)
    assert len(ref) == 18 and {f for _, f, _, _ in ref.values()} >= {"loop"}
    if temperature > 0:
        assert ref_engine.redone > 0  # the exact redo happened
    for window, num_slots in [(4, 3), (7, 2), (4, 2)]:
        got, engine = run(window, num_slots)
        assert got == ref, (window, num_slots)
        assert engine.generated_tokens == ref_engine.generated_tokens, (window, num_slots)
        assert engine.redone == ref_engine.redone


def test_a_kv_cache_that_cannot_fit_is_refused_in_one_line():
    """SmolLM2's shape (30 layers, 3 KV heads of 64, bf16) at 2,560 tokens is 59.0 MB a slot: on an
    80 GB GPU with 76 GB free, 85% holds 1,095 slots, so 2,048 are refused naming the batch that fits."""
    from transformers import LlamaConfig

    from nemo_dflash.data.slot_attention import SlotKVCache, check_kv_fits

    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)
    per_slot = SlotKVCache.slot_bytes(cfg, 2560, torch.bfloat16)
    assert per_slot == 2 * 30 * 3 * 2560 * 64 * 2 == 58_982_400
    check_kv_fits(1095, 2560, per_slot, 76_000_000_000)
    with pytest.raises(ValueError, match=r"^2048 slots x 2560 tokens need a 120.8 GB KV cache and 76.0 GB is free: "
                                         r"use --batch-size 1095 or less"):
        check_kv_fits(2048, 2560, per_slot, 76_000_000_000)
    cache = SlotKVCache(cfg, 2, 128, torch.device("cpu"), torch.bfloat16)
    assert cache.nbytes == 2 * SlotKVCache.slot_bytes(cfg, 128, torch.bfloat16)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_compiled_decode_step_changes_no_output(temperature):
    """The decode step through torch.compile (inductor, here its CPU backend, over the SDPA path):
    greedy answers are HF's unbatched greedy answers, and sampled ones (T=1, top-p 0.9, with exact
    redos) are the eager step's, token for token."""
    model, prompts = _llama(), _prompts()

    def run(compiled: bool):
        engine = SlotEngine(model, num_slots=4, max_prompt_tokens=64, max_new_tokens=24, stop_ids=[STOP],
                            temperature=temperature, top_p=0.9, seed=3, use_flex=False, max_prefill_tokens=80,
                            config=EngineConfig(decode_compile=compiled))
        done = {c.request.key: c.token_ids
                for c in engine.generate(collections.deque(Request(i, p) for i, p in enumerate(prompts)))}
        return done, engine

    got, engine = run(True)
    assert engine.decode_compile  # it compiled and ran (no fallback)
    if temperature == 0:
        assert got == {i: _hf_greedy(model, p, 24) for i, p in enumerate(prompts)}
    else:
        ref, ref_engine = run(False)
        assert got == ref
        assert engine.redone == ref_engine.redone > 0


def test_a_decode_step_that_fails_to_compile_runs_eagerly(monkeypatch, caplog):
    """A compiled step that raises (an inductor without a compiler, a kernel it cannot lower) is
    said once and replaced by the eager step; the answers are HF's greedy answers."""
    model, prompts = _llama(), _prompts(5)

    def broken(fn, **kwargs):
        def run(*args, **kw):
            raise RuntimeError("no compiler here")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    engine = SlotEngine(model, num_slots=2, max_prompt_tokens=64, max_new_tokens=12, stop_ids=[STOP],
                        use_flex=False, config=EngineConfig(decode_compile=True))
    with caplog.at_level("WARNING"):
        done = {c.request.key: c.token_ids
                for c in engine.generate(collections.deque(Request(i, p) for i, p in enumerate(prompts)))}
    assert not engine.decode_compile
    assert sum("compiled decode step failed" in r.message for r in caplog.records) == 1
    assert done == {i: _hf_greedy(model, p, 12) for i, p in enumerate(prompts)}


def test_gpu_clock_reads_only_finished_work(monkeypatch):
    """GpuClock adds an event pair's time once its end event has completed (query), keeps the
    others for a later read, and never synchronises; the gap between one piece of work's end and
    the next one's start is the GPU's idle time before that phase (none across a pause); off CUDA
    it records nothing."""
    from nemo_dflash.data.generation import GpuClock

    class Event:  # a CUDA event on a fake clock: recorded at a time, complete once the clock passes it
        now, done_until = 0.0, 0.0

        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.at = Event.now

        def query(self):
            return self.at <= Event.done_until

        def elapsed_time(self, end):
            assert end.query(), "read before its work finished"
            return (end.at - self.at) * 1e3  # ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    clock = GpuClock(True)
    start = clock.start("decode")
    Event.now = 2.0
    clock.stop("decode", start)  # decode 0 -> 2 s
    Event.now = 2.25
    start = clock.start("prefill")  # idle 2 -> 2.25 s
    Event.now = 2.75
    clock.stop("prefill", start)  # prefill 2.25 -> 2.75 s
    Event.done_until = 2.0  # only the decode pair has finished
    clock.read()
    assert clock.seconds == {"decode": 2.0}
    Event.done_until = 3.0
    clock.read()
    assert clock.seconds == {"decode": 2.0, "idle_before_prefill": 0.25, "prefill": 0.5}
    clock.read()  # nothing counted twice
    assert clock.seconds == {"decode": 2.0, "idle_before_prefill": 0.25, "prefill": 0.5}
    clock.pause()
    Event.now = 10.0
    clock.stop("decode", clock.start("decode"))
    clock.read()
    assert "idle_before_decode" not in clock.seconds  # the 7.25 s since the pause are not counted
    off = GpuClock(False)
    off.stop("decode", off.start("decode"))
    off.read()
    assert not off.seconds


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash varlen kernel runs on GPUs")
def test_flash_varlen_attention_equals_the_per_row_reference():
    """PyTorch's flash varlen kernel, causal aligned at each row's end (rows with a cached prefix:
    fewer queries than keys), GQA 9:3 as SmolLM2, bf16: the per-row SDPA reference's output."""
    from nemo_dflash.data.slot_attention import varlen_attention, varlen_attention_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    q_lens, k_lens = [5, 1, 130, 40, 7], [5, 300, 130, 41, 900]  # fresh, decode-like, fresh, 1 cached, long prefix
    cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *itertools.accumulate(k_lens)], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), 9, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(sum(k_lens), 3, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(sum(k_lens), 3, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    out = varlen_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), 0.125)
    ref = varlen_attention_reference(q.float(), k.float(), v.float(), cu_q, cu_k, 0.125)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [1, 4])
def test_sampled_answers_equal_a_naive_keyed_decoding_loop(window):
    """At T=1 and top-p 0.9 over the tiny model's flat logits many samples (first tokens included)
    have a nucleus wider than the candidates and are redone exactly after the step or prefill that
    drew them. Every answer must be what a naive loop gives: the whole sequence through the model
    each step, the last logits through ``keyed_sample`` at (seed, key, position)."""
    model, prompts = _llama(), _prompts(7)
    engine = SlotEngine(model, num_slots=3, max_prompt_tokens=64, max_new_tokens=16, stop_ids=[STOP],
                        temperature=1.0, top_p=0.9, seed=11, config=EngineConfig(decode_window=window))
    got = {c.request.key: c.token_ids
           for c in engine.generate(collections.deque(Request(100 + i, p) for i, p in enumerate(prompts)))}
    assert engine.redone > 0
    for i, p in enumerate(prompts):
        seq, answer = list(p), []
        with torch.no_grad():
            for pos in range(16):
                logits = model(torch.tensor([seq])).logits[:, -1].float()
                tok = int(keyed_sample(logits, torch.tensor([100 + i]), torch.tensor([pos]), seed=11,
                                       temperature=1.0, top_p=0.9)[0])
                if tok == STOP:
                    break
                answer.append(tok)
                seq.append(tok)
        assert got[100 + i] == answer, i


def test_answers_that_end_at_their_first_token(monkeypatch):
    """An answer whose first token is a stop token, or one capped at a single token, ends at the
    collect after its prefill (the first token stays on the device): empty or one-token answers,
    HF's for the cap, and a held slot's follow-up still continues in it."""
    model, prompts = _llama(), _prompts(6)
    engine = SlotEngine(model, num_slots=2, max_prompt_tokens=64, max_new_tokens=1, stop_ids=[STOP])
    got = {c.request.key: (c.token_ids, c.finish)
           for c in engine.generate(collections.deque(Request(i, p) for i, p in enumerate(prompts)))}
    assert got == {i: (_hf_greedy(model, p, 1), "length") for i, p in enumerate(prompts)}

    real = SlotEngine._pick

    def pick(self, logits, keys, positions):  # even requests stop at once
        out, wide = real(self, logits, keys, positions)
        return torch.where((keys % 2 == 0) & (positions == 0), torch.full_like(out, STOP), out), wide

    monkeypatch.setattr(SlotEngine, "_pick", pick)
    engine = SlotEngine(model, num_slots=2, max_prompt_tokens=128, max_new_tokens=6, stop_ids=[STOP])
    pending = collections.deque(Request(i, p, hold=True) for i, p in enumerate(prompts))
    got = {}
    for c in engine.generate(pending):
        got[c.request.key] = (c.token_ids, c.finish)
        if c.request.key < 6:  # a follow-up (odd key: it answers) in the slot the first turn held
            pending.append(Request(101 + 2 * c.request.key, c.request.prompt_ids + c.token_ids + [7], after=c))
    for i, p in enumerate(prompts):
        first = ([], "stop") if i % 2 == 0 else (_hf_greedy(model, p, 6), got[i][1])
        assert got[i] == first, i
        follow = p + got[i][0] + [7]
        assert got[101 + 2 * i][0] == _hf_greedy(model, follow, 6), i
    assert engine.continued == 6


@pytest.mark.parametrize("window,compiled", [(1, False), (4, False), (3, True)])
def test_each_request_is_capped_at_its_own_max_new_tokens(window, compiled):
    """Requests of caps 1, 5, 9 and the engine's 16 (None) share 3 slots and decode windows (and the
    compiled step: the cap is a tensor it reads, not a branch); at T=1, top-p 0.9 (exact redos too)
    every answer, its finish and its generated count are the request's alone under an engine whose
    cap is the request's, and a held slot's follow-up takes its own cap. A cap above the engine's is
    refused naming the range."""
    model, prompts = _llama(), _prompts(9)
    caps = [1, 5, 9, None] * 3
    kw = dict(max_prompt_tokens=128, stop_ids=[STOP], temperature=1.0, top_p=0.9, seed=7,
              config=EngineConfig(decode_window=window, decode_compile=compiled))
    engine = SlotEngine(model, num_slots=3, max_new_tokens=16, **kw)
    pending = collections.deque(Request(i, p, hold=i < 3, max_new_tokens=caps[i]) for i, p in enumerate(prompts))
    got = {}
    for c in engine.generate(pending):
        got[c.request.key] = (c.request, c.token_ids, c.finish, c.generated)
        if c.request.key < 3:  # a follow-up in the held slot, with the next cap
            pending.append(Request(100 + c.request.key, c.request.prompt_ids + c.token_ids + [7], after=c,
                                   max_new_tokens=caps[c.request.key + 1]))
    assert len(got) == 12 and engine.continued == 3
    assert engine.decode_compile == compiled  # the compiled step ran (no fallback)
    kw["config"] = EngineConfig(decode_window=window)  # the references: the eager step
    alone = {}  # each request alone in one slot (one after the other) under an engine of its cap
    for cap in (1, 5, 9, 16):
        ref = SlotEngine(model, num_slots=1, max_new_tokens=cap, **kw)
        alone.update((c.request.key, c) for c in ref.generate(collections.deque(
            Request(key, req.prompt_ids) for key, (req, *_) in got.items() if (req.max_new_tokens or 16) == cap)))
    lengths = set()
    for key, (req, answer, finish, generated) in got.items():
        cap, ref = req.max_new_tokens or 16, alone[key]
        assert (answer, finish, generated) == (ref.token_ids, ref.finish, ref.generated), key
        assert len(answer) <= cap and (finish != "length" or len(answer) == cap)
        lengths.add((cap, finish))
    assert {(1, "length"), (5, "length"), (9, "length")} <= lengths  # the caps cut answers
    assert engine.redone > 0
    with pytest.raises(ValueError, match=r"max_new_tokens 17; the engine takes 1..16"):
        list(engine.generate(collections.deque([Request(0, prompts[0], max_new_tokens=17)])))
