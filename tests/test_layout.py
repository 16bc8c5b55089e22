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
