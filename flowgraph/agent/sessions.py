"""Black-box agents: an OpenAI-compatible endpoint whose completions are the policy's turns.

An agent program flowgraph did not write (a plain `openai` client loop, an agents SDK,
LangGraph) is trained by pointing its client at an endpoint the rollout serves:

    async def run(task: dict, client: openai.AsyncOpenAI) -> float | dict

`agent_rollout` with `agent: my_agent.py:run` starts one `run` per episode on the
agents' event loop, each with a client whose `base_url` carries the episode's session
id (`http://127.0.0.1:<port>/s/<session>/v1`, served by `flowgraph.agent.server`). Each
`POST .../chat/completions` (or `.../completions`, read and answered in OpenAI's wire
format: `flowgraph.agent.wire`) is one assistant turn: the session's next prompt is
worked out from the request, the turn is sampled in the rollout's batch with every
other episode's (lockstep: a batch is sampled once every session waits for a completion
or has ended), and the answer carries the sampled text, its tool calls and, when asked,
its log-probs.

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

A turn past `max_turns`, or one with no room left in T, is answered at once with no
tokens and `finish_reason: length` (status `max_turns` / `context_exhausted`): the
program ends as a client would, and its return value is the episode's reward.

Torch-free; the caller samples (`Sessions` has `Episodes`' interface).

One module past ~450 lines, on purpose: one state machine, a session's row as its
requests extend or fork it (`Session`) and the rollout's phases over them (`Sessions`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flowgraph.agent.env import Message
from flowgraph.agent.episodes import (
    FAILED,
    AgentLoop,
    Limits,
    Run,
    ToolTimeout,
    apply_on_error,
    cut_message,
    numbered,
    score_of,
)
from flowgraph.agent.parsers import ToolCallParser
from flowgraph.agent.render import ChatRenderer
from flowgraph.agent.server import Server
from flowgraph.agent.wire import (
    EndpointError,
    answer_message,
    chat_choice,
    check_sampling,
    completion_choice,
    reply,
    request_messages,
    request_prompt,
    same_message,
    token_log_probs,
)
from flowgraph.errors import FlowgraphError

__all__ = ["Program", "Session", "Sessions"]

Program = Callable[[dict[str, Any], Any], Awaitable[Any]]
"""`async def run(task, client) -> float | dict`: a black-box agent."""


@dataclass
class Session:
    """One episode's side of the endpoint: its row, its conversation, its waiting turn.
    Answers the server's routes (`flowgraph.agent.server.Served`)."""

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

    # -- the routes ------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.owner.model_name

    def fail(self, exc: Exception) -> None:
        self.run.end("error", exc)

    def one_at_a_time(self) -> None:
        """Refuse a request while the session's previous one waits for its turn (two
        branches of a LangGraph graph, an `asyncio.gather`): a row holds one chain of
        turns, and both would extend it. The episode ends `error`, so it trains on
        nothing, and the request is answered at once (409) instead of waiting until
        turn_timeout_s."""
        if self.pending is None or self.pending.done():
            return
        message = ("two completions at once on one episode's session (parallel branches, "
                   "asyncio.gather): concurrent completions on one session are not "
                   "supported yet; await each completion before asking for the next")
        self.run.end("error", FlowgraphError(message))
        raise EndpointError(409, message)

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        self.one_at_a_time()
        owner = self.owner
        room = check_sampling(body, owner.temperature, owner.top_p, owner.limits.turn_tokens)
        messages = request_messages(body)
        tools = list(body.get("tools") or [])
        ended = self.chat_prompt(messages, tools)
        ids, log_probs, stopped = ([], [], False) if ended else await owner.sample(self, room)
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        if ids:
            turn, message = self.turn(ids, stopped)
            self.messages.append(turn)
            self.run.episode.messages.append(turn)
        pieces = token_log_probs(owner.tokenizer, ids, log_probs) if body.get("logprobs") \
            else None
        return self.reply("chat.completion", chat_choice(message, stopped, pieces), len(ids))

    async def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        self.one_at_a_time()
        owner = self.owner
        room = check_sampling(body, owner.temperature, owner.top_p, owner.limits.turn_tokens)
        ended = self.text_prompt(request_prompt(body))
        ids, log_probs, stopped = ([], [], False) if ended else await owner.sample(self, room)
        text = self.decode(ids, stopped)
        self.text += text
        pieces = token_log_probs(owner.tokenizer, ids, log_probs) \
            if body.get("logprobs") is not None else None
        return self.reply("text_completion", completion_choice(text, stopped, pieces),
                          len(ids))

    def reply(self, kind: str, choice: dict[str, Any], sampled: int) -> dict[str, Any]:
        run = self.run
        return reply(kind, f"{kind}-{self.sid[:12]}-{run.episode.turns}", self.model_name,
                     choice, len(run.prompt) + len(run.ids), sampled)

    # -- a request's prompt on the row -----------------------------------------------------

    def chat_prompt(self, messages: list[Message], tools: list[Any]) -> bool:
        """Extend the row with the request's new messages (or fork it); True when the
        episode cannot take another turn (answered with no tokens)."""
        run, owner = self.run, self.owner
        if self.renderer is not None and tools == self.tools and self._extends(messages):
            names = {c["id"]: c["function"]["name"] for m in self.messages
                     for c in m.get("tool_calls") or []}
            new = [{**m, "name": names[m["tool_call_id"]]} if m["role"] == "tool" and
                   "name" not in m and m.get("tool_call_id") in names else m
                   for m in messages[len(self.messages):]]
            shown = [cut_message(m, owner.tokenizer, owner.limits) for m in new]
            self.messages = list(messages)
            run.episode.messages += shown
            return self._extend(self.renderer.delta(shown, self.stopped))
        if self.renderer is not None:
            self.forks += 1
        self.renderer = owner.base.with_tools(tools)
        self.tools, self.messages = tools, list(messages)
        run.episode.messages = list(messages)
        return self._start_row(self.renderer.prompt(messages))

    def text_prompt(self, prompt: str | list[int]) -> bool:
        """The completions API's `chat_prompt`: a prompt that starts with the session's
        text (or ids) so far extends it; any other starts a new row."""
        run, tokenizer = self.run, self.owner.tokenizer
        if isinstance(prompt, list):
            held = run.prompt + run.ids
            if run.prompt and prompt[:len(held)] == held and len(prompt) > len(held):
                return self._extend(prompt[len(held):])
            if run.prompt:
                self.forks += 1
            return self._start_row(list(prompt))
        if run.prompt and prompt.startswith(self.text) and len(prompt) > len(self.text):
            rest = prompt[len(self.text):]
            self.text = prompt
            return self._extend(list(tokenizer(rest, add_special_tokens=False).input_ids))
        if run.prompt:
            self.forks += 1
        self.text = prompt
        return self._start_row(list(tokenizer(prompt).input_ids))

    def _extends(self, messages: list[Message]) -> bool:
        held = self.messages
        if len(messages) <= len(held):
            return False
        if any(m["role"] == "assistant" for m in messages[len(held):]):
            return False  # a turn the policy did not sample
        return all(same_message(a, b) for a, b in zip(held, messages, strict=False))

    def _extend(self, delta: list[int]) -> bool:
        run, limits = self.run, self.owner.limits
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

    def _start_row(self, prompt: list[int]) -> bool:
        """The episode's row starts at `prompt`: a first request, or a fork. A fork
        closes the present row, kept as a row of its own while the episode has rows
        left (`rows_per_episode`), and starts the next: its prompt fills P, the rest
        of a longer history goes first in its response, a hole."""
        run, owner = self.run, self.owner
        P = owner.prompt_tokens
        if not run.active:
            return True
        if run.episode.turns >= owner.limits.max_turns:
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
        if len(prompt) - P >= owner.limits.budget:  # no room for a sampled token
            run.end("context_exhausted")
            return True
        run.restart(prompt[:P], keep=len(run.chains) < owner.rows - 1)
        if len(prompt) > P:
            run.add_delta(prompt[P:])
        return False

    # -- a sampled turn --------------------------------------------------------------------

    def turn(self, ids: list[int], stopped: bool) -> tuple[Message, dict[str, Any]]:
        """A sampled turn as the session holds it (tool calls with their arguments, as
        native episodes hold them) and as the client gets it (arguments as JSON text).
        A turn with a call the parser cannot read is all content, as vLLM answers it."""
        text = self.decode(ids, stopped)
        content, parsed = self.owner.parser.parse(text)
        calls = numbered(parsed, self.run.episode.tool_calls)
        self.run.count_cut(stopped, calls)
        if not calls or any(c.error is not None for c in calls):
            turn: Message = {"role": "assistant", "content": text if calls else content}
            return turn, dict(turn)
        self.run.episode.tool_calls += len(calls)
        turn = {"role": "assistant", "content": content,
                "tool_calls": [c.as_dict() for c in calls]}
        return turn, answer_message(content, calls)

    def decode(self, ids: list[int], stopped: bool) -> str:
        text: str = self.owner.tokenizer.decode(ids[:-1] if stopped else ids)
        return text


class Sessions:
    """The black-box episodes of one rollout call: `Episodes`' interface (`reset`, then
    `requests` / `begin` / `wait` each turn, then `finish`) over agent programs talking
    to the endpoint."""

    def __init__(self, program: Program, tokenizer: Any, template: str | None,
                 stop_ids: Sequence[int], parser: ToolCallParser, limits: Limits,
                 prompt_tokens: int, model_name: str, temperature: float, top_p: float,
                 concurrency: int = 64, rows: int = 1, show_tools: str = "template") -> None:
        self.program, self.tokenizer, self.template = program, tokenizer, template
        self.stop_ids, self.parser, self.limits = list(stop_ids), parser, limits
        self.prompt_tokens, self.model_name = prompt_tokens, model_name
        self.temperature, self.top_p, self.concurrency = temperature, top_p, concurrency
        self.rows = rows
        """Rows an episode may take: its forks' chains (`rows_per_episode`)."""
        self.base = ChatRenderer(tokenizer, template, (), stop_ids, show_tools=show_tools)
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

    async def sample(self, session: Session, room: int
                     ) -> tuple[list[int], list[float], bool]:
        """The session's next turn, once the rollout has sampled it."""
        session.room = min(room, self.limits.turn_tokens,
                           self.limits.budget - len(session.run.ids))
        session.pending = asyncio.get_running_loop().create_future()
        session.settle()
        return await session.pending

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
