"""Agent rollouts checked before launch (`flowgraph.checker.agents`, FG601-FG606): each
case is the graph below with one edit. graphs/broken/agent_*.yaml hold one graph per
check, run by test_graphs_dir."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flowgraph.checker import check_graph
from flowgraph.cli import main
from flowgraph.diagnostics import Diagnostic
from flowgraph.frontend import load_graph

ROOT = Path(__file__).resolve().parents[2]

# T = 64 holds exactly 3 turns of 16 tokens and the 2 tool results of 8 between them:
# 3 × 16 + 2 × 8 = 64 (the last turn has no tool result after it).
GRAPH = """\
version: 1
name: agent
dims: {Bp: 2, N: 2, P: 128, T: 64}
models:
  actor: {path: "builtin:tiny-lm-sft", trainable: true, optimizer: {lr: 1.0e-4}}
data:
  train: {kind: prompts, path: "builtin:reverse"}
plugins: [envs.py]
nodes:
  agent:
    kind: agent_rollout
    model: actor
    inputs: {row: train.row}
    params:
      env: envs.py:Guess
      tools: [envs.py:lookup]
      max_turns: 3
      max_turn_tokens: 16
      max_tool_tokens: 8
  adv:
    kind: grpo
    inputs: {scores: agent.scores, response_mask: agent.response_mask, index: agent.index}
  update:
    kind: ppo_actor_update
    model: actor
    inputs:
      prompts: agent.prompts
      prompt_mask: agent.prompt_mask
      responses: agent.responses
      response_mask: agent.response_mask
      advantages: adv.advantages
"""

PLUGIN = '''\
from flowgraph.agent import Env
from flowgraph.agent.tools import tool
from flowgraph.registry import policy_loss


def lookup(word: str) -> str:
    """Look a word up.

    Args:
        word: the word
    """
    return word


def raw(word):
    return word


@tool(timeout_s=300)
def slow(word: str) -> str:
    """Answer slowly.

    Args:
        word: the word
    """
    return word


class Guess(Env):
    @tool
    def hint(self, parity: str) -> str:
        """Say even or odd.

        Args:
            parity: even or odd
        """
        return "yes"


class Raw(Env):
    tools = [raw]


@policy_loss("episode_ratio", per_sequence=True)
def episode_ratio(old_log_prob, log_prob, advantages, response_mask):
    return -advantages * (log_prob - old_log_prob).exp(), {}
'''


def _check(tmp_path: Path, *edits: tuple[str, str], plugin: str = PLUGIN,
           code: str = "FG6") -> list[Diagnostic]:
    """The diagnostics whose code starts with `code` for GRAPH with `edits`."""
    text = GRAPH
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    (tmp_path / "envs.py").write_text(plugin)
    path = tmp_path / "g.yaml"
    path.write_text(text)
    graph, diags = load_graph(path)
    assert graph is not None, diags
    return [d for d in check_graph(graph).diagnostics if d.code.startswith(code)]


def _lines(diags: list[Diagnostic], tmp_path: Path) -> list[str]:
    return [f"{d.severity} {d.code}: {d.message}".replace(str(tmp_path), "TMP")
            for d in diags]


def test_the_agent_graph_checks_clean(tmp_path: Path) -> None:
    assert _check(tmp_path, code="FG") == []


# --- FG601 ------------------------------------------------------------------------------


@pytest.mark.parametrize(("edits", "expected"), [
    ([("max_turn_tokens: 16", "max_turn_tokens: 512")],
     "error FG601: `agent.params.max_turn_tokens` = 512 is over the response length T = 64: "
     "no turn can sample 512 tokens (T holds every turn and every message between)"),
    ([("max_turns: 3", "max_turns: 40")],  # 40 + 39 = 79 > 64
     "error FG601: no episode of `agent` can take max_turns = 40 turns in T = 64 tokens: "
     "each turn samples at least one token and each message between turns takes at least "
     "one (40 + 39 = 79 > 64)"),
    ([("max_tool_tokens: 8", "max_tool_tokens: 9")],  # 3 × 16 + 2 × 9 = 66 > 64
     "warning FG601: `agent`: max_turns × max_turn_tokens + (max_turns − 1) × "
     "max_tool_tokens = 3 × 16 + 2 × 9 = 66 tokens, over the response length T = 64: "
     "episodes whose turns and tool results use their budgets end as `context_exhausted` "
     "before max_turns"),
    ([("max_turn_tokens: 16", "max_turn_tokens: null"),  # 3 × 1 + 2 × 32 = 67 > 64
      ("max_tool_tokens: 8", "max_tool_tokens: 32")],
     "warning FG601: `agent`: max_turns × max_turn_tokens + (max_turns − 1) × "
     "max_tool_tokens = 3 × 1 (max_turn_tokens null: a turn takes what is left) + 2 × 32 = "
     "67 tokens, over the response length T = 64: episodes whose turns and tool results "
     "use their budgets end as `context_exhausted` before max_turns"),
], ids=["turn_over_T", "no_episode_reaches_max_turns", "worst_case_over_T",
        "tool_results_alone_over_T"])
def test_budget_over_T_is_fg601(edits: list[tuple[str, str]], expected: str,
                                tmp_path: Path) -> None:
    assert _lines(_check(tmp_path, *edits), tmp_path) == [expected]


@pytest.mark.parametrize(("edits", "hint"), [
    ([("max_tool_tokens: 8", "max_tool_tokens: 9")],
     # max_turns: (64 + 9) // (16 + 9) = 2; max_turn_tokens: (64 − 18) // 3 = 15;
     # max_tool_tokens: (64 − 48) // 2 = 8
     "raise T to 66 (dims.T, or the rollout's max_new_tokens), or lower max_turns to 2 or "
     "max_turn_tokens to 15 or max_tool_tokens to 8; or keep it: context_exhausted is the "
     "status such episodes end with"),
    ([("max_turn_tokens: 16", "max_turn_tokens: 512")],
     "lower max_turn_tokens to at most 64, or raise T to 1552 (max_turns × max_turn_tokens "
     "+ (max_turns − 1) × max_tool_tokens = 3 × 512 + 2 × 8)"),
], ids=["worst_case", "turn_over_T"])
def test_fg601_says_the_fix(edits: list[tuple[str, str]], hint: str, tmp_path: Path) -> None:
    [d] = _check(tmp_path, *edits)
    assert d.hint == hint


# --- FG602 ------------------------------------------------------------------------------


@pytest.mark.parametrize(("param", "value", "expected"), [
    ("tool_timeout_s", 0,
     "error FG602: `agent.params.tool_timeout_s` is 0: no timeout. Tools and envs run the "
     "user's code, and a hung call must end its episode (status `timeout`), never the run; "
     "the rollout would also end every call at once as a timeout; the tools without a "
     "timeout_s of their own would take it: `hint` (TMP/envs.py:30), `lookup` "
     "(TMP/envs.py:6)"),
    ("turn_timeout_s", 0,
     "error FG602: `agent.params.turn_timeout_s` is 0: no timeout. Tools and envs run the "
     "user's code, and a hung call must end its episode (status `timeout`), never the run; "
     "the rollout would also end every call at once as a timeout"),
    ("tool_timeout_s", 200,
     "warning FG602: `agent.params.tool_timeout_s` = 200 s is over turn_timeout_s = 120 s: "
     "a hung tool call is stopped by turn_timeout_s first, so tool_timeout_s never fires"),
    ("turn_timeout_s", 700,
     "warning FG602: `agent.params.turn_timeout_s` = 700 s is over episode_timeout_s = "
     "600 s: a turn's env and tool work is stopped by episode_timeout_s first, so "
     "turn_timeout_s never fires"),
], ids=["tool_zero", "turn_zero", "tool_over_turn", "turn_over_episode"])
def test_timeouts_are_fg602(param: str, value: int, expected: str, tmp_path: Path) -> None:
    edit = ("      max_tool_tokens: 8\n", f"      max_tool_tokens: 8\n      {param}: {value}\n")
    assert _lines(_check(tmp_path, edit), tmp_path) == [expected]


def test_a_tools_own_timeout_over_the_turns_is_fg602(tmp_path: Path) -> None:
    found = _check(tmp_path, ("[envs.py:lookup]", "[envs.py:lookup, envs.py:slow]"))
    assert _lines(found, tmp_path) == [
        "warning FG602: tool `slow` (tools, TMP/envs.py:19) has timeout_s = 300 s, over "
        "`agent.params.turn_timeout_s` = 120 s: the turn's timeout stops a hung call "
        "first, so the tool's never fires"]


def test_a_tool_with_its_own_timeout_is_not_named_as_taking_zero(tmp_path: Path) -> None:
    found = _check(tmp_path, ("[envs.py:lookup]", "[envs.py:slow]"),
                   ("      max_tool_tokens: 8\n",
                    "      max_tool_tokens: 8\n      tool_timeout_s: 0\n      "
                    "turn_timeout_s: 400\n"))
    [d] = found
    assert d.code == "FG602" and d.is_error and "`hint`" in d.message
    assert "`slow`" not in d.message


# --- FG603, FG605 -----------------------------------------------------------------------


@pytest.mark.parametrize(("edit", "expected"), [
    (("[envs.py:lookup]", "[envs.py:raw]"),
     "error FG603: parameter `tools` of `agent`: tool `envs.py:raw` cannot be offered to "
     "the policy: ToolSchemaError: tool `raw` (TMP/envs.py:15): has no docstring"),
    (("env: envs.py:Guess", "env: envs.py:Raw"),
     "error FG603: parameter `env` of `agent`: a tool of `envs.py:Raw` cannot be offered "
     "to the policy: ToolSchemaError: tool `raw` (TMP/envs.py:15): has no docstring"),
    (("[envs.py:lookup]", "[envs.py:Guess]"),
     "error FG603: parameter `tools` of `agent`: tool `envs.py:Guess` cannot be offered to "
     "the policy: ToolSchemaError:"),
], ids=["tool", "env_tools", "a_class_as_a_tool"])
def test_a_tool_whose_schema_cannot_be_built_is_fg603(edit: tuple[str, str], expected: str,
                                                      tmp_path: Path) -> None:
    [line] = _lines(_check(tmp_path, edit), tmp_path)
    assert line.startswith(expected), line


def test_a_bad_tool_decorated_in_a_plugin_is_fg603_not_fg113(tmp_path: Path) -> None:
    # `@tool` builds the schema when the plugin file is imported: that import fails.
    plugin = PLUGIN + "\n\n@tool\ndef broken(x):\n    return x\n"
    found = _check(tmp_path, plugin=plugin, code="FG")
    assert [d.code for d in found if d.is_error] == ["FG603"], found
    [d] = found
    assert d.pos is not None and d.pos.line == 8  # the `plugins:` entry
    assert d.message.startswith("plugin `envs.py` defines a tool that cannot be offered "
                                "to the policy: tool `broken` (")


@pytest.mark.parametrize(("edits", "expected"), [
    ([("plugins: [envs.py]\n", "")],
     ["error FG605: parameter `env` of `agent` names `envs.py:Guess`, but `envs.py` is not "
      "listed under plugins:, so it cannot be imported",
      "error FG605: parameter `tools` of `agent` names `envs.py:lookup`, but `envs.py` is "
      "not listed under plugins:, so it cannot be imported"]),
    ([("env: envs.py:Guess", "env: envs.py:Gues")],
     ["error FG605: parameter `env` of `agent` names `envs.py:Gues`, but `envs.py` has no "
      "`Gues` (TMP/envs.py)"]),
    ([("[envs.py:lookup]", "[lookup]")],
     ["error FG605: parameter `tools` of `agent` names `lookup`, not a tool (`file.py:Name` "
      "or `module:Name`)"]),
    ([("env: envs.py:Guess", "env: tools.yaml")],
     ["error FG605: parameter `env` of `agent` names the verl tool config `tools.yaml`, "
      "which is not there (TMP/tools.yaml)"]),
], ids=["not_listed", "misspelt", "no_module", "verl_config_missing"])
def test_an_env_or_tool_that_cannot_be_imported_is_fg605(edits: list[tuple[str, str]],
                                                         expected: list[str],
                                                         tmp_path: Path) -> None:
    assert _lines(_check(tmp_path, *edits), tmp_path) == expected


def test_fg605_suggests_the_name(tmp_path: Path) -> None:
    [d] = _check(tmp_path, ("env: envs.py:Guess", "env: envs.py:Gues"))
    assert d.hint == "did you mean `Guess`?"


def test_a_plugin_that_fails_to_import_is_one_fg113(tmp_path: Path) -> None:
    found = _check(tmp_path, plugin="raise ImportError('no such thing')\n", code="FG")
    assert [d.code for d in found] == ["FG113"], found


def test_env_null_over_tools_is_accepted(tmp_path: Path) -> None:
    # `env: null`: a plain env over `tools` (the kind's doc), not "needs `env`".
    assert _check(tmp_path, ("env: envs.py:Guess", "env: null"), code="FG") == []


# --- FG604 ------------------------------------------------------------------------------

UPDATE = "      advantages: adv.advantages\n"


@pytest.mark.parametrize(("params", "why"), [
    ("{policy_loss: gspo}", "policy_loss `gspo`, one importance ratio per sequence"),
    ("{policy_loss: episode_ratio}",
     "policy_loss `episode_ratio`, one importance ratio per sequence"),
    ("{rollout_is: sequence}", "`rollout_is: sequence`, one weight per sequence"),
], ids=["gspo", "plugin_loss", "sequence_tis"])
def test_a_sequence_level_loss_on_episodes_is_fg604(params: str, why: str,
                                                    tmp_path: Path) -> None:
    wired = UPDATE + "      rollout_log_prob: agent.rollout_log_prob\n"
    found = _check(tmp_path, (UPDATE, f"{wired}    params: {params}\n"))
    assert _lines(found, tmp_path) == [
        f"warning FG604: `update` trains on the episodes of `agent` (up to 3 turns, the tool "
        f"and env messages between them as holes) with {why}: there a sequence is a whole "
        "episode, so one number stands for every turn of it, and a turn far from the "
        "sampler clips or down-weights the others' gradients too"]


def test_fg604_sees_episodes_through_a_filter(tmp_path: Path) -> None:
    keep = ("  keep:\n    kind: filter\n    inputs: {scores: agent.scores, index: agent.index, "
            "prompts: agent.prompts, prompt_mask: agent.prompt_mask, responses: "
            "agent.responses, response_mask: agent.response_mask}\n"
            "    params: {metric: std_nonzero}\n")
    found = _check(tmp_path, ("  adv:\n", keep + "  adv:\n"),
                   ("{scores: agent.scores, response_mask: agent.response_mask, index: "
                    "agent.index}", "{scores: keep.scores, response_mask: keep.response_mask, "
                    "index: keep.index}"),
                   *[(f"      {p}: agent.{p}\n", f"      {p}: keep.{p}\n") for p in
                     ("prompts", "prompt_mask", "responses", "response_mask")],
                   (UPDATE, UPDATE + "    params: {policy_loss: gspo}\n"), code="FG")
    assert [(d.code, d.severity) for d in found] == [("FG604", "warning")], found


@pytest.mark.parametrize("edits", [
    [(UPDATE, UPDATE + "    params: {policy_loss: vanilla}\n")],
    [(UPDATE, UPDATE + "    params: {policy_loss: gspo}\n"), ("max_turns: 3", "max_turns: 1")],
], ids=["token_level_loss", "single_turn"])
def test_no_fg604_where_a_sequence_is_not_an_episode(edits: list[tuple[str, str]],
                                                     tmp_path: Path) -> None:
    assert _check(tmp_path, *edits) == []


def test_gspo_on_generate_is_not_fg604() -> None:
    graph, _ = load_graph(ROOT / "graphs" / "gspo.yaml")
    assert graph is not None
    assert [d for d in check_graph(graph).diagnostics if d.code == "FG604"] == []


# --- FG606 (check --data: the tokenizer is loaded) ---------------------------------------

THINKING = (  # Qwen3's way: an earlier assistant turn keeps only what follows </think>
    '{%- for m in messages %}{%- if m.role == "assistant" and not loop.last %}'
    '{{ "<|assistant|>" + (m.content.split("</think>")[-1] | trim) + "<|eos|>" }}'
    '{%- else %}{{ "<|" + m.role + "|>" + m.content }}'
    '{%- if m.role == "assistant" %}<|eos|>{%- endif %}{%- endif %}{%- endfor %}'
    '{%- if add_generation_prompt %}<|assistant|>{%- endif %}')


LISTING = ("{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}"
           "{% endfor %}{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
           "{% if m['role'] == 'assistant' %}<|eos|>{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""The tiny template, listing the tools first (as Qwen's lists them in its system prompt)."""


@pytest.mark.parametrize(("template", "show", "expected"), [
    (None, None,
     ["FG606: `agent` cannot render its episodes turn by turn with the chat template of "
      "model `actor`'s tokenizer: the chat template does not show the episode's tools in "
      "the prompt (rendered with `tools=`, the prompt leaves out hint, lookup): the policy "
      "would be trained on prompts that never show its tools."]),
    (None, "none", []),
    (None, "system", []),
    ("listing.jinja", None, []),
    ("think.jinja", "none",
     ["FG606: `agent` cannot render its episodes turn by turn with its `chat_template`: "
      "the chat template does not extend a conversation as a prefix"]),
], ids=["tools_left_out", "shown_by_none", "shown_by_system", "listed", "thinking"])
def test_check_data_probes_the_chat_template(template: str | None, show: str | None,
                                             expected: list[str], tmp_path: Path) -> None:
    """FG606: a template that cannot render an episode turn by turn, or that leaves out
    the tools the env (`Guess.hint`) and `tools` (`lookup`) offer when it is the one
    to show them; `show_tools: system` or `none` says how else they reach the prompt."""
    from flowgraph.checker.data import check_data
    from flowgraph.nodes.models import load_tokenizer

    (tmp_path / "think.jinja").write_text(THINKING)
    (tmp_path / "listing.jinja").write_text(LISTING)
    added = "".join(f"      {k}: {v}\n" for k, v in (("chat_template", template),
                                                     ("show_tools", show)) if v)
    (tmp_path / "envs.py").write_text(PLUGIN)
    path = tmp_path / "g.yaml"
    path.write_text(GRAPH.replace("      max_tool_tokens: 8\n",
                                  "      max_tool_tokens: 8\n" + added))
    graph, _ = load_graph(path)
    assert graph is not None
    check_graph(graph)  # as `check --data` does first: it imports the plugins
    found = [f"{d.code}: {d.message}" for d in check_data(graph, load_tokenizer)
             if d.code == "FG606"]
    assert [f[:len(e)] for f, e in zip(found, expected, strict=True)] == expected


# --- light ------------------------------------------------------------------------------


def test_checking_an_agent_graph_imports_no_heavy_module() -> None:
    # The env and tools are imported and their schemas built without torch/transformers.
    graph = ROOT / "graphs" / "broken" / "agent_tool_no_timeout.yaml"
    code = ("import sys\nfrom flowgraph.cli import main\n"
            f"status = main(['check', {str(graph)!r}, '--format', 'github'])\n"
            "print('STATUS', status, *sorted(sys.modules))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    _, status, *modules = run.stdout[run.stdout.index("STATUS "):].split()
    assert status == "1"  # it ran, and found the FG602
    assert "agent_tools" in modules and "flowgraph.checker.agents" in modules
    heavy = [m for m in modules if m.split(".")[0] in ("torch", "transformers", "ray", "vllm")]
    assert heavy == []


# --- from Python: the env and tools as objects ------------------------------------------


def _raw(word):  # type: ignore[no-untyped-def]
    return word


def test_objects_given_in_python_are_checked_too() -> None:
    from flowgraph.agent import Env
    from flowgraph.builder import GraphBuilder

    class RawEnv(Env):
        tools = (_raw,)

    g = GraphBuilder("py")
    g.dims(Bp=2, N=2, P=128, T=64)
    g.model("actor", "builtin:tiny-lm-sft", trainable=True)
    g.data("train", "prompts", "builtin:reverse")
    g.node("agent", "agent_rollout", model="actor", row="train.row",
           params={"env": RawEnv, "max_turns": 3, "max_turn_tokens": 16,
                   "max_tool_tokens": 8, "tool_timeout_s": 0})
    found = [d for d in check_graph(g.build()).diagnostics if d.code.startswith("FG6")]
    assert [(d.code, d.severity) for d in found] == [("FG602", "error"), ("FG603", "error")]
    assert "RawEnv" in found[1].message and f"_raw` ({__file__}:" in found[1].message


# --- FG607 ------------------------------------------------------------------------------

PROGRAMS = PLUGIN + '''

async def run(task, client):
    return 1.0


def plain(task, client):
    return 1.0


async def lonely(task):
    return 1.0
'''


@pytest.mark.parametrize(("edits", "expected"), [
    ([("      env: envs.py:Guess\n      tools: [envs.py:lookup]\n",
       "      agent: envs.py:run\n")], []),
    # it calls its own tools: no FG602 about tool_timeout_s (the rollout times none)
    ([("      env: envs.py:Guess\n      tools: [envs.py:lookup]\n",
       "      agent: envs.py:run\n      turn_timeout_s: 10\n      tool_timeout_s: 0\n")],
     []),
    ([("      env: envs.py:Guess\n", "      agent: envs.py:run\n")],
     ["error FG607: `agent` names the agent program `envs.py:run` and `tools`: a black-box "
      "agent brings its own tools and plays its own episodes, so they would be ignored"]),
    ([("      env: envs.py:Guess\n      tools: [envs.py:lookup]\n",
       "      agent: envs.py:plain\n")],
     ["error FG607: the agent program `envs.py:plain` of `agent` is not `async def run(task, "
      "client)` (TMP/envs.py:53)"]),
    ([("      env: envs.py:Guess\n      tools: [envs.py:lookup]\n",
       "      agent: envs.py:lonely\n")],
     ["error FG607: the agent program `envs.py:lonely` of `agent` is not `async def "
      "run(task, client)` (TMP/envs.py:57)"]),
    ([("      env: envs.py:Guess\n      tools: [envs.py:lookup]\n",
       "      agent: envs.py:runner\n")],
     ["error FG605: parameter `agent` of `agent` names `envs.py:runner`, but `envs.py` has "
      "no `runner` (TMP/envs.py)"]),
])
def test_an_agent_program_is_awaited_with_task_and_client(
        tmp_path: Path, edits: list[tuple[str, str]], expected: list[str]) -> None:
    assert _lines(_check(tmp_path, *edits, plugin=PROGRAMS), tmp_path) == expected


# --- FG608 ------------------------------------------------------------------------------

AGENT = ("      env: envs.py:Guess\n      tools: [envs.py:lookup]\n",
         "      agent: envs.py:run\n      n: 1\n      rows_per_episode: 2\n")
EPISODE = ("index: agent.index}", "index: agent.index, episode: agent.episode}")


@pytest.mark.parametrize(("edits", "expected"), [
    ([AGENT, EPISODE], []),
    ([AGENT, EPISODE, ("kind: grpo", "kind: rloo")], []),
    ([AGENT], ["error FG608: `adv` (grpo) counts each row of `agent` as a sample of its "
               "group, but an episode takes up to 2 rows: one that took 2 would count 2 "
               "times, an unused row as a score of 0"]),
    ([AGENT, ("kind: grpo\n    inputs: {scores: agent.scores, response_mask: "
              "agent.response_mask, index: agent.index}",
              "kind: reinforce_pp\n    inputs: {token_level_rewards: "
              "agent.token_level_rewards, response_mask: agent.response_mask}")],
     ["error FG608: `adv` (reinforce_pp) takes its credit along each row of `agent`, whose "
      "episodes take up to 2 rows: an episode's earlier rows would get none of its "
      "reward"]),
    ([AGENT, EPISODE, ("advantages: adv.advantages",
                       "advantages: adv.advantages\n    params: "
                       "{loss_agg_mode: seq-mean-token-mean}")],
     ["error FG608: `update` averages each row's token mean (loss_agg_mode: "
      "seq-mean-token-mean), and `agent` splits an episode into up to 2 rows: an episode "
      "of 2 rows would weigh 2 times"]),
    ([AGENT, EPISODE, ("advantages: adv.advantages",
                       "advantages: adv.advantages\n    params: "
                       "{loss_agg_mode: seq-mean-token-sum}")], []),
    ([(AGENT[0], "      agent: envs.py:run\n      rows_per_episode: 2\n"), EPISODE],
     ["error FG608: `agent` gives each episode 2 rows and leaves `n` to the global N: N·2 "
      "rows per prompt where the graph's batch holds N"]),
    ([("      tools: [envs.py:lookup]\n",
       "      tools: [envs.py:lookup]\n      n: 1\n      rows_per_episode: 2\n"), EPISODE],
     ["error FG608: `agent` gives each episode 2 rows, but its episodes are an env's, "
      "which never fork: a row each would be used and 1 of every 2 left empty"]),
])
def test_episodes_of_several_rows_count_as_episodes(
        tmp_path: Path, edits: list[tuple[str, str]], expected: list[str]) -> None:
    """rows_per_episode: 2 with n: 1 gives the N = 2 rows per prompt the graph has."""
    found = _check(tmp_path, *edits, plugin=PROGRAMS, code="FG608")
    assert _lines(found, tmp_path) == expected
    if not expected:  # and nothing else, the shapes included
        assert _check(tmp_path, *edits, plugin=PROGRAMS, code="FG") == []


# --- FG609: an env per row ------------------------------------------------------------------

ENVS = ("env: envs.py:Guess", "envs: {guess: envs.py:Guess, raw: envs.py:Raw}")
"""Two envs by name; the rows name theirs in `env_class`."""
RAW_TOOLS = ("class Raw(Env):\n    tools = [raw]", "class Raw(Env):\n    pass")


def test_two_envs_by_name_check_clean_and_their_tools_are_checked(tmp_path: Path) -> None:
    clean, raw, misspelt = (tmp_path / d for d in ("clean", "raw", "misspelt"))
    for d in (clean, raw, misspelt):  # a plugin file is imported once per path
        d.mkdir()
    assert _check(clean, ENVS, plugin=PLUGIN.replace(*RAW_TOOLS), code="FG") == []
    assert _lines(_check(raw, ENVS), raw) == [
        "error FG603: parameter `envs` of `agent`: a tool of `envs.py:Raw` cannot be offered "
        "to the policy: ToolSchemaError: tool `raw` (TMP/envs.py:15): has no docstring; add "
        "a Google-style one: a line saying what the tool does, then `Args:` with one "
        "`name: what it is` per argument"]
    assert _lines(_check(misspelt, ("env: envs.py:Guess",
                                    "envs: {guess: envs.py:Guess, raw: envs.py:Rw}")),
                  misspelt) == ["error FG605: parameter `envs` of `agent` names `envs.py:Rw`, "
                                "but `envs.py` has no `Rw` (TMP/envs.py)"]


@pytest.mark.parametrize(("edits", "expected"), [
    ([("tools: [envs.py:lookup]", "envs: {raw: envs.py:Raw}")],
     "error FG609: `agent` names an env per row (`envs`: raw) and the one `env` beside "
     "them, which would never run"),
    ([("env: envs.py:Guess", "envs: {}")],
     "error FG609: `agent.params.envs` is empty: no row could be routed"),
    ([("env: envs.py:Guess", "envs: {a/b: envs.py:Guess}")],
     "error FG609: `agent.params.envs` names an env `a/b`: an env's name is part of its "
     "metrics' names (agent/<env>/turns), so letters, digits, `_`, `.` and `-`"),
    ([ENVS, ("max_turns: 3", "max_turns: 3\n      env_params: {gues: {n: 1}}")],
     "error FG609: `agent.params.env_params` has `gues`, which is no env of `envs` (did "
     "you mean `guess`?): with `envs`, env_params holds each env's own keyword arguments "
     "by its name"),
], ids=["beside_env", "empty", "slash", "params_by_name"])
def test_envs_that_cannot_route_are_fg609(edits: list[tuple[str, str]], expected: str,
                                          tmp_path: Path) -> None:
    plugin = PLUGIN.replace(*RAW_TOOLS)
    assert _lines(_check(tmp_path, *edits, plugin=plugin, code="FG609"), tmp_path) == \
        [expected]


def _routed(tmp_path: Path, rows: list[dict[str, str]], route_by: str = "") -> Path:
    (tmp_path / "envs.py").write_text(PLUGIN.replace(*RAW_TOOLS))
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = GRAPH.replace(*ENVS).replace('path: "builtin:reverse"', "path: q.jsonl")
    if route_by:
        text = text.replace("max_turns: 3", f"max_turns: 3\n      route_by: {route_by}")
    path = tmp_path / "g.yaml"
    path.write_text(text)
    return path


ROWS = [{"prompt": "1+1=", "env_class": "guess"}, {"prompt": "2+2=", "env_class": "raw"},
        {"prompt": "3+3=", "env_class": "gess"}, {"prompt": "4+4=", "env_class": "rav"}]


@pytest.mark.parametrize(("rows", "route_by", "expected"), [
    (ROWS[:2], "", None),
    ([{"prompt": "1+1=", "agent_name": "raw"}, *ROWS[:1]], "", None),  # verl's name
    ([{"prompt": "1+1=", "task": "raw"}], "task", None),
    (ROWS, "", "`agent` routes each row to one of its envs (guess, raw) by `env_class`: row "
     "2 (0-based) of dataset `TMP/q.jsonl` names the env `gess` (column `env_class`), which "
     "the node does not declare in `envs`: did you mean `guess`? (2 of its 4 rows name none "
     "of them)"),
    ([*ROWS[:1], {"prompt": "2+2="}], "", "`agent` routes each row to one of its envs "
     "(guess, raw) by `env_class`: row 1 (0-based) of dataset `TMP/q.jsonl` has no "
     "`env_class` (nor `agent_name`, verl's name) naming its env: add the column (one of "
     "guess, raw), or set `route_by` to the column that names it"),
    (ROWS[:2], "task", "`agent` routes each row to one of its envs (guess, raw) by `task`: "
     "row 0 (0-based) of dataset `TMP/q.jsonl` has no `task` naming its env: add the column "
     "(one of guess, raw), or set `route_by` to the column that names it (2 of its 2 rows "
     "name none of them)"),
], ids=["routed", "agent_name", "route_by", "unknown", "no_column", "other_column"])
def test_check_data_refuses_a_row_naming_no_declared_env_as_fg609(
        rows: list[dict[str, str]], route_by: str, expected: str | None, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`check --data` reads every row by the rule the rollout routes by, and `run` stops
    on the same diagnostic before the models load."""
    graph = _routed(tmp_path, rows, route_by)
    main(["check", str(graph), "--data", "--format", "json"])
    found = [d for d in json.loads(capsys.readouterr().out) if d["code"] == "FG609"]
    assert [d["message"].replace(str(tmp_path), "TMP") for d in found] == \
        ([expected] if expected else [])
    if expected is None:
        return
    assert found[0]["line"] == _line_of(graph, "envs:") and found[0]["node"] == "agent"
    assert main(["run", str(graph), f"trainer.run_dir={tmp_path / 'run'}"]) == 1
    assert "error[FG609]" in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _line_of(path: Path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


def test_the_readmes_fg609_is_what_check_data_says_of_the_mixed_example(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graphs = ROOT / "graphs"
    for name in ("agent_calculator.py", "agent_guess.py"):
        (tmp_path / name).write_text((graphs / name).read_text())
    graph = tmp_path / "agent_mixed.yaml"
    graph.write_text((graphs / "agent_mixed.yaml").read_text().replace(
        'guess: "agent_guess.py:GuessEnv"', 'gues: "agent_guess.py:GuessEnv"'))
    main(["check", str(graph), "--data", "--format", "json"])
    found = [d for d in json.loads(capsys.readouterr().out) if d["code"] == "FG609"]
    assert len(found) == 2  # the training rows and the held-out ones
    d = found[0]
    said = f"graphs/agent_mixed.yaml:{d['line']}:{d['column']}: error[FG609]: {d['message']}"
    assert said in (ROOT / "README.md").read_text()
