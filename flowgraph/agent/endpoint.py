"""Black-box agents: an OpenAI-compatible endpoint whose completions are the policy's turns.

An agent program flowgraph did not write (a plain `openai` client loop, an agents SDK,
LangGraph) is trained by pointing its client at an endpoint the rollout serves:

    async def run(task: dict, client: openai.AsyncOpenAI) -> float | dict

`agent_rollout` with `agent: my_agent.py:run` starts one `run` per episode on the
agents' event loop, each with a client whose `base_url` carries the episode's session
id (`http://127.0.0.1:<port>/s/<session>/v1`). Each `POST .../chat/completions` (or
`.../completions`) is one assistant turn: the session's next prompt is worked out from
the request, the turn is sampled in the rollout's batch with every other episode's
(lockstep: a batch is sampled once every session waits for a completion or has ended),
and the answer carries the sampled text, its tool calls and, when asked, its log-probs.

Token in, token out, as with native envs (`flowgraph.agent.episodes`): a session holds
the ids of its row (first prompt, sampled turns, deltas). A request's messages must
extend the session's conversation: its earlier messages equal what the session holds,
each re-sent assistant message matched to the turn that was sampled for it (content,
tool names and parsed arguments: a client's re-serialisation changes nothing), never
re-tokenized; only the new messages (tool results, user turns) are rendered, as a delta.
A history that does not extend the session's (a rewritten or dropped message, other
tools, a sub-agent's own) is a fork, counted (`agent/forks`, the episode's `forks`) —
never a silent splice. A row holds one chain of turns: a fork closes the episode's row
and starts the next from that request's prompt (P tokens of it; the rest of a longer
history opens the row's response, a hole), up to the rollout's `rows_per_episode`;
past the last row, the row starts again and its chain so far is not trained
(`Run.dropped`).

Sampling parameters come from the graph: a request whose `temperature`, `top_p`, `n`,
`stop`, penalties, `response_format` or `stream` ask for something else is refused
(HTTP 400, which the client raises in the program: the episode ends `error`, its line
named); `max_tokens` / `max_completion_tokens` shorten a turn; `model`, `seed`, `user`,
`metadata`, `parallel_tool_calls` are ignored. A turn past `max_turns`, or one with no
room left in T, is answered at once with no tokens and `finish_reason: length` (status
`max_turns` / `context_exhausted`): the program ends as a client would, and its return
value is the episode's reward.

Security: the server listens on 127.0.0.1 only, on a port the OS picks; each session
id is 32 random bytes (`secrets.token_urlsafe`); a request to an unknown or closed
session is refused (404).

Torch-free; the caller samples (`Sessions` has `Episodes`' interface).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import secrets
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from flowgraph.agent.env import Message
from flowgraph.agent.episodes import (
    FAILED,
    AgentLoop,
    Limits,
    Run,
    ToolTimeout,
    apply_on_error,
    cut_message,
    describe,
    score_of,
)
from flowgraph.agent.parsers import ToolCallParser
from flowgraph.agent.render import ChatRenderer
from flowgraph.errors import FlowgraphError

__all__ = ["REFUSED", "Program", "Server", "Sessions"]

Program = Callable[[dict[str, Any], Any], Awaitable[Any]]
"""`async def run(task, client) -> float | dict`: a black-box agent."""

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


@dataclass
class Session:
    """One episode's side of the endpoint: its row, its conversation, its waiting turn."""

    sid: str
    run: Run
    owner: Sessions
    messages: list[Message] = field(default_factory=list)
    """The conversation as the client sent it, each sampled turn as the session holds
    it: what the next request's history is matched against (the episode's `messages`
    hold what the policy was shown: tool results cut to their budget)."""
    tools: list[Any] = field(default_factory=list)
    text: str = ""
    """The completions API's view: the prompt and completions so far, as text."""
    renderer: ChatRenderer | None = None
    stopped: bool = True
    """Whether the last sampled turn ended with a stop token."""
    forks: int = 0
    pending: asyncio.Future[tuple[list[int], list[float], bool]] | None = None
    room: int = 0
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while the program waits for a completion, waits for a `concurrency` slot, or
    has ended: no batch waits for it."""
    busy_since: float = field(default_factory=time.perf_counter)
    task: asyncio.Task[Any] | None = None
    result: Any = None
    done: bool = False

    def settle(self) -> None:
        """The program waits for a completion, or has ended: its busy time is counted."""
        if not self.settled.is_set():
            self.run.spent_s += time.perf_counter() - self.busy_since
            self.settled.set()

    def unsettle(self) -> None:
        """The program works again (its completion came)."""
        self.busy_since = time.perf_counter()
        self.settled.clear()


class Server:
    """The process's endpoint: FastAPI served by uvicorn on 127.0.0.1, on the agents'
    event loop (`AgentLoop`), started on first use. Sessions come and go with episodes."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _one: ClassVar[Server | None] = None

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self._http: Any = None
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)  # connections wait in the backlog until uvicorn serves
        self.port: int = self.sock.getsockname()[1]
        import uvicorn

        config = uvicorn.Config(_app(self), log_level="warning", lifespan="off",
                                access_log=False)
        self.server = uvicorn.Server(config)
        self.serving = AgentLoop.submit(self.server.serve(sockets=[self.sock]))

    def http(self) -> Any:
        """The HTTP client every episode's `AsyncOpenAI` sends through (one connection
        pool: making one per client costs ~20 ms, an SSL context each). It ignores the
        environment's HTTP(S)_PROXY, which would carry loopback requests to a cluster's
        proxy."""
        if self._http is None:
            from openai import DefaultAsyncHttpxClient

            self._http = DefaultAsyncHttpxClient(trust_env=False)
        return self._http

    @classmethod
    def get(cls) -> Server:
        with cls._lock:
            if cls._one is None:
                cls._one = Server()
            return cls._one

    def url(self, sid: str) -> str:
        return f"http://127.0.0.1:{self.port}/s/{sid}/v1"

    def session(self, sid: str) -> Session:
        found = self.sessions.get(sid)
        if found is None or found.done:
            raise EndpointError(404, "unknown or closed session: each episode's client has "
                                     "its own base_url, valid while the episode runs")
        return found


def _app(server: Server) -> Any:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    def _error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error"
                                       if status < 500 else "server_error", "code": status}},
                            status)

    app = FastAPI(title="flowgraph agent endpoint", docs_url=None, redoc_url=None,
                  openapi_url=None)

    def answer(handler: Callable[[Session, dict[str, Any]], Awaitable[dict[str, Any]]]
               ) -> Callable[[str, Request], Awaitable[JSONResponse]]:
        async def route(sid: str, request: Request) -> JSONResponse:
            try:
                session = server.session(sid)
            except EndpointError as exc:
                return _error(exc.status, str(exc))
            try:
                body = await request.json()
                if not isinstance(body, dict):
                    raise EndpointError(400, "the request's body is not a JSON object")
                return JSONResponse(await handler(session, body))
            except EndpointError as exc:
                return _error(exc.status, str(exc))
            except Exception as exc:  # a bug of ours, or a tokenizer's: the episode's error
                session.run.end("error", exc)
                return _error(500, f"flowgraph could not answer: {describe(exc)}")
        # real classes, not this module's postponed annotations: FastAPI reads them
        route.__annotations__ = {"sid": str, "request": Request, "return": JSONResponse}
        return route

    async def models(sid: str) -> JSONResponse:
        try:
            session = server.session(sid)
        except EndpointError as exc:
            return _error(exc.status, str(exc))
        return JSONResponse({"object": "list", "data": [
            {"id": session.owner.model_name, "object": "model", "created": 0,
             "owned_by": "flowgraph"}]})

    models.__annotations__ = {"sid": str, "return": JSONResponse}
    app.get("/s/{sid}/v1/models")(models)
    app.post("/s/{sid}/v1/chat/completions")(answer(_chat))
    app.post("/s/{sid}/v1/completions")(answer(_completion))
    return app


# -- the two completions routes --------------------------------------------------------


async def _chat(session: Session, body: dict[str, Any]) -> dict[str, Any]:
    owner = session.owner
    room = owner.check_sampling(body)
    messages = [_message(m, i) for i, m in enumerate(_list(body, "messages"))]
    tools = list(body.get("tools") or [])
    ended = owner.chat_prompt(session, messages, tools)
    ids, log_probs, stopped = ([], [], False) if ended else await owner.sample(session, room)
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    if ids:
        turn, message = owner.turn(session, ids, stopped)
        session.messages.append(turn)
        session.run.episode.messages.append(turn)
    reason = "tool_calls" if message.get("tool_calls") else "stop" if stopped else "length"
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": reason,
                              "logprobs": None}
    if body.get("logprobs"):
        choice["logprobs"] = {"content": owner.token_log_probs(ids, log_probs)}
    return owner.reply(session, "chat.completion", choice, len(ids))


async def _completion(session: Session, body: dict[str, Any]) -> dict[str, Any]:
    owner = session.owner
    room = owner.check_sampling(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if not isinstance(prompt, str) and not (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        raise EndpointError(400, "`prompt` is one string or one list of token ids")
    ended = owner.text_prompt(session, prompt)
    ids, log_probs, stopped = ([], [], False) if ended else await owner.sample(session, room)
    text = owner.decode(ids, stopped)
    session.text += text
    reason = "stop" if stopped else "length"
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": reason,
                              "logprobs": None}
    if body.get("logprobs") is not None:
        pieces = owner.token_log_probs(ids, log_probs)
        choice["logprobs"] = {"tokens": [p["token"] for p in pieces],
                              "token_logprobs": [p["logprob"] for p in pieces],
                              "top_logprobs": None, "text_offset": None}
    return owner.reply(session, "text_completion", choice, len(ids))


def _list(body: Mapping[str, Any], key: str) -> list[Any]:
    value = body.get(key)
    if not isinstance(value, list) or not value:
        raise EndpointError(400, f"`{key}` must be a non-empty list")
    return value


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


def _same(ours: Message, theirs: Message) -> bool:
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


# -- the rollout's side ------------------------------------------------------------------


class Sessions:
    """The black-box episodes of one rollout call: `Episodes`' interface (`reset`, then
    `requests` / `begin` / `wait` each turn, then `finish`) over agent programs talking
    to the endpoint."""

    def __init__(self, program: Program, tokenizer: Any, template: str | None,
                 stop_ids: Sequence[int], parser: ToolCallParser, limits: Limits,
                 prompt_tokens: int, model_name: str, temperature: float, top_p: float,
                 concurrency: int = 64, rows: int = 1) -> None:
        self.program, self.tokenizer, self.template = program, tokenizer, template
        self.stop_ids, self.parser, self.limits = list(stop_ids), parser, limits
        self.prompt_tokens, self.model_name = prompt_tokens, model_name
        self.temperature, self.top_p, self.concurrency = temperature, top_p, concurrency
        self.rows = rows
        """Rows an episode may take: its forks' chains (`rows_per_episode`)."""
        self.base = ChatRenderer(tokenizer, template, (), stop_ids)
        """The chat template, probed (TemplateError here, before any episode starts)."""
        self.sessions: list[Session] = []
        missing = [m for m in ("fastapi", "uvicorn", "openai")
                   if importlib.util.find_spec(m) is None]
        if missing:
            raise FlowgraphError(f"agent_rollout's `agent` (a black-box program) serves an "
                                 f"endpoint and gives it a client: {', '.join(missing)} "
                                 "not installed; pip install 'flowgraph[agents]'")
        self.server = Server.get()

    @property
    def runs(self) -> list[Run]:
        return [s.run for s in self.sessions]

    # -- the phases, as Episodes' -------------------------------------------------------

    def reset(self, tasks: Sequence[Mapping[str, Any]], rows: Sequence[int],
              seeds: Sequence[int]) -> list[list[int]]:
        """Start every episode's program; returns once each waits for its first turn or
        has ended. The first prompts are known only then (the programs' requests)."""
        AgentLoop.run(self._start(tasks, rows, seeds))
        self.wait()
        return [s.run.prompt for s in self.sessions]

    def requests(self) -> list[tuple[int, list[int], int]]:
        return [(i, s.run.prompt + s.run.ids, s.room) for i, s in enumerate(self.sessions)
                if s.pending is not None and not s.pending.done()]

    def begin(self, i: int, ids: Sequence[int], log_probs: Sequence[float], stopped: bool
              ) -> None:
        """Session i's sampled turn: recorded on its row, handed to its waiting request."""
        session = self.sessions[i]
        run = session.run
        run.add_turn(ids, log_probs)
        run.episode.turn_rewards.append(0.0)
        session.stopped = stopped
        assert AgentLoop.loop is not None
        AgentLoop.loop.call_soon_threadsafe(self._answer, session, list(ids), list(log_probs),
                                        stopped)

    def wait(self) -> None:
        """Until every program waits for a completion or has ended; a program busy past
        its turn's (or episode's) time left is cancelled (status `timeout`)."""
        AgentLoop.run(self._all_quiet())

    def finish(self) -> list[Run]:
        """Each program's return value as its episode's reward; `on_error` applied."""
        for session in self.sessions:  # past the last turn: answered without tokens
            if session.pending is not None and not session.pending.done():
                AgentLoop.loop.call_soon_threadsafe(  # type: ignore[union-attr]
                    self._answer, session, [], [], False)
        self.wait()
        for session in self.sessions:
            session.done = True
            self.server.sessions.pop(session.sid, None)
            self._score(session)
        return apply_on_error(self.runs, self.limits.on_error)

    # -- on the loop -----------------------------------------------------------------------

    async def _start(self, tasks: Sequence[Mapping[str, Any]], rows: Sequence[int],
                     seeds: Sequence[int]) -> None:
        from openai import AsyncOpenAI

        gate = asyncio.Semaphore(self.concurrency)
        for task, row, seed in zip(tasks, rows, seeds, strict=True):
            sid = secrets.token_urlsafe(32)
            session = Session(sid, Run(task, row=row, seed=seed), self)
            self.server.sessions[sid] = session
            self.sessions.append(session)
            client = AsyncOpenAI(base_url=self.server.url(sid), api_key="flowgraph",
                                 max_retries=0, timeout=self.limits.episode_timeout_s,
                                 http_client=self.server.http())
            session.task = asyncio.ensure_future(self._play(session, dict(task), client, gate))

    async def _play(self, session: Session, task: dict[str, Any], client: Any,
                    gate: asyncio.Semaphore) -> None:
        try:
            if gate.locked():  # waits for a slot: no batch waits for it meanwhile
                session.settle()
            async with gate:
                session.unsettle()
                session.result = await self.program(task, client)
        except asyncio.CancelledError:
            if session.run.active:
                session.run.end("timeout", ToolTimeout("cancelled"))
        except Exception as exc:  # the user's program: its error is the episode's status
            if session.run.active or session.run.episode.status not in FAILED:
                session.run.end("error", exc)
        else:
            session.run.active = False
        finally:  # the client's connections are the server's pool's (not closed)
            session.done = True
            session.settle()

    async def _all_quiet(self) -> None:
        # again while a program that got a `concurrency` slot meanwhile works
        while busy := [s for s in self.sessions if not s.settled.is_set()]:
            await asyncio.gather(*(self._quiet(s) for s in busy))

    async def _quiet(self, session: Session) -> None:
        if session.done or session.settled.is_set():
            return
        run, limits = session.run, self.limits
        left = min(limits.turn_timeout_s, limits.episode_timeout_s - run.spent_s)
        try:
            await asyncio.wait_for(session.settled.wait(), max(left, 0.0))
        except TimeoutError:
            which = "turn" if left == limits.turn_timeout_s else "episode"
            limit = getattr(limits, f"{which}_timeout_s")
            run.end("timeout", ToolTimeout(
                f"the agent program worked past {which}_timeout_s = {limit} s between "
                "completions"))
            assert session.task is not None
            session.task.cancel()
            await asyncio.gather(session.task, return_exceptions=True)

    def _answer(self, session: Session, ids: list[int], log_probs: list[float],
                stopped: bool) -> None:
        if session.pending is not None and not session.pending.done():
            session.unsettle()
            session.pending.set_result((ids, log_probs, stopped))

    # -- what the routes ask --------------------------------------------------------------

    async def sample(self, session: Session, room: int
                     ) -> tuple[list[int], list[float], bool]:
        """The session's next turn, once the rollout has sampled it."""
        session.room = min(room, self.limits.turn_tokens,
                           self.limits.budget - len(session.run.ids))
        session.pending = asyncio.get_running_loop().create_future()
        session.settle()
        return await session.pending

    def check_sampling(self, body: Mapping[str, Any]) -> int:
        """The tokens the request lets a turn take; EndpointError for a sampling field
        the graph decides."""
        for key, allowed in REFUSED.items():
            if body.get(key, allowed) not in (allowed, None):
                raise EndpointError(400, f"`{key}`: {body[key]!r} is not served here: "
                                         "sampling is the graph's (the rollout node's "
                                         "params); leave it out")
        for key, ours in (("temperature", self.temperature), ("top_p", self.top_p)):
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
        return int(given) if given else self.limits.turn_tokens

    def chat_prompt(self, session: Session, messages: list[Message], tools: list[Any]
                    ) -> bool:
        """Extend the session's row with the request's new messages (or fork it); True
        when the episode cannot take another turn (answered with no tokens)."""
        run = session.run
        if session.renderer is not None and tools == session.tools and \
                self._extends(session.messages, messages):
            names = {c["id"]: c["function"]["name"] for m in session.messages
                     for c in m.get("tool_calls") or []}
            new = [{**m, "name": names[m["tool_call_id"]]} if m["role"] == "tool" and
                   "name" not in m and m.get("tool_call_id") in names else m
                   for m in messages[len(session.messages):]]
            shown = [cut_message(m, self.tokenizer, self.limits) for m in new]
            session.messages = list(messages)
            run.episode.messages += shown
            return self._extend(session, session.renderer.delta(shown, session.stopped))
        if session.renderer is not None:
            session.forks += 1
        session.renderer = self._renderer(tools)
        session.tools, session.messages = tools, list(messages)
        run.episode.messages = list(messages)
        return self._start_row(session, session.renderer.prompt(messages))

    def text_prompt(self, session: Session, prompt: str | list[int]) -> bool:
        """The completions API's `chat_prompt`: a prompt that starts with the session's
        text (or ids) so far extends it; any other starts a new row."""
        run = session.run
        if isinstance(prompt, list):
            held = run.prompt + run.ids
            if run.prompt and prompt[:len(held)] == held and len(prompt) > len(held):
                return self._extend(session, prompt[len(held):])
            if run.prompt:
                session.forks += 1
            return self._start_row(session, list(prompt))
        if run.prompt and prompt.startswith(session.text) and len(prompt) > len(session.text):
            rest = prompt[len(session.text):]
            session.text = prompt
            return self._extend(session, list(self.tokenizer(
                rest, add_special_tokens=False).input_ids))
        if run.prompt:
            session.forks += 1
        session.text = prompt
        return self._start_row(session, list(self.tokenizer(prompt).input_ids))

    def _extends(self, held: list[Message], messages: list[Message]) -> bool:
        if len(messages) <= len(held):
            return False
        if any(m["role"] == "assistant" for m in messages[len(held):]):
            return False  # a turn the policy did not sample
        return all(_same(a, b) for a, b in zip(held, messages, strict=False))

    def _extend(self, session: Session, delta: list[int]) -> bool:
        run, limits = session.run, self.limits
        if not run.active:
            return True
        if run.episode.turns >= limits.max_turns:
            run.end("max_turns")
            return True
        if len(run.ids) + len(delta) >= limits.budget:  # no room for a sampled token
            run.end("context_exhausted")
            return True
        run.add_delta(delta)
        return False

    def _start_row(self, session: Session, prompt: list[int]) -> bool:
        """The episode's row starts at `prompt`: a first request, or a fork. A fork
        closes the present row, kept as a row of its own while the episode has rows
        left (`rows_per_episode`), and starts the next: its prompt fills P, the rest
        of a longer history goes first in its response, a hole."""
        run, P = session.run, self.prompt_tokens
        if not run.active:
            return True
        if run.episode.turns >= self.limits.max_turns:
            run.end("max_turns")
            return True
        if not run.prompt:
            if len(prompt) > P:
                run.end("error", FlowgraphError(
                    f"the agent's first request is {len(prompt)} tokens, over P = {P}; "
                    "raise P (dims.P) or shorten its messages"))
                return True
            run.prompt = prompt
            return False
        if len(prompt) - P >= self.limits.budget:  # no room for a sampled token
            run.end("context_exhausted")
            return True
        run.restart(prompt[:P], keep=len(run.chains) < self.rows - 1)
        if len(prompt) > P:
            run.add_delta(prompt[P:])
        return False

    def _renderer(self, tools: list[Any]) -> ChatRenderer:
        return self.base.with_tools(tools)

    def turn(self, session: Session, ids: list[int], stopped: bool
             ) -> tuple[Message, dict[str, Any]]:
        """A sampled turn as the session holds it (tool calls with their arguments, as
        native episodes hold them) and as the client gets it (arguments as JSON text).
        A turn with a call the parser cannot read is all content, as vLLM answers it."""
        text = self.decode(ids, stopped)
        content, calls = self.parser.parse(text)
        if not calls or any(c.error is not None for c in calls):
            turn: Message = {"role": "assistant", "content": text if calls else content}
            return turn, dict(turn)
        session.run.episode.tool_calls += len(calls)
        turn = {"role": "assistant", "content": content,
                "tool_calls": [c.as_dict() for c in calls]}
        answer = {"role": "assistant", "content": content or None, "tool_calls": [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in calls]}
        return turn, answer

    def decode(self, ids: list[int], stopped: bool) -> str:
        text: str = self.tokenizer.decode(ids[:-1] if stopped else ids)
        return text

    def token_log_probs(self, ids: list[int], log_probs: list[float]) -> list[dict[str, Any]]:
        out = []
        for t, lp in zip(ids, log_probs, strict=True):
            piece = self.tokenizer.decode([t])
            out.append({"token": piece, "logprob": lp, "bytes": list(piece.encode()),
                        "top_logprobs": []})
        return out

    def reply(self, session: Session, kind: str, choice: dict[str, Any], sampled: int
              ) -> dict[str, Any]:
        run = session.run
        return {"id": f"{kind}-{session.sid[:12]}-{run.episode.turns}", "object": kind,
                "created": int(time.time()), "model": self.model_name, "choices": [choice],
                "usage": {"prompt_tokens": len(run.prompt) + len(run.ids) - sampled,
                          "completion_tokens": sampled,
                          "total_tokens": len(run.prompt) + len(run.ids)}}

    def _score(self, session: Session) -> None:
        run = session.run
        run.extra["forks"] = session.forks
        if self.rows > 1:
            run.extra |= {"rows": len(run.rows()), "forks_dropped": run.dropped}
        if run.episode.status in FAILED:
            return
        if not run.prompt:
            run.end("error", FlowgraphError("the agent program returned without asking "
                                            "the endpoint for a completion"))
            return
        try:
            run.score, extra = score_of(session.result, "the agent program")
        except ValueError as exc:
            run.end("error", exc)
            return
        run.extra |= extra
