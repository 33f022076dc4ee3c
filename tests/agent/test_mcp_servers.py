"""Tools from MCP servers (`flowgraph.agent.mcp_servers`), each test starting real stdio
servers as subprocesses: graphs/calc_mcp.py (the example's calculator) and
tests/plugins/mcp_server.py (tools that answer, raise, sleep, flood, exit mid-call). Their
tools go through the episodes' own machinery (a scripted policy, as in test_episodes.py):
the argument check, `tool_timeout_s`, the statuses, `max_tool_tokens`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from flowgraph.agent import Env, Episode
from flowgraph.agent.episodes import AgentLoop, Episodes, Limits
from flowgraph.agent.mcp_servers import McpServer, declared, probe, resolved, server_tools
from flowgraph.agent.parsers import get_parser
from flowgraph.agent.render import ChatRenderer
from flowgraph.checker.agents import offered_schemas
from flowgraph.errors import McpServerError
from flowgraph.frontend import graph_from_yaml
from flowgraph.nodes.models import load_tokenizer
from flowgraph.registry import Registry
from flowgraph.source import SourcePos

ROOT = Path(__file__).resolve().parents[2]
FAULTY = str(ROOT / "tests" / "plugins" / "mcp_server.py")


def faulty(tag: str, **more: object) -> McpServer:
    """The faulty server; `tag` makes it a declaration (a server) of its own."""
    (server,) = declared({"faulty": {"command": ["python", FAULTY], "cwd": str(ROOT),
                                     "env": {"TAG": tag}, **more}}, "test")
    return server


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny-lm")


@pytest.fixture(scope="module")
def shared():
    """One faulty server for the tests that leave it serving (a start takes ~1-2 s)."""
    return faulty("shared")


# --- declarations ----------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "message"), [
    (["calc"], r"node `a`: `mcp_servers` is \['calc'\]; give a mapping of server names"),
    ({"calc": "python calc.py"}, r"MCP server `calc` is 'python calc.py'; declare it as a "
                                 r"mapping with a `command`"),
    ({"calc": {"comand": ["python"]}}, r"MCP server `calc` has no setting `comand`; did you "
                                       r"mean `command`\?"),
    ({"calc": {"env": {}}}, r"MCP server `calc` has no `command`"),
    ({"calc": {"command": []}}, r"MCP server `calc`: `command` is \[\]; give the program"),
    ({"calc": {"command": ["x"], "env": ["A=1"]}}, r"`env` is \['A=1'\]; give a mapping"),
    ({"calc": {"command": ["x"], "check": "no"}}, r"`check` is 'no' and `cwd` '\.'; `check` "
                                                  r"is true or false"),
    ({"calc": {"command": ["x"], "start_timeout_s": 0}}, r"start_timeout_s=0 is not a "
                                                         r"positive, finite number"),
    ({"my calc": {"command": ["x"]}}, r"MCP server 'my calc': a server's name is 1 to 64"),
])
def test_a_declaration_that_is_not_one_names_the_node_and_the_server(value, message):
    with pytest.raises(McpServerError, match=message) as caught:
        declared(value, "node `a`")
    assert str(caught.value).startswith("node `a`: ")


def test_a_servers_folder_is_the_graph_files_unless_it_says_one(tmp_path):
    graph = tmp_path / "g.yaml"
    graph.write_text("")
    at = SourcePos(str(graph), 3, 5)
    value = {"a": {"command": ["python", "s.py"]}, "b": {"command": ["s"], "cwd": "srv"},
             "c": {"command": ["s"], "cwd": "/opt/srv"}}
    got = resolved(value, at)
    assert [s["cwd"] for s in got.values()] == [str(tmp_path), str(tmp_path / "srv"),
                                               "/opt/srv"]
    assert [s.cwd for s in declared(got, "n")] == [str(tmp_path), str(tmp_path / "srv"),
                                                  "/opt/srv"]
    assert resolved("not a mapping", at) == "not a mapping"  # the checker says what is wrong


# --- the calculator example's server ---------------------------------------------------------


def test_the_calculator_servers_tool_is_its_list_tools_entry_and_call_tool_answers():
    (calc,) = declared(resolved({"calc": {"command": ["python", "calc_mcp.py"]}},
                                SourcePos(str(ROOT / "graphs" / "agent_mcp.yaml"), 1, 1)),
                       "node `agent`")
    (tool,) = server_tools([calc], "node `agent`")
    assert tool.name == "calculator" and tool.is_async and tool.timeout_s is None
    params = tool.schema()["function"]["parameters"]
    assert params["type"] == "object" and params["required"] == ["expression"]
    assert params["properties"]["expression"]["type"] == "string"
    assert AgentLoop.run(tool.fn(expression="37*86")) == "3182"
    assert AgentLoop.run(tool.fn(expression="2**5")) == "error: only whole numbers and " \
                                                          "+ - * // % are allowed"
    assert tool.check_arguments({"expression": 3}) is not None  # checked before a call


def test_the_show_tools_probe_and_the_timeout_check_see_a_servers_tools():
    text = (ROOT / "graphs" / "agent_mcp.yaml").read_text()
    graph = graph_from_yaml(text, file=str(ROOT / "graphs" / "agent_mcp.yaml"))
    (node,) = [n for n in graph.nodes if n.name == "agent"]
    kind = Registry.default().get(node.kind)
    assert kind is not None
    names = [s["function"]["name"] for s in offered_schemas(graph, node, kind)]
    assert names == ["calculator"]


# --- calls through the episodes' machinery --------------------------------------------------


class Play(Env):
    def reset(self, task):
        return task["prompt"]

    def reward(self, episode: Episode) -> float:
        return 1.0


def call(name: str, **arguments: object) -> str:
    import json

    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def play(tok, tools, script: Sequence[str], **limits: float):
    base = dict(max_turns=3, budget=200, turn_tokens=96, tool_tokens=16, tool_timeout_s=5.0,
                turn_timeout_s=10.0, episode_timeout_s=30.0)
    renderer = ChatRenderer(tok, tools=[t.schema() for t in tools],
                            stop_ids=[tok.eos_token_id], show_tools="none")
    episodes = Episodes(Play, tools, renderer, get_parser("hermes"),
                        Limits(**{**base, **limits}))  # type: ignore[arg-type]
    episodes.reset([{"prompt": "go"}])
    turn = 0
    while asks := episodes.requests():
        episodes.advance({i: (ids := [*tok(script[turn], add_special_tokens=False).input_ids,
                                      tok.eos_token_id][:room], [-0.5] * len(ids), True)
                          for i, _, room in asks})
        turn += 1
    (run,) = episodes.finish()
    return run


def test_a_call_answers_as_a_tool_message_cut_to_max_tool_tokens(tok, shared):
    tools = server_tools([shared], "node `a`")
    run = play(tok, tools, [call("echo", text="hi"), call("flood", n=5000), "done"])
    assert run.episode.status == "completed" and run.episode.tool_calls == 2
    said = [m["content"] for m in run.episode.messages if m["role"] == "tool"]
    assert said[0] == "echo: hi"
    assert "chars cut)" in said[1] and len(tok(said[1]).input_ids) <= 16
    # a call with arguments the listed schema refuses never reaches the server
    run = play(tok, tools, [call("echo", txt="hi"), "done"], tool_tokens=256, budget=600)
    assert run.episode.status == "completed"
    assert run.episode.messages[2]["content"].startswith("error: `echo` is missing the "
                                                         "argument `text`")


def test_a_call_past_tool_timeout_s_ends_the_episode_as_timeout_and_the_server_serves_on(
        tok, shared):
    tools = server_tools([shared], "node `a`")
    t0 = time.perf_counter()
    run = play(tok, tools, [call("slow", seconds=3), "done"], tool_timeout_s=0.5)
    assert time.perf_counter() - t0 < 2.5
    assert run.episode.status == "timeout"
    assert "tool `slow` ran past its timeout of 0.5 s" in run.episode.error
    assert play(tok, tools, [call("echo", text="again"), "done"]).episode.status == "completed"


def test_an_error_result_ends_the_episode_as_a_raising_python_tool_does(tok, shared):
    tools = server_tools([shared], "node `a`")
    run = play(tok, tools, [call("boom", x=1), "done"])
    assert run.episode.status == "error"
    assert "MCP server `faulty`: tool `boom` answered with an error" in run.episode.error


def test_a_server_that_dies_mid_call_ends_the_episode_and_starts_again_at_the_next_rollout(
        tok, capfd):
    server = faulty("dies")
    tools = server_tools([server], "node `a`")
    first = AgentLoop.run(tools[-1].fn())  # pid
    run = play(tok, tools, [call("die"), "done"])
    assert run.episode.status == "error"
    assert "exited during a call of `die`" in run.episode.error
    assert "faulty: exiting on purpose" in run.episode.error  # its stderr
    again = server_tools([server], "node `a`")  # the next rollout call
    assert "exited (its stderr: faulty: exiting on purpose" in capfd.readouterr().err
    assert AgentLoop.run(again[-1].fn()) != first
    assert play(tok, again, [call("echo", text="back"), "done"]).episode.status == "completed"


def test_a_server_starts_once_per_process(shared):
    pid = AgentLoop.run(server_tools([shared], "n")[-1].fn())
    assert AgentLoop.run(server_tools([shared], "n")[-1].fn()) == pid


def test_two_tools_of_one_name_are_refused_naming_both(shared):
    tools = server_tools([shared], "n")
    with pytest.raises(McpServerError, match=r"node `a`: MCP server `faulty` offers a tool "
                                             r"named `echo`, as `tools` does"):
        server_tools([shared], "node `a`", beside=tools[:1])


# --- servers that do not start ---------------------------------------------------------------


def test_a_server_that_exits_at_start_names_itself_and_its_stderr():
    (server,) = declared({"search": {"command": ["python", "-c",
                                                 "import sys; sys.exit('no index at ./idx')"]}},
                         "n")
    with pytest.raises(McpServerError, match=r"node `agent`: MCP server `search` \(`python -c "
                                             r".*it exited before it answered `initialize`; "
                                             r"its stderr: no index at \./idx"):
        server_tools([server], "node `agent`")
    with pytest.raises(McpServerError, match=r"no index at \./idx"):
        probe(server)  # check's look: the same message (FG610)


def test_a_program_that_is_not_there_is_said_so():
    (server,) = declared({"s": {"command": ["no-such-mcp-server"]}}, "n")
    with pytest.raises(McpServerError, match=r"cannot run 'no-such-mcp-server': No such file"):
        server_tools([server], "n")


def test_a_server_that_never_answers_is_stopped_at_start_timeout_s():
    server = faulty("mute", command=["python", "-c", "import time; time.sleep(60)"],
                    start_timeout_s=1)
    t0 = time.perf_counter()
    with pytest.raises(McpServerError, match=r"did not answer `initialize` and `list_tools` "
                                             r"within start_timeout_s = 1 s"):
        server_tools([server], "n")
    assert time.perf_counter() - t0 < 8  # the client's shutdown: stdin, 2 s, SIGTERM


# --- no orphans ------------------------------------------------------------------------------

SCRIPT = f"""
import sys, time
from flowgraph.agent.episodes import AgentLoop
from flowgraph.agent.mcp_servers import declared, server_tools
(server,) = declared({{"faulty": {{"command": ["python", {FAULTY!r}]}}}}, "n")
tools = server_tools([server], "n")
print(AgentLoop.run(tools[-1].fn()), flush=True)
if sys.argv[1] == "wait":  # killed in a call the server is busy with
    AgentLoop.submit(tools[2].fn(seconds=60))
    time.sleep(60)
"""


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how", ["exit", "kill -9"])
def test_the_server_ends_with_its_process(how):
    """At a normal exit the servers are stopped (stdin closed, group killed); a process
    killed with SIGKILL takes them along (PR_SET_PDEATHSIG)."""
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, "wait" if how != "exit" else "exit"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        pid = int(proc.stdout.readline())
        assert not _gone(pid, 0.2)
        if how == "kill -9":
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert _gone(pid, 10), f"the MCP server {pid} outlived its trainer ({how})"
    finally:
        proc.kill()
        proc.wait()
