"""docs/bench/ and benchmarks/: one row schema for the measurement files, and docs that cite only what exists."""

from __future__ import annotations

import ast
import itertools
import json
import types
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _torchrun import communicate_all, run_command

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "docs" / "bench"
SCRIPTS = REPO / "benchmarks"
HEAD = ("date", "commit", "device", "command")
# The reference pages: they cite the current tools and files. CHANGELOG.md is history and may name removed ones.
PAGES = [REPO / "README.md", REPO / "Makefile", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.json")), ids=lambda p: p.name)
def test_every_measurement_file_is_a_list_of_rows(path):
    rows = json.loads(path.read_text())
    assert isinstance(rows, list) and rows, path
    for i, row in enumerate(rows):
        assert isinstance(row, dict), (path.name, i)
        assert [k for k in HEAD if k not in row] == [], (path.name, i)
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]), (path.name, i, row["date"])
    dates = [r["date"] for r in rows]
    assert dates == sorted(dates), f"{path.name}: rows are appended, so dates never go back"


def test_training_throughput_rows_share_one_schema():
    """Every row, old or new, names its shape, case and GPU count, and has the figures or the error."""
    rows = json.loads((BENCH / "train_throughput.json").read_text())
    for row in rows:
        assert row["shape"] in ("qwen3_8b", "qwen3_4b", "small", "smollm2_135m"), row
        assert isinstance(row["case"], str) and isinstance(row["world"], int), row
        assert isinstance(row["packed"], bool) and isinstance(row["compiled"], bool), row
        assert row["tokens_per_s_note"].startswith("per GPU"), row  # one meaning in every row, `world` beside it
        if "error" not in row:
            assert row["tokens_per_s"] > 0 and row["peak_gb"] > 0, row
            # a recipe's own training logs no FLOP count: its row has no MFU rather than a borrowed one
            assert (0 < row["mfu"] < 1) if row["mfu"] is not None else "recipes.train" in row["command"], row
    assert {r["world"] for r in rows} >= {1, 2, 4}


def _expand(ref: str) -> list[str]:
    """`a{b,c}d` -> [abd, acd]; `a|b` alternatives of one path segment -> both."""
    parts = re.split(r"\{([^}]*)\}", ref)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    out = ["".join(c) for c in itertools.product(*choices)]
    return [re.sub(r"[^/]*\|[^/]*", lambda m: m.group(0).split("|")[k], o) for o in out for k in (0, 1)] \
        if any("|" in o for o in out) else out


def _cited(pattern: str) -> set[tuple[str, str]]:
    found = set()
    for page in PAGES:
        for ref in re.findall(pattern, page.read_text()):
            found.add((page.name, ref.rstrip(".,:)")))
    return found


def test_the_pages_cite_only_scripts_that_exist():
    missing = {(page, ref) for page, ref in _cited(r"benchmarks/[A-Za-z0-9_-]+\.(?:py|sh)\b") if not (REPO / ref).is_file()}
    assert not missing, sorted(missing)


def test_the_pages_cite_only_measurement_files_that_exist():
    """A cited file exists, or is the output a shipped benchmark names and has not been run for yet."""
    outputs = {m for f in SCRIPTS.iterdir() if f.is_file() for m in re.findall(r"docs/bench/[\w.-]+\.json", f.read_text())}
    missing = set()
    for page, ref in _cited(r"docs/bench/[A-Za-z0-9_./{},|*-]+"):  # a glob (`*`) names a family of files
        if ref in outputs or "*" in ref:
            continue
        missing.update((page, p) for p in _expand(ref) if not (REPO / p).exists())
    assert not missing, sorted(missing)


def _py_scripts() -> list[Path]:
    return sorted(p for p in SCRIPTS.glob("*.py"))


@pytest.mark.parametrize("script", _py_scripts(), ids=lambda p: p.name)
def test_benchmarks_take_flags_not_environment_variables(script):
    """Knobs are argparse flags; the environment is read only for torchrun's rank variables."""
    tree = ast.parse(script.read_text())
    reads = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                and isinstance(node.args[0], ast.Constant):
            owner = ast.unparse(node.func.value)
            if (owner == "os.environ" and node.func.attr == "get") or ast.unparse(node.func) == "os.getenv":
                reads.add(node.args[0].value)
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ" \
                and isinstance(node.ctx, ast.Load):
            reads.add(node.slice.value if isinstance(node.slice, ast.Constant) else ast.unparse(node.slice))
    assert reads <= {"WORLD_SIZE", "RANK", "LOCAL_RANK"}, sorted(reads)
    assert "argparse" in script.read_text()


@pytest.fixture(scope="module")
def helps(request) -> dict[str, tuple[int, str, str]]:
    """The `--help` of every script a selected test asks about, each in a process of its own, started together
    (their imports overlap on the cores): name -> (exit status, stdout, stderr)."""
    selected = {item.callspec.params["script"].name for item in request.session.items
                if getattr(item, "originalname", None) == "test_every_benchmark_script_starts"}
    procs = {p.name: subprocess.Popen([sys.executable, str(p), "--help"], cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True,
                                      env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
             for p in _py_scripts() if p.name in selected}
    return communicate_all(procs, 240)


@pytest.mark.parametrize("script", _py_scripts(), ids=lambda p: p.name)
def test_every_benchmark_script_starts(script, helps):
    """`--help` runs: the script imports, and its flags parse."""
    returncode, stdout, stderr = helps[script.name]
    assert returncode == 0, stderr[-2000:]
    assert "usage:" in stdout



@pytest.mark.parametrize("fsdp2", [False, True])
def test_the_trainer_step_under_torchrun_counts_the_worlds_tokens(tmp_path, monkeypatch, fsdp2):
    """`train_throughput.py --shape smollm2_135m` under torchrun (two CPU ranks, gloo): DDP or FSDP2 as `train`
    wraps it, each rank its own batches, and a step's tokens are both ranks' batches, counted here from the
    batches. The step updates the wrapped draft (a gradient norm above zero: an optimizer over the parameters
    FSDP2 replaced sees none). In fp32, one draft layer, 8 anchors: a CPU without bf16 matmuls (AMX, AVX512-BF16)
    takes minutes a bf16 step of this shape (318 s for the run in bf16 with oneDNN held to AVX2, 10 s in fp32)."""
    from nemo_dflash.data.synthetic import make_packed_batches
    from nemo_dflash.evaluation.rows import throughput_row

    # 2 batches a rank (4 in all), warm-up step 0 then steps 1 and 2: each batch stepped once, on its rank
    batches = make_packed_batches(4, 1, 256, 104, 0.15, 0.25, 49152)
    expected = sum(float(b["attention_mask"].sum()) for b in batches) / 2
    out = tmp_path / "rows.json"
    res = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       str(SCRIPTS / "train_throughput.py"), "--shape", "smollm2_135m", "--device", "cpu",
                       "--cases", "1:8:104:0:0:256", "--steps", "2", "--warmup", "1", "--distinct-batches", "2",
                       "--precision", "fp32", "--draft-layers", "1", "--json", str(out),
                       *(["--fsdp2"] if fsdp2 else [])], 240, cwd=REPO,
                      env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"cpu x2 ({'FSDP2' if fsdp2 else 'DDP'})" in res.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["world"] == 2 and row["tokens_step"] == pytest.approx(expected), (row, expected)
    assert row["grad_norm"] > 0 and row["fsdp2"] is fsdp2 and row["cpu_threads"] == 1, row  # OMP_NUM_THREADS=1
    assert row["precision"] == "fp32" and row["anchors"] == 8, row
    # the appended row is per GPU: the world's tokens a step over the step time, over the world
    bench_args = types.SimpleNamespace(commit="abc1234", shape="smollm2_135m", data=None)
    made = throughput_row(bench_args, "cpu", {**row, "mfu": 0.5}, world=2, packed=True, compiled=False, case="c")
    assert made["tokens_per_s"] == pytest.approx(row["tokens_s"] / 2, abs=0.1) and made["world"] == 2
    assert made["tokens_per_s_note"] == "per GPU" and made["fsdp2"] is fsdp2 and made["backend"] == "sdpa"


def test_a_row_names_torchrun_when_it_ran_under_it(monkeypatch):
    from nemo_dflash.evaluation import rows

    monkeypatch.setattr(sys, "argv", ["benchmarks/train_throughput.py", "--shape", "smollm2_135m"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert rows.this_command() == "python benchmarks/train_throughput.py --shape smollm2_135m"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert rows.this_command() == "torchrun --nproc-per-node 2 benchmarks/train_throughput.py --shape smollm2_135m"


def test_a_row_names_the_commit_of_the_tree_that_ran(tmp_path, monkeypatch):
    """A checkout gives its HEAD (+dirty when a tracked file changed); a copied tree's `.commit` file wins over
    the copy's own git state, which does not know the commit the tree holds."""
    from nemo_dflash.evaluation.rows import git_commit

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert git_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == head + "+dirty"
    (tmp_path / ".commit").write_text("abc1234\n")
    assert git_commit(tmp_path) == "abc1234 (copied tree)"
    assert git_commit(tmp_path / "nowhere") is None


def test_no_run_artifact_under_docs_bench_is_larger_than_200_kb():
    """docs/bench keeps summary rows and plots; per-step metrics and per-answer files stay out of git."""
    big = {str(p.relative_to(REPO)): p.stat().st_size for p in BENCH.rglob("*") if p.is_file()
           and p.stat().st_size > 200_000}
    assert not big, big


def test_benchmarks_are_at_most_eight_files():
    assert len([p for p in SCRIPTS.iterdir() if p.is_file()]) <= 8, sorted(p.name for p in SCRIPTS.iterdir())


_DATE = re.compile(r"20\d\d-\d\d-\d\d")
# a date inside a report's or a bench file's name, or a link's text, is a name, not a figure's date
_NAMED = re.compile(r"reports/20\d\d-\d\d-\d\d[\w.-]*|bench/[\w./-]*20\d\d-\d\d-\d\d[\w./-]*|\[20\d\d-\d\d-\d\d[^\]]*\]")


def _undated_by_a_current_figure(text: str) -> list[str]:
    """Paragraphs that carry a date outside a "current figure" (the reference pages' only dated statements)."""
    return [p[:120] for p in re.split(r"\n\s*\n", text)
            if _DATE.search(_NAMED.sub("", p)) and not re.search(r"[Cc]urrent figure", p)]


def test_reference_pages_date_only_their_current_figures():
    """README and docs/*.md are a user's reference: a date appears only with the figure it measured (history
    lives in CHANGELOG.md and the dated reports)."""
    found = {page.name: _undated_by_a_current_figure(page.read_text()) for page in PAGES if page.suffix == ".md"}
    assert not {k: v for k, v in found.items() if v}, found


def test_the_date_check_sees_a_diary_line():
    assert _undated_by_a_current_figure("Intro.\n\nOn 2026-11-20 we tried X.\n\nCurrent figure (2026-11-21): 3x.") \
        == ["On 2026-11-20 we tried X."]
    assert _undated_by_a_current_figure("See [2026-11-20-x.md](reports/2026-11-20-x.md) and docs/bench/r_2026-11-20/a.png.") \
        == []
