"""A Python sandbox tool: the model's code runs in a fresh, limited subprocess.

    tools: [flowgraph.agent.sandbox:python]           # the default limits
    python = flowgraph.agent.sandbox.sandbox(timeout_s=5, memory_mb=512)   # your own

Each call (`PythonSandbox.run`, an `async def`: 32 concurrent calls need no thread pool):

1. makes a fresh temporary working directory (also `HOME` and `TMPDIR`), removed after;
2. starts `python -I -u` (isolated mode: no user site, no `PYTHON*` variables, no
   script or working directory on `sys.path`) in a new session, so in its own process
   group, with stdin closed and an environment of `PATH`, `LANG`, `HOME`, `TMPDIR` and
   one-thread BLAS settings only: nothing of the trainer's environment (keys, tokens);
3. sets, in the child before the code is read, the rlimits: CPU seconds, address space
   (memory), the size of a written file, open files, processes (see `process_limit`),
   no core files; then `exec`s the code, so the limits hold for it and its children;
4. reads stdout and stderr from one pipe, so interleaved in the order the code wrote
   them, as a terminal shows them; at most `max_output_chars` are kept (the head and
   the tail, a marker saying how many characters were cut between): a flood never grows
   the trainer's memory;
5. at the wall-clock timeout, and in every case once the code's process ends, kills the
   whole process group (SIGKILL), so a child the code started dies with it.

What the code does wrong is output the model reads, never an exception: a traceback,
a `MemoryError`, a non-zero exit status, the kill at the timeout (a line in brackets
says which). Only the sandbox's own failure to start raises `SandboxError`.

It is not a security boundary: no seccomp, no namespaces. The code runs as the trainer's
user (or `user`), can read what that user can read and reach the network. README: "The
Python sandbox" says what protects against a determined attacker.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import io
import json
import os
import resource
import shutil
import signal
import stat
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flowgraph.errors import SandboxError

if TYPE_CHECKING:
    from flowgraph.agent.tools import Tool

__all__ = ["PythonSandbox", "SandboxResult", "process_limit_applies", "python", "sandbox"]

KILL_GRACE_S = 2.0
"""Seconds the sandbox waits for the killed group's pipe to close; a tool's `timeout_s`
is the sandbox's own timeout plus this, so the sandbox's kill comes first."""

_READ_CHUNK = 1 << 16

_BOOTSTRAP = """\
import json, os, resource, sys
limits = json.loads(sys.argv[1])
for name, soft in limits["rlimits"]:
    which = getattr(resource, name, None)
    if which is None:
        continue
    # the CPU hard limit is a second later: SIGXCPU first, SIGKILL if it is caught
    hard, now = soft + (name == "RLIMIT_CPU"), resource.getrlimit(which)[1]
    if now != resource.RLIM_INFINITY:
        soft, hard = min(soft, now), min(hard, now)
    resource.setrlimit(which, (soft, hard))
if limits["processes"] is not None and os.getuid() != 0 and os.path.isdir("/proc"):
    uid, tasks = str(os.getuid()), 0
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except (OSError, ValueError):
            continue
        if fields.get("Uid", "").split()[:1] == [uid]:
            tasks += int(fields.get("Threads", "1"))
    resource.setrlimit(resource.RLIMIT_NPROC, (tasks + limits["processes"],) * 2)
os.execv(sys.executable, [sys.executable, "-I", "-u", limits["script"]])
"""
"""Runs in the child (`python -I -S -c`) before the code: sets the limits, then `exec`s
a fresh interpreter on the code, so the code's traceback has no frame of ours and the
limits are set without a `preexec_fn` (unsafe in a process with threads).

RLIMIT_NPROC counts every process and thread of the user, the trainer's included: the
limit is the user's count now plus `processes`. Linux ignores it for root."""


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """What one run gave: the text the model reads, and how it ended."""

    output: str
    """stdout and stderr interleaved as written, cut to `max_output_chars`, then a line in
    brackets if the code did not exit with status 0 (its status, a signal, the kill)."""
    returncode: int
    """The process's exit status; -N: killed by signal N."""
    timed_out: bool
    """Killed at the wall-clock timeout."""
    chars_cut: int
    """Characters of output dropped from the middle to fit `max_output_chars`."""


@dataclass(frozen=True)
class PythonSandbox:
    """The limits of one sandbox; `run(code)` runs code under them, `tool()` makes the
    model's `python` tool."""

    timeout_s: float = 10.0
    """Wall-clock seconds a run may take; then its process group is killed."""
    cpu_s: int | None = None
    """CPU seconds of each process (RLIMIT_CPU, then SIGXCPU); None: `timeout_s`, rounded
    up."""
    memory_mb: int | None = 1024
    """Address space of each process in MiB (RLIMIT_AS); an allocation past it raises
    MemoryError in the code. None: unlimited."""
    file_mb: int | None = 64
    """Largest file the code may write, in MiB (RLIMIT_FSIZE: a write past it fails with
    EFBIG). None: unlimited."""
    open_files: int | None = 64
    """File descriptors of each process (RLIMIT_NOFILE)."""
    processes: int | None = 16
    """Processes and threads the code may add (RLIMIT_NPROC over the user's current
    count). Linux ignores RLIMIT_NPROC for root: see `process_limit_applies`."""
    max_output_chars: int = 16_384
    """Characters of output kept (head and tail); a safety cap against a flood, above the
    rollout's `max_tool_tokens`, which cuts to the token budget."""
    user: int | str | None = None
    """Run the code as this user (a name or uid; the trainer must be root to switch): it
    then cannot touch the trainer's files, and RLIMIT_NPROC holds. None: the trainer's."""
    executable: str = sys.executable
    """The Python that runs the code (by default the trainer's, with its packages)."""
    workdir: str | None = None
    """Where the temporary working directories are made; None: the system's temp dir."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables added to the child's minimal environment."""

    def __post_init__(self) -> None:
        positive = {"timeout_s": self.timeout_s, "cpu_s": self.cpu_s,
                    "memory_mb": self.memory_mb, "file_mb": self.file_mb,
                    "open_files": self.open_files, "processes": self.processes,
                    "max_output_chars": self.max_output_chars}
        bad = [f"{k}={v!r}" for k, v in positive.items()
               if v is not None and (isinstance(v, bool) or not v > 0)]
        if bad:
            raise SandboxError(f"PythonSandbox: {', '.join(bad)}; every limit is a positive "
                               "number (None where allowed: no limit)")
        if self.open_files is not None and self.open_files < 16:
            raise SandboxError(f"PythonSandbox: open_files={self.open_files}; Python needs "
                               "about 16 file descriptors to start")

    @property
    def description(self) -> str:
        """What the model reads about the tool: what it does and its limits."""
        memory = f", {self.memory_mb} MiB of memory" if self.memory_mb else ""
        return ("Run Python 3 code in a fresh process and return what it printed (stdout and "
                "stderr, interleaved). Nothing is kept between calls: print what you need. "
                f"Limits: {self.timeout_s:g} s{memory}, no input.")

    def rlimits(self) -> list[tuple[str, int]]:
        """(resource name, soft limit) for the child; names the platform lacks are skipped
        there."""
        mib = 1 << 20
        cpu = self.cpu_s if self.cpu_s is not None else int(-(-self.timeout_s // 1))
        limits = [("RLIMIT_CPU", cpu), ("RLIMIT_CORE", 0)]
        if self.memory_mb is not None:
            limits.append(("RLIMIT_AS", self.memory_mb * mib))
        if self.file_mb is not None:
            limits.append(("RLIMIT_FSIZE", self.file_mb * mib))
        if self.open_files is not None:
            limits.append(("RLIMIT_NOFILE", self.open_files))
        return limits

    async def run(self, code: str) -> SandboxResult:
        """Run `code` under the limits; SandboxError only if the process cannot start."""
        workdir = tempfile.mkdtemp(prefix="flowgraph-sandbox-", dir=self.workdir)
        try:
            script = os.path.join(workdir, "main.py")
            with open(script, "w", encoding="utf-8") as f:
                f.write(code)
            uid = self._chown(workdir)
            # our own pipe, not asyncio's PIPE: the process's end is then seen when it
            # exits, even while a child it left behind holds the pipe open
            read_fd, write_fd = os.pipe()
            try:
                proc = await self._start(workdir, script, uid, write_fd)
            except BaseException:
                os.close(read_fd)
                raise
            finally:
                os.close(write_fd)
            return await self._supervise(proc, read_fd)
        finally:
            _remove(workdir)

    def run_sync(self, code: str) -> SandboxResult:
        """`run` for code outside an event loop (a script, a sync tool, a test)."""
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop()
            raise SandboxError("PythonSandbox.run_sync: called inside a running event loop; "
                               "`await sandbox.run(code)` there instead")
        return asyncio.run(self.run(code))

    async def __call__(self, code: str) -> str:
        """The tool's text: the output, with its status line."""
        return (await self.run(code)).output

    def tool(self) -> Tool:
        """This sandbox as the model's `python` tool (`flowgraph.agent.tools.Tool`), whose
        timeout is the sandbox's own plus KILL_GRACE_S, so the sandbox's kill comes first."""
        from flowgraph.agent.tools import tool

        box = self

        async def python(code: str) -> str:
            """Run Python 3 code in a fresh process and return what it printed.

            Args:
                code: A complete Python program; print the values you need to see.
            """
            return await box(code)

        made: Tool = tool(name="python", description=self.description,
                          timeout_s=self.timeout_s + KILL_GRACE_S)(python)
        return made

    def _chown(self, workdir: str) -> int | None:
        """The uid to run as (None: the trainer's), owning `workdir`."""
        if self.user is None:
            return None
        import pwd

        try:
            entry = (pwd.getpwuid(self.user) if isinstance(self.user, int)
                     else pwd.getpwnam(self.user))
        except KeyError:
            raise SandboxError(f"PythonSandbox: no user {self.user!r} on this machine") from None
        os.chown(workdir, entry.pw_uid, entry.pw_gid)
        os.chown(os.path.join(workdir, "main.py"), entry.pw_uid, entry.pw_gid)
        return entry.pw_uid

    async def _start(self, workdir: str, script: str, uid: int | None,
                     output_fd: int) -> asyncio.subprocess.Process:
        """The child, in its own session (process group), limits set before the code."""
        limits = json.dumps({"rlimits": self.rlimits(), "processes": self.processes,
                             "script": script})
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
               "HOME": workdir, "TMPDIR": workdir, "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **self.env}
        who: dict[str, Any] = {}
        if uid is not None:
            import pwd

            who = {"user": uid, "group": pwd.getpwuid(uid).pw_gid, "extra_groups": []}
        try:
            return await asyncio.create_subprocess_exec(
                self.executable, "-I", "-S", "-c", _BOOTSTRAP, limits,
                stdin=asyncio.subprocess.DEVNULL, stdout=output_fd,
                stderr=asyncio.subprocess.STDOUT, cwd=workdir, env=env,
                start_new_session=True, **who)
        except (OSError, ValueError) as e:
            raise SandboxError(f"PythonSandbox: cannot start {self.executable} "
                               f"(user {self.user!r}): {e}") from e

    async def _supervise(self, proc: asyncio.subprocess.Process,
                         read_fd: int) -> SandboxResult:
        """Read the output while the code runs; kill its group at the timeout, or when it
        ends (its children too), or when the caller is cancelled."""
        output = _CappedText(self.max_output_chars)
        stream = asyncio.StreamReader(limit=_READ_CHUNK)
        pipe = open(read_fd, "rb", buffering=0)  # noqa: SIM115 (closed by _finish_reading)
        transport: asyncio.BaseTransport | None = None
        reader: asyncio.Future[None] | None = None
        timed_out = False
        try:
            transport, _ = await asyncio.get_running_loop().connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(stream), pipe)
            reader = asyncio.ensure_future(_drain(stream, output))
            await asyncio.wait_for(proc.wait(), self.timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            _kill_group(proc.pid)
            await _finish_reading(reader, transport or pipe)
        returncode = -signal.SIGKILL
        with contextlib.suppress(asyncio.TimeoutError):
            returncode = await asyncio.wait_for(proc.wait(), KILL_GRACE_S)
        text, status = output.text(), self._status(returncode, timed_out)
        if status:
            text += ("" if not text or text.endswith("\n") else "\n") + f"[{status}]"
        return SandboxResult(text or "(no output)", returncode, timed_out, output.cut)

    def _status(self, returncode: int, timed_out: bool) -> str:
        """How a run that did not exit with 0 ended; '' if it did."""
        if timed_out:
            line = f"killed: ran past the {self.timeout_s:g} s time limit"
        elif returncode == -getattr(signal, "SIGXCPU", 0):
            line = "killed: used up its CPU time limit"
        elif returncode < 0:
            line = f"killed by signal {signal.Signals(-returncode).name}"
        elif returncode > 0:
            line = f"exit status {returncode}"
        else:
            return ""
        return line


class _CappedText:
    """Decoded output, at most `limit` characters kept: the first half and the last."""

    def __init__(self, limit: int) -> None:
        self.head_limit = limit - limit // 2
        self.tail_limit = limit // 2
        self.head = ""
        self.tail = ""
        self.cut = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, data: bytes, final: bool = False) -> None:
        """Append raw output; the middle past the limit is counted, not kept."""
        text = self.decoder.decode(data, final)
        room = max(0, self.head_limit - len(self.head))
        self.head += text[:room]
        self.tail += text[room:]
        if len(self.tail) > 2 * self.tail_limit + _READ_CHUNK:
            self._trim()

    def _trim(self) -> None:
        over = len(self.tail) - self.tail_limit
        if over > 0:
            self.cut += over
            self.tail = self.tail[over:]

    def text(self) -> str:
        self._trim()
        if not self.cut:
            return self.head + self.tail
        return f"{self.head}\n[... {self.cut} characters cut ...]\n{self.tail}"


async def _drain(stream: asyncio.StreamReader, out: _CappedText) -> None:
    """Read the pipe to its end in bounded chunks."""
    while chunk := await stream.read(_READ_CHUNK):
        out.add(chunk)
    out.add(b"", final=True)


async def _finish_reading(reader: asyncio.Future[None] | None,
                          pipe: asyncio.BaseTransport | io.RawIOBase) -> None:
    """Read the killed group's output to its end, then close the pipe. A process that left
    the group (`setsid`) may hold the pipe open: reading stops KILL_GRACE_S later."""
    try:
        if reader is not None:
            await asyncio.wait({reader}, timeout=KILL_GRACE_S)
    finally:
        if reader is not None:
            reader.cancel()
        pipe.close()


def _kill_group(pgid: int) -> None:
    """SIGKILL every process of the group; a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _remove(workdir: str) -> None:
    """Remove the working directory, even where the code took away its permissions."""
    shutil.rmtree(workdir, ignore_errors=True)
    if not os.path.lexists(workdir):
        return
    for root, dirs, _files in os.walk(workdir):
        for d in dirs:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(root, d), stat.S_IRWXU)
    shutil.rmtree(workdir, ignore_errors=True)


def process_limit_applies(user: int | str | None = None) -> bool:
    """Whether RLIMIT_NPROC (`processes`) holds for code run as `user` (None: this
    process's user). Linux exempts root and any process with CAP_SYS_ADMIN or
    CAP_SYS_RESOURCE, so as root, give the sandbox an unprivileged `user`."""
    if not hasattr(resource, "RLIMIT_NPROC") or not os.path.isdir("/proc"):
        return False
    if user is not None:
        import pwd

        uid = user if isinstance(user, int) else pwd.getpwnam(user).pw_uid
        return uid != 0
    if os.getuid() == 0:
        return False
    with open("/proc/self/status") as f:
        caps = next((line.split()[1] for line in f if line.startswith("CapEff:")), "0")
    cap_sys_admin, cap_sys_resource = 21, 24
    return not int(caps, 16) & ((1 << cap_sys_admin) | (1 << cap_sys_resource))


def sandbox(**limits: Any) -> Tool:
    """A `python` tool with these limits (the fields of `PythonSandbox`)."""
    return PythonSandbox(**limits).tool()


_DEFAULT = PythonSandbox()


async def python(code: str) -> str:
    """Run Python 3 code in a fresh process and return what it printed.

    Args:
        code: A complete Python program; print the values you need to see.
    """
    return await _DEFAULT(code)
