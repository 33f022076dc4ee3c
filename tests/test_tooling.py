"""House tooling runs with the tests: ruff (complexity <= 10) and mypy --strict on the
core, the nodes and the compilers."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".mypy_cache"
LINKED = {"nodes": ROOT / "nodes", "compilers": ROOT / "compilers"}
"""Subpackages pyproject's package-dir installs from outside flowgraph/."""


def test_ruff_is_clean() -> None:
    if shutil.which("ruff") is None:
        pytest.fail("ruff is not installed: pip install -e '.[dev]'")
    proc = subprocess.run(["ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def installed_layout(view: Path) -> Path:
    """`view/flowgraph`: links to flowgraph/'s files with the `LINKED` folders linked in
    (nodes/ as flowgraph/nodes, compilers/ as flowgraph/compilers), the layout a wheel
    installs. mypy cannot
    follow package-dir (an editable install maps the folders with an import hook), so it
    checks this view; its paths map back to the repository's by `_repo_paths`."""
    package = view / "flowgraph"
    shutil.rmtree(view, ignore_errors=True)
    package.mkdir(parents=True)
    for entry in (ROOT / "flowgraph").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in LINKED.items():
        (package / name).symlink_to(folder)
    return package


def _repo_paths(text: str) -> str:
    for name in LINKED:
        text = text.replace(f"flowgraph/{name}/", f"{name}/")
    return text


def test_mypy_strict_is_clean() -> None:
    """mypy --strict over the installed layout (~2 min on one core with a cold cache: the
    suite's other xdist worker goes on meanwhile)."""
    view = CACHE / "installed"  # a fixed place, so mypy's cache stays valid between runs
    installed_layout(view)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(CACHE), "flowgraph"],
        cwd=view, capture_output=True, text=True)
    assert proc.returncode == 0, _repo_paths(proc.stdout[-5000:] + proc.stderr[-2000:])
