"""The wheel ships the recipes: `--config qwen3_8b.yaml` works after a non-editable `pip install .`."""

import importlib.util
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
from _torchrun import run_command

REPO = Path(__file__).resolve().parent.parent
# What a build reads: the package, the build files and the YAML folders (copied, so the build's
# `build/` and `*.egg-info` stay out of the checkout).
BUILD_INPUTS = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "nemo_dflash", "recipes", "configs")


def _offline_backend_available() -> bool:
    """The build runs without isolation (nothing downloaded): it needs setuptools with bdist_wheel here."""
    return (importlib.util.find_spec("setuptools") is not None
            and importlib.util.find_spec("setuptools.command.bdist_wheel") is not None)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if not _offline_backend_available():
        pytest.skip("setuptools with bdist_wheel is not installed: the wheel cannot be built offline")
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_INPUTS:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "_shipped"))
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    r = run_command(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", ".", "-w", str(out)],
        300, cwd=src, env={**os.environ, "PIP_NO_INPUT": "1"},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = out.glob("nemo_dflash-*.whl")
    return whl


def test_wheel_contains_the_shipped_recipes_and_configs(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = [(folder, y.relative_to(REPO / folder).as_posix()) for folder in ("recipes", "configs")
               for y in sorted((REPO / folder).rglob("*.yaml"))]
    assert ("configs", "draft/paper_block16.yaml") in shipped and ("configs", "cluster/fsdp2.yaml") in shipped
    for folder, rel in shipped:  # config groups are sub-folders: they ship too
        assert f"nemo_dflash/_shipped/{folder}/{rel}" in names, rel
    assert "nemo_dflash/config.py" in names and not any(n.startswith(("recipes/", "configs/")) for n in names)


def test_installed_package_finds_its_recipes(wheel, tmp_path):
    """Unpacked as pip installs it, away from the checkout: the recipe and its config groups compose."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    code = (
        "import json, nemo_dflash, nemo_dflash.config as c\n"
        "cfg = c.load_recipe('qwen3_8b.yaml', ['cluster=fsdp2', 'optim.lr=1e-4'])\n"
        "print(json.dumps([nemo_dflash.__file__, str(c.resolve_recipe_path('qwen3_8b.yaml')), str(c.REPO_CONFIGS),"
        " cfg.draft.block_size, cfg.distributed.strategy, cfg.optim.lr]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = run_command([sys.executable, "-c", code], 120, cwd=elsewhere, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    package, recipe, configs, block, strategy, lr = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(package).is_relative_to(site)  # the installed copy, not the checkout
    assert Path(recipe) == site / "nemo_dflash" / "_shipped" / "recipes" / "qwen3_8b.yaml"
    assert Path(configs) == site / "nemo_dflash" / "_shipped" / "configs"
    assert (block, strategy, lr) == (16, "fsdp2", 1e-4)  # from the config groups the recipe names, and overrides


def test_checkout_reads_the_root_folders():
    from nemo_dflash.config import REPO_CONFIGS, REPO_RECIPES

    assert (REPO_RECIPES, REPO_CONFIGS) == (REPO / "recipes", REPO / "configs")
