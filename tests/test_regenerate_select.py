"""regenerate's selection of usable conversations: forked workers give the one-process result."""

from __future__ import annotations

import random

from nemo_dflash.data.sources import Conversation
from nemo_dflash.data.selection import select

from _tiny_target import make_tiny_target_dir


def test_workers_select_what_one_process_selects(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(make_tiny_target_dir(tmp_path)))
    rng = random.Random(0)
    pool = []
    for i in range(5000):  # over the 4,096 below which one process examines them
        kind = i % 10
        if kind == 0:  # no user turn
            messages = [{"role": "assistant", "content": "hello"}]
        elif kind == 1:  # a first prompt over the cap
            messages = [{"role": "user", "content": "word " * 200}]
        else:
            messages = [{"role": "user", "content": " ".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 20)))}]
        pool.append(Conversation(messages, f"t:{i}"))
    for count in (100, 4600):  # far fewer than the pool, and more than the usable ones (4,000)
        one = select(pool, tok, count=count, seed=3, turns="first", max_prompt_tokens=64, workers=1)
        two = select(pool, tok, count=count, seed=3, turns="first", max_prompt_tokens=64, workers=2)
        assert [c.location for c in two[0]] == [c.location for c in one[0]] and two[1:] == one[1:]
    chosen, skipped, examined = one
    assert len(chosen) == 4000 and skipped == {"no_user_turn": 500, "prompt_too_long": 500} and examined == 5000
