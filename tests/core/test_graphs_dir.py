"""Every graph file under graphs/, found by a recursive glob.

Good graphs check clean. Each file under graphs/broken/ starts with

    # expect: FG202 at 31:28
    # <a sentence: the bug and the user's pain it mirrors>

and must report exactly that code as an error at that line:column, and no error of
another code. `# expect: warning FG604 at 36:27` declares a graph that checks with no
error but must carry that warning there (a setting that runs, but not as its author
thinks: GSPO on multi-turn episodes). Two broken graphs use plugin kinds from
tests/plugins/broken_heads.py; the `plugins_on_path` fixture puts that directory on
`sys.path` (as a user's CI would install their plugin package).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flowgraph.cli import main

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = ROOT / "graphs"
PLUGINS = ROOT / "tests" / "plugins"
ALL = sorted(GRAPHS.glob("**/*.yaml"))
BROKEN = [p for p in ALL if "broken" in p.relative_to(GRAPHS).parts]
GOOD = [p for p in ALL if p not in BROKEN]
EXPECT = re.compile(r"# expect: (warning )?(FG\d{3}) at (\d+):(\d+)")
UNREADABLE = frozenset({"FG001", "FG008"})
"""Codes for files that cannot be read into a graph: `flowgraph check` exits 2."""
HEAVY = ("torch", "transformers", "ray", "vllm", "networkx")
"""Modules `flowgraph check` must never import (DESIGN.md: check starts fast)."""


def _name(path: Path) -> str:
    return path.name


def expectation(path: Path) -> tuple[str, str, int, int]:
    """(severity, code, line, column) from the file's `# expect:` line; the next line
    explains."""
    first, second = path.read_text(encoding="utf-8").splitlines()[:2]
    m = EXPECT.fullmatch(first)
    assert m, (f"{path}: the first line must be `# expect: [warning ]FGnnn at LINE:COL`, "
               f"got {first!r}")
    assert second.startswith("# ") and len(second.split()) >= 6, (
        f"{path}: the second line must be a sentence saying what the bug is")
    return "warning" if m.group(1) else "error", m.group(2), int(m.group(3)), int(m.group(4))


@pytest.fixture
def plugins_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))


def test_the_glob_finds_every_graph() -> None:
    # A moved or renamed directory must fail here, not silently check nothing.
    assert len(GOOD) >= 6, [str(p) for p in GOOD]
    assert len(BROKEN) >= 14, [str(p) for p in BROKEN]
    assert {p.name for p in GOOD} >= {"ppo.yaml", "grpo.yaml", "dpo.yaml", "rloo.yaml",
                                      "reinforce_pp.yaml", "remax.yaml"}


@pytest.mark.parametrize("path", GOOD, ids=_name)
def test_good_graph_checks_clean(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(path), "--format", "json"]) == 0
    diags = json.loads(capsys.readouterr().out)
    assert [d for d in diags if d["severity"] == "error"] == []


@pytest.mark.parametrize("path", BROKEN, ids=_name)
@pytest.mark.usefixtures("plugins_on_path")
def test_broken_graph_reports_its_documented_error(path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    severity, code, line, col = expectation(path)
    status = main(["check", str(path), "--format", "json"])
    diags = json.loads(capsys.readouterr().out)
    found = {(d["code"], d["line"], d["column"]) for d in diags if d["severity"] == severity}
    errors = {(d["code"], d["line"], d["column"]) for d in diags if d["severity"] == "error"}
    assert (code, line, col) in found, found
    if severity == "warning":
        assert errors == set() and status == 0, f"a warning's graph has errors: {errors}"
        return
    assert {c for c, _, _ in errors} == {code}, f"other errors besides {code}: {errors}"
    assert status == (2 if code in UNREADABLE else 1)


@pytest.mark.parametrize("path", BROKEN, ids=_name)
@pytest.mark.usefixtures("plugins_on_path")
def test_broken_graph_text_names_file_line_and_column(path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    severity, code, line, col = expectation(path)
    main(["check", str(path)])
    out = capsys.readouterr().out
    assert f"{path}:{line}:{col}: {severity}[{code}]: " in out
    assert "Traceback" not in out


def test_check_imports_no_heavy_module() -> None:
    # A fresh interpreter: what `flowgraph check` imports, and nothing else has.
    code = (
        "import sys\n"
        "from flowgraph.cli import main\n"
        f"status = main(['check', {str(GRAPHS / 'ppo.yaml')!r}, '--format', 'github'])\n"
        "print('STATUS', status, *sorted(sys.modules))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    _, status, *modules = run.stdout[run.stdout.index("STATUS "):].split()
    assert status == "0"  # the check really ran, and passed
    assert "flowgraph.checker.shapes" in modules
    loaded = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert loaded == [], f"`flowgraph check` imported {loaded}"
