"""The acceptance rule (`engine/acceptance.py`) against naive per-slot loops, and written nowhere else: every
decoder, replay, parity and the trainer's simulated tau count with it."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import torch

from nemo_dflash.engine.acceptance import (
    accepted_prefix, expected_block_length, greedy_accepted, greedy_accepted_list, sampled_accepted,
)

PACKAGE = Path(__file__).resolve().parent.parent / "nemo_dflash"


def _naive_prefix(flags: list[bool]) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


def test_greedy_and_sampled_rules_match_a_loop():
    g = torch.Generator().manual_seed(0)
    proposals = torch.randint(0, 3, (50, 6), generator=g)
    target = torch.randint(0, 3, (50, 7), generator=g)  # K + 1 target tokens: the last is the bonus
    got = greedy_accepted(proposals, target)
    want = [_naive_prefix([int(proposals[r, k]) == int(target[r, k]) for k in range(6)]) for r in range(50)]
    assert got.tolist() == want and 0 < sum(want) < 50 * 6  # some rows accept, none all
    u, q, p = (torch.rand(50, 6, generator=g) for _ in range(3))
    got = sampled_accepted(u, q, p)
    assert got.tolist() == [_naive_prefix([float(u[r, k]) < float(p[r, k]) / float(q[r, k]) for k in range(6)])
                            for r in range(50)]
    assert sampled_accepted(torch.full((1, 2), 0.5), torch.zeros(1, 2), torch.zeros(1, 2)).item() == 0  # q = p = 0
    assert accepted_prefix(torch.zeros(3, 0, dtype=torch.bool)).tolist() == [0, 0, 0]


def test_list_rule_and_expected_length():
    rnd = random.Random(1)
    for _ in range(200):
        d = [rnd.randrange(3) for _ in range(rnd.randrange(6))]
        t = [rnd.randrange(3) for _ in range(rnd.randrange(6))]
        assert greedy_accepted_list(d, t) == _naive_prefix([a == b for a, b in zip(d, t)])
    alpha = torch.tensor([[0.5, 0.5, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    assert expected_block_length(alpha).tolist() == [1 + 0.5 + 0.25, 5.0]  # slot 3 rejects: slot 4 never counts


def test_the_rule_is_written_once():
    """No module but engine/acceptance.py takes a cumulative product of accept decisions (the rule's form); the
    D-PACE survival weights (a product of probabilities, not decisions) are the one other cumprod."""
    allowed = {"engine/acceptance.py", "objective/selector_loss.py"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "cumprod" and rel not in allowed:
                found.append(f"{rel}:{node.lineno}")
    assert not found, found
