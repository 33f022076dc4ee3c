"""A process's output kept in a log file in the run dir as well as shown where it went.

    output = tee(log)                   from here on, what this process (and any child
                                        it starts) writes on file descriptors 1 and 2 —
                                        Python's prints and warnings, C libraries' lines,
                                        a crash's traceback (`faulthandler`) — is appended
                                        to `log` and copied on to the stdout and stderr
                                        the process had (`merged`: both to its stderr)
    output.close()                      the process's own stdout and stderr back, every
                                        line written so far in the log and shown
    output.note(text)                   `text` in the log alone (after `close`, in order)

Used by each fsdp rank (`run_dir/logs/rank-<R>.log`, `flowgraph.compilers.targets.fsdp.launch`)
and by each Ray worker (`run_dir/logs/<pool>-<rank>.log`, merged: Ray forwards a worker's
stderr to the driver's console; `flowgraph.compilers.targets.ray.worker.log_to`).

How. File descriptors 1 and 2 become pipes read by a small copying process of their
own (`COPIER`), which appends what it reads to the log and writes it on. A process
rather than a thread: what the rank wrote before it died — SIGKILL, a segfault's
traceback — is still in the pipe, and the copier, alive, takes it to the log and the
console; it ends when every writer of the pipes is gone. It ignores SIGINT, SIGTERM and
SIGHUP: a Ctrl-C on the terminal reaches the whole process group, and the rank still
has lines to say while it saves. Merged, one pipe takes both streams, in the order
they were written; else one a stream, and the log interleaves them by line (Python's
streams write a line at a time here).
"""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
from contextlib import suppress
from pathlib import Path
from types import TracebackType

COPIER = """\
import os, select, signal, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
log, shown = int(sys.argv[1]), {1: True, 2: True}
to = dict(zip(map(int, sys.argv[2::2]), map(int, sys.argv[3::2])))
def put(fd, data):
    while data:
        data = data[os.write(fd, data):]
while to:
    for fd in select.select(list(to), [], [])[0]:
        data = os.read(fd, 1 << 16)
        if not data:
            del to[fd]
            continue
        try:
            put(log, data)
        except OSError:  # a full disk: the console still shows it
            pass
        if shown[to[fd]]:
            try:
                put(to[fd], data)
            except OSError:  # the console is gone (a closed terminal): the log goes on
                shown[to[fd]] = False
"""
"""The copying process's program: `python -c COPIER LOG_FD PIPE OUT [PIPE OUT]`; it
reads each pipe until every writer has closed it, appending to LOG_FD and writing on to
OUT (1 or 2: its own stdout or stderr)."""


class Tee:
    """This process's stdout and stderr going to a log and on (`tee`)."""

    def __init__(self, log: Path, copier: subprocess.Popen[bytes], saved: tuple[int, int]
                 ) -> None:
        self.log, self.copier, self._saved = log, copier, saved
        self.closed = False

    def close(self, wait_s: float = 10.0) -> None:
        """The process's stdout and stderr as they were before `tee`; waits (up to
        `wait_s`) until the copier has written all it was sent. A child of this process
        still holding the pipes keeps it copying, and the wait ends at `wait_s`."""
        if self.closed:
            return
        self.closed = True
        for stream in (sys.stdout, sys.stderr):
            with suppress(Exception):
                stream.flush()
        for fd, saved in zip((1, 2), self._saved, strict=True):
            os.dup2(saved, fd)
            os.close(saved)
        with suppress(subprocess.TimeoutExpired):
            self.copier.wait(wait_s)

    def note(self, text: str) -> None:
        """`text` appended to the log alone (a failed rank's traceback, which the console
        does not show: the launcher names the failure there)."""
        with open(self.log, "a", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")

    def __enter__(self) -> Tee:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


_KEPT: list[Tee] = []
"""The tees of this process (a Ray worker never closes its own)."""


def tee(log: Path, *, merged: bool = False) -> Tee:
    """From now on this process's stdout and stderr, at the file descriptors, appended to
    `log` (created 0644 with its folder) and shown where they went before: stdout on
    stdout, stderr on stderr, or (`merged`) both on stderr."""
    log.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):
            stream.flush()
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pipes = [os.pipe()] if merged else [os.pipe(), os.pipe()]
    routes = [(pipes[0], 2)] if merged else [(pipes[0], 1), (pipes[1], 2)]
    try:
        # pipes are not inherited (os.pipe): the copier gets the read ends alone, so it
        # sees the end of the pipes when this process and its children have closed them
        copier = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", COPIER, str(log_fd),
             *(str(n) for (read, _), out in routes for n in (read, out))],
            stdin=subprocess.DEVNULL, pass_fds=(log_fd, *(read for read, _ in pipes)))
    finally:
        os.close(log_fd)
        for read, _ in pipes:
            os.close(read)
    saved = os.dup(1), os.dup(2)
    writes = [write for _, write in pipes]
    os.dup2(writes[0], 1)
    os.dup2(writes[-1], 2)
    for write in writes:
        os.close(write)
    # a line a write, at its end: a killed process's last lines are out, and the lines of
    # processes sharing a console (fsdp ranks) do not break into each other's (under
    # PYTHONUNBUFFERED a print is two writes: the text, then its newline)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=False)
    faulthandler.enable(file=sys.stderr)
    _KEPT.append(output := Tee(log, copier, saved))
    return output
