"""Episodes between sampled turns: tool calls, the env's replies, budgets, timeouts, statuses.

The `agent_rollout` kind samples every active episode's next turn in one batch, then
hands the sampled ids to `Episodes.advance`, which for each episode at once (asyncio):
decodes the turn, reads its tool calls (`parser`), runs them (a sync tool in a thread
of its own, so a slow one blocks no other), or asks the env's `step`; renders the new
messages as a delta of ids (`ChatRenderer.delta`); and decides whether the episode goes
on. Token in, token out: the ids an episode holds are the sampled ones and the deltas,
never a re-tokenized history.

Everything that can hang has a timeout (a tool call, a turn's env and tool work, the
whole episode's), everything that can fail has a status (`STATUSES`): a raising or
hanging tool or env ends its episode, and the step completes; `on_error` says what the
episode then counts for. A hung sync call's thread cannot be killed: it is abandoned
(the episode ends; the daemon thread finishes or not, and never holds the process at
exit); the Python sandbox tool runs code in a process group it kills.

Torch-free; the caller does the sampling.

One module past ~450 lines, on purpose: one state machine (`Chain`, `Run`,
`Episodes`) and the limits, statuses and errors it moves through.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from flowgraph.agent.env import Env, Episode, Message, ToolResult, as_messages
from flowgraph.agent.parsers import ToolCall, ToolCallParser
from flowgraph.agent.render import ChatRenderer, TemplateError
from flowgraph.agent.tools import Tool, tools_of
from flowgraph.errors import FlowgraphError

__all__ = ["FAILED", "AgentError", "AgentLoop", "Chain", "Episodes", "Limits", "Run",
           "apply_on_error", "cut_message", "numbered", "own_frame", "score_of"]

FAILED = ("timeout", "error")
"""Statuses `on_error` applies to."""


class AgentError(FlowgraphError):
    """An episode failed and the rollout's `on_error` is `raise`."""


class ToolTimeout(Exception):
    """A tool call, a turn or an episode ran past its timeout (status `timeout`)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """An agent rollout's budgets and timeouts (its params)."""

    max_turns: int
    budget: int
    """T: tokens after the first prompt, every turn and message between."""
    turn_tokens: int
    """Tokens one assistant turn may sample."""
    tool_tokens: int
    """Tokens one tool result or env message may take; longer ones are cut."""
    truncate_side: str = "middle"
    """Which part of a long message is cut: left, middle or right."""
    tool_timeout_s: float = 30.0
    turn_timeout_s: float = 120.0
    episode_timeout_s: float = 600.0
    on_error: str = "mask"


@dataclass(frozen=True)
class Chain:
    """One row of an episode: a prompt and the tokens after it (`Run`'s row fields)."""

    prompt: list[int]
    ids: list[int]
    sampled: list[int]
    log_probs: list[float]
    versions: list[int]
    ends: list[int]
    turn_rewards: list[float]


@dataclass
class Run:
    """One episode's state: its env, its ids, and what it has become.

    An episode is one row (one chain of turns), but for a black-box agent whose
    history forks (`flowgraph.agent.sessions`): each fork closes the row (`chains`)
    and starts the next, up to the rollout's `rows_per_episode`."""

    task: Mapping[str, Any]
    row: int = 0
    """The task's row of the step's batch."""
    seed: int = 0
    """The episode's own seed (its first turn's)."""
    env: Env = field(default_factory=Env)
    """The episode's env (the default `Env` until `make_env` made one)."""
    tools: dict[str, Tool] = field(default_factory=dict)
    renderer: ChatRenderer | None = None
    """The rollout's renderer, listing every tool the episode may call (its env's too)
    to the chat template."""
    episode: Episode = field(init=False)
    prompt: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    """Every token after the first prompt."""
    sampled: list[int] = field(default_factory=list)
    """1 where the policy sampled the token (the response mask)."""
    log_probs: list[float] = field(default_factory=list)
    version: int = 0
    """The policy version of the weights sampling the episode's next turn (partial
    rollouts: it may change between turns)."""
    versions: list[int] = field(default_factory=list)
    """The version that sampled each token of `ids` (-1 on the tokens it did not sample)."""
    ends: list[int] = field(default_factory=list)
    """Where each turn's last sampled token is in `ids`."""
    turn: list[int] = field(default_factory=list)
    """The ids of the turn sampled last."""
    active: bool = True
    spent_s: float = 0.0
    """Seconds of env and tool work so far (the episode timeout's clock)."""
    score: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    """The entries of a dict `Env.reward` returned, but `score`."""
    failure: BaseException | None = None
    chains: list[Chain] = field(default_factory=list)
    """The episode's earlier rows, each closed by a fork."""
    dropped: int = 0
    """Forks whose chain so far was not kept (no row left for it)."""
    cut: int = 0
    """Turns that ended without their stop token: cut by a token limit (`max_turn_tokens`,
    a black-box agent's own `max_tokens`), finish_reason `length`."""
    cut_calls: int = 0
    """Of those, the turns cut inside a tool call: a call the parser cannot read."""

    def count_cut(self, stopped: bool, calls: Sequence[ToolCall]) -> None:
        """A sampled turn's finish: cut by a limit (inside a tool call) or stopped."""
        if not stopped:
            self.cut += 1
            self.cut_calls += any(c.error is not None for c in calls)

    def __post_init__(self) -> None:
        self.episode = Episode(task=self.task)

    def add_turn(self, ids: Sequence[int], log_probs: Sequence[float]) -> None:
        """A turn the policy sampled: on the row, trained (mask 1)."""
        self.ids += ids
        self.sampled += [1] * len(ids)
        self.log_probs += log_probs
        self.versions += [self.version] * len(ids)
        self.ends.append(len(self.ids) - 1)
        self.episode.turns += 1

    def add_delta(self, delta: Sequence[int]) -> None:
        """The ids of the messages between two turns: on the row, a hole (mask 0)."""
        self.ids += delta
        self.sampled += [0] * len(delta)
        self.log_probs += [0.0] * len(delta)
        self.versions += [-1] * len(delta)

    def chain(self) -> Chain:
        """The present row."""
        return Chain(self.prompt, self.ids, self.sampled, self.log_probs, self.versions,
                     self.ends, self.episode.turn_rewards)

    def rows(self) -> list[Chain]:
        """Every row of the episode: the chains forks closed, then the present one."""
        return [*self.chains, self.chain()]

    def restart(self, prompt: list[int], keep: bool) -> None:
        """A black-box agent's fork: a new row starts from `prompt`; the present one,
        if it holds a turn, is kept as a row of its own (`keep`) or not trained
        (counted in `dropped`)."""
        if self.ends and keep:
            self.chains.append(self.chain())
        elif self.ends:
            self.dropped += 1
        self.prompt = prompt
        self.ids, self.sampled, self.log_probs, self.versions, self.ends = [], [], [], [], []
        self.episode.turn_rewards = []

    def end(self, status: str, failure: BaseException | None = None) -> None:
        self.active, self.episode.status = False, status
        if failure is not None:
            self.failure = failure
            self.episode.error = describe(failure)


def own_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of a user's code in `exc`'s traceback (not flowgraph's, not
    the standard library's), or None; an error re-raised with its cause (an adapter's
    `EnvError`) is looked up in the cause's traceback, where the user's line raised."""
    import sysconfig

    while exc.__cause__ is not None:
        exc = exc.__cause__
    skip = tuple(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib"))
    here = __file__.rsplit("/", 2)[0]  # flowgraph/
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(skip) and not f.filename.startswith(here)]
    return frames[-1] if frames else None


def describe(exc: BaseException) -> str:
    """`Type: message at file:line in function` of a user's error."""
    frame = own_frame(exc)
    text = f"{type(exc).__name__}: {exc}".rstrip(": ")
    return text + (f" at {frame.filename}:{frame.lineno} in {frame.name}" if frame else "")


class AgentLoop:
    """One event loop in a daemon thread for every rollout of the process: an async env
    keeps its loop from turn to turn."""

    lock: ClassVar[threading.Lock] = threading.Lock()
    loop: ClassVar[asyncio.AbstractEventLoop | None] = None

    @classmethod
    def submit(cls, coro: Any) -> Future[Any]:
        """Start `coro` on the loop (started on first use); its future."""
        with cls.lock:
            if cls.loop is None:
                cls.loop = asyncio.new_event_loop()
                threading.Thread(target=cls.loop.run_forever, name="flowgraph-agents",
                                 daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, cls.loop)

    @classmethod
    def run(cls, coro: Any) -> Any:
        """`coro`'s result, run on the loop."""
        return cls.submit(coro).result()



async def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn`'s result: awaited when it is a coroutine function, else run in a thread of
    its own. A daemon thread: a call abandoned at its timeout (a thread cannot be
    killed) never holds the process at exit, as a pool's worker would."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not done.done():  # not cancelled by a timeout meanwhile
            done.set_exception(error) if error is not None else done.set_result(result)

    def work() -> None:
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # the awaiting coroutine re-raises it
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=work, name="flowgraph-tool", daemon=True).start()
    out = await done
    return await out if inspect.isawaitable(out) else out


class Episodes:
    """The episodes of one rollout call: `reset`, then `requests` / `advance` each turn,
    then `finish`."""

    def __init__(self, make_env: Callable[[], Env] | None, tools: Sequence[Tool],
                 renderer: ChatRenderer, parser: ToolCallParser, limits: Limits,
                 concurrency: int = 64) -> None:
        self.make_env, self.tools = make_env, list(tools)
        self.renderer, self.parser, self.limits = renderer, parser, limits
        self.concurrency = concurrency
        self.gate: asyncio.Semaphore | None = None
        self.makers: list[Callable[[], Env] | None] = []
        self.runs: list[Run] = []
        self.started: list[Future[Any]] = []

    def route(self, makers: Sequence[Callable[[], Env] | None]) -> None:
        """Each episode's own env factory for the next `reset` (an `agent_rollout` with
        several `envs`: the one its row names), instead of `make_env` for all."""
        self.makers = list(makers)

    # -- the three phases ------------------------------------------------------------------

    def reset(self, tasks: Sequence[Mapping[str, Any]], rows: Sequence[int] | None = None,
              seeds: Sequence[int] | None = None) -> list[list[int]]:
        """Make each episode's env and its first prompt's ids (an episode that failed to
        start has an empty prompt and ends as `error` or `timeout`); `rows`, `seeds`: each
        episode's row of the step's batch and its own seed (`Env.row`, `Env.seed`)."""
        self.runs = [Run(task, row=i if rows is None else rows[i],
                         seed=i if seeds is None else seeds[i])
                     for i, task in enumerate(tasks)]
        AgentLoop.run(self._all(self._reset, range(len(self.runs))))
        return [run.prompt for run in self.runs]

    def requests(self) -> list[tuple[int, list[int], int]]:
        """(episode, prompt + ids so far, tokens it may sample) of each active episode."""
        out = []
        for i, run in enumerate(self.runs):
            if run.active:
                room = min(self.limits.turn_tokens, self.limits.budget - len(run.ids))
                out.append((i, run.prompt + run.ids, room))
        return out

    def advance(self, turns: Mapping[int, tuple[Sequence[int], Sequence[float], bool]]) -> None:
        """Each episode's sampled turn (ids, their log-probs, whether it ended with a stop
        token): its tool calls or the env's reply, then its next prompt's delta."""
        for i, turn in turns.items():
            self.begin(i, *turn)
        self.wait()

    def begin(self, i: int, ids: Sequence[int], log_probs: Sequence[float], stopped: bool
              ) -> None:
        """Episode i's sampled turn, whose tool calls (or env reply) start now, in the
        background, while other episodes may still be sampling theirs (`wait` for all)."""
        run = self.runs[i]
        run.turn = list(ids)
        run.add_turn(ids, log_probs)
        self.started.append(AgentLoop.submit(self._one(i, self._turn, i, stopped)))

    def wait(self) -> None:
        """Until every turn `begin` started is done (each ends within its timeouts)."""
        started, self.started = self.started, []
        for future in started:
            future.result()

    def finish(self) -> list[Run]:
        """Each episode's reward (`Env.reward`), its env closed; `on_error` applied."""
        AgentLoop.run(self._all(self._finish, range(len(self.runs))))
        return apply_on_error(self.runs, self.limits.on_error)

    # -- per episode -------------------------------------------------------------------------

    async def _all(self, each: Callable[..., Any], which: Sequence[int] | range) -> None:
        await asyncio.gather(*(self._one(i, each, i) for i in which))

    async def _one(self, i: int, each: Callable[..., Any], *args: Any) -> None:
        """`each(*args)` on episode i, at most `concurrency` episodes at once."""
        if self.gate is None:  # made on the loop's thread, once
            self.gate = asyncio.Semaphore(self.concurrency)
        async with self.gate:
            await self._timed(self.runs[i], each(*args))

    async def _timed(self, run: Run, work: Any) -> None:
        """`work` on `run` within its turn's and its episode's time left; a timeout or an
        error of the user's code ends the episode with that status."""
        left = min(self.limits.turn_timeout_s, self.limits.episode_timeout_s - run.spent_s)
        start = time.perf_counter()
        try:
            await asyncio.wait_for(work, max(left, 0.0))
        except TimeoutError:
            which = "turn" if left == self.limits.turn_timeout_s else "episode"
            limit = getattr(self.limits, f"{which}_timeout_s")
            run.end("timeout", ToolTimeout(f"the {which}'s env and tool work ran past "
                                           f"{which}_timeout_s = {limit} s"))
        except ToolTimeout as exc:
            run.end("timeout", exc)
        except Exception as exc:  # the user's env: its error is the episode's status
            run.end("error", exc)
        finally:
            run.spent_s += time.perf_counter() - start

    async def _reset(self, i: int) -> None:
        run = self.runs[i]
        make_env = self.makers[i] if self.makers else self.make_env
        if make_env is not None:
            run.env = await _call(make_env)
        env = run.env
        env.row, env.seed = run.row, run.seed
        run.tools = {t.name: t for t in [*self.tools, *tools_of(env)]}
        run.renderer = self.renderer.with_tools([t.schema() for t in run.tools.values()])
        first = as_messages(await _call(env.reset, run.task),
                            f"{type(env).__name__}.reset")
        run.episode.messages = first
        run.prompt = run.renderer.prompt(first)

    async def _turn(self, i: int, stopped: bool) -> None:
        run = self.runs[i]
        ids = run.turn
        text = self.renderer.tokenizer.decode(ids[:-1] if stopped else ids)
        content, parsed = self.parser.parse(text)
        calls = numbered(parsed, run.episode.tool_calls)
        run.count_cut(stopped, calls)
        message: Message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": c.arguments}} for c in calls]
        run.episode.messages.append(message)
        # counted before they run: a call that raises or times out was still made
        run.episode.tool_calls += len(calls)
        reward, done, new = 0.0, False, []
        if calls:
            for call in calls:
                result = await self._tool(run, call)
                reward += result.reward
                new.append({"role": "tool", "name": call.name, "tool_call_id": call.id,
                            "content": result.content})
        else:
            env = run.env
            step = await _call(env.step, message)
            reward, done = float(step.reward), bool(step.done)
            new = as_messages(step.messages, f"{type(env).__name__}.step")
            done = done or not new
        run.episode.turn_rewards.append(reward)
        new = [cut_message(m, self.renderer.tokenizer, self.limits) for m in new]
        run.episode.messages += new
        self._next(run, new, done, stopped)

    def _next(self, run: Run, new: list[Message], done: bool, stopped: bool) -> None:
        """Whether the episode goes on, and if so its next prompt's delta."""
        if done:
            return run.end("completed")
        if run.episode.turns >= self.limits.max_turns:
            return run.end("max_turns")
        assert run.renderer is not None  # made at reset
        delta = run.renderer.delta(new, stopped)
        if len(run.ids) + len(delta) >= self.limits.budget:  # no room for a sampled token
            return run.end("context_exhausted")
        run.add_delta(delta)
        return None

    async def _tool(self, run: Run, call: ToolCall) -> ToolResult:
        """A tool call's result; a malformed or unknown call's message is the model's to
        read. A tool that raises or runs past its timeout raises (the episode's status)."""
        if call.error is not None:
            return ToolResult(call.error)
        tool = run.tools.get(call.name)
        if tool is None:
            known = ", ".join(run.tools) or "none"
            return ToolResult(f"error: no tool `{call.name}`; the tools are: {known}")
        problem = tool.check_arguments(call.arguments)
        if problem is not None:
            return ToolResult(f"error: {problem}")
        limit = tool.timeout_s or self.limits.tool_timeout_s
        start = time.perf_counter()
        try:
            out = await asyncio.wait_for(_call(tool.fn, **call.arguments), limit)
        except TimeoutError:
            raise ToolTimeout(f"tool `{call.name}` ran past its timeout of {limit} s "
                               f"(arguments {call.arguments})") from None
        finally:
            run.episode.tool_time_s += time.perf_counter() - start
        return out if isinstance(out, ToolResult) else ToolResult(_text(out))

    async def _finish(self, i: int) -> None:
        run = self.runs[i]
        env = run.env
        try:
            if run.episode.status not in FAILED:
                got = await _call(env.reward, run.episode)
                run.score, run.extra = score_of(got, f"{type(env).__name__}.reward")
        finally:
            run.active = False
            await _call(env.close)


def numbered(calls: Sequence[ToolCall], made: int) -> list[ToolCall]:
    """A turn's calls with ids unique in their episode, `call_<made>` on (`made`: the
    calls of its earlier turns): a parser numbers the calls of one turn, and a client
    that keys tool results by id (an OpenAI agent's dict of them) would mix up two
    turns' `call_0`."""
    return [replace(c, id=f"call_{made + k}") for k, c in enumerate(calls)]


def apply_on_error(runs: list[Run], on_error: str) -> list[Run]:
    """`runs` with `on_error` applied to the failed ones (`FAILED`): raise AgentError
    naming the first, or score 0 (and no token trained, for `mask`)."""
    for i, run in enumerate(runs):
        if run.episode.status not in FAILED:
            continue
        if isinstance(run.failure, TemplateError):  # the rollout's setting, not the episode's
            raise TemplateError(str(run.failure)) from None
        if on_error == "raise":
            raise AgentError(
                f"episode {i} (row {run.row}) ended with status `{run.episode.status}`: "
                f"{run.episode.error}; set on_error: mask (or zero) to train on the other "
                "episodes") from run.failure
        run.score = 0.0
        run.episode.turn_rewards = [0.0] * len(run.episode.turn_rewards)
        run.chains = [replace(c, turn_rewards=[0.0] * len(c.turn_rewards),
                              sampled=[0] * len(c.sampled) if on_error == "mask"
                              else c.sampled) for c in run.chains]
        if on_error == "mask":
            run.sampled = [0] * len(run.sampled)
    return runs


CHARS_PER_TOKEN = 32
"""Characters of a long message tokenized per token it may keep: a token of the
tokenizers met spans a few characters (a long whitespace run in code up to ~16), so
32 of them hold the kept tokens, and a 1 MB tool result costs the tokenizer
`32 × max_tool_tokens` characters, not a megabyte."""


def cut_message(message: Message, tokenizer: Any, limits: Limits) -> Message:
    """`message` with its content cut to `limits.tool_tokens` tokens on `truncate_side`,
    the `...(N chars cut)` marker counted in them (a tool result or env message the
    policy reads). A content longer than `CHARS_PER_TOKEN` characters a token is cut by
    characters first, so a flood is never tokenized whole. A limit the marker does not
    fit in keeps `tool_tokens` tokens of the content alone."""
    content = message.get("content")
    if not isinstance(content, str):
        return message
    limit, side = limits.tool_tokens, limits.truncate_side
    front, back = _by_characters(content, CHARS_PER_TOKEN * limit, side)
    tokens = tokenizer([front, back], add_special_tokens=False).input_ids
    if front + back == content and len(tokens[0]) + len(tokens[1]) <= limit:
        return message
    marker = len(tokenizer(_marker(len(content)), add_special_tokens=False).input_ids)
    for said in (content, None):  # with the marker; without, where it does not fit
        room = limit - (marker if said is not None else 0)
        while room > 0:  # decoded pieces can tokenize longer than their ids: shrink
            text = _kept(tokenizer, tokens, room, side, said)  # until the whole fits
            over = len(tokenizer(text, add_special_tokens=False).input_ids) - limit
            if over <= 0:
                return {**message, "content": text}
            room -= over
    return {**message, "content": ""}


def _by_characters(content: str, bound: int, side: str) -> tuple[str, str]:
    """The text kept at the front and at the back of `content`, `bound` characters in all."""
    if len(content) <= bound:
        return content, ""
    if side == "left":
        return "", content[-bound:]
    if side == "right":
        return content[:bound], ""
    return content[:bound // 2], content[len(content) - (bound - bound // 2):]


def _kept(tokenizer: Any, tokens: list[list[int]], room: int, side: str,
          content: str | None) -> str:
    """`room` tokens of the front and back pieces on `side`, with the marker saying how
    many characters of `content` were cut (None: no marker)."""
    front, back = tokens
    if side == "left":
        front, back = [], (front + back)[-room:]
    elif side == "right":
        front, back = (front + back)[:room], []
    elif back:  # cut by characters in the middle already: each piece gives its half
        half = room // 2
        front, back = front[:half], back[-(room - half):]
    else:
        half = room // 2
        front, back = front[:half], front[half:][-(room - half):]
    # a character whose bytes the cut split decodes as U+FFFD: not shown
    head: str = tokenizer.decode(front).rstrip("\ufffd")
    tail: str = tokenizer.decode(back).lstrip("\ufffd")
    if content is None:
        return head + tail
    return head + _marker(len(content) - len(head) - len(tail)) + tail


def _marker(cut: int) -> str:
    return f"...({cut} chars cut)"


def score_of(value: Any, who: str) -> tuple[float, dict[str, Any]]:
    """(score, other entries) of an episode's reward as `who` returned it: a number, or
    a mapping with a `score` (verl's compute_score convention)."""
    extra: dict[str, Any] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(f"{who} returned a mapping without `score`: {value!r}")
        extra = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{who} returned {value!r}; a reward is a number (or a "
                         "mapping with `score`)")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{who} returned {value}; a reward must be finite")
    return float(value), extra


def _text(value: Any) -> str:
    """A tool's result as the text of its message: a string as it is, else JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
