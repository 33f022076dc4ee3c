"""`flowgraph.voice`: one table says how each option is spelt on the command line and in
Python; the entry point picks the words (issue #26, point 4)."""

from __future__ import annotations

import os

import pytest

from flowgraph.voice import ENTRY_ENV, Word, command, from_python, option, python_entry


@pytest.mark.parametrize(("name", "value", "cli", "python"), [
    ("resume", True, "--resume", "resume=True"),
    ("overwrite", True, "--overwrite", "overwrite=True"),
    ("allow_changed", ["dims.Bp", "trainer.seed"],
     "--allow-changed dims.Bp --allow-changed trainer.seed",
     "allow_changed=['dims.Bp', 'trainer.seed']"),
    ("run_dir", "runs/my run", "'trainer.run_dir=runs/my run'", "run_dir='runs/my run'"),
    ("target", "fsdp", "--target fsdp", "target='fsdp'"),
    ("nproc", Word("1→2"), "--nproc 1→2", "nproc=1→2"),
    ("step", Word("N"), "--step N", "step=N"),
])
def test_one_option_in_both_voices(name: str, value: object, cli: str, python: str) -> None:
    assert option(name, value) == cli
    with python_entry():
        assert option(name, value) == python


def test_a_command_and_the_entry_point_restored() -> None:
    options = [("target", "ray"), ("disable", []), ("resume", True),
               ("overrides", ["trainer.steps=3"]), ("run_dir", "runs/a")]
    assert command("run", "g.yaml", options) == \
        "flowgraph run g.yaml --target ray --resume trainer.steps=3 trainer.run_dir=runs/a"
    assert not from_python()
    with python_entry():
        assert from_python() and os.environ[ENTRY_ENV] == "python"
        assert command("run", Word("graph"), options) == (
            "flowgraph.run(graph, target='ray', resume=True, overrides=['trainer.steps=3'], "
            "run_dir='runs/a')")
        assert command("run", "g.yaml", options).startswith("flowgraph.run('g.yaml', ")
    assert ENTRY_ENV not in os.environ
