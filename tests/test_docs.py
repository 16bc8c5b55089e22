"""The docs a user reads: every command the README shows starts, the pages stay small, and every link resolves."""

from __future__ import annotations

import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from _torchrun import communicate_all

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
REPORTS = REPO / "benchmarks" / "reports"  # the dated reports: history, never edited
MB = 1_000_000
# Files that name docs pages as the reference to read (the dated reports are history and name pages of their day).
NAMING = ("README.md", "CHANGELOG.md", "Makefile", "nemo_dflash", "benchmarks", "recipes", "configs", "tests")
EXTERNAL = ("vllm", "python3 -m sglang", "sglang")  # serving engines the README shows, not part of this package


def _tracked(under: str) -> list[Path]:
    """The files git would commit under `under` (tracked, or new and not ignored)."""
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard", "-z", under],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [REPO / p for p in out.stdout.split("\0") if p and (REPO / p).is_file()]


def bash_commands(text: str) -> list[tuple[int, list[str]]]:
    """The commands of a markdown page's bash blocks, each with the page line it starts on: continuation lines
    joined, comments dropped."""
    commands = []
    for block in re.finditer(r"```bash\n(.*?)```", text, flags=re.S):
        first = text.count("\n", 0, block.start(1)) + 1
        lines = block.group(1).split("\n")
        i = 0
        while i < len(lines):
            start, line = i, lines[i]
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].lstrip()
            i += 1
            words = shlex.split(line, comments=True)
            if words:
                commands.append((first + start, words))
    return commands


def readme_commands(text: str) -> list[list[str]]:
    """The commands of the README's bash blocks: continuation lines joined, comments dropped."""
    return [words for _, words in bash_commands(text)]


def help_argv(words: list[str]) -> list[str] | None:
    """The `--help` run of a README command: `python -m M` / `torchrun ... -m M` -> `python -m M --help`,
    `python SCRIPT.py [SUBCOMMAND]` -> the same with --help; None for make targets and the serving engines."""
    if words[0] == "make" or any(" ".join(words).startswith(e) for e in EXTERNAL):
        return None
    if "-m" in words and words[0] in ("python", "python3", "torchrun", ".venv/bin/python"):
        module = words[words.index("-m") + 1]
        return [sys.executable, "-m", module, "--help"]
    if words[0] in ("python", "python3") and words[1].endswith(".py"):
        sub = [words[2]] if len(words) > 2 and not words[2].startswith("-") else []
        return [sys.executable, words[1], *sub, "--help"]
    raise AssertionError(f"README command of an unknown kind: {' '.join(words)} (teach tests/test_docs.py to run it)")


def test_readme_commands_are_read_from_its_bash_blocks():
    text = "```bash\nmake demo   # a comment\ntorchrun --nproc-per-node 8 -m pkg.mod --config a.yaml \\\n    x=1\n```\n" \
           "```python\nimport x\n```\n```bash\npython benchmarks/b.py sub --flag\nvllm serve M\n```\n"
    commands = readme_commands(text)
    assert commands == [["make", "demo"], ["torchrun", "--nproc-per-node", "8", "-m", "pkg.mod", "--config", "a.yaml", "x=1"],
                        ["python", "benchmarks/b.py", "sub", "--flag"], ["vllm", "serve", "M"]]
    assert [help_argv(c) for c in commands] == [None, [sys.executable, "-m", "pkg.mod", "--help"],
                                               [sys.executable, "benchmarks/b.py", "sub", "--help"], None]
    assert [line for line, _ in bash_commands(text)] == [2, 3, 10, 11]  # the page line each command starts on


def _help_in_process(argv: tuple[str, ...], monkeypatch, capsys) -> tuple[object, str]:
    """`python -m M --help` in this process (runpy runs M as `__main__`, as `-m` does): its exit code and stdout."""
    module = argv[argv.index("-m") + 1]
    capsys.readouterr()
    with monkeypatch.context() as m, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "found in sys.modules": this process imported M before
        m.setattr(sys, "argv", [module, *argv[argv.index("-m") + 2:]])
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code
    return code or 0, capsys.readouterr().out


def test_every_readme_command_runs_with_help(monkeypatch, capsys):
    """Each command the README shows starts: its `--help` exits 0 and prints a usage; each `make` target it shows is
    one the Makefile defines. The `python -m` commands run in this process (no interpreter start-up and torch import
    each), the pipeline's also in a process of its own (a fresh interpreter, as a user starts it), and the
    scripts in processes of their own, all at once."""
    commands = readme_commands(README.read_text())
    targets = set(re.findall(r"(?m)^([\w-]+):", (REPO / "Makefile").read_text()))
    assert {c[1] for c in commands if c[0] == "make"} <= targets
    runs = sorted({tuple(a) for a in map(help_argv, commands) if a})
    assert any("nemo_dflash.recipes.pipeline" in a for a in runs) and len(runs) >= 5, runs
    modules = [a for a in runs if "-m" in a]
    fresh = [a for a in modules if "nemo_dflash.recipes.pipeline" in a]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = {a: subprocess.Popen(list(a), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for a in [*fresh, *(a for a in runs if "-m" not in a)]}
    failed = {" ".join(argv[1:]): (code, out[-1500:]) for argv in modules
              for code, out in [_help_in_process(argv, monkeypatch, capsys)] if code != 0 or "usage:" not in out}
    failed.update({" ".join(argv[1:]) + " (a process)": (rc, err[-1500:])
                   for argv, (rc, out, err) in communicate_all(procs, 300).items() if rc != 0 or "usage:" not in out})
    assert not failed, failed


def test_readme_is_under_120_lines():
    assert len(README.read_text().splitlines()) < 120


def test_docs_stay_under_their_sizes():
    """docs/ under 1.5 MB and docs/bench under 1 MB (summary rows and the plots a page cites; raw per-run files
    stay out of git)."""
    docs = sum(p.stat().st_size for p in _tracked("docs"))
    bench = sum(p.stat().st_size for p in _tracked("docs/bench"))
    assert bench < 1 * MB, f"docs/bench holds {bench / MB:.2f} MB"
    assert docs < 1.5 * MB, f"docs/ holds {docs / MB:.2f} MB"


def _pages() -> list[Path]:
    return [README, REPO / "CHANGELOG.md", *sorted(DOCS.rglob("*.md")), *sorted(REPORTS.glob("*.md"))]


def broken_links(page: Path, text: str) -> list[str]:
    """The relative links (`[x](path)`, `![x](path)`) of a markdown page that name no file or folder."""
    bad = []
    for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        if not (page.parent / target.split("#")[0]).exists():
            bad.append(target)
    return bad


def test_the_link_check_sees_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("x")
    text = "[a](a.md#s) [b](b.md) ![c](img/c.png) [web](https://x.org/y.md) [here](#top)"
    assert broken_links(tmp_path / "page.md", text) == ["b.md", "img/c.png"]


def test_every_relative_link_in_readme_changelog_and_docs_resolves():
    bad = {str(p.relative_to(REPO)): broken_links(p, p.read_text()) for p in _pages()}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_every_docs_page_a_file_names_exists():
    """`docs/NAME.md` in the README, the code, the recipes and the tests names a page that exists (pages
    renamed or merged leave no stale pointer)."""
    missing = set()
    for top in NAMING:
        root = REPO / top
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file() and p.suffix in
                                                (".py", ".md", ".yaml", ".yml", ".txt") and "__pycache__" not in p.parts
                                                and REPORTS not in p.parents]  # reports name the pages of their day
        for f in files:
            for ref in re.findall(r"docs/[\w/.-]*?\.md\b", f.read_text(errors="ignore")):
                if not (REPO / ref).is_file() and f != Path(__file__):
                    missing.add((str(f.relative_to(REPO)), ref))
    assert not missing, sorted(missing)


@pytest.mark.parametrize("path", sorted((DOCS / "bench").glob("*.json")), ids=lambda p: p.name)
def test_no_measurement_file_repeats_a_row(path):
    """A row written twice is one measurement counted twice (`python benchmarks/_common.py dedupe FILE` drops it;
    drafter_summary.json is written keyed, one row per draft and protocol)."""
    rows = [json.dumps(r, sort_keys=True) for r in json.loads(path.read_text())]
    assert len(rows) == len(set(rows)), [i for i, r in enumerate(rows) if rows.index(r) != i]


def test_drafter_summary_has_one_row_per_draft_and_protocol():
    rows = json.loads((DOCS / "bench" / "drafter_summary.json").read_text())
    keys = [(r["draft_sha256"], r.get("draft"), *((r.get("protocol") or {}).get(k) for k in
             ("name", "max_new_tokens", "block_size", "num_prompts"))) for r in rows if r.get("draft_sha256")]
    assert len(keys) == len(set(keys)), keys
