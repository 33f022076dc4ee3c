"""Registry: built-in kinds as data, plugins, entry points, jaxtyping-declared kinds."""

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from flowgraph.checker import check_graph
from flowgraph.errors import RegistryError
from flowgraph.frontend import load_graph
from flowgraph.kinds import BUILTIN_KINDS
from flowgraph.kindspec import NODE_PARAMS
from flowgraph.registry import Registry
from flowgraph.runtime.context import EXECUTOR_PARAMS

DESIGN_KINDS = [
    "generate", "logprob", "values", "reward", "kl_penalty", "gae", "grpo", "rloo",
    "reinforce_pp", "remax", "ppo_actor_update", "ppo_critic_update", "dpo_loss", "dpo_update",
    "prompts", "preferences",
]


@pytest.mark.parametrize("kind", DESIGN_KINDS)
def test_every_design_kind_is_registered(kind: str) -> None:
    spec = BUILTIN_KINDS[kind]
    assert spec.impl.startswith("flowgraph.nodes.")
    assert spec.inputs or spec.outputs


def test_update_kinds_are_sinks_and_need_a_model() -> None:
    for spec in BUILTIN_KINDS.values():
        if spec.trains:
            assert spec.sink and spec.model == "required" and not spec.outputs


PLUGIN = '''
from jaxtyping import Float, Int
from torch import Tensor
from flowgraph.registry import node_kind

@node_kind("shifted_reward", outputs=["token_level_scores"])
def shifted_reward(response_mask: Int[Tensor, "b T"], scale: float = 1.0
                   ) -> Float[Tensor, "b T-1"]:
    """A buggy reward: one position short."""
    return response_mask[:, 1:].float() * scale
'''

GRAPH = '''
dims: {{Bp: 2, N: 1, P: 4, T: 8}}
plugins: [{module}]
models:
  actor: {{path: "builtin:tiny-lm", trainable: true}}
data:
  train: {{kind: prompts, path: "builtin:arith"}}
nodes:
  gen:
    kind: generate
    model: actor
    inputs: {{prompts: train.input_ids, prompt_mask: train.attention_mask}}
  lp:
    kind: logprob
    model: actor
    inputs: &seq
      prompts: gen.prompts
      prompt_mask: gen.prompt_mask
      responses: gen.responses
      response_mask: gen.response_mask
  rew:
    kind: shifted_reward
    inputs: {{response_mask: gen.response_mask}}
    params: {{scale: 2.0}}
  adv:
    kind: reinforce_pp
    inputs:
      token_level_rewards: rew.token_level_scores
      response_mask: gen.response_mask
  upd:
    kind: ppo_actor_update
    model: actor
    inputs:
      <<: *seq
      old_log_prob: lp.log_prob
      advantages: adv.advantages
'''


def _write_plugin(tmp_path: Path, module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / f"{module}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_plugin_kind_contract_comes_from_jaxtyping(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _write_plugin(tmp_path, "fg_plugin_a", monkeypatch)
    path = tmp_path / "g.yaml"
    path.write_text(GRAPH.format(module="fg_plugin_a"))
    graph, diags = load_graph(path)
    assert graph is not None and not diags
    result = check_graph(graph)
    kind = result.registry.get("shifted_reward")
    assert kind is not None
    assert [p.name for p in kind.params] == ["scale", "timeout_s"]  # + the one every kind takes
    assert kind.outputs[0].spec.dims == "b T-1"
    # The (b, T-1) output meets reinforce_pp's (b, T): one error on that edge, at its line.
    errors = [d for d in result.diagnostics if d.is_error]
    assert [(d.code, d.edge) for d in errors] == [
        ("FG202", "rew.token_level_scores -> adv.token_level_rewards")
    ]
    assert errors[0].pos is not None and errors[0].pos.line == 28
    assert "off-by-one" in (errors[0].hint or "")


def test_only_listed_plugins_are_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_plugin(tmp_path, "fg_plugin_unlisted", monkeypatch)
    text = GRAPH.format(module="fg_plugin_missing_xyz")
    graph, _ = load_graph(tmp_path / "g.yaml", text=text)
    assert graph is not None
    result = check_graph(graph)
    codes = {d.code for d in result.diagnostics if d.is_error}
    assert "FG113" in codes  # the listed module does not exist
    assert "FG102" in codes  # so its kind is unknown
    assert "fg_plugin_unlisted" not in sys.modules


def test_entry_point_is_loaded_only_for_its_kind(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    module = "fg_ep_plugin"
    (tmp_path / f"{module}.py").write_text(PLUGIN.replace("shifted_reward", "ep_reward"))
    dist = tmp_path / "fg_ep_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fg-ep-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        f"[flowgraph.nodes]\nep_reward = {module}:ep_reward\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry.default()
    assert module not in sys.modules
    assert registry.get("no_such_kind_here") is None
    assert module not in sys.modules
    kind = registry.get("ep_reward")
    assert kind is not None and kind.source == module


def test_redeclaring_a_builtin_kind_is_an_error() -> None:
    from flowgraph.registry import KindSpec, register_kind

    with pytest.raises(RegistryError, match="built in"):
        register_kind(KindSpec("gae", "custom", "mine"))


def test_bad_return_annotation_is_a_clear_error() -> None:
    from flowgraph.registry import node_kind

    with pytest.raises(RegistryError, match="return annotation"):
        @node_kind("bad_ret", outputs=["a", "b"])
        def bad(x: float) -> float:
            return x


def test_plugin_source_text() -> None:
    assert textwrap.dedent(PLUGIN).count("@node_kind") == 1


def test_public_api_names_resolve() -> None:
    import flowgraph

    for name in flowgraph.__all__:
        assert getattr(flowgraph, name) is not None


LIST_PLUGIN = '''
from typing import Any
import torch
from jaxtyping import Float, Int
from torch import Tensor
from flowgraph.registry import node_kind

@node_kind("answer_length", outputs=["scores", "notes"], category="reward")
def answer_length(response_mask: Int[Tensor, "b T"], ground_truth: list[str],
                  extra_info: list[dict[str, Any]] | None = None
                  ) -> tuple[Float[Tensor, "b"], list[str]]:
    scores = torch.tensor([float(len(g)) for g in ground_truth])
    return scores, [f"{len(g)} chars" for g in ground_truth]
'''


def test_plain_list_annotations_are_ports_of_one_value_per_sequence(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`list[str]` is a str port, `list[dict]` (optional with `| None`) an object port,
    in and out; the checker holds edges to them: a str port takes `gen.ground_truth`,
    not a token tensor."""
    (tmp_path / "fg_list_plugin.py").write_text(LIST_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    text = GRAPH.format(module="fg_list_plugin").replace(
        "  rew:\n    kind: shifted_reward\n    inputs: {response_mask: gen.response_mask}\n"
        "    params: {scale: 2.0}\n",
        "  rew:\n    kind: answer_length\n    inputs: {response_mask: gen.response_mask, "
        "ground_truth: WIRE}\n")
    assert "WIRE" in text
    good, _ = load_graph(tmp_path / "g.yaml", text=text.replace("WIRE", "gen.ground_truth")
                         .replace("prompt_mask: train.attention_mask}",
                                  "prompt_mask: train.attention_mask, "
                                  "ground_truth: train.ground_truth}"))
    assert good is not None
    result = check_graph(good)
    kind = result.registry.get("answer_length")
    assert kind is not None
    assert [(p.name, p.spec.describe(), p.optional) for p in kind.inputs] == [
        ("response_mask", "int[b T]", False), ("ground_truth", "str[b]", False),
        ("extra_info", "object[b]", True)]
    assert [(p.name, p.spec.describe()) for p in kind.outputs] == [
        ("scores", "float[b]"), ("notes", "str[b]")]
    assert str(good.node("rew").input("ground_truth")) == "gen.ground_truth"  # type: ignore[union-attr]
    assert not [d for d in result.diagnostics if d.is_error and d.edge is not None
                and d.edge.endswith("rew.ground_truth")], \
        [d.one_line() for d in result.diagnostics]
    bad, _ = load_graph(tmp_path / "g.yaml", text=text.replace("WIRE", "gen.responses"))
    assert bad is not None
    errors = [d for d in check_graph(bad).diagnostics if d.is_error
              and d.edge == "gen.responses -> rew.ground_truth"]
    assert errors, [d.one_line() for d in check_graph(bad).diagnostics]


def test_every_builtin_param_says_what_it_means() -> None:
    """`flowgraph kinds <kind>` and the JSON Schema print these docs."""
    from flowgraph.kinds import BUILTIN_KINDS, POLICY_LOSSES

    undocumented = [f"{k.name}.{p.name}" for k in BUILTIN_KINDS.values() for p in k.params
                    if not p.doc.strip()]
    undocumented += [f"policy_loss {loss.name}.{p.name}" for loss in POLICY_LOSSES.values()
                     for p in loss.params if not p.doc.strip()]
    assert not undocumented


def test_a_plugin_file_is_this_graphs_even_after_anothers_of_its_name(tmp_path: Path) -> None:
    """Two graphs run in one process (a notebook, a test session), each with a
    `rewards.py` of its own: the second gets its own file, not the module the first
    left in `sys.modules`."""
    import importlib

    from flowgraph.registry import plugin_module

    def load(folder: str) -> Any:
        return importlib.import_module(plugin_module("rewards_twice.py", [str(tmp_path / folder)]))

    for name, value in (("first", 1.0), ("second", 2.0)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "rewards_twice.py").write_text(f"def score():\n    return {value}\n")
    try:
        first = load("first")
        assert first.score() == 1.0
        assert load("first") is first  # the same file: the module as it is
        assert load("second").score() == 2.0
    finally:
        sys.modules.pop("rewards_twice", None)
        sys.path[:] = [p for p in sys.path if not p.startswith(str(tmp_path))]


def test_the_params_every_kind_takes_are_the_ones_the_executor_reads() -> None:
    """`NODE_PARAMS` declares them (type, default, doc); the calling convention, below the
    kinds' records, names them to leave them out of an implementation's call."""
    assert tuple(p.name for p in NODE_PARAMS) == EXECUTOR_PARAMS
    assert all(p.executor for p in NODE_PARAMS)
