"""Black-box agents through the OpenAI-compatible endpoint (`flowgraph.agent.sessions`):
a real `openai.AsyncOpenAI` client loop gives the rows the equivalent native env gives,
re-sent turns are matched (never re-tokenized), rewritten histories fork, and the
endpoint refuses what the graph decides and sessions it does not hold."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from flowgraph.agent.episodes import AgentError
from flowgraph.agent.parsers import PARSERS, ToolCall
from flowgraph.agent.render import TemplateError
from flowgraph.agent.server import Server
from flowgraph.agent.tools import as_tool
from flowgraph.errors import FlowgraphError
from flowgraph.nodes.agent import agent_rollout
from flowgraph.nodes.models import load_model, load_tokenizer
from flowgraph.runtime.context import NodeContext


def lookup(query: str) -> str:
    """Look a query up.

    Args:
        query: what to look up
    """
    return f"{len(query)} chars"


class SomeTurnsCall:
    """The tiny model writes no tool call: a turn whose text is not a multiple of 3
    characters long is read as one call of `lookup` (its text the query)."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if len(text) % 3 == 0:
            return text.strip(), []
        return "", [ToolCall("lookup", {"query": text}, "call_0")]


@pytest.fixture(scope="module", autouse=True)
def some_turns_call():
    with pytest.MonkeyPatch.context() as patch:  # registered for this module's tests only
        patch.setitem(PARSERS, "test_some_turns_call", SomeTurnsCall())
        yield
SCHEMA = as_tool(lookup).schema()
ROWS = [{"prompt": "reverse 123"}, {"prompt": "reverse 4567"}, {"prompt": "reverse 89"}]


async def program(task, client):
    """An agent as users write them: the official client, its messages re-sent as the
    client's objects serialise them, tool results appended."""
    messages = [{"role": "user", "content": task["prompt"]}]
    calls = 0
    while True:
        r = await client.chat.completions.create(model="policy", messages=messages,
                                                 tools=[SCHEMA])
        message = r.choices[0].message
        if not message.tool_calls:
            return {"score": 0.25 * calls, "finish": r.choices[0].finish_reason}
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            calls += 1
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": lookup(**json.loads(call.function.arguments))})


@pytest.fixture(scope="module", params=["builtin:tiny-lm", "builtin:tiny-tied"])
def model_and_tok(request):
    return load_model(request.param), load_tokenizer(request.param)


def run(model, tok, rows=ROWS, **params):
    ctx = NodeContext("agent", "agent_rollout", step=3, seed=7, strict=True,
                      dims={"P": 48, "T": 40, "N": 2})
    kw = {"max_turns": 4, "max_turn_tokens": 6, "n": 2, "parser": "test_some_turns_call",
          "max_tool_tokens": 8, "show_tools": "none"} | params  # the tiny template lists none
    return agent_rollout(ctx, model, tok, row=rows, **kw), ctx


ROW_PORTS = ("prompts", "prompt_mask", "responses", "response_mask", "rollout_log_prob",
             "num_turns", "tool_calls", "turn_mask", "index")


def test_endpoint_rows_equal_the_native_env_rows(model_and_tok, monkeypatch):
    model, tok = model_and_tok
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):  # a cluster's, for its web
        monkeypatch.setenv(proxy, "http://127.0.0.1:9")      # traffic: not the endpoint's
    native, _ = run(model, tok, tools=[lookup])
    black, ctx = run(model, tok, agent=program)
    for port in ROW_PORTS:
        assert torch.equal(native[port], black[port]), port
    assert native["status"] == black["status"]
    assert native["messages"] == black["messages"]
    assert black["tool_calls"].sum() > 0 and (black["num_turns"] > 1).any()
    holes = black["response_mask"].sum() < (black["responses"] != 0).sum()
    assert holes  # tool results between the turns, never trained
    assert black["scores"].tolist() == pytest.approx((0.25 * black["tool_calls"]).tolist())
    assert ctx.metrics["agent/forks"] == 0.0
    assert {i["finish"] for i in black["reward_extra_info"]} <= {"stop", "length"}


def test_a_template_that_leaves_the_programs_tools_out_stops_the_rollout(model_and_tok):
    """The program's `tools=` reach the prompt as `show_tools` says: the tiny template
    renders none, so with `show_tools: template` the rollout stops naming them, whatever
    `on_error` says (the session's request is answered 500 meanwhile)."""
    model, tok = model_and_tok
    with pytest.raises(TemplateError, match="leaves out lookup"):
        run(model, tok, agent=program, show_tools="template")


async def rewriting(task, client):
    """Rewrites its own history after the first call: the endpoint must fork, not splice."""
    messages = [{"role": "user", "content": task["prompt"]}]
    r = await client.chat.completions.create(model="m", messages=messages, tools=[SCHEMA])
    messages.append({"role": "assistant", "content": "I did it differently."})
    messages.append({"role": "user", "content": "go on"})
    await client.chat.completions.create(model="m", messages=messages, tools=[SCHEMA])
    return 1.0 if r.choices else 0.0


def test_a_rewritten_history_forks_the_row(model_and_tok):
    model, tok = model_and_tok
    out, ctx = run(model, tok, rows=ROWS[:1], agent=rewriting, max_turns=4)
    assert ctx.metrics["agent/forks"] == 1.0
    assert [i["forks"] for i in out["reward_extra_info"]] == [1, 1]
    # the row is the second chain only: its prompt holds the rewritten history, and
    # only the second turn's tokens are trained
    prompt = tok.decode(out["prompts"][0][out["prompt_mask"][0].bool()])
    assert "I did it differently." in prompt
    assert out["num_turns"].tolist() == [2, 2]
    assert int(out["turn_mask"][0].sum()) == 1


async def forking(task, client):
    """A sub-agent's way: after each completion it starts a history of its own (the
    answer so far summed up), `task["forks"]` times; then it answers from the last."""
    messages = [{"role": "user", "content": task["prompt"]}]
    for k in range(task.get("forks", 1) + 1):
        r = await client.chat.completions.create(model="m", messages=messages)
        messages = [{"role": "system", "content": task.get("system", "")},
                    {"role": "user", "content": f"part {k + 1}: {task['prompt']}"}]
    return 1.0 if r.choices else 0.0


def _row_ids(out, k):
    """Row k as a trainer sees it: the prompt's tokens, then the response's up to its
    last trained one."""
    prompt = out["prompts"][k][out["prompt_mask"][k].bool()].tolist()
    mask = out["response_mask"][k]
    last = int(mask.nonzero().max()) + 1 if mask.any() else 0
    return prompt + out["responses"][k][:last].tolist()


def test_each_fork_trains_as_a_row_of_its_episode(model_and_tok):
    model, tok = model_and_tok
    out, ctx = run(model, tok, rows=ROWS[:1], agent=rewriting, max_turns=4,
                   rows_per_episode=2)
    # 2 episodes x 2 rows, an episode's rows one after the other
    assert out["episode"].tolist() == [0, 0, 1, 1]  # row 0 x n 2 + sample
    assert out["responses"].shape[0] == 4 and out["index"].tolist() == [0, 0, 0, 0]
    for e in (0, 2):
        first, fork = out["response_mask"][e], out["response_mask"][e + 1]
        assert first.any() and fork.any()  # the chain before the fork is trained too
        assert "I did it differently." not in tok.decode(_row_ids(out, e))
        assert "I did it differently." in tok.decode(_row_ids(out, e + 1))
        assert out["turn_mask"][e].sum() == 1 and out["turn_mask"][e + 1].sum() == 1
        # the episode's score on each of its rows, its reward once, on its last row
        assert out["scores"][e] == out["scores"][e + 1] == 1.0
        assert out["token_level_rewards"][e].sum() == 0.0
        assert out["token_level_rewards"][e + 1].sum() == 1.0
        assert out["status"][e] == out["status"][e + 1]
    assert ctx.metrics["agent/forks"] == 1.0 and ctx.metrics["agent/rows"] == 2.0
    assert ctx.metrics["agent/forks_dropped"] == 0.0
    assert [i["rows"] for i in out["reward_extra_info"]] == [2, 2, 2, 2]


def test_forks_past_the_last_row_are_counted_and_unused_rows_train_nothing(model_and_tok):
    model, tok = model_and_tok
    rows = [{"prompt": "reverse 12", "forks": 3}, {"prompt": "reverse 34", "forks": 0}]
    out, ctx = run(model, tok, rows=rows, agent=forking, n=1, max_turns=4,
                   rows_per_episode=2)
    # episode 0 forked 3 times into 2 rows: its first chain, then its last (the two
    # between were not trained); episode 1 never forked: its second row is unused
    assert out["episode"].tolist() == [0, 0, 1, -1]
    assert "part 3" in tok.decode(_row_ids(out, 1)) and "part" not in tok.decode(
        _row_ids(out, 0))
    assert out["response_mask"][3].sum() == 0 and out["response_mask"][2].any()
    assert out["num_turns"].tolist() == [4, 4, 1, 1]
    assert ctx.metrics["agent/forks"] == 1.5 and ctx.metrics["agent/forks_dropped"] == 1.0
    assert ctx.metrics["agent/rows"] == 1.5


def test_a_fork_longer_than_P_starts_its_row_with_a_hole(model_and_tok):
    """A fork's history over P tokens: P of them are the row's prompt, the rest its
    response's first tokens, never trained; its turn is trained and checked."""
    model, tok = model_and_tok
    rows = [{"prompt": "reverse 12", "forks": 1, "system": "x " * 30}]
    out, _ = run(model, tok, rows=rows, agent=forking, n=1, rows_per_episode=2)
    fork = out["response_mask"][1]
    start = int(fork.nonzero().min())
    assert start > 0 and out["prompt_mask"][1].sum() == 48  # P, whole
    assert (out["responses"][1][:start] != 0).all()  # the rest of the history: a hole
    assert out["status"] == ["completed", "completed"]


def test_rows_per_episode_is_the_black_box_agents(model_and_tok):
    model, tok = model_and_tok
    with pytest.raises(FlowgraphError, match="rows_per_episode 2 holds a black-box agent"):
        run(model, tok, rows=ROWS[:1], tools=[lookup], rows_per_episode=2)


async def hot(task, client):
    await client.chat.completions.create(model="m", temperature=0.7,
                                         messages=[{"role": "user", "content": "hi"}])
    return 1.0


def test_a_client_temperature_is_refused_at_the_programs_line(model_and_tok):
    model, tok = model_and_tok
    with pytest.raises(AgentError) as caught:
        run(model, tok, rows=ROWS[:2], agent=hot, n=1)
    error = str(caught.value)
    assert "every episode of step 3 ended `timeout` or `error`" in error
    assert "`temperature`: 0.7 differs from the graph's 1.0" in error
    assert "test_endpoint.py:" in error and "in hot" in error


async def texting(task, client):
    """The completions API, the prompt grown as text by the program."""
    prompt = task["prompt"]
    r = await client.completions.create(model="m", prompt=prompt, logprobs=0)
    prompt += r.choices[0].text + "\nmore:"
    r2 = await client.completions.create(model="m", prompt=prompt)
    assert r.choices[0].logprobs.token_logprobs  # the sampled tokens' log-probs
    return float(len(r2.choices[0].text) >= 0)


def test_the_completions_api_extends_its_text(model_and_tok):
    model, tok = model_and_tok
    out, ctx = run(model, tok, rows=ROWS[:1], agent=texting, n=1)
    assert out["status"] == ["completed"] and out["num_turns"].tolist() == [2]
    more = tok("\nmore:", add_special_tokens=False).input_ids
    row = out["responses"][0][: int(out["response_mask"][0].nonzero().max()) + 1].tolist()
    assert any(row[i:i + len(more)] == more for i in range(len(row)))
    assert ctx.metrics["agent/forks"] == 0.0


URLS: list[str] = []


async def remembering(task, client):
    URLS.append(str(client.base_url))
    models = await client.models.list()
    await client.chat.completions.create(model=models.data[0].id,
                                         messages=[{"role": "user", "content": "hi"}])
    return 1.0


def test_a_closed_session_is_refused_and_urls_are_loopback_and_unguessable(model_and_tok):
    model, tok = model_and_tok
    URLS.clear()
    out, _ = run(model, tok, rows=ROWS[:2], agent=remembering, n=1)
    assert out["status"] == ["completed", "completed"]
    assert len(set(URLS)) == 2
    for url in URLS:
        assert url.startswith("http://127.0.0.1:")
        assert len(url.split("/s/")[1].split("/")[0]) >= 43  # 32 random bytes, base64
        r = httpx.post(url.rstrip("/") + "/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and "unknown or closed session" in r.text


def test_an_unknown_session_is_refused():
    server = Server.get()
    r = httpx.post(server.url("not-a-session") + "/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and "unknown or closed session" in r.text
    assert httpx.get(server.url("nope") + "/models").status_code == 404


def test_programs_past_the_concurrency_start_later_with_the_same_rows(model_and_tok):
    """concurrency 2 of 6 episodes: the others wait for a slot (no batch waits for them)
    and take their turns later, each turn drawn from its own seed: the same rows."""
    model, tok = model_and_tok
    all_at_once, _ = run(model, tok, agent=program)
    two_at_a_time, _ = run(model, tok, agent=program, concurrency=2)
    for port in ROW_PORTS:
        if port != "rollout_log_prob":
            assert torch.equal(all_at_once[port], two_at_a_time[port]), port
    # other batches, other float sums: the same log-probs to rounding
    assert torch.allclose(all_at_once["rollout_log_prob"], two_at_a_time["rollout_log_prob"],
                          atol=1e-5)
    assert all_at_once["status"] == two_at_a_time["status"]


ANSWERS: list[object] = []


async def branching(task, client):
    """Two branches at once on one session (LangGraph's parallel branches); the second
    row's program is a plain loop."""
    import asyncio

    if task["prompt"] != ROWS[0]["prompt"]:
        return await program(task, client)
    ask = [{"role": "user", "content": task["prompt"]}]
    ANSWERS.extend(await asyncio.gather(
        client.chat.completions.create(model="m", messages=ask),
        client.chat.completions.create(model="m", messages=ask), return_exceptions=True))
    return 1.0


def test_two_completions_at_once_on_a_session_are_refused_at_once(model_and_tok):
    # they hung until turn_timeout_s, reported as "the agent program worked past" it
    import openai

    model, tok = model_and_tok
    ANSWERS.clear()
    out, _ = run(model, tok, rows=ROWS[:2], agent=branching, n=1, turn_timeout_s=8.0)
    refused = [a for a in ANSWERS if isinstance(a, openai.APIStatusError)]
    assert len(ANSWERS) == 2 and len(refused) == 1 and refused[0].status_code == 409
    assert "concurrent completions on one session are not supported yet" in str(refused[0])
    assert out["status"][0] == "error" and out["status"][1] != "error"
    error = out["reward_extra_info"][0]["error"]
    assert "concurrent completions on one session are not supported yet" in error
    assert not out["response_mask"][0].any()  # on_error mask: nothing trained


class EveryTurnAnOpenCall:
    """Reads every turn as a tool call left open, as hermes reads one cut by its limit."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return "", [ToolCall("", {}, "call_0", "this tool call is not closed")]


async def short(task, client):
    """An agent whose own max_tokens cuts every turn."""
    r = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": task["prompt"]}], max_tokens=2,
        tools=[SCHEMA])
    return {"score": 0.0, "finish": r.choices[0].finish_reason}


def test_turns_cut_inside_a_tool_call_are_counted_and_said_once(model_and_tok, monkeypatch,
                                                                capsys):
    # an agent whose every call was cut by its own max_tokens trained on nothing, silently
    import flowgraph.nodes.agent as agent_node

    monkeypatch.setitem(PARSERS, "test_open_call", EveryTurnAnOpenCall())
    monkeypatch.setattr(agent_node, "_SAID", set())
    model, tok = model_and_tok
    out, ctx = run(model, tok, agent=short, parser="test_open_call")
    assert {i["finish"] for i in out["reward_extra_info"]} == {"length"}
    assert ctx.metrics["agent/finish/length"] == 1.0  # one cut turn per episode
    said = capsys.readouterr().err
    assert "6 of 6 turns were cut inside a tool call by their token limit" in said
    run(model, tok, agent=short, parser="test_open_call")
    assert "cut inside a tool call" not in capsys.readouterr().err  # said once


def test_a_missing_endpoint_package_names_the_extra(model_and_tok, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvicorn" else real(name, *a))
    model, tok = model_and_tok
    with pytest.raises(FlowgraphError, match=r"uvicorn not installed; pip install "
                                             r"'flowgraph\[agents\]'"):
        run(model, tok, rows=ROWS[:1], agent=program, n=1)
