"""Multi-turn, tool-using rollouts: what a user writes (an `Env`, tools) and what reads it.

Torch-free: `flowgraph check` imports environments and tools to build their schemas.
The rollout itself (sampling, token bookkeeping) is the `agent_rollout` kind,
`flowgraph.nodes.agent`.
"""

from flowgraph.agent.adapters import load_env
from flowgraph.agent.env import STATUSES, Env, Episode, Message, Step, ToolResult, as_messages
from flowgraph.agent.parsers import (
    PARSERS,
    ToolCall,
    ToolCallParser,
    get_parser,
    hermes,
    register_parser,
)
from flowgraph.agent.tools import Tool, ToolSchemaError, as_tool, tool, tools_of

__all__ = [
    "PARSERS",
    "STATUSES",
    "Env",
    "Episode",
    "Message",
    "Step",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolResult",
    "ToolSchemaError",
    "as_messages",
    "as_tool",
    "get_parser",
    "hermes",
    "load_env",
    "register_parser",
    "tool",
    "tools_of",
]
