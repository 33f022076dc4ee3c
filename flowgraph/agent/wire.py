"""The agent endpoint's wire format: OpenAI's chat and completions requests read, answers
written (`flowgraph.agent.sessions` holds what they mean for an episode's row).

Sampling parameters come from the graph: a request whose `temperature`, `top_p`, `n`,
`stop`, penalties, `response_format` or `stream` ask for something else is refused
(HTTP 400, which the client raises in the program: the episode ends `error`, its line
named); `max_tokens` / `max_completion_tokens` shorten a turn; `model`, `seed`, `user`,
`metadata`, `parallel_tool_calls` are ignored.

Torch-free, and free of the server: plain functions over JSON bodies.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from typing import Any

from flowgraph.agent.env import Message
from flowgraph.agent.parsers import ToolCall
from flowgraph.errors import FlowgraphError

__all__ = ["REFUSED", "EndpointError", "answer_message", "chat_choice", "check_sampling",
           "completion_choice", "error_body", "reply", "request_messages", "request_prompt",
           "same_message", "token_log_probs"]

REFUSED: dict[str, Any] = {"n": 1, "stop": None, "presence_penalty": 0,
                           "frequency_penalty": 0, "logit_bias": None,
                           "response_format": None, "stream": False, "best_of": 1,
                           "echo": False, "suffix": None}
"""Request fields the graph decides: a request may leave them out or give these values,
anything else is refused. `temperature` and `top_p` may be given equal to the graph's."""


class EndpointError(FlowgraphError):
    """A request the endpoint refuses (its HTTP status and message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error answer, as OpenAI's server writes it."""
    return {"error": {"message": message, "type": "invalid_request_error"
                      if status < 500 else "server_error", "code": status}}


# -- requests ------------------------------------------------------------------------------


def check_sampling(body: Mapping[str, Any], temperature: float, top_p: float,
                   turn_tokens: int) -> int:
    """The tokens the request lets a turn take (at most `turn_tokens` unless it says);
    EndpointError for a sampling field the graph decides."""
    for key, allowed in REFUSED.items():
        if body.get(key, allowed) not in (allowed, None):
            raise EndpointError(400, f"`{key}`: {body[key]!r} is not served here: "
                                     "sampling is the graph's (the rollout node's "
                                     "params); leave it out")
    for key, ours in (("temperature", temperature), ("top_p", top_p)):
        given = body.get(key)
        if given is not None and abs(float(given) - ours) > 1e-9:
            raise EndpointError(400, f"`{key}`: {given} differs from the graph's "
                                     f"{ours}: sampling is the graph's (the rollout "
                                     "node's params); leave it out")
    top = body.get("top_logprobs") or 0
    if top:
        raise EndpointError(400, "`top_logprobs` is not served (the sampled tokens' "
                                 "log-probs are: `logprobs: true`)")
    given = body.get("max_completion_tokens") or body.get("max_tokens")
    return int(given) if given else turn_tokens


def request_messages(body: Mapping[str, Any]) -> list[Message]:
    """A chat request's messages as a chat template takes them."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EndpointError(400, "`messages` must be a non-empty list")
    return [_message(m, i) for i, m in enumerate(messages)]


def request_prompt(body: Mapping[str, Any]) -> str | list[int]:
    """A completions request's prompt: one string, or one list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if not isinstance(prompt, str) and not (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        raise EndpointError(400, "`prompt` is one string or one list of token ids")
    return prompt


def _message(m: Any, i: int) -> Message:
    """A request's message as a chat template takes it: content as one string (text
    parts joined), tool calls with parsed arguments."""
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
        raise EndpointError(400, f"message {i} is not a chat message with a `role`")
    out: Message = {"role": m["role"], "content": _content(m.get("content"), i)}
    if m.get("tool_calls"):
        out["tool_calls"] = [_call(c, i) for c in m["tool_calls"]]
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out


def _content(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text"
                                         for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise EndpointError(400, f"message {i}: content is text or a list of text parts here "
                             "(no images or audio)")


def _call(c: Any, i: int) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise EndpointError(400, f"message {i}: a tool call without a function name")
    arguments = fn.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # kept as text: matches no turn
            arguments = json.loads(arguments) if arguments.strip() else {}
    return {"id": c.get("id"), "type": "function",
            "function": {"name": fn["name"], "arguments": arguments}}


def same_message(ours: Message, theirs: Message) -> bool:
    """Whether a re-sent message is the one the session holds: role and text; a tool
    call by name and arguments (ids, JSON spacing and key order aside)."""
    if ours["role"] != theirs["role"] or (ours.get("content") or "") != theirs["content"]:
        return False
    def calls(m: Message) -> list[tuple[str, Any]]:
        return [(c["function"]["name"], c["function"]["arguments"])
                for c in m.get("tool_calls") or []]
    if calls(ours) != calls(theirs):
        return False
    return ours.get("tool_call_id") == theirs.get("tool_call_id") or ours["role"] != "tool"


# -- answers -------------------------------------------------------------------------------


def answer_message(content: str, calls: list[ToolCall]) -> dict[str, Any]:
    """A turn with tool calls as the client gets it: arguments as JSON text."""
    return {"role": "assistant", "content": content or None, "tool_calls": [
        {"id": c.id, "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
        for c in calls]}


def chat_choice(message: dict[str, Any], stopped: bool,
                pieces: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A chat answer's choice; `pieces` the sampled tokens' log-probs, when asked."""
    reason = "tool_calls" if message.get("tool_calls") else "stop" if stopped else "length"
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": reason,
                              "logprobs": None}
    if pieces is not None:
        choice["logprobs"] = {"content": pieces}
    return choice


def completion_choice(text: str, stopped: bool, pieces: list[dict[str, Any]] | None
                      ) -> dict[str, Any]:
    """A completions answer's choice; `pieces` the sampled tokens' log-probs, when asked."""
    reason = "stop" if stopped else "length"
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": reason,
                              "logprobs": None}
    if pieces is not None:
        choice["logprobs"] = {"tokens": [p["token"] for p in pieces],
                              "token_logprobs": [p["logprob"] for p in pieces],
                              "top_logprobs": None, "text_offset": None}
    return choice


def token_log_probs(tokenizer: Any, ids: list[int], log_probs: list[float]
                    ) -> list[dict[str, Any]]:
    """The sampled tokens' log-probs, as a chat answer's `logprobs.content`."""
    out = []
    for t, lp in zip(ids, log_probs, strict=True):
        piece = tokenizer.decode([t])
        out.append({"token": piece, "logprob": lp, "bytes": list(piece.encode()),
                    "top_logprobs": []})
    return out


def reply(kind: str, reply_id: str, model: str, choice: dict[str, Any], tokens: int,
          sampled: int) -> dict[str, Any]:
    """A completion's answer: one choice; `tokens` in the row so far, the last `sampled`
    of them this turn's."""
    return {"id": reply_id, "object": kind, "created": int(time.time()), "model": model,
            "choices": [choice],
            "usage": {"prompt_tokens": tokens - sampled, "completion_tokens": sampled,
                      "total_tokens": tokens}}
