"""Write tests/fixtures/verl/agent_tools.json: verl 0.9.1 calling the tools of
tests/fixtures/verl/agent_tools.yaml as its agent loop does, and flowgraph's adapter
(`flowgraph.agent.adapters.load_env`) calling the same tools, checked equal here.

verl's side is its own code: `initialize_tools_from_config` reads the YAML and makes the
tools (verl's `BaseTool` itself among them), and `ToolAgentLoop._call_tool` runs each call
on a stand-in loop object, as verl's tests/experimental/agent_loop/test_call_tool_on_cpu.py
does. Recorded per call: the tool message's content (`tool_response.text or ""`) and the
reward (flowgraph's turn reward, a `ToolResult`); then verl's `tool_rewards`, each tool's
prompt schema (`model_dump(exclude_unset=True, exclude_none=True)`) and the order of
create / release.
tests/agent/test_adapters.py holds the adapter to these without verl. (verl 0.9.1 ships
no example tool such as the older gsm8k_tool; agent_tools.py's tools keep per-instance
state, so the record shows verl creating and releasing an instance around every call.)

Run (verl is not a dependency of flowgraph):

    pip install --no-deps verl==0.9.1
    pip install tensordict omegaconf codetiming      # what `verl.tools` imports
    python scripts/verl_tool_fixtures.py

Made with verl 0.9.1, pydantic 2.13, omegaconf 2.4, transformers 5.19.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "verl"
sys.path[:0] = [str(ROOT), str(FIXTURES)]

import agent_tools  # noqa: E402
import verl  # noqa: E402
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop  # noqa: E402
from verl.experimental.agent_loop.tool_parser import FunctionCall  # noqa: E402
from verl.tools.tool_registry import initialize_tools_from_config  # noqa: E402

YAML = FIXTURES / "agent_tools.yaml"
OUT = FIXTURES / "agent_tools.json"
ROW = {"prompt": [{"role": "user", "content": "Count with me."}],
       "extra_info": {"tools_kwargs": {"counter": {"create_kwargs": {"start": 5}}}}}
"""A row as verl's RLHFDataset keeps it: the tools' create_kwargs in extra_info."""
CALLS = [("counter", {"n": 2}), ("counter", {"n": 3}), ("flaky", {"query": "x"}),
         ("silent", {}), ("base", {"note": "a"})]
"""One episode's tool calls, in order."""


async def verl_side() -> dict[str, Any]:
    tools = initialize_tools_from_config(str(YAML))
    loop = MagicMock(spec=ToolAgentLoop)
    loop.tools = {tool.name: tool for tool in tools}
    loop.max_tool_response_length = 10_000  # verl truncates by characters; none here
    loop.tool_response_truncate_side = "middle"
    call_tool = ToolAgentLoop._call_tool.__get__(loop, ToolAgentLoop)
    tools_kwargs = ROW["extra_info"]["tools_kwargs"]
    agent_data = SimpleNamespace(tools_kwargs=tools_kwargs)
    agent_tools.LOG.clear()
    contents, rewards, tool_rewards = [], [], []
    for name, arguments in CALLS:
        call = FunctionCall(name=name, arguments=json.dumps(arguments))
        response, reward, _ = await call_tool(call, tools_kwargs, agent_data)
        contents.append(response.text or "")  # the tool message verl builds
        rewards.append(reward)
        if reward is not None:
            tool_rewards.append(reward)
    return {"contents": contents, "rewards": rewards, "tool_rewards": tool_rewards,
            "schemas": [t.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
                        for t in tools],
            "log": [list(e) for e in agent_tools.LOG]}


async def flowgraph_side() -> dict[str, Any]:
    if importlib.util.find_spec("flowgraph.agent.tools") is None:  # not merged yet
        stand_in = importlib.util.spec_from_file_location(
            "stand_in", ROOT / "tests" / "agent" / "conftest.py")
        module = sys.modules["stand_in"] = importlib.util.module_from_spec(stand_in)
        stand_in.loader.exec_module(module)
    from flowgraph.agent import Episode
    from flowgraph.agent.adapters import load_env

    env = load_env(str(YAML))()
    env.reset(ROW)
    agent_tools.LOG.clear()
    by_name = {tool.name: tool for tool in env.tools}
    results = [await by_name[name].fn(**arguments) for name, arguments in CALLS]
    reward = env.reward(Episode(task=ROW))
    await env.close()
    return {"contents": [r.content for r in results], "rewards": [r.reward for r in results],
            "tool_rewards": env.agent_data.tool_rewards, "reward": reward,
            "log": [list(e) for e in agent_tools.LOG]}


def main() -> None:
    reference = asyncio.run(verl_side())
    ours = asyncio.run(flowgraph_side())
    for key in ("contents", "tool_rewards", "log"):
        assert ours[key] == reference[key], (key, ours[key], reference[key])
    # each call's reward is its turn's (None: 0); the episode's own reward is 0
    assert ours["rewards"] == [0.0 if r is None else r for r in reference["rewards"]]
    assert ours["reward"] == 0.0
    OUT.write_text(json.dumps({"verl": verl.__version__, "row": ROW, "calls": CALLS,
                               **reference}, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: flowgraph's adapter matches verl "
          f"{verl.__version__} on {len(CALLS)} calls")


if __name__ == "__main__":
    main()
