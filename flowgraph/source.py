"""Source positions: every IR element remembers where it was written."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SourcePos:
    """A position in a graph file, a Python file or on the command line."""

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
