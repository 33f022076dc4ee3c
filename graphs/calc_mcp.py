"""A tiny stdio MCP server: agent_calculator.py's `calculator`, served over MCP.

graphs/agent_mcp.yaml declares it (`mcp_servers: {calc: {command: [python, calc_mcp.py]}}`);
the rollout starts it once per process, lists its one tool and calls it with
`call_tool`. It serves the very function graphs/agent_calculator.yaml calls in-process,
so the two graphs train on the same numbers. Any MCP server works the same way.

    python graphs/calc_mcp.py        # speaks MCP (JSON-RPC) on stdin and stdout
"""

from __future__ import annotations

from agent_calculator import calculator  # next to this file: its folder is on sys.path

try:
    from mcp.server.mcpserver import MCPServer  # mcp 2
except ImportError:  # mcp 1
    from mcp.server.fastmcp import FastMCP as MCPServer  # type: ignore[no-redef]

server = MCPServer("calc")
server.tool()(calculator)

if __name__ == "__main__":
    server.run()  # stdio
