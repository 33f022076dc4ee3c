"""Episodes between sampled turns (`flowgraph.agent.episodes`), driven by a scripted
policy: each turn's "sampled" ids are the tokens of a given text and the EOS, so every
rule is checked on known ids — tool calls, the env's replies, deltas as holes, budgets,
timeouts and statuses, on_error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest

from flowgraph.agent import Env, Episode, Step
from flowgraph.agent.episodes import CHARS_PER_TOKEN, AgentError, Episodes, Limits, cut_message
from flowgraph.agent.parsers import get_parser
from flowgraph.agent.render import ChatRenderer, TemplateError, tools_system_message
from flowgraph.agent.tools import tool
from flowgraph.nodes.models import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny-lm")


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "slept"


def broken(x: int) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("the tool broke")


CALL = '<tool_call>{"name": "mul", "arguments": {"a": 6, "b": 7}}</tool_call>'


class Answer(Env):
    """One question; the right answer (the ground truth) ends it with reward 1."""

    def reset(self, task):
        return task["prompt"]

    def step(self, message):
        right = message["content"].strip() == self.truth
        return Step(["try again"], reward=-0.1, done=right) if not right else Step(done=True)

    def reward(self, episode: Episode) -> float:
        return 1.0 if episode.messages[-1]["content"].strip() == self.truth else 0.0

    truth = "42"


def limits(**over) -> Limits:
    base = dict(max_turns=4, budget=96, turn_tokens=64, tool_tokens=16, tool_timeout_s=5.0,
                turn_timeout_s=10.0, episode_timeout_s=30.0)
    return Limits(**{**base, **over})


def make(tok, env=Answer, tools=(mul,), **over) -> Episodes:
    """Episodes over the tiny template, which lists no tools (`show_tools: none`)."""
    tools = [tool(t) for t in tools]
    renderer = ChatRenderer(tok, tools=[t.schema() for t in tools], stop_ids=[tok.eos_token_id],
                            show_tools="none")
    return Episodes(env, tools, renderer, get_parser("hermes"), limits(**over))


def play(episodes: Episodes, tok, script: Sequence[Sequence[str]], n: int = 1):
    """Run `n` episodes; turn k of episode i samples `script[i][k]` (and EOS)."""
    first = episodes.reset([{"prompt": "What is 6*7?"}] * n)
    turn = 0
    while asks := episodes.requests():
        episodes.advance({i: (ids := [*tok(script[i][turn], add_special_tokens=False).input_ids,
                                      tok.eos_token_id][:room], [-0.5] * len(ids),
                              ids[-1] == tok.eos_token_id)
                          for i, _, room in asks})
        turn += 1
    return first, episodes.finish()


def test_a_tool_call_then_the_answer_is_two_turns_with_the_tool_result_as_a_hole(tok):
    first, (run,) = play(make(tok), tok, [[CALL, "42"]])
    assert run.episode.status == "completed"
    assert run.episode.turns == 2 and run.episode.tool_calls == 1
    assert run.score == 1.0 and run.episode.turn_rewards == [0.0, 0.0]
    assert [m["role"] for m in run.episode.messages] == ["user", "assistant", "tool", "assistant"]
    assert run.episode.messages[2]["content"] == "42"
    # token in, token out: the response is turn 1's ids, the delta, turn 2's ids
    turn1 = [*tok(CALL, add_special_tokens=False).input_ids, tok.eos_token_id]
    delta = tok("<|tool|>42<|assistant|>", add_special_tokens=False).input_ids
    turn2 = [*tok("42", add_special_tokens=False).input_ids, tok.eos_token_id]
    assert run.ids == turn1 + delta + turn2
    assert run.sampled == [1] * len(turn1) + [0] * len(delta) + [1] * len(turn2)
    assert run.log_probs == [-0.5] * len(turn1) + [0.0] * len(delta) + [-0.5] * len(turn2)
    assert run.ends == [len(turn1) - 1, len(run.ids) - 1]
    # the rendered conversation is the ids: the template's text of the whole episode
    text = tok.apply_chat_template(run.episode.messages[:1], add_generation_prompt=True,
                                   tokenize=False)
    assert tok.decode(first[0] + run.ids) == text + CALL + "<|eos|><|tool|>42<|assistant|>42<|eos|>"


def test_the_env_replies_with_a_turn_reward_until_the_answer_is_right(tok):
    _, (run,) = play(make(tok), tok, [["41", "43", "42"]])
    assert run.episode.status == "completed" and run.episode.turns == 3
    assert run.episode.turn_rewards == [-0.1, -0.1, 0.0]
    assert [m["content"] for m in run.episode.messages if m["role"] == "user"][1:] == \
        ["try again", "try again"]


def test_max_turns_ends_an_episode_that_never_finishes(tok):
    _, (run,) = play(make(tok, max_turns=2), tok, [["1", "2"]])
    assert run.episode.status == "max_turns" and run.episode.turns == 2
    assert run.score == 0.0


def test_context_exhausted_when_the_next_turn_would_not_fit(tok):
    # turn 1 leaves too little room for the tool message and a sampled token
    ids = len(tok(CALL, add_special_tokens=False).input_ids) + 1
    _, (run,) = play(make(tok, budget=ids + 3), tok, [[CALL]])
    assert run.episode.status == "context_exhausted" and run.episode.turns == 1
    assert len(run.ids) == ids  # the delta that did not fit is not there


def test_a_turn_cut_by_its_budget_gets_the_whole_closing_as_a_hole(tok):
    _, (run,) = play(make(tok, turn_tokens=3), tok, [["1234567", "42"]])
    cut = tok("1234567", add_special_tokens=False).input_ids[:3]
    delta = tok("<|eos|><|user|>try again<|assistant|>", add_special_tokens=False).input_ids
    assert run.ids[: len(cut) + len(delta)] == cut + delta
    assert run.sampled[: len(cut) + len(delta)] == [1] * len(cut) + [0] * len(delta)


def test_malformed_and_unknown_calls_are_told_to_the_model(tok):
    bad = "<tool_call>{not json</tool_call>"
    unknown = '<tool_call>{"name": "div", "arguments": {}}</tool_call>'
    _, (run,) = play(make(tok, tool_tokens=64, budget=400), tok, [[bad, unknown, "42"]])
    tool_msgs = [m["content"] for m in run.episode.messages if m["role"] == "tool"]
    assert run.episode.status == "completed"
    assert "not valid JSON" in tool_msgs[0]
    assert "no tool `div`" in tool_msgs[1] and "mul" in tool_msgs[1]


def test_a_long_tool_result_is_cut_to_its_token_budget(tok):
    def echo(text: str) -> str:
        """Echo.

        Args:
            text: What to say.
        """
        return "9" * 50

    call = '<tool_call>{"name": "echo", "arguments": {"text": "x"}}</tool_call>'
    # 24 tokens in all, the marker's 13 among them (`...(`, two digits, ` chars cut)`)
    _, (run,) = play(make(tok, tools=(echo,), tool_tokens=24, budget=300,
                          truncate_side="right"), tok, [[call, "42"]])
    assert run.episode.messages[2]["content"] == "9" * 11 + "...(39 chars cut)"
    _, (run,) = play(make(tok, tools=(echo,), tool_tokens=24, budget=300), tok,
                     [[call, "42"]])
    assert run.episode.messages[2]["content"] == "9" * 5 + "...(39 chars cut)" + "9" * 6


@pytest.mark.parametrize("side", ["left", "middle", "right"])
@pytest.mark.parametrize("limit", [1, 6, 12, 20, 40])
def test_max_tool_tokens_is_a_hard_cap_the_marker_included(tok, side, limit):
    # a limit of 6 gave 14 tokens of marker alone; a limit the marker's 13-14 tokens do
    # not fit in cuts the content without one (and never shows half a character)
    for content in ("9" * 50, "the number is 12345 and more " * 9, "é" * 80, "日本語" * 30):
        cut = cut_message({"role": "tool", "content": content}, tok,
                          limits(tool_tokens=limit, truncate_side=side))["content"]
        assert len(tok(cut, add_special_tokens=False).input_ids) <= limit, (content, cut)
        assert ("chars cut)" in cut) == (limit >= 20) and "\ufffd" not in cut


class Counting:
    """The tiny tokenizer, counting the characters it is asked to tokenize."""

    def __init__(self, tok):
        self.tok, self.chars = tok, 0

    def __call__(self, text, **kw):
        self.chars += sum(map(len, text)) if isinstance(text, list) else len(text)
        return self.tok(text, **kw)

    def decode(self, ids):
        return self.tok.decode(ids)


def test_a_flood_is_cut_by_characters_before_it_is_tokenized(tok):
    # a 1 MB tool result made each step's generation 13-19 s instead of ~3 s: it was
    # tokenized whole before being cut to its 256 tokens
    counting = Counting(tok)
    flood = "the number is 12345 and more " * 36_000
    cut = cut_message({"role": "tool", "content": flood}, counting,
                      limits(tool_tokens=256))["content"]
    assert counting.chars <= 4 * CHARS_PER_TOKEN * 256
    assert cut.startswith("the number is 12345") and cut.endswith("and more ")
    assert f"...({len(flood) - len(cut) + len('...(1035523 chars cut)')} chars cut)" in cut
    assert len(tok(cut, add_special_tokens=False).input_ids) <= 256


@pytest.mark.parametrize("on_error", ["mask", "zero"])
def test_a_raising_tool_is_an_error_status_and_the_others_go_on(tok, on_error):
    call = '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>'
    _, runs = play(make(tok, tools=(mul, broken), on_error=on_error), tok,
                   [[call], [CALL, "42"]], n=2)
    failed, fine = runs
    assert failed.episode.status == "error"
    assert "RuntimeError: the tool broke" in failed.episode.error
    assert "test_episodes.py" in failed.episode.error  # the user's own frame
    assert failed.score == 0.0
    assert any(failed.sampled) == (on_error == "zero")
    assert fine.episode.status == "completed" and fine.score == 1.0
    # the call that raised was made: agent/tool_calls read 0.0 where 5 of 8 episodes
    # called a raising tool
    assert failed.episode.tool_calls == fine.episode.tool_calls == 1


def test_a_turn_cut_inside_a_tool_call_is_counted(tok):
    _, (run,) = play(make(tok, turn_tokens=8), tok, [[CALL, "42"]])
    assert run.cut == run.cut_calls == 1  # the call, cut at 8 tokens; "42" stopped
    assert run.episode.status == "completed"


def test_tool_call_ids_are_unique_in_their_episode(tok):
    # every turn's first call was `call_0`: a client keying results by id mixed them up
    two = CALL + CALL
    _, (run,) = play(make(tok, budget=300, turn_tokens=120), tok, [[CALL, two, "42"]])
    ids = [c["id"] for m in run.episode.messages for c in m.get("tool_calls", [])]
    answered = [m["tool_call_id"] for m in run.episode.messages if m["role"] == "tool"]
    assert ids == answered == ["call_0", "call_1", "call_2"]


def test_on_error_raise_names_the_episode_and_the_cause(tok):
    call = '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>'
    with pytest.raises(AgentError, match=r"episode 0 .*`error`: RuntimeError: the tool broke"):
        play(make(tok, tools=(broken,), on_error="raise"), tok, [[call]])


def test_a_hanging_tool_times_out_and_sync_tools_run_at_once(tok):
    """Each call of `slow` notes when it started and ended: the eight 0.3 s calls all
    overlap (one thread each, not one after another), and the rollout returns while the
    3 s one still sleeps (cut at its 1 s timeout, not waited for)."""
    spans: dict[float, list[list[float | None]]] = {}  # seconds -> [start, end] a call

    def slow(seconds: float) -> str:
        """Sleep, then answer.

        Args:
            seconds: How long to sleep.
        """
        span: list[float | None] = [time.perf_counter(), None]
        spans.setdefault(seconds, []).append(span)
        time.sleep(seconds)
        span[1] = time.perf_counter()
        return "slept"

    call = '<tool_call>{"name": "slow", "arguments": {"seconds": 0.3}}</tool_call>'
    hang = '<tool_call>{"name": "slow", "arguments": {"seconds": 3}}</tool_call>'
    _, runs = play(make(tok, tools=(slow,), tool_timeout_s=1.0), tok,
                   [[call, "42"]] * 8 + [[hang]], n=9)
    assert [end for _, end in spans[3]] == [None]  # started, not ended: abandoned
    assert [r.episode.status for r in runs] == ["completed"] * 8 + ["timeout"]
    assert "ran past its timeout of 1.0 s" in runs[-1].episode.error
    assert runs[-1].episode.tool_calls == 1  # a call that timed out was made
    starts, ends = zip(*spans[0.3], strict=True)
    assert len(starts) == 8 and max(starts) < min(ends)  # all 8 at once
    assert all(r.episode.tool_time_s >= 0.3 for r in runs[:8])


def test_an_async_env_keeps_its_loop_and_a_hung_turn_times_out(tok):
    class Async(Env):
        async def reset(self, task):
            self.loop = asyncio.get_running_loop()
            return task["prompt"]

        async def step(self, message):
            assert asyncio.get_running_loop() is self.loop
            if message["content"] == "hang":
                await asyncio.sleep(10)
            return Step(["again"])

    _, runs = play(make(tok, env=Async, turn_timeout_s=0.5, max_turns=2), tok,
                   [["1", "2"], ["hang"]], n=2)
    assert [r.episode.status for r in runs] == ["max_turns", "timeout"]
    assert "turn_timeout_s = 0.5 s" in runs[1].episode.error


def test_an_env_that_fails_to_start_is_an_error_with_its_frame(tok):
    class Bad(Env):
        def reset(self, task):
            return {"not": "messages"}

    first, (run,) = play(make(tok, env=Bad), tok, [[]])
    assert run.episode.status == "error" and first == [[]]
    assert "message 0 is {'not': 'messages'}" in run.episode.error
    assert "Bad.reset" in run.episode.error


@pytest.mark.parametrize("value, message", [
    ({"acc": 1}, "without `score`"),
    ("1", "a reward is a number"),
    (float("nan"), "must be finite"),
])
def test_a_bad_reward_is_an_error_status_naming_it(tok, value, message):
    class Bad(Answer):
        def reward(self, episode):
            return value

    _, (run,) = play(make(tok, env=Bad), tok, [["42"]])
    assert run.episode.status == "error" and message in run.episode.error


def test_a_dict_reward_keeps_its_other_entries(tok):
    class Scored(Answer):
        def reward(self, episode):
            return {"score": 0.5, "acc": 1.0}

    _, (run,) = play(make(tok, env=Scored), tok, [["42"]])
    assert run.score == 0.5 and run.extra == {"acc": 1.0}


def test_a_hung_sync_tool_never_holds_the_process_at_exit(tok, tmp_path):
    """Its thread is abandoned at the timeout; the process still exits at once."""
    import subprocess
    import sys

    script = tmp_path / "hang.py"
    script.write_text(
        "import time\n"
        "from flowgraph.agent import tool\n"
        "from flowgraph.agent.episodes import Episodes, Limits\n"
        "from flowgraph.agent.parsers import get_parser\n"
        "from flowgraph.agent.render import ChatRenderer\n"
        "from flowgraph.nodes.models import load_tokenizer\n"
        "def hang(x: int) -> str:\n"
        "    '''Hang.\n\n    Args:\n        x: Anything.\n    '''\n"
        "    time.sleep(60)\n"
        "tok = load_tokenizer('builtin:tiny-lm')\n"
        "e = Episodes(None, [tool(hang)], ChatRenderer(tok), get_parser('hermes'),\n"
        "             Limits(2, 64, 32, 8, tool_timeout_s=0.5))\n"
        "e.reset([{'prompt': 'hi'}])\n"
        "call = '<tool_call>{\"name\": \"hang\", \"arguments\": {\"x\": 1}}</tool_call>'\n"
        "e.advance({0: (tok(call).input_ids + [2], [0.0] * 99, True)})\n"
        "print(e.finish()[0].episode.status)\n")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=40)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "timeout"
    assert time.perf_counter() - start < 30  # not the 60 s the thread sleeps


LISTING = ("{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}"
           "{% endfor %}{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
           "{% if m['role'] == 'assistant' %}<|eos|>{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""The tiny template, listing the tools first (as Qwen's lists them in its system prompt)."""


class WithHint(Answer):
    @tool
    def hint(self, parity: str) -> str:
        """Say whether the answer is even or odd.

        Args:
            parity: even or odd
        """
        return "yes"


def test_the_template_lists_the_envs_tools_with_the_rollouts(tok):
    tools = [tool(mul)]
    renderer = ChatRenderer(tok, LISTING, [t.schema() for t in tools], [tok.eos_token_id])
    episodes = Episodes(WithHint, tools, renderer, get_parser("hermes"), limits())
    first = episodes.reset([{"prompt": "What is 6*7?"}])
    assert tok.decode(first[0]).startswith("<|system|>tools: mul hint<|user|>What is 6*7?")


class GuessTRL:
    """A TRL environment_factory class: its public methods are its tools."""

    def reset(self, **row):
        return "guess my number (1 to 10)"

    def guess(self, number: int) -> str:
        """Guess the number.

        Args:
            number: the guess
        """
        return "higher"


def test_a_template_that_leaves_the_tools_out_is_refused(tok):
    """TRL refuses a template that does not render `tools`; so does the rollout when the
    template is to show them (the default): the policy would train on prompts that never
    show its tools. `system` lists them in a system message, `none` in no prompt."""
    schemas = [tool(mul).schema()]
    with pytest.raises(TemplateError, match=r"does not show the episode's tools in the "
                                            r"prompt \(rendered with `tools=`, the prompt "
                                            r"leaves out mul\)"):
        ChatRenderer(tok, tools=schemas)
    with pytest.raises(TemplateError, match="leaves out mul"):
        ChatRenderer(tok).with_tools(schemas)
    assert ChatRenderer(tok, LISTING, schemas).text([{"role": "user", "content": "Hi"}], True) \
        == "<|system|>tools: mul<|user|>Hi<|assistant|>"
    hi = [{"role": "user", "content": "Hi"}]
    assert ChatRenderer(tok, tools=schemas, show_tools="none").text(hi, True) \
        == ChatRenderer(tok).text(hi, True) == "<|user|>Hi<|assistant|>"
    listed = ChatRenderer(tok, tools=schemas, show_tools="system").text(hi, True)
    assert listed == f"<|system|>{tools_system_message(schemas)}<|user|>Hi<|assistant|>"
    assert '"name": "mul"' in listed and "<tool_call>" in listed
    system = [{"role": "system", "content": "Be brief."}, *hi]
    assert ChatRenderer(tok, tools=schemas, show_tools="system").text(system, True) == \
        f"<|system|>Be brief.\n\n{tools_system_message(schemas)}<|user|>Hi<|assistant|>"


@pytest.mark.parametrize("on_error", ["mask", "zero"])
def test_a_trl_env_whose_tools_the_template_leaves_out_stops_the_rollout(tok, on_error):
    """A TRL env's tools are known when it is made: the episode that finds them unshown
    ends, and the rollout raises the template's error whatever `on_error` says (it is the
    rollout's setting, not the episode's failure)."""
    from flowgraph.agent.adapters import load_env

    episodes = Episodes(load_env(GuessTRL), [], ChatRenderer(tok, stop_ids=[tok.eos_token_id]),
                        get_parser("hermes"), limits(on_error=on_error))
    episodes.reset([{"prompt": "x"}])
    assert episodes.requests() == []
    with pytest.raises(TemplateError, match="leaves out guess"):
        episodes.finish()
