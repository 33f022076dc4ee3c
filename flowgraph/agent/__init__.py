"""Multi-turn, tool-using rollouts: what a user writes (an `Env`, tools) and what reads it.

Torch-free: `flowgraph check` imports environments and tools to build their schemas.
The rollout itself (sampling, token bookkeeping) is the `agent_rollout` kind,
`flowgraph.nodes.agent`.
"""

from flowgraph.agent.env import STATUSES, Env, Episode, Message, Step, ToolResult, as_messages

__all__ = ["STATUSES", "Env", "Episode", "Message", "Step", "ToolResult", "as_messages"]
