"""The package's shape, checked by parsing imports (not by importing): who may import whom."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nemo_dflash"


def package_of(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])


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
            found.update(f"{base}.{a.name}" for a in node.names)  # `from nemo_dflash import export`
    return found


@pytest.mark.parametrize("folder", ["train", "inference"])
def test_train_and_inference_do_not_import_export(folder):
    """Drafts are built, loaded and checked by `nemo_dflash.build`; `export` only writes the serving format."""
    offenders = {
        str(f.relative_to(PACKAGE.parent)): sorted(m for m in imported_modules(f, package_of(f)) if m == "nemo_dflash.export"
                                                   or m.startswith("nemo_dflash.export."))
        for f in sorted((PACKAGE / folder).rglob("*.py"))
    }
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_the_import_parser_sees_every_form(tmp_path):
    """The check above must not miss a function-level, `from nemo_dflash import export` or relative import."""
    probe = tmp_path / "probe.py"
    forms = ["import nemo_dflash.export", "from nemo_dflash.export import load_draft", "from nemo_dflash import export",
             "from ..export import load_draft", "from .. import export"]
    for form in forms:
        probe.write_text(f"def f():\n    {form}\n")
        assert "nemo_dflash.export" in imported_modules(probe, "nemo_dflash.inference"), form
    probe.write_text("from nemo_dflash.build import load_draft\n")
    assert "nemo_dflash.export" not in imported_modules(probe, "nemo_dflash.inference")


# ---- Folders that show the flow: data -> target -> draft / trainer module -> train -> export, inference ----

# Where each top-level module or folder sits in the flow. A module may import its own level or one
# before it, never one after it (data/ knows nothing of targets, target/ nothing of drafts, ...).
FLOW = {
    "files": 0,  # the run directory's layout names and file modes: below everything
    "attention": 0,  # which SDPA kernels run calls of changing shapes
    "sampling": 0,  # keyed sampling and the acceptance rule: regeneration (data/) and decoding (inference/) share it
    "data": 1,  # chat files -> token batches; regenerate.py + generation.py make the data
    "target": 2,  # the frozen model: loading.py, then hooks.py
    "config": 3,  # the recipe schema (reads data/ and target/ checks)
    "draft": 4,  # registry.py, build.py, model/
    "core": 5,  # the trainer module: anchors, block mask, draft, loss
    "train": 6,
    "export": 7,
    "inference": 7,
    "recipes": 8,  # the commands
}
# Old import paths kept for users, tests and docs: each is the new module itself (sys.modules alias).
COMPAT = {
    "nemo_dflash.loading": "nemo_dflash.target.loading",
    "nemo_dflash.regenerate": "nemo_dflash.data.regenerate",
    "nemo_dflash.generation": "nemo_dflash.data.generation",
    "nemo_dflash.registry": "nemo_dflash.draft.registry",
    "nemo_dflash.build": "nemo_dflash.draft.build",
    "nemo_dflash.model": "nemo_dflash.draft.model",
    "nemo_dflash.model.modeling": "nemo_dflash.draft.model.modeling",
    "nemo_dflash.model.configuration": "nemo_dflash.draft.model.configuration",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    base = PACKAGE.parent.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def package_modules() -> dict[str, Path]:
    return {module_name(f): f for f in sorted(PACKAGE.rglob("*.py"))}


def is_compat(name: str) -> bool:
    return any(name == old or name.startswith(old + ".") for old in COMPAT)


def internal_imports(path: Path, package: str, top_level_only: bool = False) -> set[str]:
    """The package modules `path` imports (`from a import b` counts as `a.b` when that is a module).

    `top_level_only`: what runs at import time, i.e. not inside a function nor `if TYPE_CHECKING:`.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    if top_level_only:
        nodes = []
        todo = list(tree.body)
        while todo:
            node = todo.pop()
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                todo.extend(node.orelse)
            elif isinstance(node, (ast.If, ast.Try)):
                todo.extend(node.body + node.orelse + getattr(node, "handlers", []) + getattr(node, "finalbody", []))
            elif isinstance(node, ast.ExceptHandler):
                todo.extend(node.body)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                nodes.append(node)
        wrapper = ast.Module(body=nodes, type_ignores=[])
    else:
        wrapper = tree
    names = set()
    for node in ast.walk(wrapper):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names if is_module(f"{base}.{a.name}")}
            names.update(subs or {base})
    return {n for n in names if n == "nemo_dflash" or n.startswith("nemo_dflash.")}


def test_compat_paths_are_the_moved_modules():
    import importlib

    for old, new in COMPAT.items():
        assert importlib.import_module(old) is importlib.import_module(new), old


def test_the_package_imports_its_own_modules_by_their_new_paths():
    """The old paths are for users; inside the package every import names where the code lives."""
    offenders = {}
    for name, path in package_modules().items():
        if is_compat(name):
            continue
        bad = sorted(m for m in internal_imports(path, package_of(path)) if is_compat(m))
        if bad:
            offenders[name] = bad
    assert not offenders, offenders


def test_no_module_imports_a_later_stage_of_the_flow():
    offenders = {}
    for name, path in package_modules().items():
        if name == "nemo_dflash" or is_compat(name):
            continue  # the package facade re-exports from everywhere; compat paths point at their new home
        level = FLOW[name.split(".")[1]]  # a KeyError here: place the new folder or module in FLOW
        later = sorted(m for m in internal_imports(path, package_of(path))
                       if m != "nemo_dflash" and not is_compat(m) and FLOW[m.split(".")[1]] > level)
        if later:
            offenders[name] = later
    assert not offenders, offenders


def find_cycle(graph: dict[str, set[str]]) -> None:
    """Raise with the first import cycle of `graph` (module -> modules it imports)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(nxt):] + [node, nxt]))
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_no_import_cycles_at_import_time():
    find_cycle({name: internal_imports(path, package_of(path), top_level_only=True) - {"nemo_dflash"}
                for name, path in package_modules().items()})


def test_no_import_cycles_counting_function_level_imports():
    """A lazy (function-level) import hides a cycle from the import-time check; two modules that need each
    other should share a lower module instead (as spec_decode and static_decode share inference.output)."""
    find_cycle({name: internal_imports(path, package_of(path)) - {"nemo_dflash"}
                for name, path in package_modules().items() if not is_compat(name)})


def test_the_cycle_check_sees_a_cycle():
    with pytest.raises(AssertionError, match="a -> b -> a"):
        find_cycle({"a": {"b"}, "b": {"a"}})
    find_cycle({"a": {"b"}, "b": set()})
