"""House tooling runs with the tests: ruff (complexity <= 10) and mypy --strict on flowgraph/."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean() -> None:
    if shutil.which("ruff") is None:
        pytest.fail("ruff is not installed: pip install -e '.[dev]'")
    proc = subprocess.run(["ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict_is_clean() -> None:
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
