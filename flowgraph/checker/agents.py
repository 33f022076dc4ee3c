"""Agent rollouts, checked before launch: a rollout kind that takes `max_turns`
(`agent_rollout`), and the updates that train on its episodes.

- FG601 (budget): the response length T holds every token after the first prompt, so
  an episode that uses every budget needs K·t + (K−1)·u tokens (K = max_turns turns of
  t = max_turn_tokens, the K−1 tool results or env replies between them of
  u = max_tool_tokens; the last turn has none after it). Over T is a *warning*: such
  episodes end as `context_exhausted`, a status the metrics report, and most episodes
  are shorter than their budgets. An *error* where the setting can never be what it
  says: t over T (no turn can sample t tokens), or 2K−1 over T (each turn samples at
  least one token and each message between takes at least one: no episode can reach
  max_turns, while the (B, K) turn tensors are sized for K).
- FG602 (timeouts): a timeout of 0 is no timeout; a hung tool must end its episode,
  never the run (`episodes.py` would even time every call out at once), so 0 is an
  error naming the tools that would take it. A tool's timeout over the turn's, or the
  turn's over the episode's, can never fire: a warning. A black-box agent (`agent`)
  calls its own tools, so `tool_timeout_s` is not checked for it.
- FG603 (schemas): every tool the rollout offers has its JSON schema built here, as the
  policy will be shown it (`flowgraph.agent.tools`): the `tools` param's and an `Env`
  subclass's (`tools_of` on the class). A `@tool` whose schema fails raises when its
  plugin file is imported; `check_graph` reports that as FG603 too.
- FG604 (sequence-level losses): an update fed by multi-turn episodes whose loss takes
  one ratio per sequence (GSPO, `LossSpec.per_sequence`) or whose correction weighs a
  sequence by one number (`rollout_is: sequence`, `ParamSpec.per_sequence`): the
  sequence is the episode. A warning: an episode-level unit may be what is wanted.
- FG605 (imports): the env and tools (`ParamSpec.agent`) are found in the plugins the
  graph lists, as `flowgraph.checker.functions` finds reward functions (the plugin's
  own import failure is FG113, once, on its `plugins:` line).

- FG610 (MCP servers): each server an `mcp_servers` param declares is started as the
  run will start it (its `cwd` resolved by the compiler's rule), its tools listed (they
  join the offered tools: FG602's names, FG606's probe) and stopped; a declaration that
  is not one, or a server that does not start, is an error naming it and the tail of
  its stderr. `check: false` leaves a server to the run (it stops at step 0 then).
- FG607 (agent programs): a black-box agent (`agent: my_agent.py:run`) is called as
  `await run(task, client)`: an `async def` taking two arguments. It brings its own
  tools and plays its own episode, so an `env` or `tools` beside it would be ignored:
  an error too.
- FG608 (episodes of several rows): `rows_per_episode: c > 1` gives each episode c
  rows, so that a black-box agent's forks each train (the rows of one episode share its
  score). Errors, each where a row would silently count as an episode: without `agent`
  (an env's episode never forks: c − 1 of every c rows would be empty); with `n` unset
  (n defaults to N, so the rollout would give N·c rows per prompt: n·c = N is meant);
  a grpo or rloo fed by it without its `episode` (each row a sample of the group: an
  episode of c rows would count c times, an unused row as a score of 0);
  another advantage estimator (credit flows along a row, so an episode's earlier rows
  would get none of its reward); and an update averaging each row's token mean
  (`seq-mean-token-mean`: an episode split in c rows would weigh c times).

The chat template (FG606) needs the tokenizer: `check --data` probes it
(`flowgraph.checker.data`); otherwise the rollout refuses it when it starts
(`flowgraph.agent.render.ChatRenderer`).

One module past ~450 lines, on purpose: one family of diagnostics (FG601-FG610) over the
same rollout and update pairs, sharing the helpers that find them.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowgraph.agent.adapters import ToolConfigError, VerlTools
from flowgraph.agent.env import Env
from flowgraph.agent.mcp_servers import declared, probe
from flowgraph.agent.mcp_servers import resolved as mcp_resolved
from flowgraph.agent.routing import bad_env_names
from flowgraph.agent.tools import Tool, as_tool, tools_of
from flowgraph.checker.functions import plugin_module
from flowgraph.checker.shapes import DimEnv
from flowgraph.checker.structure import Resolved, param_value
from flowgraph.diagnostics import Diagnostic, error, warning
from flowgraph.document import did_you_mean
from flowgraph.errors import EnvError, McpServerError
from flowgraph.ir import Graph, NodeSpec, Param, Params, to_python
from flowgraph.objects import PyObject, defined_at
from flowgraph.paths import RULE, written_file
from flowgraph.registry import KindSpec, ParamSpec, loss_spec
from flowgraph.source import SourcePos

__all__ = ["check_agents", "offered_schemas"]

TIMEOUTS = ("tool_timeout_s", "turn_timeout_s", "episode_timeout_s")
SCHEMA_HINT = ("a tool is a function with a type hint on every argument and a Google-style "
               "docstring whose `Args:` block describes each (as transformers' "
               "get_json_schema reads it), or a flowgraph.tool")

Offered = tuple[Tool, str]
"""A tool the rollout offers and where it comes from (`tools` or the env), for messages."""


def check_agents(graph: Graph, table: dict[str, Resolved], dims: DimEnv,
                 out: list[Diagnostic]) -> None:
    listed = {p.module for p in graph.plugins}
    for r in table.values():
        if not _is_agent(r):
            continue
        offered = _offered_tools(r, listed, out)
        _check_program(r, listed, out)
        _check_budget(r, dims, out)
        _check_timeouts(r, offered, out)
        _check_rows(r, table, out)
        _check_routing(r, out)
    _check_sequence_level(table, out)


def offered_schemas(graph: Graph, node: NodeSpec, kind: KindSpec) -> list[dict[str, Any]]:
    """The JSON schemas of the tools `node` offers that the checker finds and builds (the
    `tools` param's, an `Env` subclass's), as the chat template's probe shows them to it
    (FG606); what is wrong with them is reported by `check_agents`. A TRL or verl env's
    tools are known when the env is made: the rollout probes them then."""
    schemas = []
    for tool, _ in _offered_tools(Resolved(node, kind), {p.module for p in graph.plugins}, []):
        try:
            schemas.append(tool.schema())
        except Exception:
            continue
    return schemas


def _is_agent(r: Resolved) -> bool:
    return r.kind is not None and isinstance(r.spec, NodeSpec) and r.kind.multi_turn


def _pos(r: Resolved, name: str) -> SourcePos:
    """Where param `name` is written, else the node."""
    p = r.spec.params.find(name) if isinstance(r.spec, NodeSpec) else None
    return p.pos if p is not None else r.pos


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


# --- FG601: the response budget ---------------------------------------------------------


def _check_budget(r: Resolved, dims: DimEnv, out: list[Diagnostic]) -> None:
    K, u, T = (_count(param_value(r, "max_turns")), _count(param_value(r, "max_tool_tokens")),
               dims.values.get("T"))
    t = param_value(r, "max_turn_tokens")
    if K is None or u is None or T is None or (t is not None and _count(t) is None):
        return  # a wrong value is FG112's; an unbound T is refused when the rollout runs
    why_T = tuple(w for w in (dims.why.get("T"),) if w)
    if isinstance(t, int) and t > T:
        out.append(error(
            "FG601", f"`{r.name}.params.max_turn_tokens` = {t} is over the response length "
            f"T = {T}: no turn can sample {t} tokens (T holds every turn and every message "
            "between)", _pos(r, "max_turn_tokens"), node=r.name,
            expected=f"max_turn_tokens <= T = {T}", actual=str(t), notes=why_T,
            hint=f"lower max_turn_tokens to at most {T}, or raise T to {K * t + (K - 1) * u} "
                 f"(max_turns × max_turn_tokens + (max_turns − 1) × max_tool_tokens = "
                 f"{K} × {t} + {K - 1} × {u})"))
        return
    turn = t if isinstance(t, int) else 1  # null: a turn takes what is left of T
    need = K * turn + (K - 1) * u
    if 2 * K - 1 > T:
        out.append(error(
            "FG601", f"no episode of `{r.name}` can take max_turns = {K} turns in T = {T} "
            f"tokens: each turn samples at least one token and each message between turns "
            f"takes at least one ({K} + {K - 1} = {2 * K - 1} > {T})", _pos(r, "max_turns"),
            node=r.name, expected=f"T >= {2 * K - 1}", actual=f"T = {T}", notes=why_T,
            hint=f"raise T to {need} ({_formula(K, t, u)}), or lower max_turns to "
                 f"{max((T + u) // (turn + u), 1)} (the most whose turns and tool results "
                 "all fit T)"))
        return
    if need <= T:
        return
    out.append(warning(
        "FG601", f"`{r.name}`: {_formula(K, t, u)} = {need} tokens, over the response "
        f"length T = {T}: episodes whose turns and tool results use their budgets end as "
        f"`context_exhausted` before max_turns", _pos(r, "max_turns"), node=r.name,
        expected=f"T >= {need}", actual=f"T = {T}",
        notes=(*why_T, "the chat template's own tokens around each message come on top"),
        hint=_budget_fix(K, t, u, T, need)))


def _formula(K: int, t: object, u: int) -> str:
    turn = f"{K} × {t}" if isinstance(t, int) else f"{K} × 1 (max_turn_tokens null: a turn " \
                                                   "takes what is left)"
    return (f"max_turns × max_turn_tokens + (max_turns − 1) × max_tool_tokens = {turn} + "
            f"{K - 1} × {u}")


def _budget_fix(K: int, t: object, u: int, T: int, need: int) -> str:
    """Raise T to `need`, or lower one of max_turns, max_turn_tokens, max_tool_tokens to
    the largest value that fits T (the ones that can)."""
    turn = t if isinstance(t, int) else 1
    lower = [f"max_turns to {(T + u) // (turn + u)}"]
    if isinstance(t, int) and (T - (K - 1) * u) // K >= 1:
        lower.append(f"max_turn_tokens to {(T - (K - 1) * u) // K}")
    if (T - K * turn) // (K - 1) >= 1:
        lower.append(f"max_tool_tokens to {(T - K * turn) // (K - 1)}")
    return (f"raise T to {need} (dims.T, or the rollout's max_new_tokens), or lower "
            f"{' or '.join(lower)}; or keep it: context_exhausted is the status such "
            "episodes end with")


# --- FG602: timeouts --------------------------------------------------------------------


def _check_timeouts(r: Resolved, offered: list[Offered], out: list[Diagnostic]) -> None:
    limits = {k: param_value(r, k) for k in TIMEOUTS}
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
               for v in limits.values()):
        return  # a wrong type, or an infinite one: FG112's
    tool_s, turn_s, episode_s = (float(limits[k]) for k in TIMEOUTS)  # type: ignore[arg-type]
    # a black-box agent calls its own tools: the rollout times none, tool_timeout_s unused
    program = param_value(r, "agent") is not None
    for name, seconds in zip(TIMEOUTS, (tool_s, turn_s, episode_s), strict=True):
        if seconds == 0 and not (program and name == "tool_timeout_s"):
            _no_timeout(r, name, offered, out)
    if 0 < turn_s < tool_s and not program:
        out.append(_never_fires(r, "tool_timeout_s", tool_s, "turn_timeout_s", turn_s,
                                "a hung tool call"))
    if 0 < episode_s < turn_s:
        out.append(_never_fires(r, "turn_timeout_s", turn_s, "episode_timeout_s", episode_s,
                                "a turn's env and tool work"))
    for t, origin in offered:
        if t.timeout_s is not None and 0 < turn_s < t.timeout_s:
            out.append(warning(
                "FG602", f"tool `{t.name}` ({origin}, {defined_at(t.fn)}) has timeout_s = "
                f"{t.timeout_s:g} s, over `{r.name}.params.turn_timeout_s` = {turn_s:g} s: the "
                "turn's timeout stops a hung call first, so the tool's never fires",
                _pos(r, "tools" if origin == "tools" else "env"), node=r.name,
                hint=f"lower the tool's timeout_s below {turn_s:g}, or raise turn_timeout_s"))


def _no_timeout(r: Resolved, name: str, offered: list[Offered], out: list[Diagnostic]) -> None:
    taking = dict.fromkeys(f"`{t.name}` ({_tool_at(t, origin)})" for t, origin in offered
                           if t.timeout_s is None)
    spec = r.kind.param(name) if r.kind is not None else None
    default = spec.default if spec is not None else None
    tools = (f"; the tools without a timeout_s of their own would take it: "
             f"{', '.join(taking)}" if name == "tool_timeout_s" and taking else "")
    out.append(error(
        "FG602", f"`{r.name}.params.{name}` is 0: no timeout. Tools and envs run the user's "
        f"code, and a hung call must end its episode (status `timeout`), never the run; the "
        f"rollout would also end every call at once as a timeout{tools}", _pos(r, name),
        node=r.name, expected="seconds > 0", actual="0",
        hint=f"give seconds: `{name}: {default}` (the default)"
             + (", or each tool its own (@tool(timeout_s=...))" if name == "tool_timeout_s"
                else "")))


def _never_fires(r: Resolved, name: str, seconds: float, other: str, limit: float,
                 what: str) -> Diagnostic:
    return warning(
        "FG602", f"`{r.name}.params.{name}` = {seconds:g} s is over {other} = {limit:g} s: "
        f"{what} is stopped by {other} first, so {name} never fires", _pos(r, name),
        node=r.name, expected=f"{name} <= {other} = {limit:g}", actual=f"{seconds:g}",
        hint=f"lower {name} to at most {limit:g}, or raise {other}")


# --- FG607: a black-box agent program ---------------------------------------------------


def _check_program(r: Resolved, listed: set[str], out: list[Diagnostic]) -> None:
    assert isinstance(r.spec, NodeSpec)
    given = r.spec.params.find("agent")
    if given is None or given.value is None:
        return
    beside = [p for p in ("env", "envs", "tools", "mcp_servers") if param_value(r, p)]
    if beside:
        out.append(error(
            "FG607", f"`{r.name}` names the agent program `{_label(given.value)}` and "
            f"{' and '.join(f'`{p}`' for p in beside)}: a black-box agent brings its own "
            "tools and plays its own episodes, so they would be ignored", given.pos,
            node=r.name, hint="keep `agent` (its tools are what it passes as `tools=` to "
            "the client) or the env and tools, not both"))
    ref = given.value
    program = ref.obj if isinstance(ref, PyObject) else _lookup(ref, "agent program", listed)[0]
    if program is None or _runs_as_agent(program):
        return
    where = defined_at(program)
    out.append(error(
        "FG607", f"the agent program `{_label(ref)}` of `{r.name}` is not `async def "
        f"run(task, client)`" + (f" ({where})" if where else ""), given.pos, node=r.name,
        hint="the rollout awaits run(task, client) for each episode: `task` the dataset "
             "row, `client` an openai.AsyncOpenAI on the rollout's endpoint; it returns "
             "the episode's reward (a number, or a dict with `score`)"))


def _runs_as_agent(fn: object) -> bool:
    if not inspect.iscoroutinefunction(fn):
        return False
    try:
        inspect.signature(fn).bind(None, None)
    except (TypeError, ValueError):
        return False
    return True


def _label(ref: object) -> str:
    return ref.ref if isinstance(ref, PyObject) else str(ref)


# --- FG605, FG603: the env and tools, found and their schemas built ------------------------


def _offered_tools(r: Resolved, listed: set[str], out: list[Diagnostic]) -> list[Offered]:
    """The tools the rollout offers whose schemas build (FG603 for the others), from the
    params that name an env or tools (`ParamSpec.agent`) and are found (FG605)."""
    assert r.kind is not None and isinstance(r.spec, NodeSpec)
    offered: list[Offered] = []
    for spec in r.kind.params:
        given = r.spec.params.find(spec.name) if spec.agent is not None else None
        if given is None or given.value is None:
            continue
        if spec.agent == "mcp":
            offered += _server_tools(r, given, out)
            continue
        for at, ref in _refs(given):
            obj = _found(r, spec, at, ref, listed, out)
            if obj is not None:
                offered += _built(r, spec, at, ref, obj, out)
    return offered


def _refs(given: Param) -> list[tuple[Param, object]]:
    """Each reference a param holds and where it is written: a list's items, a mapping's
    values (`envs`: each at its own line), or the one value."""
    if isinstance(given.value, Params):
        return [(p, p.value) for p in given.value.items]
    if isinstance(given.value, tuple):
        return [(given, ref) for ref in given.value]
    return [(given, given.value)]


def _found(r: Resolved, spec: ParamSpec, given: Param, ref: object, listed: set[str],
           out: list[Diagnostic]) -> object | None:
    """What one reference names, as the rollout will load it; None (and FG605 where the
    reference is wrong) when it is not found here."""
    if isinstance(ref, PyObject):
        held: object | None = ref.obj
        return held  # None: FG113, from the structure check
    what = {"env": "env", "tools": "tool"}.get(spec.agent or "", "agent program")
    if what == "env" and isinstance(ref, str) and ref.endswith(spec.files):
        _tool_config(r, spec, given, ref, out)
        return None  # a verl tool config: its adapter reads its tools when it is made
    obj, problem = _lookup(ref, what, listed)
    if problem is not None:
        out.append(error("FG605", f"parameter `{spec.name}` of `{r.name}` {problem[0]}",
                         given.pos, node=r.name, hint=problem[1]))
    return obj


def _tool_config(r: Resolved, spec: ParamSpec, given: Param, ref: str,
                 out: list[Diagnostic]) -> None:
    """FG605 for a verl tool config that is not there, or whose classes cannot be
    imported as the run will import them (`VerlTools.from_config`: a module next to the
    config, then the installed ones), at the config's `class_name` line."""
    path = Path(written_file(ref, given.pos))
    where = f"parameter `{spec.name}` of `{r.name}`"
    if not path.is_file():
        out.append(error("FG605", f"{where} names the verl tool config `{ref}`, which is not "
                         f"there ({path})", given.pos, node=r.name, hint=RULE))
        return
    try:
        VerlTools.from_config(path)
    except EnvError as exc:
        pos = exc.pos if isinstance(exc, ToolConfigError) and exc.pos else given.pos
        out.append(error("FG605", f"{where} ({given.pos}): {exc}", pos,
                         node=r.name, hint="a module next to the tool config (or an installed "
                         "one) that defines the class, as verl imports `class_name`"))


Problem = tuple[str, str]
"""What is wrong, and the fix."""


def _lookup(ref: object, what: str, listed: set[str]) -> tuple[object | None, Problem | None]:
    """(the object `ref` names, None), or (None, the problem); (None, None) where it is not
    known here (a plugin that failed to import: FG113)."""
    if not isinstance(ref, str):
        if callable(ref):
            return ref, None
        return None, (f"holds {ref!r}, not a {what}", f"`file.py:Name` or `module:Name` of "
                      f"a plugin listed under plugins:, or the {what} itself")
    module, colon, name = ref.partition(":")
    if not colon or not module or not name:
        return None, (f"names `{ref}`, not a {what} (`file.py:Name` or `module:Name`)",
                      f"write the {what} as `file.py:Name` (the file listed under plugins:)")
    own = module.startswith("flowgraph.")  # flowgraph's own tools: installed where it runs
    if module not in listed and not own:
        return None, (f"names `{ref}`, but `{module}` is not listed under plugins:, so it "
                      "cannot be imported", f"add it: `plugins: [{module}]` (every file or "
                      "module a graph runs is listed there)")
    try:
        loaded = importlib.import_module(module) if own else plugin_module(module)
    except ImportError as exc:
        return None, (f"names `{ref}`, which cannot be imported: {exc}",
                      "a module of flowgraph's, as `flowgraph.agent.sandbox:python`")
    obj: object | None = getattr(loaded, name, None)
    if loaded is None or obj is not None:
        return obj, None
    names = [n for n in vars(loaded) if not n.startswith("_")]
    return None, (f"names `{ref}`, but `{module}` has no `{name}` "
                  f"({getattr(loaded, '__file__', module)})", did_you_mean(name, names))


def _built(r: Resolved, spec: ParamSpec, given: Param, ref: object, obj: object,
           out: list[Diagnostic]) -> list[Offered]:
    """The tools `obj` offers, their schemas built; FG603 naming the one that fails."""
    label = ref.ref if isinstance(ref, PyObject) else str(ref)
    what = "tool" if spec.agent == "tools" else "a tool of"
    make: Callable[[], list[Tool]]
    if spec.agent == "tools":
        origin = "tools"

        def make() -> list[Tool]:
            return [as_tool(obj)]
    elif inspect.isclass(obj) and issubclass(obj, Env):
        origin = f"env {obj.__qualname__}"

        def make() -> list[Tool]:
            return tools_of(obj)
    else:
        return []  # a TRL, verl or SkyRL env: its adapter reads its tools when it is made
    try:
        return [(t, origin) for t in make()]
    except Exception as exc:  # the user's hints and docstrings: any failure is theirs
        out.append(error(
            "FG603", f"parameter `{spec.name}` of `{r.name}`: {what} `{label}` cannot be "
            f"offered to the policy: {type(exc).__name__}: {exc}", given.pos, node=r.name,
            hint=SCHEMA_HINT))
        return []


# --- FG610: MCP servers, started ------------------------------------------------------------


def _server_tools(r: Resolved, given: Param, out: list[Diagnostic]) -> list[Offered]:
    """The tools of the MCP servers `given` declares, each started as the run will start
    it (its `cwd` resolved by the compiler's rule), listed and stopped (`probe`); FG610
    for a declaration that is not one, or a server that does not start, naming it and
    its stderr. A server declared `check: false` is left to the run."""
    where = f"parameter `{given.name}` of `{r.name}`"
    try:
        servers = declared(mcp_resolved(to_python(given.value), given.pos), where)
    except McpServerError as exc:
        out.append(error("FG610", str(exc), given.pos, node=r.name, hint=MCP_HINT))
        return []
    offered: list[Offered] = []
    for server in servers:
        if not server.check:
            continue
        entry = given.value.find(server.name) if isinstance(given.value, Params) else None
        try:
            offered += [(t, f"MCP server `{server.name}`") for t in probe(server)]
        except McpServerError as exc:
            out.append(error(
                "FG610", f"{where}: {exc}", entry.pos if entry is not None else given.pos,
                node=r.name, hint="run the command in that folder to see it fail; a server "
                "that can only start where the run runs (a GPU machine, a cluster's files) "
                "takes `check: false`, and the run then stops at step 0 if it does not "
                "start"))
    return offered


MCP_HINT = ("declare each server as `name: {command: [program, args...], env: {VAR: value}, "
            "cwd: folder, start_timeout_s: 30, check: true}` (only `command` is needed)")


def _tool_at(t: Tool, origin: str) -> str:
    """Where a tool comes from, for messages: its function's file:line, or its MCP server."""
    return origin if origin.startswith("MCP server") else defined_at(t.fn)


# --- FG604: sequence-level losses on episodes ---------------------------------------------


def _check_sequence_level(table: dict[str, Resolved], out: list[Diagnostic]) -> None:
    for r in table.values():
        if r.kind is None or not r.kind.trains or not isinstance(r.spec, NodeSpec):
            continue
        source = _episodes_of(table, r.spec)
        if source is None:
            continue
        for spec in r.kind.params:
            why = _per_sequence(spec, param_value(r, spec.name))
            if why is None:
                continue
            turns = param_value(source, "max_turns")
            out.append(warning(
                "FG604", f"`{r.name}` trains on the episodes of `{source.name}` (up to "
                f"{turns} turns, the tool and env messages between them as holes) with "
                f"{why}: there a sequence is a whole episode, so one number stands for "
                "every turn of it, and a turn far from the sampler clips or down-weights "
                "the others' gradients too", _pos(r, spec.name), node=r.name,
                hint="keep it if one unit per episode is what you want; for one per token, "
                     "policy_loss: vanilla (or cispo), rollout_is: token"))


def _per_sequence(spec: ParamSpec, value: object) -> str | None:
    """Why `spec: value` takes one number per sequence, or None."""
    if spec.names == "policy_loss" and isinstance(value, str):
        loss = loss_spec(value)
        if loss is not None and loss.per_sequence:
            return f"policy_loss `{value}`, one importance ratio per sequence"
    if isinstance(value, str) and value in spec.per_sequence:
        return f"`{spec.name}: {value}`, one weight per sequence"
    return None


def _episodes_of(table: dict[str, Resolved], node: NodeSpec) -> Resolved | None:
    """The multi-turn rollout (max_turns > 1) whose responses reach `node`."""
    producer = _rollout_of(table, node, "responses")
    turns = param_value(producer, "max_turns") if producer is not None else None
    return producer if isinstance(turns, int) and turns > 1 else None


def _rollout_of(table: dict[str, Resolved], node: NodeSpec, port: str) -> Resolved | None:
    """The agent rollout whose output `port` reaches `node`'s input `port`: back along
    the wiring, each node passing on its input of the output's name (a filter's)."""
    ref, seen = node.input(port), set()
    while ref is not None and (ref.node, ref.port) not in seen:
        seen.add((ref.node, ref.port))
        producer = table.get(ref.node)
        if producer is None or producer.kind is None or not isinstance(producer.spec,
                                                                        NodeSpec):
            return None
        if _is_agent(producer):
            return producer
        ref = producer.spec.input(ref.port)
    return None


# --- FG608: episodes of several rows -------------------------------------------------------

EPISODE_ESTIMATORS = ("grpo", "rloo")
"""The advantage kinds that count a group's samples by episode (their `episode` input)."""


def _check_rows(r: Resolved, table: dict[str, Resolved], out: list[Diagnostic]) -> None:
    c = param_value(r, "rows_per_episode")
    if not isinstance(c, int) or isinstance(c, bool) or c <= 1:
        return
    at, why = _pos(r, "rows_per_episode"), f"`{r.name}` gives each episode {c} rows"
    if param_value(r, "agent") is None:
        out.append(error(
            "FG608", f"{why}, but its episodes are an env's, which never fork: a row each "
            f"would be used and {c - 1} of every {c} left empty", at, node=r.name,
            hint="rows_per_episode holds a black-box agent's (`agent`) forks; leave it at 1"))
        return
    if param_value(r, "n") is None:
        out.append(error(
            "FG608", f"{why} and leaves `n` to the global N: N·{c} rows per prompt where "
            "the graph's batch holds N", at, node=r.name,
            hint=f"set `n` (episodes per prompt) to N / {c}: n·rows_per_episode rows per "
                 "prompt make the graph's N"))
    for other in table.values():
        if other.kind is None or not isinstance(other.spec, NodeSpec):
            continue
        kind, spec = other.kind, other.spec
        if kind.category == "advantage" and _rollout_of(table, spec, "response_mask") is r:
            if kind.name not in EPISODE_ESTIMATORS:
                out.append(error(
                    "FG608", f"`{other.name}` ({kind.name}) takes its credit along each row "
                    f"of `{r.name}`, whose episodes take up to {c} rows: an episode's "
                    "earlier rows would get none of its reward", other.pos, node=other.name,
                    hint=f"an outcome estimator that counts episodes: "
                         f"{' or '.join(EPISODE_ESTIMATORS)} with `episode: {r.name}.episode`"))
            elif spec.input("episode") is None:
                out.append(error(
                    "FG608", f"`{other.name}` ({kind.name}) counts each row of `{r.name}` as "
                    f"a sample of its group, but an episode takes up to {c} rows: one "
                    f"that took {c} would count {c} times, an unused row as a score of 0",
                    other.pos, node=other.name,
                    hint=f"wire `episode: {r.name}.episode` into `{other.name}`"))
        if kind.trains and _rollout_of(table, spec, "responses") is r and \
                param_value(other, "loss_agg_mode") == "seq-mean-token-mean":
            out.append(error(
                "FG608", f"`{other.name}` averages each row's token mean "
                f"(loss_agg_mode: seq-mean-token-mean), and `{r.name}` splits an episode "
                f"into up to {c} rows: an episode of {c} rows would weigh {c} times",
                _pos(other, "loss_agg_mode"), node=other.name,
                hint="token-mean (or seq-mean-token-sum, seq-mean-token-sum-norm): a "
                     "token's weight then does not depend on its episode's rows"))


# --- FG609: an env per row ---------------------------------------------------------------


def _check_routing(r: Resolved, out: list[Diagnostic]) -> None:
    """`envs` names each row's env: not beside `env` (which would be ignored), not empty,
    names that can be part of a metric name, and with it `env_params` is keyed by those
    names. (A row naming an env `envs` does not declare: `check --data`, FG609 too.)"""
    assert isinstance(r.spec, NodeSpec)
    given = r.spec.params.find("envs")
    if given is None or not isinstance(given.value, Params):
        return  # unset, or not a mapping: FG112's
    names = list(given.value.names())
    if param_value(r, "env") is not None:
        out.append(error(
            "FG609", f"`{r.name}` names an env per row (`envs`: {', '.join(names)}) and the "
            "one `env` beside them, which would never run", _pos(r, "env"), node=r.name,
            hint="put that env among `envs` under a name, or drop `envs`"))
    if not names:
        out.append(error(
            "FG609", f"`{r.name}.params.envs` is empty: no row could be routed", given.pos,
            node=r.name, hint="name each env: `envs: {calc: \"my_env.py:CalcEnv\", ...}`, "
                              "or use `env` for one"))
    for name in bad_env_names(names):
        out.append(error(
            "FG609", f"`{r.name}.params.envs` names an env `{name}`: an env's name is part of "
            "its metrics' names (agent/<env>/turns), so letters, digits, `_`, `.` and `-`",
            given.pos, node=r.name, hint="rename it, and the rows' values with it"))
    params = r.spec.params.find("env_params")
    if params is None or not isinstance(params.value, Params):
        return
    for p in params.value.items:
        if p.name not in names or not isinstance(p.value, Params | type(None)):
            out.append(error(
                "FG609", f"`{r.name}.params.env_params` has `{p.name}`"
                + (f", which is no env of `envs` ({did_you_mean(p.name, names)})"
                   if p.name not in names else ", which is not a mapping")
                + ": with `envs`, env_params holds each env's own keyword arguments by its "
                "name", p.pos, node=r.name,
                hint="env_params: {<env>: {<argument>: <value>}} for the envs that take any"))
