"""Source positions: every IR element remembers where it was written."""

from __future__ import annotations

from typing import NamedTuple


class SourcePos(NamedTuple):
    """A position in a graph file, a Python file or on the command line.

    A named tuple, not a frozen dataclass like the IR records: a 10,000-node graph
    file has 350,000 positions, and a tuple is made in half the time.
    """

    file: str
    """Path as the user gave it, `<python>` or `<command line>`."""
    line: int
    """1-based line; 0 when unknown."""
    col: int
    """1-based column; 0 when unknown."""

    def __str__(self) -> str:
        if self.line <= 0:
            return self.file
        return f"{self.file}:{self.line}:{self.col}"


UNKNOWN_POS = SourcePos("<unknown>", 0, 0)
