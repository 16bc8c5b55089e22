"""Code prompts from a source tree: read by several processes, the output is the one-process output;
code too deeply nested for ``ast`` is skipped, never a crash."""

from __future__ import annotations

import sys

from nemo_dflash.data.prompts import CODE_KINDS, code_tree_prompts, plant_bug


def _tree(root, files: int) -> None:
    for i in range(files):
        pkg = root / f"pkg{i % 7}"
        pkg.mkdir(exist_ok=True)
        (pkg / f"mod{i}.py").write_text(
            f'"""Module {i} holds helpers that add and compare numbers for the tests."""\n\n'
            f"def add_{i}(a, b=1):\n"
            f'    """Return a plus b plus {i}, or zero when a is below b."""\n'
            f"    if a < b:\n        return 0\n    return a + b + {i}\n\n\n"
            f"class Box{i}:\n"
            f'    """A box that holds one value and compares it with others."""\n\n'
            f"    def bigger(self, other):\n"
            f'        """True when this value is greater than the other value."""\n'
            f"        return self.value > other\n")


def test_workers_give_the_one_process_output(tmp_path, monkeypatch):
    import concurrent.futures

    pools = []
    real = concurrent.futures.ProcessPoolExecutor
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", lambda *a, **k: pools.append(a) or real(*a, **k))
    _tree(tmp_path, 80)  # over the 64 files below which one process reads the tree
    one = code_tree_prompts(tmp_path, name="t", exclude=set(), kinds=CODE_KINDS, workers=1)
    two = code_tree_prompts(tmp_path, name="t", exclude=set(), kinds=CODE_KINDS, workers=2)
    assert [(c.location, c.messages) for c in two] == [(c.location, c.messages) for c in one]
    assert len(pools) == 1  # the second read went through the worker pool
    kinds = {c.location.rsplit("/", 1)[-1] if "/" in c.location else "humaneval" for c in one}
    assert kinds == set(CODE_KINDS)  # every kind made, the fix prompts among them
    assert len({c.location for c in one}) == len(one) > 80 * 6


def test_too_deep_code_is_skipped(tmp_path):
    deep = "x = " + "(" * (sys.getrecursionlimit() + 50) + "1" + ")" * (sys.getrecursionlimit() + 50) + "\n"
    assert plant_bug(deep, "k") is None
    (tmp_path / "deep.py").write_text('"""A module of generated code nested far too deep."""\n' + deep)
    (tmp_path / "ok.py").write_text('def f(a):\n    """Return a plus one for the caller."""\n    return a + 1\n')
    convs = code_tree_prompts(tmp_path, name="t", exclude=set(), kinds=CODE_KINDS, workers=1)
    assert any(c.location.startswith("t:ok.f") for c in convs)
    assert not any("deep" in c.location for c in convs)


class _Question:
    def __init__(self, text: str) -> None:
        self.question = text


class _Template:
    """A stand-in for a GSM-Symbolic template: seeded questions, one template failing to sample."""

    constrained_lines: list = []

    def __init__(self, i: int) -> None:
        self.id_orig = i

    def generate_questions(self, n, replacements, seed, verbose):
        import random

        if self.id_orig == 3:
            raise ValueError("no assignment satisfies the constraints")
        rng = random.Random(seed)
        names = replacements["names"]
        return [_Question(f"{rng.choice(names)} has {rng.randint(1, 9)} apples and buys {rng.randint(1, 9)} more "
                          f"in shop {self.id_orig}. How many apples does she have now?") for _ in range(n)]


def test_gsm_workers_give_the_one_process_questions(caplog):
    from nemo_dflash.data.prompts import _gsm_questions

    templates, tables = [_Template(i) for i in range(9)], {"names": ["Ann", "Bo", "Cy"]}
    one = _gsm_questions(templates, tables, 40, 5, "gsm", workers=1)
    two = _gsm_questions(templates, tables, 40, 5, "gsm", workers=2)
    assert [(c.location, c.messages) for c in two] == [(c.location, c.messages) for c in one]
    assert len(one) == 40 and not any(c.location.startswith("gsm:3.") for c in one)
    assert "template 3 failed" in caplog.text
