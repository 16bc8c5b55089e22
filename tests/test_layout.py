"""The package's shape, checked by parsing imports (not by importing): who may import whom."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nemo_dflash"


def package_of(path: Path, root: Path = PACKAGE) -> str:
    return ".".join(path.relative_to(root.parent).with_suffix("").parts[:-1])


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module `path` (in `package`) imports, at any depth (function-level too), as absolute names."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this file's package
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from nemo_dflash.serving import export`
    return found


SERVING_EXPORT = "nemo_dflash.serving.export"


@pytest.mark.parametrize("folder", ["train", "evaluation"])
def test_train_and_evaluation_do_not_import_export(folder):
    """Drafts are built, loaded and checked by `nemo_dflash.draft.build`; `serving.export` only writes the
    serving format."""
    offenders = {
        str(f.relative_to(PACKAGE.parent)): sorted(m for m in imported_modules(f, package_of(f))
                                                   if m == SERVING_EXPORT or m.startswith(SERVING_EXPORT + "."))
        for f in sorted((PACKAGE / folder).rglob("*.py"))
    }
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_the_import_parser_sees_every_form(tmp_path):
    """The check above must not miss a function-level, `from nemo_dflash.serving import export` or relative
    import."""
    probe = tmp_path / "probe.py"
    forms = ["import nemo_dflash.serving.export", "from nemo_dflash.serving.export import export_draft",
             "from nemo_dflash.serving import export", "from ..serving.export import export_draft",
             "from ..serving import export"]
    for form in forms:
        probe.write_text(f"def f():\n    {form}\n")
        assert SERVING_EXPORT in imported_modules(probe, "nemo_dflash.evaluation"), form
    probe.write_text("from nemo_dflash.draft.build import load_draft\n")
    assert SERVING_EXPORT not in imported_modules(probe, "nemo_dflash.evaluation")


# ---- Folders that show the flow: data -> target -> draft -> objective -> train -> serving, evaluation ----

# Where each top-level module or folder sits in the flow. A module may import its own level or one
# before it, never one after it (data/ knows nothing of targets, target/ nothing of drafts, ...).
# A dotted key places one module of a folder apart from the rest (the longest key that names it wins).
FLOW = {
    "files": 0,  # the run directory's layout names and file modes: below everything
    "engine": 0,  # decoding (caches, graphs, sampling, attention, acceptance): regeneration and evaluation run on it
    "data": 1,  # chat files -> token batches; regeneration and Magpie prompts make the data
    "target": 2,  # the frozen model: loading.py, then hooks.py
    "config": 3,  # the recipe schema (reads data/ and target/ checks)
    "draft": 4,  # registry.py, build.py, model/
    "engine.spec_decode": 4,  # the one-prompt eager decoder over a real draft and target: the tests' oracle
    "objective": 5,  # anchors, block mask, losses, metrics and the trainer module
    "train": 6,  # the loop, checkpoints, and the device's memory between phases
    "serving": 7,  # export and the serving engines' limits
    "evaluation": 7,  # protocol, run, replay, parity
    "recipes": 8,  # the commands
}

# The only modules loose at the package's top: the recipe schema, the run directory's names, the facade.
LOOSE = {"__init__.py", "config.py", "files.py"}


def flow_level(name: str) -> int:
    """`name`'s level in FLOW: its longest dotted key (`engine.spec_decode` before `engine`)."""
    parts = name.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in FLOW:
            return FLOW[".".join(parts[:n])]
    raise KeyError(f"{name}: place its folder in FLOW (tests/test_layout.py)")


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, root: Path = PACKAGE) -> bool:
    base = root.parent.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def package_modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(f, root): f for f in sorted(root.rglob("*.py"))}


def _without_type_checking(tree: ast.Module) -> ast.Module:
    """`if TYPE_CHECKING:` bodies never run: drop them (their `else:` stays)."""

    class Strip(ast.NodeTransformer):
        def visit_If(self, node: ast.If):
            if "TYPE_CHECKING" in ast.unparse(node.test):
                return [self.visit(n) for n in node.orelse] or None
            return self.generic_visit(node)

    return Strip().visit(tree)


def internal_imports(path: Path, package: str, top_level_only: bool = False, root: Path = PACKAGE) -> set[str]:
    """The package modules `path` imports (`from a import b` counts as `a.b` when that is a module),
    at any depth (function-level, lazy imports too) unless `top_level_only`; never `if TYPE_CHECKING:`."""
    tree = _without_type_checking(ast.parse(path.read_text(), filename=str(path)))
    if top_level_only:
        nodes = []
        todo = list(tree.body)
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.If, ast.Try)):
                todo.extend(node.body + node.orelse + getattr(node, "handlers", []) + getattr(node, "finalbody", []))
            elif isinstance(node, ast.ExceptHandler):
                todo.extend(node.body)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                nodes.append(node)
        tree = ast.Module(body=nodes, type_ignores=[])
    top = root.name
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names if is_module(f"{base}.{a.name}", root)}
            names.update(subs or {base})
    return {n for n in names if n == top or n.startswith(top + ".")}


def test_no_module_imports_a_later_stage_of_the_flow():
    offenders = {}
    for name, path in package_modules().items():
        if name == "nemo_dflash":
            continue  # the package facade re-exports from everywhere
        level = flow_level(name)
        later = sorted(m for m in internal_imports(path, package_of(path))
                       if m != "nemo_dflash" and flow_level(m) > level)
        if later:
            offenders[name] = later
    assert not offenders, offenders




# ---- Rooms of a size a reader takes in: no loose modules, no long modules, no long functions

MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80

def loose_modules(root: Path = PACKAGE) -> list[str]:
    """The modules at the package's top that are not in LOOSE: each belongs in the folder of its job."""
    return sorted(f.name for f in root.glob("*.py") if f.name not in LOOSE)


def long_modules(root: Path = PACKAGE, limit: int = MAX_MODULE_LINES) -> dict[str, int]:
    """Modules over `limit` lines, as `nemo_dflash/...py: lines`."""
    found = {}
    for f in sorted(root.rglob("*.py")):
        lines = len(f.read_text().splitlines())
        if lines > limit:
            found[str(f.relative_to(root.parent))] = lines
    return found


def long_functions(root: Path = PACKAGE, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """Functions and methods over `limit` lines (decorators and docstring included), as `path:name: lines`."""
    found = {}
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found[f"{f.relative_to(root.parent)}:{node.name}"] = lines
    return found


def test_no_module_loose_at_the_top_but_config_files_and_the_facade():
    assert not loose_modules(), f"move these into the folder of their job (FLOW): {loose_modules()}"


def test_no_module_over_700_lines():
    assert not long_modules(), f"split these into modules of one job each: {long_modules()}"


def test_no_function_over_80_lines():
    assert not long_functions(), f"split these into functions of one step each: {long_functions()}"


def test_the_size_checks_find_a_loose_a_long_module_and_a_long_function(tmp_path):
    body = "def f():\n" + "    x = 1\n" * 4 + "\n\ndef g():\n    return 1\n"
    pkg = tmp_path / "nemo_dflash"
    (pkg / "inner").mkdir(parents=True)
    for name in ("__init__.py", "config.py", "files.py", "loose.py"):
        (pkg / name).write_text("")
    (pkg / "inner" / "m.py").write_text(body)
    assert loose_modules(pkg) == ["loose.py"]
    assert long_modules(pkg, limit=8) == {"nemo_dflash/inner/m.py": 9}
    assert long_functions(pkg, limit=4) == {"nemo_dflash/inner/m.py:f": 5}
    assert long_modules(pkg, limit=9) == {} and long_functions(pkg, limit=5) == {}


# ---- The decoding engine: the only modules that open a KV cache or capture a CUDA graph

# A decode loop needs a KV cache; a fast one, CUDA graphs. Decoding lives in these modules (the engine that
# regeneration, Magpie prompts, replay and evaluation run on, and the one-prompt reference decoder); a new loop
# elsewhere is a second engine. The caches' own classes (DFlashContextCache, ...) may be defined elsewhere.
ENGINE = {
    "nemo_dflash.engine.spec_decode",  # the one-prompt speculative decoder (the eager reference)
    "nemo_dflash.engine.static_decode",  # what the fixed-shape steps share: buckets, captured steps
    "nemo_dflash.engine.batched_static",  # the fixed-shape loops: any rows (one included), any temperature
    "nemo_dflash.engine.graphs",  # capture and replay of the steps above
    "nemo_dflash.engine.recurrent_cache",  # the hybrid targets' caches and their rollback
    "nemo_dflash.engine.static_cache",  # the static caches the graphs read
}
CACHE_OR_GRAPH = {"DynamicCache", "StaticCache", "HybridCache", "DFlashContextCache",
                  "TargetStaticCache", "StaticDraftContextCache", "CUDAGraph", "graph", "make_graphed_callables"}


def opens_cache_or_graph(path: Path) -> list[str]:
    """The calls in `path` that build a KV cache or capture a CUDA graph (`torch.cuda.graph(...)`, `CUDAGraph()`,
    `DynamicCache(...)`, ...), as `line: name`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name == "graph" and not (isinstance(f, ast.Attribute) and ast.unparse(f.value).endswith("cuda")):
            continue  # only torch.cuda.graph(...) is a capture
        if name in CACHE_OR_GRAPH:
            found.append(f"{node.lineno}: {name}")
    return found


def test_only_the_engine_opens_a_kv_cache_or_captures_a_graph():
    offenders = {name: hits for name, path in package_modules().items()
                 if name not in ENGINE and (hits := opens_cache_or_graph(path))}
    assert not offenders, f"decoding outside the engine modules (tests/test_layout.py ENGINE): {offenders}"
    assert all(is_module(m) for m in ENGINE), "an ENGINE entry names no module: update the list"


def test_the_engine_check_sees_caches_and_captures(tmp_path):
    probe = tmp_path / "probe.py"
    for code in ("from transformers import DynamicCache\nc = DynamicCache()\n",
                 "import torch\ng = torch.cuda.CUDAGraph()\nwith torch.cuda.graph(g):\n    pass\n",
                 "def f(m):\n    return m.DFlashContextCache(4)\n"):
        probe.write_text(code)
        assert opens_cache_or_graph(probe), code
    probe.write_text("import matplotlib.pyplot as plt\nplt.graph = 1\ndef graph(x):\n    return x\ny = graph(2)\n")
    assert opens_cache_or_graph(probe) == []


# ---- No import cycles, lazy (function-level) imports included


# Cycles being broken elsewhere: each entry is one cycle's modules, allowed until it is gone.
KNOWN_CYCLES: list[set[str]] = []


def import_cycles(root: Path = PACKAGE) -> list[list[str]]:
    """Every strongly connected group of modules in the import graph (lazy imports count: a
    function-level import is a dependency all the same), as a sorted list of names."""
    graph = {name: internal_imports(path, package_of(path, root), root=root) - {root.name, name}
             for name, path in package_modules(root).items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            connect(name)
    return cycles


def test_no_import_cycles_lazy_imports_included():
    cycles = [c for c in import_cycles() if set(c) not in KNOWN_CYCLES]
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


# ---- Nothing at the package root only re-exports another module


def only_reexports(path: Path) -> bool:
    """A module whose body is nothing but imports, `__all__`, docstrings and aliases of imported names
    (`sys.modules[...] = other`, `X = other.X`): an old path pointing at code that lives elsewhere."""
    body = [n for n in ast.parse(path.read_text()).body
            if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]  # docstrings
    imported = {(a.asname or a.name).split(".")[0] for n in body if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names}
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Assign):
            targets = [ast.unparse(t) for t in node.targets]
            names = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
            if targets == ["__all__"] or (names and names <= imported):
                continue
        return False
    return bool(body)


def reexport_only_modules(root: Path = PACKAGE) -> list[str]:
    """Modules at the package root (and root-level folders) that only re-export; `__init__.py` of the
    package itself is its facade and may."""
    found = [f.name for f in sorted(root.glob("*.py")) if f.name != "__init__.py" and only_reexports(f)]
    for folder in sorted(d for d in root.iterdir() if (d / "__init__.py").is_file()):
        files = sorted(folder.rglob("*.py"))
        if files and all(only_reexports(f) or f.read_text().strip() == "" for f in files):
            found.append(folder.name + "/")
    return found


def test_no_package_root_module_only_reexports_another():
    assert not reexport_only_modules(), "re-export-only modules: import the module where the code lives instead"


# ---- The checks above can fail: a small package with each defect


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        f = root / "nemo_dflash" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return root / "nemo_dflash"


def test_a_lazy_import_cycle_is_found(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "a.py": "from nemo_dflash.b import g\n\ndef f():\n    return g()\n",
        "b.py": "def g():\n    from nemo_dflash import a  # lazy: runs only when called\n    return a\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nemo_dflash.d import x\n",
        "d.py": "from nemo_dflash.c import TYPE_CHECKING\n",  # c's import of d never runs: no cycle
    })
    assert import_cycles(pkg) == [["nemo_dflash.a", "nemo_dflash.b"]]
    (pkg / "b.py").write_text("def g():\n    return 1\n")
    assert import_cycles(pkg) == []


def test_a_reexport_only_module_is_found(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "from nemo_dflash.inner.real import f\n__all__ = ['f']\n",
        "inner/__init__.py": "",
        "inner/real.py": "def f():\n    return 1\n",
        "old.py": '"""Old path."""\nimport sys\n\nfrom nemo_dflash.inner import real as _m\n\nsys.modules[__name__] = _m\n',
        "alias.py": "from nemo_dflash.inner import real\nf = real.f\n__all__ = ['f']\n",
        "own.py": "from nemo_dflash.inner.real import f\n\ndef g():\n    return f() + 1\n",
        "shim/__init__.py": "from nemo_dflash.inner.real import *  # noqa\n",
    })
    assert reexport_only_modules(pkg) == ["alias.py", "old.py", "shim/"]


# ---- Benchmarks measure; tests test the library: no test imports a benchmark module

REPO = PACKAGE.parent
TESTS = REPO / "tests"
BENCHMARKS = REPO / "benchmarks"
# calls that load a file as a module or put a folder on the import path
_LOADERS = {"spec_from_file_location", "run_path", "SourceFileLoader", "import_module", "syspath_prepend"}

# Test files that still import a benchmark module (issue 74 step 6), their code to be moved into the library.
# An entry that no longer imports one fails the test, so the list only shrinks.
BENCHMARK_IMPORTERS: set[str] = set()  # none left: the benchmarks' shared code lives in the library now


def benchmark_imports(path: Path, benchmarks: Path = BENCHMARKS) -> list[str]:
    """How `path` imports a module of `benchmarks/` (running one as a command is not importing it): an import of a
    benchmark's name, a loader call (`spec_from_file_location`, `runpy.run_path`, ...) or a `sys.path` /
    `syspath_prepend` entry naming the folder or a benchmark file, directly or through a variable that does."""
    names = {p.stem for p in benchmarks.glob("*.py")} | {benchmarks.name}
    text = path.read_text()
    if benchmarks.name not in text and not re.search(rf"\b(?:import|from)\s+(?:{'|'.join(map(re.escape, names))})\b",
                                                     text):
        return []  # neither names the folder nor imports a benchmark's name: nothing to parse
    tree = ast.parse(text, filename=str(path))
    tainted = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and benchmarks.name in ast.unparse(
        node.value) for t in node.targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in names:
                found.append(f"{node.lineno}: from {node.module} import")
        elif isinstance(node, ast.Call):
            text = ast.unparse(node)
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            loads = func in _LOADERS or text.startswith(("sys.path.insert(", "sys.path.append("))
            used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            if loads and (benchmarks.name in text or used & tainted):
                found.append(f"{node.lineno}: {text[:100]}")
    return found


def test_no_test_imports_a_benchmark_module():
    found = {p.name: benchmark_imports(p) for p in sorted(TESTS.glob("*.py"))}
    found = {k: v for k, v in found.items() if v}
    assert set(found) <= BENCHMARK_IMPORTERS, {k: v for k, v in found.items() if k not in BENCHMARK_IMPORTERS}
    assert BENCHMARK_IMPORTERS <= set(found), f"no benchmark import now: drop from BENCHMARK_IMPORTERS: " \
                                              f"{sorted(BENCHMARK_IMPORTERS - set(found))}"


@pytest.mark.parametrize("source", [
    "import regen\n",
    "from regen import row\n",
    "import sys, os\nsys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'benchmarks'))\n",
    "import importlib.util\nSCRIPT = REPO / 'benchmarks' / 'regen.py'\n"
    "spec = importlib.util.spec_from_file_location('regen', SCRIPT)\n",
    "def test(monkeypatch):\n    monkeypatch.syspath_prepend(str(REPO / 'benchmarks'))\n",
    "import runpy\nrunpy.run_path('benchmarks/regen.py')\n",
])
def test_the_benchmark_import_check_sees_every_form(tmp_path, source):
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "regen.py").write_text("")
    test = tmp_path / "test_x.py"
    test.write_text(source)
    assert benchmark_imports(test, bench)
    test.write_text("import subprocess, sys\nsubprocess.run([sys.executable, 'benchmarks/regen.py', '--help'])\n"
                    "from nemo_dflash.recipes import regenerate\n")
    assert benchmark_imports(test, bench) == []
