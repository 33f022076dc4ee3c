"""The calculator example as a black-box agent (graphs/agent_calculator_openai.yaml).

`run` is an agent program as users write them for any OpenAI-compatible server: the
official `openai.AsyncOpenAI` client, a tool loop, and a reward at the end. flowgraph
serves the endpoint its `client` points at (`flowgraph.agent.sessions`): each
completion is a turn of the policy, sampled in the rollout's batch, its tokens and
log-probs recorded. It plays the game `CalculatorEnv` plays in
graphs/agent_calculator.yaml: while the model's calls are well formed, the rollout's
rows are the same to the token. Where they are not, the two part: the native rollout
tells the model what was wrong in a tool message of its own; here a call the parser
cannot read comes back as text (and the episode ends), and arguments the calculator
does not take are answered with this program's own error message.
"""

from __future__ import annotations

import json
from typing import Any

from agent_calculator import calculator, ground_truth  # the plugin file next to this one

from flowgraph.agent import as_tool

TOOLS = [as_tool(calculator).schema()]
"""The calculator's JSON schema, as OpenAI's `tools=` takes it."""


async def run(task: dict[str, Any], client: Any) -> dict[str, float]:
    """One episode: ask, run the calculator calls the model makes, score the last answer."""
    prompt = task["prompt"]  # the dataset's chat messages (or one string)
    messages: list[dict[str, Any]] = (
        [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt))
    while True:
        reply = await client.chat.completions.create(model="policy", messages=messages,
                                                     tools=TOOLS)
        message = reply.choices[0].message
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:  # the model's arguments: maybe not the calculator's
                result = calculator(**json.loads(call.function.arguments))
            except (json.JSONDecodeError, TypeError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    right = float((message.content or "").strip() == ground_truth(task))
    return {"score": right, "acc": right}
