"""`flowgraph.spelling`: one table says how each option is spelt on the command line and in
Python; the entry point picks the words (issue #26, point 4)."""

from __future__ import annotations

import argparse
import inspect
import os
from dataclasses import fields

import pytest

import flowgraph
from flowgraph.cli import build_parser
from flowgraph.compilers import RunOptions
from flowgraph.spelling import (
    ENTRY_ENV,
    OPTIONS,
    Word,
    command,
    from_python,
    option,
    python_entry,
)


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



def command_line_flags() -> set[str]:
    """Every option string of every `flowgraph` subcommand, as the parser reads them."""
    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {flag for sub in subcommands.choices.values() for action in sub._actions
            for flag in action.option_strings}


def python_arguments() -> set[str]:
    """Every keyword of the Python API: its functions' and `flowgraph.run`'s options."""
    functions = (flowgraph.run, flowgraph.compile, flowgraph.check, flowgraph.debug,
                 flowgraph.export)
    return {f.name for f in fields(RunOptions)} | {
        name for fn in functions for name in inspect.signature(fn).parameters}


def misspelt(table: dict[str, str], flags: set[str]) -> dict[str, str]:
    """The table's flags the parser does not read."""
    return {name: flag for name, flag in table.items()
            if flag.startswith("-") and flag not in flags}


def test_the_table_spells_the_parsers_flags_and_the_apis_arguments() -> None:
    """A flag renamed or dropped in `flowgraph/cli.py`, or a Python argument renamed in
    the API, fails here: the messages would name an option that does not exist."""
    assert misspelt(OPTIONS, command_line_flags()) == {}
    assert set(OPTIONS) - python_arguments() == set()
    overrides = {n: f for n, f in OPTIONS.items() if not f.startswith("-")}
    assert overrides == {"run_dir": "trainer.run_dir=", "overrides": ""}


def test_a_flag_the_parser_does_not_read_is_caught() -> None:
    table = {"resume": "--resume", "allow_changed": "--allow_changed", "disable": "--disable"}
    assert misspelt(table, command_line_flags()) == {"allow_changed": "--allow_changed",
                                                     "disable": "--disable"}
