"""A black-box agent whose second request forks: it asks the policy once, then hands
the task to a "sub-agent" with a history of its own (the first answer summed up in a
new user message), as context-compacting and sub-agent programs do. With
`rows_per_episode: 2` each chain is a row of the episode
(tests/compilers/test_agent_endpoint.py)."""

from __future__ import annotations

from typing import Any


async def run(task: dict[str, Any], client: Any) -> float:
    prompt = task["prompt"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) \
        else list(prompt)
    first = await client.chat.completions.create(model="policy", messages=messages)
    draft = (first.choices[0].message.content or "")[:12]
    fresh = [{"role": "user", "content": f"draft: {draft}"}]
    final = await client.chat.completions.create(model="policy", messages=fresh)
    # a score with some spread across a group, from the final answer only
    return float(len(final.choices[0].message.content or "") % 3 == 0)
