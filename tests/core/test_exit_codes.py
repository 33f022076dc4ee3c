"""Every command's exit codes, as the README states them: 1 a failure (the command ran
and could not do it), 2 a usage error or an input that cannot be read; one message,
never a traceback. Runs that fail exit 1 too (`tests/compilers/test_e2e.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowgraph.cli import main

ROOT = Path(__file__).resolve().parents[2]
PPO = str(ROOT / "graphs" / "ppo.yaml")


@pytest.mark.parametrize(("args", "code", "words"), [
    # failures: each command ran, and could not write its output
    (["compile", PPO, "-o", "{tmp}/no/such/folder/plan.json"], 1, "cannot write"),
    (["schema", "-o", "{tmp}/no/such/folder/schema.json"], 1, "cannot write"),
    (["viz", PPO, "-o", "{tmp}/no/such/folder/g.mmd"], 1, "cannot write"),
    # usage: a wrong argument, an input that is not there or cannot be read
    (["run", "{tmp}/plan.json"], 2, "cannot read the plan"),
    (["kinds", "no_such_kind"], 2, "no kind `no_such_kind`"),
    (["export", "{tmp}", "--model", "actor", "-o", "{tmp}/out"], 2,
     "is not a flowgraph run dir (no plan.json)"),
    (["plot", "{tmp}/no-run"], 2, "does not exist: give a run dir"),
], ids=["compile-o", "schema-o", "viz-o", "run-plan", "kinds", "export", "plot"])
def test_exit_codes_of_every_command(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     args: list[str], code: int, words: str) -> None:
    assert main([a.replace("{tmp}", str(tmp_path)) for a in args]) == code
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err
