"""A process's output in its log and on its console (`flowgraph.compilers.logs.tee`), as
fsdp ranks and Ray workers use it: each stream stays where it went (or both go to
stderr, merged), a child's and C-level writes land too, and what a SIGKILLed process
wrote is in its log and on the console."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

WRITER = """\
import os, signal, subprocess, sys
from pathlib import Path
from flowgraph.compilers.logs import tee
print("before the tee")
output = tee(Path(sys.argv[1]), merged=sys.argv[2] == "merged")
print("a print")
print("a warning", file=sys.stderr)
os.write(1, b"fd 1 raw\\n")
os.write(2, b"fd 2 raw\\n")
subprocess.run([sys.executable, "-c", "print('a child')"], check=True)
if sys.argv[2] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
output.close()
print("after the tee")
output.note("noted")
"""


def _run(cwd: Path, log: Path, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WRITER, str(log), mode], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def test_each_stream_stays_where_it_went_and_a_killed_process_s_lines_are_kept(
        tmp_path: Path) -> None:
    log = tmp_path / "logs" / "rank-0.log"
    proc = _run(tmp_path, log, "killed")
    assert proc.returncode == -9, proc.stderr
    assert proc.stdout.splitlines() == ["before the tee", "a print", "fd 1 raw", "a child"]
    assert proc.stderr.splitlines() == ["a warning", "fd 2 raw"]
    lines = log.read_text().splitlines()
    assert sorted(lines) == sorted(["a print", "fd 1 raw", "a child", "a warning",
                                    "fd 2 raw"]), lines
    assert stat.S_IMODE(log.stat().st_mode) == 0o644


def test_merged_both_streams_go_to_stderr_in_order_and_close_gives_them_back(
        tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text("an earlier run\n")
    proc = _run(tmp_path, log, "merged")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["before the tee", "after the tee"]
    written = ["a print", "a warning", "fd 1 raw", "fd 2 raw", "a child"]
    assert proc.stderr.splitlines() == written
    assert log.read_text().splitlines() == ["an earlier run", *written, "noted"]
