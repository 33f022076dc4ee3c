"""Tools from MCP servers: an `agent_rollout`'s `mcp_servers`, each a stdio server.

    mcp_servers:
      calc: {command: [python, calc_mcp.py], env: {DIGITS: "12"}, cwd: ., check: true}

A server's tools (its `list_tools`) join the rollout's Python tools as `Tool`s whose `fn`
awaits its `call_tool`: one more source of tools for the same machinery
(`flowgraph.agent.episodes`: the argument check, the timeouts, the statuses,
`max_tool_tokens`). A result with `isError`, or a server that exits mid-call, raises
McpServerError: the episode ends `error`, as when a Python tool raises.

Per process, a server starts the first time a rollout asks for its tools and serves the
process's later episodes, steps and nodes; its session lives on the agent event loop
(`AgentLoop`), which the tool calls run on. It stops at the process's exit
(`multiprocessing.util.Finalize`: a multiprocessing child's too); a trainer killed with
SIGKILL takes it along (`_BOOTSTRAP`: PR_SET_PDEATHSIG, as
`flowgraph.compilers.signals.die_with_parent`). One that exited starts again at the next
rollout call. It sees the `mcp` client's default environment and its `env`, never the
trainer's keys.

Check is run: `cwd` (default: the graph file's folder) is made absolute at compile time
(`resolved`), and `flowgraph check` starts each server, lists its tools and stops it
(`probe`; FG610 where it does not start). `mcp` is imported when a server starts, never
on import of this module.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import math
import multiprocessing.util
import os
import re
import shlex
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from flowgraph.agent.episodes import AgentLoop
from flowgraph.agent.tools import Tool
from flowgraph.document import did_you_mean
from flowgraph.errors import McpServerError, ToolSchemaError
from flowgraph.paths import written_file
from flowgraph.source import SourcePos

__all__ = ["KEYS", "McpServer", "declared", "probe", "resolved", "server_tools",
           "stop_all"]

KEYS = ("command", "env", "cwd", "start_timeout_s", "check")
"""What one server's declaration may say."""
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""What a server may be called (it names the server in messages and metrics)."""
STDERR_BYTES, STDERR_SHOWN = 8192, 2000
"""Bytes of a server's stderr kept (its tail), and characters of it a message shows."""
STOP_S = 15.0
"""Seconds a server's shutdown may take (the `mcp` client's own steps are bounded:
stdin closed, 2 s, SIGTERM to its group, 2 s, SIGKILL)."""

_BOOTSTRAP = """\
import ctypes, os, signal, sys
parent, command = int(sys.argv[1]), sys.argv[2:]
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
except (OSError, AttributeError):
    pass
if os.getppid() != parent:
    sys.exit("flowgraph: the trainer exited before its MCP server started")
try:
    os.execvp(command[0], command)
except OSError as exc:
    sys.exit(f"flowgraph: cannot run {command[0]!r}: {exc.strerror}")
"""
"""Runs first in the server's process (`python -I -S -c`): PR_SET_PDEATHSIG (1), SIGKILL
when the trainer's thread that started it (the agent loop's: the process's life) dies;
then `exec`s the command, so the process the `mcp` client stops is the server itself."""


@dataclass(frozen=True, slots=True)
class McpServer:
    """One stdio MCP server, as a rollout declares it."""

    name: str
    """The key under `mcp_servers`: names the server in messages."""
    command: tuple[str, ...]
    """The program and its arguments; a first word `python` / `python3` is the trainer's
    Python (`sys.executable`)."""
    env: tuple[tuple[str, str], ...] = ()
    """Variables the server gets besides the `mcp` client's defaults."""
    cwd: str = "."
    """The folder it runs in; made absolute at compile time (`resolved`)."""
    start_timeout_s: float = 30.0
    """Seconds it may take to start, initialize and list its tools."""
    check: bool = True
    """`flowgraph check` starts it (FG610 if it does not start); false: the run does."""

    def __post_init__(self) -> None:
        where = f"MCP server `{self.name}`"
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise McpServerError(f"MCP server {self.name!r}: a server's name is 1 to 64 "
                                 "letters, digits, `_` or `-`")
        if not self.command or not all(isinstance(w, str) and w for w in self.command):
            raise McpServerError(f"{where}: `command` is {list(self.command)!r}; give the "
                                 "program and its arguments as a list of strings "
                                 "(`command: [python, my_server.py]`)")
        t = self.start_timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) \
                or t <= 0:
            raise McpServerError(f"{where}: start_timeout_s={t!r} is not a positive, finite "
                                 "number of seconds")

    def argv(self) -> list[str]:
        """The command as it runs: `python` is this process's Python."""
        first = sys.executable if self.command[0] in ("python", "python3") else self.command[0]
        return [first, *self.command[1:]]

    def describe(self) -> str:
        """`calc` (`python calc_mcp.py` in /graphs), for messages."""
        return f"`{self.name}` (`{shlex.join(self.command)}` in {self.cwd})"


def declared(value: object, where: str) -> tuple[McpServer, ...]:
    """The servers an `mcp_servers` param value (plain data) declares; McpServerError
    naming `where` (the node) and the server for anything that is not a declaration."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise McpServerError(f"{where}: `mcp_servers` is {value!r}; give a mapping of server "
                             "names to their declarations (`calc: {command: [python, "
                             "calc_mcp.py]}`)")
    return tuple(_one(str(name), spec, where) for name, spec in value.items())


def _one(name: str, spec: object, where: str) -> McpServer:
    what = f"{where}: MCP server `{name}`"
    if not isinstance(spec, Mapping):
        raise McpServerError(f"{what} is {spec!r}; declare it as a mapping with a `command` "
                             "(`{command: [python, my_server.py]}`)")
    unknown = [k for k in spec if k not in KEYS]
    if unknown:
        raise McpServerError(f"{what} has no setting `{unknown[0]}`; "
                             f"{did_you_mean(str(unknown[0]), KEYS)}")
    if "command" not in spec:
        raise McpServerError(f"{what} has no `command`; give the program and its arguments "
                             "(`command: [python, my_server.py]`)")
    command = spec["command"]
    command = [command] if isinstance(command, str) else command
    env = spec.get("env") or {}
    if not isinstance(env, Mapping) or not all(isinstance(v, str | int | float | bool)
                                               for v in env.values()):
        raise McpServerError(f"{what}: `env` is {env!r}; give a mapping of variable names "
                             "to strings")
    check, cwd = spec.get("check", True), spec.get("cwd", ".")
    if not isinstance(check, bool) or not isinstance(cwd, str):
        raise McpServerError(f"{what}: `check` is {check!r} and `cwd` {cwd!r}; `check` is "
                             "true or false, `cwd` a folder")
    try:
        return McpServer(name, tuple(command) if isinstance(command, Sequence) else (),
                         tuple((str(k), str(v)) for k, v in env.items()), cwd,
                         spec.get("start_timeout_s", 30.0), check)
    except McpServerError as exc:
        raise McpServerError(f"{where}: {exc}") from None


def resolved(value: object, pos: SourcePos) -> object:
    """The `mcp_servers` value written at `pos` with each server's `cwd` absolute, by the
    rule of a node's file params (`written_file`; no `cwd`: the graph file's folder); what
    is not a declaration as it is (the checker says what is wrong with it)."""
    if not isinstance(value, Mapping):
        return value
    return {name: {**spec, "cwd": written_file(str(spec.get("cwd", ".")), pos)}
            if isinstance(spec, Mapping) else spec for name, spec in value.items()}


# --- a running server ------------------------------------------------------------------------


class _Tail:
    """The last `STDERR_BYTES` a server wrote to its stderr, read by a daemon thread from
    a pipe (never a file that grows for the run's length); `ended` once it closes (the
    server exited)."""

    def __init__(self) -> None:
        self.chunks: collections.deque[bytes] = collections.deque()
        self.size = 0
        self.ended = threading.Event()
        self.read_fd, self.write_fd = os.pipe()
        threading.Thread(target=self._drain, name="flowgraph-mcp-stderr", daemon=True).start()

    def _drain(self) -> None:
        with open(self.read_fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(4096):
                self.chunks.append(chunk)
                self.size += len(chunk)
                while self.size - len(self.chunks[0]) >= STDERR_BYTES:
                    self.size -= len(self.chunks.popleft())
        self.ended.set()

    def text(self) -> str:
        """The tail, decoded, at most `STDERR_SHOWN` characters; `(nothing)` if empty."""
        text = b"".join(list(self.chunks)).decode(errors="replace")
        text = "\n".join(line.rstrip() for line in text.splitlines() if line.strip())
        return ("..." + text[-STDERR_SHOWN:] if len(text) > STDERR_SHOWN else text) \
            or "(nothing)"


@dataclass(eq=False)
class _Running:
    """One server's process and session, held open by a task on the agent loop."""

    server: McpServer
    tail: _Tail = field(default_factory=_Tail)
    session: Any = None
    listed: list[dict[str, Any]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    @property
    def exited(self) -> bool:  # its stderr closed, or its session ended
        return self.tail.ended.is_set() or (self.task is not None and self.task.done())

    async def start(self) -> None:
        """Start the server, initialize its session and list its tools, within its
        `start_timeout_s`; McpServerError naming it and its stderr if it does not."""
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task = asyncio.ensure_future(self._hold(ready))
        try:
            await asyncio.wait_for(asyncio.shield(ready), self.server.start_timeout_s)
            return
        except McpServerError:  # no `mcp` here
            await self.close()
            raise
        except Exception as exc:
            await self.close()
            if isinstance(exc, TimeoutError):
                what = (f"it did not answer `initialize` and `list_tools` within "
                        f"start_timeout_s = {self.server.start_timeout_s:g} s")
            else:
                await asyncio.to_thread(self.tail.ended.wait, 1.0)
                what = ("it exited before it answered `initialize`" if self.tail.ended.is_set()
                        else f"it did not start: {_leaf(exc)}")
        raise await self.failed(what)

    async def _hold(self, ready: asyncio.Future[None]) -> None:
        """The server's whole life, in one task (the `mcp` client's contexts are anyio
        task groups, entered and left by one task): start, list, wait for `stop`."""
        errlog = open(self.tail.write_fd, "w")  # noqa: SIM115 (closed once the server has it)
        try:
            from mcp import ClientSession, StdioServerParameters, stdio_client
        except ImportError:
            errlog.close()
            ready.set_exception(McpServerError(
                f"MCP server `{self.server.name}`: the `mcp` package is not installed here: "
                "pip install 'flowgraph[agents]'"))
            return
        params = StdioServerParameters(
            command=sys.executable,
            args=["-I", "-S", "-c", _BOOTSTRAP, str(os.getpid()), *self.server.argv()],
            env=dict(self.server.env), cwd=self.server.cwd)
        try:
            async with stdio_client(params, errlog=errlog) as (read, write):
                errlog.close()  # the server holds its own copy: its exit ends the tail
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    listed = await session.list_tools()
                    self.listed = [t.model_dump(by_alias=True, exclude_none=True)
                                   for t in listed.tools]
                    self.session = session
                    ready.set_result(None)
                    await self.stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception)
                                    else McpServerError(type(exc).__name__))
            if not isinstance(exc, Exception):
                raise
        finally:
            errlog.close()

    async def close(self) -> None:
        """Stop the server (stdin closed, then its group killed) and wait for it."""
        self.stop.set()
        if self.task is None or self.task.done():
            return
        if self.session is None:  # still starting (a server that never answers): the
            self.task.cancel()    # client's shutdown runs all the same, shielded
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(self.task, STOP_S)

    async def failed(self, what: str) -> McpServerError:
        """The error saying `what`, with its stderr's tail (a second for the last of it)."""
        await asyncio.to_thread(self.tail.ended.wait, 1.0)
        return McpServerError(f"MCP server {self.server.describe()}: {what}; its stderr: "
                              f"{self.tail.text()}")

    def tools(self) -> list[Tool]:
        """Its listed tools as `Tool`s that call it."""
        out = []
        for listed in self.listed:
            name = str(listed.get("name"))
            try:
                out.append(Tool(name, str(listed.get("description") or ""),
                                dict(listed.get("inputSchema") or {}),
                                functools.partial(self.call, name)))
            except ToolSchemaError as exc:
                raise McpServerError(f"MCP server {self.server.describe()} lists a tool that "
                                     f"cannot be offered to the policy: {exc}") from None
        return out

    async def call(self, name: str, /, **arguments: Any) -> str:
        """The text of one call's result. A result with `isError`, a server that exited
        or a failed request raise McpServerError: the episode ends `error`, as when a
        Python tool raises."""
        try:
            result = await self.session.call_tool(name, arguments)
        except Exception as exc:
            await asyncio.to_thread(self.tail.ended.wait, 0.5)  # an exit's EOF, read
            if self.exited:
                raise await self.failed(f"it exited during a call of `{name}`") from None
            raise McpServerError(f"MCP server `{self.server.name}`: the call of `{name}` "
                                 f"failed: {_leaf(exc)}") from None
        got = result.model_dump(by_alias=True, exclude_none=True)
        text = _text(got)
        if got.get("isError"):
            raise McpServerError(f"MCP server `{self.server.name}`: tool `{name}` answered "
                                 f"with an error: {text}")
        return text


def _text(result: Mapping[str, Any]) -> str:
    """A call result's text: its text blocks, one per line; another block is named in
    brackets; no text at all: its structured content as JSON."""
    parts = [str(block.get("text", "")) if block.get("type") == "text"
             else f"[{block.get('type')} content]" for block in result.get("content") or ()]
    if not parts and result.get("structuredContent") is not None:
        return json.dumps(result["structuredContent"])
    return "\n".join(parts)


def _leaf(exc: BaseException) -> str:
    """`Type: message` of the first leaf of an exception group (anyio's task groups
    wrap what a server's session raised)."""
    while inner := getattr(exc, "exceptions", ()):  # a BaseExceptionGroup (3.11)
        exc = inner[0]
    return f"{type(exc).__name__}: {exc}".rstrip(": ")


# --- the process's servers -----------------------------------------------------------------


class _Servers:
    """The servers this process runs, one per declaration, on the agent loop."""

    running: ClassVar[dict[McpServer, _Running]] = {}
    lock: ClassVar[asyncio.Lock | None] = None
    finalizer: ClassVar[multiprocessing.util.Finalize | None] = None
    probed: ClassVar[dict[McpServer, list[Tool] | McpServerError]] = {}

    @classmethod
    async def tools(cls, servers: Sequence[McpServer]) -> list[tuple[str, Tool]]:
        """(server name, tool) of each server's tools, in order."""
        if cls.lock is None:  # made on the loop's thread, once
            cls.lock = asyncio.Lock()
        async with cls.lock:  # two rollouts starting at once start a server once
            out = []
            for server in servers:
                out += [(server.name, t) for t in (await cls._started(server)).tools()]
            return out

    @classmethod
    async def _started(cls, server: McpServer) -> _Running:
        running = cls.running.get(server)
        if running is not None and not running.exited:
            return running
        if running is not None:
            print(f"flowgraph: MCP server {server.describe()} exited (its stderr: "
                  f"{running.tail.text()}); starting it again", file=sys.stderr, flush=True)
            await running.close()
        if cls.finalizer is None:  # the process's exit stops them (a multiprocessing
            cls.finalizer = multiprocessing.util.Finalize(  # child's too)
                None, stop_all, exitpriority=10)
        running = cls.running[server] = _Running(server)
        try:
            await running.start()
        except McpServerError:
            del cls.running[server]
            raise
        return running

    @classmethod
    async def stop(cls) -> None:
        running, cls.running = list(cls.running.values()), {}
        await asyncio.gather(*(r.close() for r in running))


def server_tools(servers: Sequence[McpServer], where: str, beside: Sequence[Tool] = ()
                 ) -> list[Tool]:
    """The tools of `servers`, each started if it does not run in this process (once per
    process); McpServerError naming `where` (the node), the server and its stderr if one
    does not start, or when a tool's name is another's (of a server, or `beside`: the
    rollout's Python tools): the policy calls a tool by its name."""
    if not servers:
        return []
    try:
        tools: list[tuple[str, Tool]] = AgentLoop.run(_Servers.tools(servers))
    except McpServerError as exc:
        raise McpServerError(f"{where}: {exc}") from None
    seen = {t.name: "`tools`" for t in beside}
    for server, t in tools:
        if t.name in seen:
            raise McpServerError(f"{where}: MCP server `{server}` offers a tool named "
                                 f"`{t.name}`, as {seen[t.name]} does: the policy calls a "
                                 "tool by its name; keep one of them")
        seen[t.name] = f"MCP server `{server}`"
    return [t for _, t in tools]


def probe(server: McpServer) -> list[Tool]:
    """`flowgraph check`'s look at a server: started, its tools listed, stopped (kept: the
    checker asks more than once); McpServerError naming it and its stderr if it fails."""
    got = _Servers.probed.get(server)
    if got is None:
        got = _Servers.probed[server] = AgentLoop.run(_probed(server))
    if isinstance(got, McpServerError):
        raise got
    return got


async def _probed(server: McpServer) -> list[Tool] | McpServerError:
    running = _Running(server)
    try:
        await running.start()
        return running.tools()
    except McpServerError as exc:
        return exc
    finally:
        await running.close()


def stop_all() -> None:
    """Stop every server this process runs (at its exit; a test's end)."""
    if _Servers.running:
        AgentLoop.submit(_Servers.stop()).result(timeout=STOP_S + 5)
