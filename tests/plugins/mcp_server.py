"""A stdio MCP server with tools that misbehave on purpose (tests/agent/test_mcp_servers.py):
one that answers, one that raises (an `isError` result), one that sleeps (a timeout), one
that floods (the token budget), one that exits mid-call, and its own pid (orphans).

    python tests/plugins/mcp_server.py
"""

from __future__ import annotations

import os
import sys
import time

try:
    from mcp.server.mcpserver import MCPServer  # mcp 2
except ImportError:  # mcp 1
    from mcp.server.fastmcp import FastMCP as MCPServer  # type: ignore[no-redef]

server = MCPServer("faulty")


@server.tool()
def echo(text: str) -> str:
    """Say the text back."""
    return f"echo: {text}"


@server.tool()
def boom(x: int) -> int:
    """Raise."""
    raise ValueError(f"boom {x}")


@server.tool()
def slow(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "slept"


@server.tool()
def flood(n: int) -> str:
    """n characters."""
    return "x" * n


@server.tool()
def die() -> str:
    """Exit in the middle of the call."""
    print("faulty: exiting on purpose", file=sys.stderr, flush=True)
    os._exit(3)


@server.tool()
def pid() -> int:
    """This server's process id."""
    return os.getpid()


if __name__ == "__main__":
    if os.environ.get("FAULTY_SAY"):
        print(os.environ["FAULTY_SAY"], file=sys.stderr, flush=True)
    server.run()
