"""`flowgraph.agent.adapters`: environments written for TRL, verl and SkyRL-gym, run as
they are. TRL's behaviour is held to tests/fixtures/trl/env_episodes.json (TRL 1.16's
GRPOTrainer running tests/fixtures/trl/envs.py, scripts/trl_env_fixtures.py), verl's to
tests/fixtures/verl/agent_tools.json (verl 0.9.1's own `ToolAgentLoop._call_tool`,
scripts/verl_tool_fixtures.py)."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from flowgraph.agent import Env, Episode, Step
from flowgraph.agent.adapters import (
    SHAPES,
    SkyRLEnv,
    TRLEnv,
    VerlToolEnv,
    load_env,
)
from flowgraph.agent.env import ToolResult
from flowgraph.compilers.worker import user_frame
from flowgraph.errors import EnvError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VERL, TRL = FIXTURES / "verl", FIXTURES / "trl"
sys.path.insert(0, str(TRL))
from envs import Guess  # noqa: E402  (TRL's GRPOTrainer ran it: scripts/trl_env_fixtures.py)

ROW = {"prompt": [{"role": "user", "content": "Guess my number."}], "answer": 7,
       "data_source": "toy"}


def line_of(fn: Any, text: str) -> int:
    """The line of `fn`'s source holding `text`."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


# --- flowgraph ---------------------------------------------------------------------------


class Mine(Env):
    pass


def test_a_flowgraph_env_is_its_own_factory() -> None:
    assert load_env(Mine) is Mine
    assert load_env("flowgraph.agent.env:Env") is Env


class Sized(Env):
    def __init__(self, size: int = 1) -> None:
        self.size = size


def test_params_make_a_factory_of_no_arguments() -> None:
    """What the agent_rollout node does: `load_env(env, params=env_params)()`."""
    assert load_env(Sized, params={"size": 3})().size == 3
    assert load_env(Guess, params={})().env.rows == []


# --- TRL ---------------------------------------------------------------------------------


def test_trl_envs_run_as_grpo_trainer_runs_them() -> None:
    """Per sample: the keywords `reset` got, the prompt after it, each tool message
    (TRL orders a turn's sync results before its async ones; compared by name) and the
    reward; the tool schemas as the chat template got them."""
    trl = json.loads((TRL / "env_episodes.json").read_text())
    factory = load_env(Guess)
    for row, kwargs, prompt, completion, reward in zip(
            trl["rows"], trl["reset_kwargs"], trl["prompts"], trl["completions"],
            trl["rewards"], strict=True):
        env = factory()
        assert env.reset(row) == prompt and env.env.rows[-1] == kwargs
        tools = {t.name: t for t in env.tools}
        for turn in [m for m in completion if m.get("tool_calls")]:
            answers = {m["name"]: m["content"] for m in completion
                       if m["role"] == "tool" and id(m) in _answers_of(completion, turn)}
            for c in turn["tool_calls"]:
                name, arguments = c["function"]["name"], c["function"]["arguments"]
                if name not in tools:  # the rollout answers an unknown tool, not the env
                    assert answers[name] == f"{{'error': 'Tool {name} not found.'}}"
                    continue
                got = tools[name].fn(**arguments)
                got = asyncio.run(got) if inspect.iscoroutine(got) else got
                assert got == answers[name]
        assert env.reward(Episode(task=row)) == reward
        env.close()
    assert [t.schema() for t in factory().tools] == trl["tools"]
    assert inspect.unwrap(factory().tools[0].fn).__func__ is Guess.guess  # for messages


def _answers_of(completion: list[dict[str, Any]], turn: dict[str, Any]) -> set[int]:
    """The ids of the tool messages that answer the assistant message `turn`."""
    at = next(i for i, m in enumerate(completion) if m is turn)
    found = set()
    for m in completion[at + 1:]:
        if m["role"] != "tool":
            break
        found.add(id(m))
    return found


def test_trl_tools_are_the_public_methods_but_reset_and_get_reward() -> None:
    env = load_env(Guess)()
    assert isinstance(env, TRLEnv)
    assert [t.name for t in env.tools] == ["guess", "hint", "rules"]  # not _secret, state, make
    guess = env.tools[0]
    assert guess.parameters == {"type": "object", "required": ["n"], "properties": {
        "n": {"type": "integer", "description": "your guess"}}}
    assert guess.description == "Guess the number."


def test_trl_reset_gets_every_column_and_its_string_ends_the_prompt() -> None:
    env = load_env(Guess)()
    assert env.reset(ROW) == [{"role": "user", "content": "Guess my number. (1 to 10)"}]
    assert env.env.rows == [ROW]  # the prompt too, as GRPOTrainer passes `x`
    assert env.reset({**ROW, "quiet": True}) == ROW["prompt"]
    # GRPOTrainer's default prompt when the env owns the data: one empty user message
    assert env.reset({"answer": 3}) == [{"role": "user", "content": " (1 to 10)"}]
    assert env.reset({**ROW, "prompt": "Guess."}) == [
        {"role": "user", "content": "Guess. (1 to 10)"}]


def test_trl_tools_answer_as_grpo_trainer_does_and_reward_is_get_reward() -> None:
    env = load_env(Guess)()
    env.reset(ROW)
    tools = {t.name: t for t in env.tools}
    assert tools["guess"].fn(n=3) == "higher"
    assert tools["guess"].fn(n=11) == "{'error': '11 is out of range'}"  # str({"error": ...})
    assert tools["guess"].fn(m=1) == (
        "{'error': \"Guess.guess() got an unexpected keyword argument 'm'\"}")
    assert asyncio.run(tools["hint"].fn()) == "1"
    assert env.reward(Episode(task=ROW)) == 0.0
    assert tools["guess"].fn(n=7) == "right"
    assert env.reward(Episode(task=ROW)) == 1.0
    assert env.step({"role": "assistant", "content": "7"}) == Step(done=True)


def test_trl_objects_are_made_once_and_reset_for_later_episodes() -> None:
    """As GRPOTrainer's pool: an object serves one episode at a time, then is reset for
    another; one whose episode failed (no reward asked) is not reused."""
    factory = load_env(Guess)
    made = Guess.made
    first = factory()
    second = factory()  # the first is still in its episode
    assert Guess.made == made + 2 and first.env is not second.env
    first.reward(Episode(task=ROW))
    first.close()
    third = factory()
    assert third.env is first.env and Guess.made == made + 2
    assert third.tools == first.tools  # built once per object
    third.close()  # a failed episode: the rollout asked for no reward; its object is dropped
    fourth = factory()
    assert fourth.env is not first.env and Guess.made == made + 3


def test_a_trl_factory_function_and_an_async_get_reward() -> None:
    class Judged(Guess):
        async def get_reward(self) -> float:  # type: ignore[override]
            return 0.25

    env = load_env(lambda: Judged())()
    assert inspect.iscoroutinefunction(env.reward)
    env.reset(ROW)
    assert asyncio.run(env.reward(Episode(task=ROW))) == 0.25


class Broken(Guess):
    def reset(self, **row: Any) -> str:
        return row["question"]  # the row has no `question`


def test_a_raising_trl_reset_names_the_method_and_its_line() -> None:
    env = load_env(Broken)()
    with pytest.raises(EnvError) as info:
        env.reset(ROW)
    where = f"{__file__}:{line_of(Broken.reset, 'def reset')}"
    assert str(info.value) == f"TRL env `Broken.reset` ({where}) raised: KeyError: 'question'"
    assert isinstance(info.value.__cause__, KeyError)
    frame = user_frame(info.value)  # what the worker reports: the raising line
    assert (frame.filename, frame.lineno) == (__file__, line_of(Broken.reset, "question"))


# --- verl --------------------------------------------------------------------------------


@pytest.fixture
def agent_tools(monkeypatch: pytest.MonkeyPatch) -> Any:
    """tests/fixtures/verl/agent_tools.py, importable as verl's YAML names it."""
    monkeypatch.syspath_prepend(str(VERL))
    monkeypatch.delitem(sys.modules, "agent_tools", raising=False)
    import agent_tools

    return agent_tools


def run_episode(env: VerlToolEnv, row: dict[str, Any], calls: list[Any]) -> list[Any]:
    env.reset(row)
    tools = {t.name: t for t in env.tools}

    async def episode() -> list[Any]:
        results = [await tools[name].fn(**arguments) for name, arguments in calls]
        await env.close()
        return results

    return asyncio.run(episode())


def test_verl_tools_run_as_verl_0_9_1_runs_them(agent_tools: Any) -> None:
    """Per call verl creates an instance with the row's create_kwargs, executes, releases
    it (so the counter starts at 5 each time); a raising tool answers an error text; a
    call's reward is its turn's (None: 0), kept in tool_rewards as verl keeps it."""
    verl = json.loads((VERL / "agent_tools.json").read_text())
    env = load_env(str(VERL / "agent_tools.yaml"))()
    assert isinstance(env, VerlToolEnv)
    agent_tools.LOG.clear()
    results = run_episode(env, verl["row"], verl["calls"])
    assert [r.content for r in results] == verl["contents"]
    assert [r.reward for r in results] == [r or 0.0 for r in verl["rewards"]]
    assert env.agent_data.tool_rewards == verl["tool_rewards"]
    assert env.reward(Episode(task=verl["row"])) == 0.0
    assert [list(e) for e in agent_tools.LOG] == verl["log"]
    for tool, schema in zip(env.tools, verl["schemas"], strict=True):
        function = schema["function"]
        assert (tool.name, tool.description) == (function["name"], function["description"])
        assert tool.parameters == function.get("parameters",
                                               {"type": "object", "properties": {}})


def test_a_verl_tool_class_or_object_without_yaml(agent_tools: Any) -> None:
    schema = {"type": "function", "function": {
        "name": "counter", "description": "Add.", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer"}}}}}
    env = load_env(agent_tools.Counter)(config={"type": "native", "scale": 2.0},
                                        tool_schema=schema)
    row = {"prompt": "Count.", "extra_info": {"tools_kwargs": {
        "counter": {"create_kwargs": {"start": 1}}}}}
    assert env.reset(row) == "Count."
    assert run_episode(env, row, [("counter", {"n": 1})]) == [ToolResult("total=2 calls=1",
                                                                        2.0)]
    made = agent_tools.Counter({"type": "native"}, schema)
    assert load_env(made)().tools[0].name == "counter"


class Duck:
    """A verl-shaped tool that inherits nothing: what `load_env` reads is the shape."""

    def __init__(self) -> None:
        self.tool_schema = {"type": "function",
                            "function": {"name": "echo", "description": "Echo."}}
        self.released: list[str] = []

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> Any:
        return "id-1", None

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> Any:
        assert kwargs["agent_data"].tools_kwargs == {}
        return f"echo {parameters}", 0.5, {}  # a string, as verl before 0.5 returned

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self.released.append(instance_id)
        if instance_id == "boom":
            raise OSError("the sandbox is gone")


def test_a_duck_typed_verl_tool_and_a_raising_release() -> None:
    duck = Duck()
    env = load_env(duck)()
    assert run_episode(env, {"prompt": "hi"}, [("echo", {"x": 1})]) == [
        ToolResult("echo {'x': 1}", 0.5)]
    assert duck.released == ["id-1"]

    async def boom(instance_id: str | None = None, **kwargs: Any) -> Any:
        return "boom", None

    duck.create = boom  # type: ignore[method-assign]
    env = load_env(duck)()
    with pytest.raises(EnvError) as info:
        run_episode(env, {"prompt": "hi"}, [("echo", {})])
    where = f"{__file__}:{line_of(Duck.release, 'def release')}"
    assert str(info.value) == (f"verl tool `Duck.release` ({where}) raised: OSError: the "
                               "sandbox is gone")


def test_verl_agent_data_says_what_it_lacks() -> None:
    data = VerlToolEnv([Duck()]).agent_data
    with pytest.raises(AttributeError, match=r"agent_data\.messages is not available"):
        _ = data.messages


def test_verl_tool_config_takes_no_env_params(agent_tools: Any) -> None:
    with pytest.raises(EnvError, match=r"env_params \['config'\] given to a verl tool "
                                       "config: each tool's `config` and `tool_schema` are "
                                       "in its YAML entry"):
        load_env(VERL / "agent_tools.yaml", params={"config": {}})()


@pytest.mark.parametrize(("config", "message"), [
    ({"tools": []}, "expected `tools:`, a list of {class_name, config, tool_schema}"),
    ({"tools": [{"class_name": "Counter"}]}, "tool 0: `class_name` must be `module.Class`"),
    ({"tools": [{"class_name": "agent_tools.Nope"}]},
     "tool 0: `agent_tools.Nope` cannot be imported: AttributeError"),
    ({"tools": [{"class_name": "agent_tools.Counter", "config": {"type": "mcp"}}]},
     "config.type is 'mcp'; verl 0.9.1 runs `native` tools only"),
])
def test_verl_tool_config_errors(agent_tools: Any, config: dict[str, Any],
                                 message: str) -> None:
    with pytest.raises(EnvError, match=message.replace("{", r"\{").replace("(", r"\(")):
        load_env(config, where="graph.yaml:7")()


# --- SkyRL-gym ---------------------------------------------------------------------------


class Countdown:
    """A SkyRL-gym BaseTextEnv, duck-typed: made per episode with the row as extras."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] = {}) -> None:  # noqa: B006
        self.config, self.extras, self.closed = env_config, extras, False

    def init(self, prompt: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        return [{"role": "system", "content": "Count down."}, *prompt], {}

    def step(self, action: str) -> dict[str, Any]:
        done = action.strip() == "0"
        observations = [] if done else [{"role": "user", "content": f"after {action}?"}]
        return {"observations": observations, "reward": 1.0 if done else -0.1, "done": done,
                "metadata": {}}

    def close(self) -> None:
        self.closed = True


def test_a_skyrl_env_steps_every_turn() -> None:
    env = load_env(Countdown)(max_turns=3, level=2)
    assert isinstance(env, SkyRLEnv)
    assert env.reset({"prompt": "From 2.", "reward_spec": {"ground_truth": "0"}}) == [
        {"role": "system", "content": "Count down."}, {"role": "user", "content": "From 2."}]
    assert env.env.config == {"level": 2}
    assert env.env.extras == {"reward_spec": {"ground_truth": "0"}, "max_turns": 3}
    assert env.step({"role": "assistant", "content": "1"}) == Step(
        messages=({"role": "user", "content": "after 1?"},), reward=-0.1, done=False)
    assert env.step({"role": "assistant", "content": "0"}) == Step(reward=1.0, done=True)
    env.close()
    assert env.env.closed


# --- anything else -----------------------------------------------------------------------


class Nothing:
    def run(self) -> None:
        pass


def test_anything_else_is_refused_naming_it_and_the_shapes() -> None:
    with pytest.raises(EnvError) as info:
        load_env(Nothing, where="graphs/agent.yaml:12")
    where = f"{__file__}:{line_of(Nothing, 'class Nothing')}"
    assert str(info.value) == (
        f"graphs/agent.yaml:12: env `Nothing` ({where}) is not an environment flowgraph "
        "runs; it takes " + "; ".join(SHAPES))
    def search(query: str) -> str:
        return query

    with pytest.raises(EnvError, match=r"env `.*search` .* is not an environment"):
        load_env(search)  # a tool, not an env: never called to find out
    with pytest.raises(EnvError, match=r"env `.*<lambda>` .* is not an environment"):
        load_env(lambda: 42)  # called (a TRL factory function may be), makes no env
    with pytest.raises(EnvError, match="env `no_such_module:Env` cannot be loaded: "
                                       "ModuleNotFoundError"):
        load_env("no_such_module:Env")
    with pytest.raises(EnvError, match=r"a mapping of environment factories \(guess, judge\) "
                                       "is TRL's multi-environment form"):
        load_env({"guess": Guess, "judge": Guess})


# --- the README --------------------------------------------------------------------------


def readme_block(starts: str) -> str:
    """The README's fenced block whose first line is `starts`."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    found = re.search(r"```\w*\n(" + re.escape(starts) + r".*?)```", readme, re.DOTALL)
    assert found, f"the README has no block starting {starts!r}"
    return found.group(1)


def test_the_readme_trl_env_runs_unchanged() -> None:
    namespace: dict[str, Any] = {}
    source = readme_block("# guess.py, next to the graph: the class you give GRPOTrainer")
    exec(compile(source, "guess.py", "exec"), namespace)
    env = load_env(namespace["Guess"])()
    row = {"prompt": [{"role": "user", "content": "Guess."}], "answer": 4}
    assert env.reset(row) == [{"role": "user", "content": "Guess. (1 to 10)"}]
    (guess,) = env.tools
    assert [guess.fn(n=11), guess.fn(n=4)] == ["{'error': 'out of range'}", "right"]
    assert env.reward(Episode(task=row)) == 1.0


def test_the_readme_verl_config_is_read_as_verl_writes_it() -> None:
    config = yaml.safe_load(readme_block("# tools.yaml, verl's format as it is"))
    with pytest.raises(EnvError, match=r"`my_tools\.Gsm8kTool` cannot be imported: "
                                       "ModuleNotFoundError"):
        load_env(config)
