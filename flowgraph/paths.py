"""Where a path written in a graph points: one rule for every front end.

A relative data, model or tokenizer path written in a graph file is relative to that
file's folder, so a graph runs from any working directory; one given on the command line
(`data.train.path=x.parquet`), or in a graph built in Python (which has no file), is
relative to the working directory, as a shell user expects. The front ends store the
result as an absolute path, so the IR, and a plan compiled from it, mean the same file
wherever they are read. `builtin:` names and hub ids (`Qwen/Qwen2.5-0.5B`, `gpt2`: no
local folder of that name) are kept as written. Plugins follow the same rule
(`Plugin.folder`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from flowgraph.builtin_models import BUILTIN_PREFIX
from flowgraph.source import SourcePos

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
"""A hub id is `name` or `org/name`; anything else (./x, /x, a/b/c, ~/x) is a local path."""
MEMORY_PREFIX = "memory:"
"""A dataset path so prefixed names a table given in Python (`flowgraph.data.held`)."""
DATA_SUFFIXES = (".parquet", ".pq", ".jsonl", ".json", ".csv", ".arrow")
"""A dataset path ending so is a file, never a hub id."""
RULE = ("a relative path in a graph file is relative to that file's folder; on the command "
        "line, in a graph built in Python or in a notebook, to the working directory")
"""The rule, as a hint under an error about a missing file."""


INTERACTIVE = re.compile(r"^<.*>$|(^|/)ipykernel_\d+/\d+\.py$")
"""Code a user types rather than keeps in a file: `<stdin>`, `<string>` (`python -c`),
`<ipython-input-3-…>`, and a notebook cell, which ipykernel compiles under a temporary
file name (`/tmp/ipykernel_4242/1234567.py`, written there when a debugger asks)."""


def interactive(file: str) -> bool:
    """Whether `file` (a code object's file name) is code typed in a session: a notebook
    cell, stdin, `python -c`. Its relative paths are relative to the working directory."""
    return bool(INTERACTIVE.search(file))


def folder_of(pos: SourcePos) -> Path:
    """The folder a path written at `pos` is relative to: that of the file it is written
    in, or the working directory where there is none (the command line, YAML text) or the
    code was typed in a session (a notebook cell, stdin: `interactive`)."""
    written_in = Path(pos.file)  # `<command line>`, `<string>`, `<python>`: no file
    if written_in.is_file() and not interactive(pos.file):
        return written_in.parent.absolute()
    return Path.cwd()


def resolve_path(path: str, folder: Path, *, hub: bool = False) -> str:
    """`path` made absolute against `folder`; a `builtin:` name is kept, and so is a hub
    id when `hub` (models and tokenizers) and `folder` has no such folder."""
    if not path or path.startswith(BUILTIN_PREFIX):
        return path
    local = folder / Path(path).expanduser()  # an absolute path stays itself
    if hub and HUB_ID.match(path) and not local.is_dir():
        return path
    return os.path.normpath(local)


def written_file(path: str, pos: SourcePos) -> str:
    """The absolute path of a file a node's param names (`env: tools.yaml`,
    `chat_template: chat.jinja`, `ParamSpec.files`), written at `pos`: relative to the graph
    file's folder when written in one; on the command line, in a graph built in Python and
    in a notebook, to the working directory, as a dataset path is."""
    in_python = pos.file.endswith(".py")  # a GraphBuilder call: a file opened as open() does
    return resolve_path(path, Path.cwd() if in_python else folder_of(pos))


def resolve_data_path(path: str, folder: Path) -> str:
    """A dataset's path resolved as `resolve_path` does, except that an in-memory table's
    key (`memory:…`) and a hub dataset id (`org/name`, no such local file or folder, no
    file suffix: `is_hub_dataset`) are kept as written."""
    if path.startswith(MEMORY_PREFIX) or is_hub_dataset(path, folder):
        return path
    return resolve_path(path, folder)


def is_local(path: str) -> bool:
    """Whether `path` is on this machine: a built-in (`builtin:...`) or an existing path."""
    return path.startswith(BUILTIN_PREFIX) or Path(path).expanduser().exists()


def is_hub_dataset(path: str, folder: Path | None = None) -> bool:
    """`org/name` with no file suffix and no such file or folder (in `folder`, else the
    working directory): a Hugging Face hub dataset (`trl-lib/tldr`)."""
    local = (folder or Path.cwd()) / Path(path).expanduser()
    return ("/" in path and HUB_ID.match(path) is not None
            and not path.endswith(DATA_SUFFIXES) and not local.exists())
