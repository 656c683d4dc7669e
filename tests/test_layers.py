"""The layering holds: import-linter's contracts (pyproject.toml, [tool.importlinter]) pass over the package.

The import names live under ``gpuwatch.*`` while the folders stay where the project layout puts them
(``package-dir``), so the package is laid out here as an installed wheel would lay it out (a tree of links)
and import-linter reads that tree.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _installed_layout(into: Path) -> Path:
    """Link every module of every package in ``package-dir`` where a wheel would put it; return the tree."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package, folder in setuptools["package-dir"].items():
        target = into / package.replace(".", "/")
        target.mkdir(parents=True, exist_ok=True)
        for module in (ROOT / folder).glob("*.py"):
            (target / module.name).symlink_to(module)
    return into


def _lint(tree: Path, config: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", command, "--config", str(config), "--no-cache"],
                          env=env, cwd=tree, capture_output=True, text=True)


def test_the_import_contracts_hold(tmp_path: Path) -> None:
    pytest.importorskip("importlinter")
    run = _lint(_installed_layout(tmp_path / "tree"), ROOT / "pyproject.toml")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 kept, 0 broken" in run.stdout, run.stdout


def test_an_upward_import_breaks_the_contracts(tmp_path: Path) -> None:
    """The check can fail: a core module importing an application is reported."""
    pytest.importorskip("importlinter")
    tree = _installed_layout(tmp_path / "tree")
    fields = tree / "gpuwatch" / "core" / "fields.py"
    text = fields.read_text()
    fields.unlink()
    fields.write_text(text + "\nfrom gpuwatch.apps import demo  # an upward import\n")
    run = _lint(tree, ROOT / "pyproject.toml")
    assert run.returncode != 0
    assert "gpuwatch.core.fields -> gpuwatch.apps.demo" in run.stdout
