"""`flowgraph schema`: the JSON Schema accepts every example graph and rejects typos."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from flowgraph.cli import main
from flowgraph.contracts import TensorSpec
from flowgraph.document import plain, read_document
from flowgraph.frontend import (
    MODEL,
    NODE,
    OPTIMIZER,
    POOL,
    RESOURCES,
    TOP,
    TRAINER,
    graph_from_yaml,
    graph_to_document,
)
from flowgraph.kinds import BUILTIN_KINDS
from flowgraph.registry import KindSpec, ParamSpec, PortSpec, Registry
from flowgraph.schema import graph_schema

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = sorted(p for p in (ROOT / "graphs").glob("**/*.yaml")
                if "broken" not in p.relative_to(ROOT / "graphs").parts)


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return graph_schema()


@pytest.fixture(scope="module")
def validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(schema)


def _load(path: Path) -> Any:
    """The document as flowgraph reads it (its YAML loader, merge keys resolved)."""
    doc, diags = read_document(path.read_text(encoding="utf-8"), str(path))
    assert doc is not None, diags
    return plain(doc)


def _errors(validator: jsonschema.Draft202012Validator, doc: Any) -> list[str]:
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in validator.iter_errors(doc))


def test_schema_is_valid_for_both_drafts(schema: dict[str, Any]) -> None:
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)
    # Editors (VS Code's YAML extension) validate with draft-07 rules.
    jsonschema.Draft7Validator.check_schema(schema)


def test_every_example_graph_is_found() -> None:
    names = {p.name for p in GRAPHS}
    assert {"ppo.yaml", "grpo.yaml", "dpo.yaml", "rloo.yaml", "reinforce_pp.yaml",
            "remax.yaml"} <= names


@pytest.mark.parametrize("path", GRAPHS, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_graph_validates(validator: jsonschema.Draft202012Validator, path: Path) -> None:
    assert _errors(validator, _load(path)) == []
    assert _errors(jsonschema.Draft7Validator(validator.schema), _load(path)) == []


def test_a_graph_using_every_key_validates(validator: jsonschema.Draft202012Validator) -> None:
    text = """\
version: 1
name: full
description: every section and key
dims: {Bp: 2, N: 2, P: 4, T: 3, V: null, K: 5}
models:
  actor:
    path: "builtin:tiny-lm"
    trainable: true
    dtype: bfloat16
    tokenizer: "builtin:tiny-lm"
    gradient_checkpointing: true
    config: {hidden_size: 128}
    optimizer: {name: adamw, lr: 1, weight_decay: 0.01, betas: [0.9, 0.95], eps: 1.0e-8,
                warmup_steps: 2, schedule: cosine, grad_clip: 0}
data:
  train: {kind: prompts, path: "builtin:arith", max_prompt_length: 4, shuffle: false,
          eval_path: null, format: builtin}
nodes:
  gen:
    kind: generate
    model: actor
    inputs: {prompts: train.input_ids, prompt_mask: train.attention_mask}
    params: {backend: vllm, n: 2, max_new_tokens: 3, top_k: 0, temperature: 0.7}
  score:
    kind: reward
    inputs: {responses: gen.responses, response_mask: gen.response_mask}
    params: {fn: length_penalty, target_length: null}
  adv:
    kind: grpo
    inputs: {scores: score.scores, response_mask: gen.response_mask, index: gen.index}
  update:
    kind: ppo_actor_update
    model: actor
    hoisted: false
    inputs: {prompts: gen.prompts, prompt_mask: gen.prompt_mask, responses: gen.responses,
             response_mask: gen.response_mask, old_log_prob: gen.rollout_log_prob,
             advantages: adv.advantages}
    params: {mini_batch_size: null, loss_agg_mode: seq-mean-token-sum}
trainer: {steps: 2, seed: 1, run_dir: runs/x, checkpoint_every: 1, eval_every: 0,
          resume: false, strict: true, on_nonfinite: skip, step_timeout_s: 30,
          metrics_port: null, loggers: [console, jsonl, wandb, mlflow],
          mlflow_tracking_uri: null}
resources:
  device: cpu
  nproc: 2
  memory_gib: 16
  pools: {main: {size: 2, models: [actor]}}
"""
    path = Path("full.yaml")
    doc, _ = read_document(text, str(path))
    assert doc is not None
    assert _errors(validator, plain(doc)) == []
    # The IR written back as a document is a graph file too.
    assert _errors(validator, graph_to_document(graph_from_yaml(text))) == []


# --- what must fail --------------------------------------------------------------------


def _ppo() -> Any:
    return _load(ROOT / "graphs" / "ppo.yaml")


def _top_key(doc: Any) -> None:
    doc["trainers"] = {"steps": 1}


def _param(doc: Any) -> None:
    doc["nodes"]["adv"]["params"]["lamda"] = 0.9


def _port(doc: Any) -> None:
    inputs = doc["nodes"]["adv"]["inputs"]
    inputs["value"] = inputs.pop("values")


def _kind(doc: Any) -> None:
    doc["nodes"]["adv"]["kind"] = "gea"


def _ref(doc: Any) -> None:
    doc["nodes"]["adv"]["inputs"]["values"] = "values"


def _choice(doc: Any) -> None:
    doc["nodes"]["kl"]["params"]["penalty"] = "kl2"


def _minimum(doc: Any) -> None:
    doc["nodes"]["adv"]["params"]["gamma"] = -0.5


def _param_type(doc: Any) -> None:
    doc["nodes"]["update_actor"]["params"]["ppo_epochs"] = 1.5


def _model_not_taken(doc: Any) -> None:
    doc["nodes"]["kl"]["model"] = "actor"


def _model_missing(doc: Any) -> None:
    del doc["nodes"]["values"]["model"]


def _data_param(doc: Any) -> None:
    doc["data"]["train"]["shufle"] = True


def _dtype(doc: Any) -> None:
    doc["models"]["actor"]["dtype"] = "fp8"


def _optimizer(doc: Any) -> None:
    doc["models"]["actor"]["optimizer"]["lr_rate"] = 1e-5


def _dim(doc: Any) -> None:
    doc["dims"]["T"] = 0


def _trainer(doc: Any) -> None:
    doc["trainer"]["on_nonfinite"] = "ignore"


def _loggers(doc: Any) -> None:
    doc["trainer"]["loggers"] = ["console", "wandbb"]


def _node_name(doc: Any) -> None:
    doc["nodes"]["bad-name"] = doc["nodes"].pop("adv")


@pytest.mark.parametrize(("mutate", "expected"), [
    (_top_key, ": Additional properties are not allowed ('trainers' was unexpected)"),
    (_param, "nodes/adv/params: Additional properties are not allowed ('lamda' was unexpected)"),
    (_port, "nodes/adv/inputs: Additional properties are not allowed ('value' was unexpected)"),
    (_kind, "nodes/adv/kind: 'gea' is not one of"),
    (_ref, "nodes/adv/inputs/values: 'values' does not match"),
    (_choice, "nodes/kl/params/penalty: 'kl2' is not one of ['kl', 'abs', 'mse', 'low_var_kl']"),
    (_minimum, "nodes/adv/params/gamma: -0.5 is less than the minimum of 0"),
    (_param_type, "nodes/update_actor/params/ppo_epochs: 1.5 is not of type 'integer'"),
    (_model_not_taken, "nodes/kl: Additional properties are not allowed ('model' was unexpected)"),
    (_model_missing, "nodes/values: 'model' is a required property"),
    (_data_param, "data/train: Additional properties are not allowed ('shufle' was unexpected)"),
    (_dtype, "models/actor/dtype: 'fp8' is not one of ['float32', 'bfloat16', 'pure_bf16', "
             "'float16']"),
    (_optimizer, "models/actor/optimizer: Additional properties are not allowed"),
    (_dim, "dims/T: 0 is less than the minimum of 1"),
    (_trainer, "trainer/on_nonfinite: 'ignore' is not one of ['stop', 'skip']"),
    (_loggers, "trainer/loggers/1: 'wandbb' is not one of ['console', 'jsonl', "
               "'tensorboard', 'wandb', 'mlflow']"),
    (_node_name, "nodes: 'bad-name' does not match any of the regexes"),
])
def test_mistakes_fail_validation(validator: jsonschema.Draft202012Validator, mutate: Any,
                                  expected: str) -> None:
    doc = copy.deepcopy(_ppo())
    mutate(doc)
    errors = _errors(validator, doc)
    assert any(e.startswith(expected) for e in errors), errors


def test_misspelt_port_also_reports_the_missing_one(
        validator: jsonschema.Draft202012Validator) -> None:
    doc = copy.deepcopy(_ppo())
    _port(doc)
    assert "nodes/adv/inputs: 'values' is a required property" in _errors(validator, doc)


def test_plugins_allow_kinds_the_registry_does_not_know(
        validator: jsonschema.Draft202012Validator) -> None:
    doc = copy.deepcopy(_ppo())
    doc["plugins"] = ["my_pkg.rewards"]
    doc["nodes"]["custom"] = {"kind": "length_reward", "inputs": {"x": "gen.responses"},
                              "params": {"scale": 0.1}}
    assert _errors(validator, doc) == []
    doc["nodes"]["custom"]["inputs"]["x"] = "gen"
    assert _errors(validator, doc) == [
        "nodes/custom/inputs/x: 'gen' does not match "
        "'^([A-Za-z_][A-Za-z0-9_]*)\\\\.([A-Za-z_][A-Za-z0-9_]*)$'"]


# --- generated from the registry and the key tables ------------------------------------


def test_every_builtin_kind_appears(schema: dict[str, Any]) -> None:
    defs = schema["$defs"]
    entries = {"node": schema["properties"]["nodes"], "data": schema["properties"]["data"]}
    for kind in BUILTIN_KINDS.values():
        role = "data" if kind.category == "data" else "node"
        assert defs[f"{role}.{kind.name}"]["properties"]["kind"]["const"] == kind.name
        choices = entries[role]["patternProperties"]["^[A-Za-z_][A-Za-z0-9_]*$"]
        consts = [c.get("const") for c in choices["properties"]["kind"]["anyOf"]]
        assert kind.name in consts


def test_kind_schema_follows_its_contract(schema: dict[str, Any]) -> None:
    gae = schema["$defs"]["node.gae"]
    assert gae["additionalProperties"] is False
    assert "model" not in gae["properties"]
    inputs = gae["properties"]["inputs"]
    assert set(inputs["properties"]) == {"token_level_rewards", "values", "response_mask"}
    assert inputs["required"] == ["token_level_rewards", "values", "response_mask"]
    assert inputs["additionalProperties"] is False
    assert "float[b T] {finite}" in inputs["properties"]["values"]["description"]
    lam = gae["properties"]["params"]["properties"]["lam"]
    assert lam == {"type": "number", "minimum": 0, "default": 1.0,
                   "description": "GAE lambda. Default: 1.0."}

    gen = schema["$defs"]["node.generate"]
    assert "model" in gen["required"]
    params = gen["properties"]["params"]["properties"]
    assert params["backend"]["enum"] == ["hf", "vllm"]
    assert params["n"]["type"] == ["integer", "null"]
    assert params["n"]["minimum"] == 1
    assert params["max_new_tokens"]["description"] == (
        "response length; binds T. Binds the dim `T`. Default: null.")
    assert "ground_truth" not in gen["properties"]["inputs"]["required"]

    prompts = schema["$defs"]["data.prompts"]
    assert prompts["required"] == ["kind", "path"]
    assert prompts["properties"]["shuffle"] == {
        "type": "boolean", "default": True,
        "description": "reshuffle the rows every epoch (seeded by the run's seed). Default: true."}


@pytest.mark.parametrize(("path", "table"), [
    (("properties",), TOP),
    (("properties", "models", "patternProperties", "*", "properties"), MODEL),
    (("properties", "models", "patternProperties", "*", "properties", "optimizer",
      "properties"), OPTIMIZER),
    (("$defs", "node.plugin", "properties"), NODE),
    (("properties", "trainer", "properties"), TRAINER),
    (("properties", "resources", "properties"), RESOURCES),
    (("properties", "resources", "properties", "pools", "patternProperties", "*",
      "properties"), POOL),
])
def test_sections_follow_the_frontend_tables(schema: dict[str, Any], path: tuple[str, ...],
                                             table: dict[str, Any]) -> None:
    node: Any = schema
    for key in path:
        node = next(iter(node.values())) if key == "*" else node[key]
    assert list(node) == list(table)
    assert all(node[k]["description"] for k in table)


def test_defaults_come_from_the_ir(schema: dict[str, Any]) -> None:
    trainer = schema["properties"]["trainer"]["properties"]
    assert trainer["steps"]["default"] == 10
    assert trainer["steps"]["minimum"] == 0
    model = schema["properties"]["models"]["patternProperties"]["^[A-Za-z_][A-Za-z0-9_]*$"]
    assert model["required"] == ["path"]
    assert model["properties"]["dtype"]["default"] == "float32"
    assert model["properties"]["optimizer"]["properties"]["betas"]["default"] == [0.9, 0.999]
    assert "default" not in model["properties"]["tokenizer"]


def test_a_registry_with_plugin_kinds(validator: jsonschema.Draft202012Validator) -> None:
    length = KindSpec(
        "length_reward", "custom", "Reward by length.",
        inputs=(PortSpec("response_mask", TensorSpec("b T", "mask")),),
        outputs=(PortSpec("scores", TensorSpec("b", "float")),),
        params=(ParamSpec("scale", ("float",), 0.01, doc="per token"),
                ParamSpec("target", ("int",), required=True)),
        source="my_pkg.rewards")
    schema = graph_schema(Registry({**BUILTIN_KINDS, length.name: length}))
    custom = schema["$defs"]["node.length_reward"]
    assert custom["required"] == ["kind", "inputs", "params"]
    assert custom["properties"]["params"]["required"] == ["target"]
    doc = copy.deepcopy(_ppo())
    doc["nodes"]["length"] = {"kind": "length_reward",
                              "inputs": {"response_mask": "gen.response_mask"},
                              "params": {"scale": 0.1}}
    check = jsonschema.Draft202012Validator(schema)
    assert _errors(check, doc) == ["nodes/length/params: 'target' is a required property"]
    # Without that kind in the registry the name is unknown.
    assert any("'length_reward' is not one of" in e for e in _errors(validator, doc))


# --- the command line ------------------------------------------------------------------


def test_cli_prints_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == graph_schema()


def test_cli_writes_the_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "flowgraph.schema.json"
    assert main(["schema", "-o", str(out)]) == 0
    assert json.loads(out.read_text(encoding="utf-8")) == graph_schema()
    assert f"schema written to {out}" in capsys.readouterr().out


def test_cli_bad_plugin_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", "--plugin", "no_such_module_xyz"]) == 2
    err = capsys.readouterr().err
    assert "no_such_module_xyz" in err and "Traceback" not in err
