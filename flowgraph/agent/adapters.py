"""Environments written for other trainers, run as they are: `load_env`.

The `agent_rollout` kind's `env` param names an environment; `load_env` turns it into a
factory the rollout calls once per episode, `factory(**env_params) -> Env` (with
`params=env_params` given to `load_env`, `factory() -> Env`). Four shapes:

- a `flowgraph.agent.Env` subclass: the class itself is the factory.
- a TRL `environment_factory` (TRL 1.16 `GRPOTrainer`): a class, or a function of no
  arguments, making an object with `reset(**row)`. `TRLEnv` drives it as GRPOTrainer
  does: `reset` gets every column of the row, a string it returns is appended to the last
  prompt message; the object's public methods are its tools (a raising one answers the
  model `{'error': ...}`); `get_reward()` (sync or async) is the episode's reward.
  Objects are pooled and reset, not rebuilt per episode ("construct once, reset often");
  one whose episode failed is dropped.
- a verl tool (verl 0.9.1 `BaseTool`: async `create`, `execute`, `release`), as a
  class, an instance, or the tool-config YAML verl reads (`tools: - class_name: ...`).
  `VerlToolEnv` calls each tool as verl's `ToolAgentLoop._call_tool` does: per call
  `create(create_kwargs=row's extra_info.tools_kwargs[name].create_kwargs)`, `execute`,
  `release`; a raising tool answers `Error executing tool '<name>': ...`; the reward
  `execute` returns is the turn's (`ToolResult`).
- a SkyRL-gym `BaseTextEnv` subclass: made per episode with the row as its `extras`,
  `init(prompt)` gives the first messages, `step(text)` answers each turn (observations,
  a turn reward, done).

An error raised by the env's own code (a TRL `reset`, a SkyRL `step`, a verl `release`)
is an `EnvError` naming the method and its file:line, the env's exception its cause (the
worker reports that frame, as for a reward function). No torch, no transformers here;
verl and SkyRL are never imported.

One module past ~450 lines, on purpose: the adapters of three trainers' environments
(TRL, verl, SkyRL), each short, all resolved by `load_env`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import threading
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from flowgraph.agent.env import Env, Episode, Message, Step, ToolResult, as_messages
from flowgraph.agent.tools import Tool, as_tool
from flowgraph.errors import EnvError
from flowgraph.objects import defined_at
from flowgraph.registry import plugin_module
from flowgraph.runtime.reward_call import load_function
from flowgraph.source import SourcePos

__all__ = ["SHAPES", "EnvFactory", "SkyRLEnv", "TRLEnv", "VerlAgentData", "VerlToolEnv",
           "load_env"]

EnvFactory = Callable[..., Env]
"""What `load_env` returns: called with the node's `env_params`, once per episode."""

SHAPES = (
    "a `flowgraph.Env` subclass",
    "a TRL environment_factory: a class (or a function of no arguments) making an object "
    "with `reset(**row)`, its public methods the tools, `get_reward()` the reward",
    "a verl tool: a `BaseTool` subclass or instance (async `create`, `execute`, "
    "`release`), or verl's tool-config YAML (`tools: - class_name: ..., config: ..., "
    "tool_schema: ...`)",
    "a SkyRL-gym `BaseTextEnv` subclass (`init(prompt)`, `step(action)`)",
)
"""The environments `load_env` takes, for its error message and the README."""

TRL_NOT_TOOLS = ("reset", "get_reward")
"""Public methods of a TRL env that GRPOTrainer does not expose as tools."""


def load_env(obj: object, *, params: Mapping[str, Any] | None = None,
             where: str = "") -> EnvFactory:
    """The factory of one environment per episode for `obj`: an `Env` subclass as it is,
    any other of the `SHAPES` wrapped; with `params` (the node's `env_params`), a factory
    of no arguments that makes each env with them. `obj` may also be a reference,
    `module:Name` or `file.py:Name` (a plugin file), or the path of a verl tool-config
    YAML. `where` (the node's file:line) prefixes the error for anything else."""
    factory = _factory(_resolve(obj, where), where)
    return functools.partial(factory, **params) if params else factory


def _factory(obj: object, where: str) -> EnvFactory:
    if inspect.isclass(obj) and issubclass(obj, Env):
        return obj
    if isinstance(obj, Mapping) and "tools" not in obj and obj and all(
            callable(v) for v in obj.values()):
        raise EnvError(f"{where + ': ' if where else ''}env: a mapping of environment "
                       f"factories ({', '.join(map(str, obj))}) is TRL's multi-environment "
                       "form: give it as the node's `envs` (each row's env named by its "
                       "`route_by` column), not as one `env`")
    if isinstance(obj, Mapping | Path):
        return VerlTools.from_config(obj, where)
    if _has(obj, "create", "execute", "release") and inspect.iscoroutinefunction(
            getattr(obj, "execute", None)):
        return VerlTools([obj], where)
    if inspect.isclass(obj) and _has(obj, "init", "step") and not _has(obj, "reset"):
        return SkyRLEnvFactory(obj)
    if inspect.isclass(obj) and _has(obj, "reset"):
        return TRLEnvFactory(obj)
    if callable(obj) and not inspect.isclass(obj) and _takes_nothing(obj):
        probe = _call(f"TRL environment_factory `{_name(obj)}`{_at(obj)}", obj)
        if _has(probe, "reset"):
            return TRLEnvFactory(obj, probe)
    raise EnvError(f"{where + ': ' if where else ''}env `{_name(obj)}`{_at(obj)} is not an "
                   "environment flowgraph runs; it takes " + "; ".join(SHAPES))


def _resolve(obj: object, where: str) -> object:
    """A reference or a YAML path as the object it names."""
    if not isinstance(obj, str | Path):
        return obj
    text = str(obj)
    if text.endswith((".yaml", ".yml")):
        return Path(text)
    try:
        return load_function(text, {}, "env")
    except (ImportError, ValueError) as exc:
        raise EnvError(f"{where + ': ' if where else ''}env `{text}` cannot be loaded: "
                       f"{type(exc).__name__}: {exc}; it names `module:Name`, `file.py:Name` "
                       "or a verl tool-config .yaml") from exc


def _takes_nothing(fn: Callable[..., Any]) -> bool:
    """Whether `fn` can be called without arguments (a TRL factory function can)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in params)


def _has(obj: object, *methods: str) -> bool:
    return all(callable(getattr(obj, m, None)) for m in methods)


def _name(obj: object) -> str:
    return str(getattr(obj, "__qualname__", None) or type(obj).__qualname__)


def _at(obj: object) -> str:
    """` (file:line)` of a function or class, or of an instance's class."""
    where = defined_at(obj if inspect.isclass(obj) or inspect.isroutine(obj) else type(obj))
    return f" ({where})" if where else ""


def _method(obj: object, method: str, trainer: str) -> str:
    """`TRL env `Guess.reset` (guess.py:12)`: how messages name a user's method."""
    owner = obj if inspect.isclass(obj) else type(obj)
    return f"{trainer} `{owner.__qualname__}.{method}`{_at(getattr(owner, method, owner))}"


def _call(label: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs); what the user's code raises becomes an `EnvError` naming
    `label`, with their exception as its cause (whose frame the worker reports)."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        raise EnvError(f"{label} raised: {type(exc).__name__}: {exc}") from exc


async def _acall(label: str, fn: Callable[..., Awaitable[Any]], *args: Any,
                 **kwargs: Any) -> Any:
    """`_call` of an async function."""
    try:
        return await fn(*args, **kwargs)
    except Exception as exc:
        raise EnvError(f"{label} raised: {type(exc).__name__}: {exc}") from exc


# --- TRL ---------------------------------------------------------------------------------


class TRLEnvFactory:
    """TRL's `environment_factory` as a flowgraph env factory. As GRPOTrainer, it keeps
    the objects it made and resets them for later episodes (each in one episode at a
    time), and builds their tools once."""

    def __init__(self, make: Callable[..., object], probe: object = None) -> None:
        self.make = make
        self._free: list[object] = [] if probe is None else [probe]
        self._tools: dict[int, tuple[object, list[Tool]]] = {}  # id -> (the object, tools)
        self._lock = threading.Lock()

    def __call__(self, **env_params: Any) -> TRLEnv:
        with self._lock:
            env = self._free.pop() if self._free else None
        if env is None:
            env = _call(f"TRL environment_factory `{_name(self.make)}`{_at(self.make)}",
                        self.make, **env_params)
        made, tools = self._tools.get(id(env), (None, []))
        if made is not env:
            tools = trl_tools(env)
            self._tools[id(env)] = (env, tools)
        cls = _AsyncRewardTRLEnv if inspect.iscoroutinefunction(
            getattr(env, "get_reward", None)) else TRLEnv
        return cls(env, tools, self._give_back)

    def _give_back(self, env: object) -> None:
        with self._lock:
            self._free.append(env)

    def __getstate__(self) -> dict[str, Any]:
        return {"make": self.make}  # a worker makes its own objects

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["make"])  # type: ignore[misc]


class TRLEnv(Env):
    """A TRL environment object driven as TRL 1.16's GRPOTrainer drives it."""

    def __init__(self, env: Any, tools: Sequence[Tool] | None = None,
                 give_back: Callable[[object], None] | None = None) -> None:
        self.env = env
        """The TRL object."""
        self.tools = list(trl_tools(env) if tools is None else tools)  # type: ignore[misc]
        self._give_back = give_back
        self._scored = False  # the rollout asks for no reward of a failed episode

    def reset(self, task: Mapping[str, Any]) -> list[Message]:
        """`env.reset(**row)`, every column (`prompt` too); a string (or content list)
        it returns is appended to the last prompt message's content, as GRPOTrainer
        does. A row without `prompt` starts from one empty user message (TRL's default);
        a string prompt is one user message."""
        observation = _call(_method(self.env, "reset", "TRL env"), self.env.reset, **task)
        prompt = as_messages(task.get("prompt", [{"role": "user", "content": ""}]),
                             "the row's prompt")
        if observation is None:
            return prompt
        content = prompt[-1]["content"]
        if isinstance(observation, list) and isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if isinstance(observation, str) and isinstance(content, list):
            observation = [{"type": "text", "text": observation}]
        return [*prompt[:-1], {**prompt[-1], "content": content + observation}]

    def reward(self, episode: Episode) -> float:
        """`env.get_reward()` where the env has one (None: 0), else 0."""
        if not callable(getattr(self.env, "get_reward", None)):
            self._scored = True
            return 0.0
        value = _call(_method(self.env, "get_reward", "TRL env"), self.env.get_reward)
        self._scored = True
        return 0.0 if value is None else float(value)

    def close(self) -> None:
        """The object back to the pool, unless its episode failed (a tool that ran past
        its timeout may still be using it)."""
        if self._give_back is not None and self._scored:
            self._give_back(self.env)


class _AsyncRewardTRLEnv(TRLEnv):
    """A TRL env whose `get_reward` is async (an LLM judge): awaited."""

    async def reward(self, episode: Episode) -> float:  # type: ignore[override]
        value = await _acall(_method(self.env, "get_reward", "TRL env"),
                             self.env.get_reward)
        self._scored = True
        return 0.0 if value is None else float(value)


def trl_tools(env: object) -> list[Tool]:
    """The tools GRPOTrainer exposes for `env`: the functions of its class (inherited
    too, properties and classmethods not), public, but `reset` and `get_reward`, bound
    to `env`; what each returns is the tool message's content as TRL makes it."""
    names = [name for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
             if name not in TRL_NOT_TOOLS and not name.startswith("_")]
    return [_trl_tool(getattr(env, name)) for name in names]


def _trl_tool(method: Callable[..., Any]) -> Tool:
    """`method` as a Tool answering as GRPOTrainer's tool loop does: a list result as it
    is (content parts), anything else `str(result)`, an exception `{'error': str(exc)}`."""
    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)  # inspect.unwrap(tool.fn): the user's method, for messages
        async def call_async(**arguments: Any) -> Any:
            try:
                result = await method(**arguments)
            except Exception as exc:
                result = {"error": str(exc)}
            return result if isinstance(result, list) else str(result)

        return dataclasses.replace(as_tool(method), fn=call_async)

    @functools.wraps(method)
    def call(**arguments: Any) -> Any:
        try:
            result = method(**arguments)
        except Exception as exc:
            result = {"error": str(exc)}
        return result if isinstance(result, list) else str(result)

    return dataclasses.replace(as_tool(method), fn=call)


# --- verl --------------------------------------------------------------------------------


class VerlTools:
    """verl tools as a flowgraph env factory. Each tool object is made once per process
    (as verl's agent-loop worker makes it) and shared by the episodes, which keep their
    state apart by the instance ids `create` returns."""

    def __init__(self, tools: Sequence[object], where: str = "",
                 configs: Sequence[Mapping[str, Any]] = ()) -> None:
        self.given = list(tools)
        """Tool classes or objects (a class is made with `config` and `tool_schema`)."""
        self.configs = list(configs) or [{} for _ in self.given]
        """Per tool, its entry of the YAML (`config`, `tool_schema`), or empty."""
        self.where = where
        self._made: list[object] | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Path, where: str = "") -> VerlTools:
        """The tools of verl's tool-config YAML (a path, or the mapping it holds):
        `tools: - class_name: module.Class, config: {type: native, ...}, tool_schema:`."""
        source = str(config) if isinstance(config, Path) else where
        places: list[SourcePos] = []
        folder = None
        if isinstance(config, Path):
            try:
                text = config.read_text()
                config, places = yaml.safe_load(text), _class_name_places(text, source)
            except (OSError, yaml.YAMLError) as exc:
                raise EnvError(f"{where + ': ' if where else ''}verl tool config `{source}` "
                               f"cannot be read: {exc}") from exc
            folder = str(Path(source).resolve().parent)
        entries = config.get("tools") if isinstance(config, Mapping) else None
        if not isinstance(entries, list) or not entries:
            raise EnvError(f"verl tool config `{source}`: expected `tools:`, a list of "
                           "{class_name, config, tool_schema} entries")
        at = places if len(places) == len(entries) else \
            [SourcePos(source, 0, 0) for _ in entries]
        return cls([_verl_class(e, at[i], i, folder) for i, e in enumerate(entries)], where,
                   entries)

    def __call__(self, **env_params: Any) -> VerlToolEnv:
        """A new episode's env; `env_params` make a tool given as a class (its
        `config` and `tool_schema`, as one entry of verl's YAML)."""
        if env_params and any(self.configs):
            raise EnvError(f"{self.where + ': ' if self.where else ''}env_params "
                           f"{sorted(env_params)} given to a verl tool config: each tool's "
                           "`config` and `tool_schema` are in its YAML entry")
        with self._lock:
            if self._made is None:
                self._made = [self._make(t, {**c, **env_params})
                              for t, c in zip(self.given, self.configs, strict=True)]
        return VerlToolEnv(self._made)

    def _make(self, tool: object, entry: Mapping[str, Any]) -> object:
        if not inspect.isclass(tool):
            return tool
        config = dict(entry.get("config") or {})
        kind = config.get("type", "native")
        if kind != "native":
            raise EnvError(f"verl tool `{_name(tool)}`{_at(tool)}: config.type is {kind!r}; "
                           "verl 0.9.1 runs `native` tools only")
        return _call(_method(tool, "__init__", "verl tool"), tool, config=config,
                     tool_schema=_verl_schema_object(entry.get("tool_schema")))

    def __getstate__(self) -> dict[str, Any]:
        return {"given": self.given, "configs": self.configs, "where": self.where}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["given"], state["where"], state["configs"])  # type: ignore[misc]


class ToolConfigError(EnvError):
    """A verl tool config's entry whose class cannot be loaded; `pos` is its `class_name`
    line (the checker's FG605 points there)."""

    def __init__(self, message: str, pos: SourcePos | None = None) -> None:
        super().__init__(message)
        self.pos = pos


def _class_name_places(text: str, source: str) -> list[SourcePos]:
    """Where each entry's `class_name` value is written in a tool config's YAML `text`
    (empty when the file is not shaped as verl's: the reader says why)."""
    root = yaml.compose(text)
    if not isinstance(root, yaml.MappingNode):
        return []
    tools = next((v for k, v in root.value if k.value == "tools"), None)
    if not isinstance(tools, yaml.SequenceNode):
        return []
    places = []
    for entry in tools.value:
        pairs = entry.value if isinstance(entry, yaml.MappingNode) else []
        node = next((v for k, v in pairs if k.value == "class_name"), entry)
        places.append(SourcePos(source, node.start_mark.line + 1, node.start_mark.column + 1))
    return places


def _verl_class(entry: object, pos: SourcePos, i: int, folder: str | None) -> type:
    """The class an entry's `class_name` (`module.Class`) names, imported as a plugin is:
    a module next to the tool config (`folder`) first, then the installed ones."""
    name = entry.get("class_name") if isinstance(entry, Mapping) else None
    if not isinstance(name, str) or "." not in name:
        raise ToolConfigError(f"verl tool config `{pos}`, tool {i}: `class_name` must be "
                              f"`module.Class`, got {name!r}", pos)
    module, _, qualname = name.rpartition(".")
    try:
        found = getattr(importlib.import_module(
            plugin_module(module, [folder] if folder else [])), qualname)
    except (ImportError, AttributeError) as exc:
        raise ToolConfigError(
            f"verl tool config `{pos}`, tool {i}: `{name}` cannot be imported: "
            f"{type(exc).__name__}: {exc} (a module next to the tool config, or an installed "
            "one)", pos) from exc
    except Exception as exc:  # the module's own code raised on import: the user's error
        raise ToolConfigError(
            f"verl tool config `{pos}`, tool {i}: importing `{module}` raised "
            f"{type(exc).__name__}: {exc}", pos) from exc
    if not inspect.isclass(found):
        raise ToolConfigError(f"verl tool config `{pos}`, tool {i}: `{name}` is not a class",
                              pos)
    return found


def _verl_schema_object(schema: object) -> object:
    """A YAML `tool_schema` as verl passes it: its pydantic model where verl is
    installed (a tool may read `tool_schema.function.name`), else the mapping."""
    if schema is None:
        return None
    try:
        from verl.tools.schemas import (  # type: ignore[import-not-found,unused-ignore]
            OpenAIFunctionToolSchema,  # only where verl is installed
        )
    except ImportError:
        return schema
    return OpenAIFunctionToolSchema.model_validate(schema)


def verl_schema(tool: object) -> dict[str, Any]:
    """A verl tool's OpenAI schema as verl puts it in the prompt:
    `tool_schema.model_dump(exclude_unset=True, exclude_none=True)`."""
    schema: Any = getattr(tool, "tool_schema", None)
    if hasattr(schema, "model_dump"):
        schema = schema.model_dump(exclude_unset=True, exclude_none=True)
    function = schema.get("function") if isinstance(schema, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise EnvError(f"verl tool `{type(tool).__qualname__}`{_at(tool)}: its tool_schema "
                       f"{schema!r} is not an OpenAI function schema "
                       "({type: function, function: {name, description, parameters}})")
    return dict(schema)


class VerlAgentData:
    """What flowgraph gives a verl tool's `execute(..., agent_data=)`: the row's
    `tools_kwargs`, a per-episode `extra_fields` dict (verl: "tool session data"), the
    episode's `request_id`, `metrics`, `tool_rewards`. verl's token and message fields are
    not kept here: flowgraph's rollout owns the tokens."""

    def __init__(self) -> None:
        self.tools_kwargs: dict[str, Any] = {}
        self.extra_fields: dict[str, Any] = {}
        self.request_id = uuid.uuid4().hex
        self.metrics: dict[str, Any] = {}
        self.tool_rewards: list[float] = []

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"verl's agent_data.{name} is not available in flowgraph's "
                             "rollouts: a tool sees tools_kwargs, extra_fields, request_id, "
                             "metrics and tool_rewards")


class VerlToolEnv(Env):
    """One episode over verl tools, each call made as verl 0.9.1's
    `ToolAgentLoop._call_tool` makes it; a call's reward (`execute`'s, not None) is its
    turn's reward, as a `ToolResult`, and is kept in `agent_data.tool_rewards` as verl
    keeps it. The episode's own reward is 0 (`Env.reward`)."""

    def __init__(self, tools: Sequence[object]) -> None:
        self.agent_data = VerlAgentData()
        self._open: dict[str, object] = {}  # created, not yet released
        self.tools = [self._tool(t) for t in tools]  # type: ignore[misc]

    def reset(self, task: Mapping[str, Any]) -> Any:
        """The row's prompt; its `extra_info.tools_kwargs` (verl's RLHFDataset) give each
        tool's `create_kwargs`."""
        info = task.get("extra_info")
        kwargs = info.get("tools_kwargs") if isinstance(info, Mapping) else None
        self.agent_data.tools_kwargs = dict(kwargs or {})
        return super().reset(task)

    async def close(self) -> None:  # type: ignore[override]
        """Release what a call left open (one cancelled by its timeout)."""
        for instance_id, tool in list(self._open.items()):
            await self._release(tool, instance_id)

    def _tool(self, tool: Any) -> Tool:
        function = verl_schema(tool)["function"]
        name = function["name"]

        @functools.wraps(tool.execute)  # inspect.unwrap(tool.fn): the tool's execute
        async def call(**arguments: Any) -> ToolResult:
            text, reward = await self._execute(tool, name, arguments)
            if reward is not None:
                self.agent_data.tool_rewards.append(float(reward))
            return ToolResult(text, 0.0 if reward is None else float(reward))

        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        return Tool(name=name, description=function.get("description", ""),
                    parameters=dict(parameters), fn=call)

    async def _execute(self, tool: Any, name: str, arguments: dict[str, Any]
                       ) -> tuple[str, float | None]:
        """create, execute, release: verl's `_call_tool` after the name and arguments
        were checked (flowgraph's parser does that)."""
        create_kwargs = self.agent_data.tools_kwargs.get(name, {}).get("create_kwargs", {})
        instance_id = None
        try:
            instance_id, _ = await tool.create(create_kwargs=create_kwargs)
            self._open[instance_id] = tool
            response, reward, _metrics = await tool.execute(instance_id, arguments,
                                                            agent_data=self.agent_data)
        except Exception as exc:
            return f"Error executing tool '{name}': {exc}", 0.0
        finally:
            if instance_id:
                await self._release(tool, instance_id)
        return _verl_text(tool, response), reward

    async def _release(self, tool: Any, instance_id: str) -> None:
        self._open.pop(instance_id, None)
        await _acall(_method(tool, "release", "verl tool"), tool.release, instance_id)


def _verl_text(tool: object, response: object) -> str:
    """A `ToolResponse`'s text (None: ""), or a string (verl before 0.5 returned one).
    Images and videos are refused: flowgraph's rollouts are text-only."""
    if isinstance(response, str):
        return response
    if getattr(response, "image", None) or getattr(response, "video", None):
        raise EnvError(f"verl tool `{type(tool).__qualname__}`{_at(tool)} returned images "
                       "or videos; flowgraph's agent rollouts are text-only")
    return str(getattr(response, "text", None) or "")


# --- SkyRL-gym ---------------------------------------------------------------------------


class SkyRLEnvFactory:
    """A SkyRL-gym env class as a flowgraph env factory: `env_params` are its
    `env_config`, but `max_turns`, which goes into `extras` (where SkyRL's generator
    puts it)."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __call__(self, **env_params: Any) -> SkyRLEnv:
        return SkyRLEnv(self.cls, env_params)


class SkyRLEnv(Env):
    """A SkyRL-gym `BaseTextEnv` driven as SkyRL's generator drives it: every assistant
    turn's text goes to `step` (the env reads its own tool calls; its
    `postprocessed_action` is ignored: flowgraph trains the sampled tokens)."""

    def __init__(self, cls: type, env_params: Mapping[str, Any]) -> None:
        self.cls = cls
        self.env_config = {k: v for k, v in env_params.items() if k != "max_turns"}
        self.max_turns = env_params.get("max_turns")
        self.env: Any = None

    def reset(self, task: Mapping[str, Any]) -> Any:
        """`cls(env_config=, extras=the row but its prompt)`, then `init(prompt)`."""
        extras = {k: v for k, v in task.items() if k not in ("prompt", "env_class")}
        if self.max_turns is not None:
            extras["max_turns"] = self.max_turns
        self.env = _call(_method(self.cls, "__init__", "SkyRL env"), self.cls,
                         env_config=self.env_config, extras=extras)
        prompt = as_messages(task.get("prompt"), "the row's prompt")
        observation, _metadata = _call(_method(self.cls, "init", "SkyRL env"),
                                       self.env.init, prompt)
        return observation

    def step(self, message: Message) -> Step:
        out = _call(_method(self.cls, "step", "SkyRL env"), self.env.step,
                    message.get("content") or "")
        try:
            return Step(messages=tuple(out["observations"] or ()), reward=float(out["reward"]),
                        done=bool(out["done"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise EnvError(f"{_method(self.cls, 'step', 'SkyRL env')} returned {out!r}; "
                           "expected {observations, reward, done}") from exc

    def close(self) -> None:
        if self.env is not None:
            _call(_method(self.cls, "close", "SkyRL env"), self.env.close)
