"""Build hook: the wheel ships the checkout's recipes/ and configs/ YAMLs as package data.

The root folders stay the one source of truth (the docs run `--config NAME.yaml` from a
checkout, and recipes name `configs/` pieces). A build copies them to `nemo_dflash/_shipped/`,
where `nemo_dflash.config` finds them after a non-editable `pip install .`. Everything else
about the build is in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED = ("recipes", "configs")  # folders at the repo root -> nemo_dflash/_shipped/<folder>/**/*.yaml


class BuildPyWithRecipes(build_py):
    """`build_py`, then the YAML folders copied into the built package (not for editable installs,
    which read the checkout's folders directly)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for folder in SHIPPED:
            dest = Path(self.build_lib) / "nemo_dflash" / "_shipped" / folder
            for src in sorted((ROOT / folder).rglob("*.yaml")):  # config groups are sub-folders (configs/draft/)
                out = dest / src.relative_to(ROOT / folder)
                self.mkpath(str(out.parent))
                self.copy_file(str(src), str(out))


setup(cmdclass={"build_py": BuildPyWithRecipes})
