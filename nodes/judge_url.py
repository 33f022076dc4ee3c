"""A judge behind an OpenAI-compatible URL: one chat completion per rubric text.

Requests go out `concurrency` at a time; a failed or timed-out one is tried again after
backoff_s · 2^k seconds (k = 0, 1, …) up to `retries` times, and the last failure stops
the step naming the node and the URL. With `cache`, each reply is kept under the run dir
(`judge_cache/<node>/<sha256 of the request>.json`), so a resumed or repeated run sends
each request once. The request asks for greedy decoding (temperature 0).

Notation: b rows.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from flowgraph.errors import FlowgraphError
from flowgraph.runtime import NodeContext

__all__ = ["JudgeServer", "ask_url"]


@dataclass(frozen=True, slots=True)
class JudgeServer:
    """How to reach a judge server; the `judge` kind's params of the same names."""

    url: str
    api_model: str | None = None
    api_key_env: str | None = None
    max_new_tokens: int = 32
    concurrency: int = 8
    retries: int = 3
    backoff_s: float = 1.0
    request_timeout_s: float = 60.0

    def request(self, text: str) -> dict[str, Any]:
        """The chat completion's body for one rubric text (what the cache is keyed by)."""
        return {"model": self.api_model or "judge", "temperature": 0.0,
                "max_tokens": self.max_new_tokens,
                "messages": [{"role": "user", "content": text}]}

    def headers(self, node: str) -> dict[str, str]:
        if self.api_key_env is None:
            return {}
        key = os.environ.get(self.api_key_env)
        if not key:
            raise FlowgraphError(f"judge node `{node}`: api_key_env names "
                                 f"`{self.api_key_env}`, which is not set in the environment")
        return {"Authorization": f"Bearer {key}"}


def _post(client: httpx.Client, server: JudgeServer, body: dict[str, Any], node: str) -> str:
    last = ""
    for k in range(server.retries + 1):
        if k:
            time.sleep(server.backoff_s * 2 ** (k - 1))
        try:
            got = client.post("/chat/completions", json=body)
            got.raise_for_status()
            return str(got.json()["choices"][0]["message"]["content"] or "")
        except httpx.TimeoutException:
            last = f"no answer within request_timeout_s {server.request_timeout_s:g}s"
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            last = f"{type(exc).__name__}: {exc}"
    raise FlowgraphError(f"judge node `{node}`: the judge server {server.url} failed "
                         f"{server.retries + 1} tries ({last})")


def ask_url(server: JudgeServer, texts: list[str], ctx: NodeContext, cache: bool) -> list[str]:
    """The server's reply to each text, in order; cached replies are not asked again."""
    folder = Path(ctx.run_dir) / "judge_cache" / ctx.node if cache and ctx.run_dir else None
    bodies = [server.request(t) for t in texts]
    keys = [hashlib.sha256(json.dumps([server.url, b], sort_keys=True).encode()).hexdigest()
            for b in bodies]
    replies: dict[int, str] = {}
    for i, key in enumerate(keys):
        if folder is not None and (folder / f"{key}.json").is_file():
            replies[i] = json.loads((folder / f"{key}.json").read_text())["reply"]
    todo = [i for i in range(len(texts)) if i not in replies]
    if todo:
        headers = server.headers(ctx.node)
        with httpx.Client(base_url=server.url, headers=headers,
                          timeout=server.request_timeout_s) as client, \
                ThreadPoolExecutor(server.concurrency) as pool:
            got = pool.map(lambda i: _post(client, server, bodies[i], ctx.node), todo)
            replies.update(zip(todo, got, strict=True))
    if folder is not None and todo:
        folder.mkdir(parents=True, exist_ok=True)
        for i in todo:  # written whole then renamed: a killed run leaves no half entry
            part = folder / f"{keys[i]}.part"
            part.write_text(json.dumps({"request": bodies[i], "reply": replies[i]}))
            part.replace(folder / f"{keys[i]}.json")
    return [replies[i] for i in range(len(texts))]
