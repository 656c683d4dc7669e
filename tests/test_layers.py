"""The layering holds: import-linter's contracts (pyproject.toml, [tool.importlinter]) pass over the checkout.

The package is whole where it stands (``gpuwatch/<component>``), so ``lint-imports`` runs on the plain checkout;
the second test lints a copy with one upward import added, to show the check can fail.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    command = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", command, "--config", str(root / "pyproject.toml"), "--no-cache"],
                          env=env, cwd=root, capture_output=True, text=True)


def test_the_import_contracts_hold() -> None:
    pytest.importorskip("importlinter")
    run = _lint(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 kept, 0 broken" in run.stdout, run.stdout


def test_an_upward_import_breaks_the_contracts(tmp_path: Path) -> None:
    """The check can fail: a core module importing an application is reported."""
    pytest.importorskip("importlinter")
    copy = tmp_path / "checkout"
    shutil.copytree(ROOT / "gpuwatch", copy / "gpuwatch", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    fields = copy / "gpuwatch" / "core" / "fields.py"
    fields.write_text(fields.read_text() + "\nfrom gpuwatch.apps import demo  # an upward import\n")
    run = _lint(copy)
    assert run.returncode != 0
    assert "gpuwatch.core.fields -> gpuwatch.apps.demo" in run.stdout
