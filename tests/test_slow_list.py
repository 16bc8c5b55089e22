"""tests/slow.txt names real tests, and tests/slow_list.py rebuilds it from a durations log."""

from __future__ import annotations

import ast
from pathlib import Path

from slow_list import slow_ids

TESTS = Path(__file__).resolve().parent


def test_every_listed_slow_test_exists():
    """An id whose test was renamed or removed would leave that test in the quick lane unnoticed."""
    ids = [line.strip() for line in (TESTS / "slow.txt").read_text().splitlines()
           if line.strip() and not line.startswith("#")]
    assert ids
    defined: dict[str, set[str]] = {}
    for node in ids:
        path, name = node.split("::", 1)
        if path not in defined:
            tree = ast.parse((TESTS.parent / path).read_text())
            defined[path] = {f.name for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert name.split("[", 1)[0] in defined[path], node


def test_slow_ids_sum_setup_call_and_teardown():
    log = ["2.00s call     tests/test_a.py::test_x", "1.00s setup    tests/test_a.py::test_y",
           "0.60s call     tests/test_a.py::test_y", "1.40s call     tests/test_b.py::test_z[p]",
           "(3 durations < 0.005s hidden.)"]
    assert slow_ids(log, 1.5) == ["tests/test_a.py::test_x", "tests/test_a.py::test_y"]
