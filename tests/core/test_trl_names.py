"""TRL's names (issue #26 point 6): unknown keys of the Python builder are the graph
file's FG003 at the user's line, a TRL name's diagnostic says which flowgraph setting it
is, `lora=` takes peft's `LoraConfig` and key names, and the README's "From TRL" table
is `flowgraph.trl_names`' data, held to settings that exist and to TRL 1.16's defaults."""

import json
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest
from peft import LoraConfig

from flowgraph.builder import GraphBuilder
from flowgraph.checker import check_graph
from flowgraph.dims import CANONICAL_DIMS
from flowgraph.errors import GraphError
from flowgraph.frontend import graph_from_yaml, load_graph
from flowgraph.ir import LoraSpec, ModelSpec, OptimizerSpec, ResourceSpec, TrainerSpec
from flowgraph.passes import compile_graph
from flowgraph.registry import Registry
from flowgraph.trl_names import ABSENT, TRAINER_ARG, TRL_NAMES, markdown_table, trl_hint

ROOT = Path(__file__).resolve().parents[2]
TRL = json.loads((ROOT / "tests" / "fixtures" / "trl" / "grpo_config_defaults.json").read_text())


def _line() -> int:
    return sys._getframe(1).f_lineno


def _raised(call: object) -> GraphError:
    with pytest.raises(GraphError) as exc:
        call()  # type: ignore[operator]
    return exc.value


@pytest.mark.parametrize(("call", "where", "key", "hint"), [
    (lambda g: g.trainer(logging_steps=5), "trainer", "logging_steps", "`trainer.log_every`"),
    (lambda g: g.trainer(stepz=5), "trainer", "stepz", "did you mean `steps`?"),
    (lambda g: g.model("actor", "builtin:tiny-lm", optimizer={"lrr": 1e-3}),
     "models.actor.optimizer", "lrr", "did you mean `lr`?"),
    (lambda g: g.model("actor", "builtin:tiny-lm", optimizer={"lr_scheduler_type": "linear"}),
     "models.actor.optimizer", "lr_scheduler_type", "`models.actor.optimizer.schedule`"),
    (lambda g: g.model("actor", "builtin:tiny-lm", tokenzier="gpt2"), "models.actor",
     "tokenzier", "did you mean `tokenizer`?"),
    (lambda g: g.model("actor", "builtin:tiny-lm", lora={"lora_alpah": 16}),
     "models.actor.lora", "lora_alpah", "did you mean `lora_alpha`?"),
    (lambda g: g.resources(num_processes=2), "resources", "num_processes",
     "expected one of: device, nproc"),
])
def test_an_unknown_builder_key_is_the_graph_files_fg003_at_the_users_line(
        call: object, where: str, key: str, hint: str) -> None:
    g = GraphBuilder("g")
    err = _raised(lambda: call(g))  # type: ignore[operator]
    (d,) = err.diagnostics
    assert (d.code, d.message) == ("FG003", f"unknown key `{key}` in {where}")
    assert (d.pos.file, d.pos.line) == (__file__, call.__code__.co_firstlineno)  # type: ignore[attr-defined]
    assert hint in (d.hint or "") and hint in str(err)


@pytest.mark.parametrize(("section", "key"), [
    ("trainer", "logging_steps"), ("trainer", "save_steps"), ("trainer", "report_to"),
    ("models.actor.optimizer", "lr_scheduler_type"), ("models.actor", "peft_config")])
def test_yaml_and_the_builder_say_the_same_for_a_trl_name(section: str, key: str) -> None:
    text = (ROOT / "graphs" / "grpo.yaml").read_text()
    _, diags = load_graph("g.yaml", overrides=[f"{section}.{key}=5"], text=text)
    (d,) = [d for d in diags if d.code == "FG003"]
    assert d.message == f"unknown key `{key}` in {section}"
    assert d.hint == trl_hint(key) and d.hint is not None
    g = GraphBuilder("g")
    if section == "trainer":
        err = _raised(lambda: g.trainer(**{key: 5}))
    elif section == "models.actor":
        err = _raised(lambda: g.model("actor", "builtin:tiny-lm", **{key: 5}))
    else:
        err = _raised(lambda: g.model("actor", "builtin:tiny-lm", optimizer={key: 5}))
    assert [(e.code, e.message, e.hint) for e in err.diagnostics] == [
        (d.code, d.message, d.hint)]


def test_a_trl_name_at_the_top_of_a_graph_file_names_its_dim() -> None:
    text = (ROOT / "graphs" / "grpo.yaml").read_text() + "num_generations: 8\n"
    _, diags = load_graph("g.yaml", text=text)
    (d,) = [d for d in diags if d.code == "FG003"]
    assert d.message == "unknown key `num_generations` in the graph file"
    assert "`dims.N`" in (d.hint or "")


def test_the_builder_takes_lists_as_a_graph_file_does_and_refuses_a_wrong_optimizer() -> None:
    g = GraphBuilder("g")
    g.trainer(loggers=["console", "wandb"])  # TRL's report_to=["wandb"]
    g.model("actor", "builtin:tiny-lm", trainable=True,
            optimizer={"lr": 1e-5, "betas": [0.9, 0.95]})
    graph = g.build()
    assert graph.trainer.loggers == ("console", "wandb")
    assert graph.models[0].optimizer == OptimizerSpec(lr=1e-5, betas=(0.9, 0.95))
    err = _raised(lambda: g.model("critic", "builtin:tiny-lm", optimizer="adamw"))
    assert [d.code for d in err.diagnostics] == ["FG004"]
    assert "`models.critic.optimizer` must be a mapping or an OptimizerSpec, got str" in str(err)


@pytest.mark.parametrize(("where", "key", "names"), [
    ("nodes.update_actor.params", "beta", "`ppo_actor_update.kl_loss_coef`, `kl_penalty.kl_coef`"),
    ("nodes.update_actor.params", "epsilon_high", "`ppo_actor_update.clip_ratio_high`"),
    ("nodes.update_actor.params", "loss_type", "`ppo_actor_update.loss_agg_mode`"),
    ("nodes.gen.params", "num_generations", "`dims.N`, `generate.n`"),
    ("nodes.gen.params", "max_completion_length", "`dims.T`"),
    ("nodes.adv.params", "scale_rewards", "`grpo.norm_by_std`"),
])
def test_a_trl_name_as_a_node_param_is_fg112_naming_the_param_here(
        where: str, key: str, names: str) -> None:
    graph, diags = load_graph(ROOT / "graphs" / "grpo.yaml", overrides=[f"{where}.{key}=1"])
    assert graph is not None and not [d for d in diags if d.is_error]
    (d,) = [d for d in check_graph(graph).diagnostics if d.code == "FG112"]
    assert d.message.endswith(f"has no parameter `{key}`")
    assert d.hint is not None and d.hint.startswith(f"`{key}` is TRL's name; here: ")
    assert names in d.hint


def test_a_trl_name_in_a_python_nodes_params_points_at_the_users_line() -> None:
    g = GraphBuilder("g")
    g.dims(Bp=2, N=2, P=8, T=4)
    g.model("actor", "builtin:tiny-lm", trainable=True)
    train = g.data("train", "prompts", "builtin:arith")
    line = _line() + 1
    g.node("gen", "generate", model="actor", params={"num_generations": 4},
           prompts=train.input_ids, prompt_mask=train.attention_mask)
    (d,) = [d for d in check_graph(g.build()).diagnostics if d.code == "FG112"]
    assert (d.pos.file, d.pos.line) == (__file__, line)
    assert "`dims.N`" in (d.hint or "")


# --- lora= ---------------------------------------------------------------------------


def _lora_of_grpo_lora() -> LoraSpec:
    graph = graph_from_yaml((ROOT / "graphs" / "grpo_lora.yaml").read_text())
    actor = graph.model("actor")
    assert actor is not None and actor.lora is not None
    return actor.lora


@pytest.mark.parametrize("lora", [
    LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
    {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear",
     "bias": "none", "task_type": "CAUSAL_LM"},
    {"r": 8, "alpha": 16, "target_modules": ["all-linear"]},
], ids=["LoraConfig", "peft-keys", "graph-file-keys"])
def test_lora_takes_a_peft_config_or_peft_keys_and_compiles_as_the_graph_file(
        lora: object) -> None:
    g = GraphBuilder("g")
    g.model("actor", "builtin:tiny-lm-sft", trainable=True, lora=lora)
    spec = g.build().model("actor")
    assert spec is not None and spec.lora == _lora_of_grpo_lora()
    # the compiler reads it (a LoraConfig stored as it was: AttributeError 'pos')
    graph = graph_from_yaml((ROOT / "graphs" / "grpo_lora.yaml").read_text())
    built = replace(graph, models=tuple(replace(m, lora=spec.lora) if m.name == "actor" else m
                                        for m in graph.models))
    result = compile_graph(built)
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]


def test_a_peft_config_keeps_its_own_values_and_names_its_modules() -> None:
    g = GraphBuilder("g")
    g.model("actor", "builtin:tiny-lm", trainable=True,
            lora=LoraConfig(r=4, lora_dropout=0.1, target_modules=["v_proj", "q_proj"]))
    spec = g.build().model("actor")
    assert spec is not None
    # peft's own default alpha (8), not the graph file's (16); its set of modules, sorted
    assert spec.lora == LoraSpec(r=4, alpha=8.0, dropout=0.1, target_modules=("q_proj", "v_proj"))


@pytest.mark.parametrize(("lora", "messages"), [
    (LoraConfig(r=8), ["`models.actor.lora`: the LoraConfig's `target_modules=None` does "
                       "not name modules"]),
    (LoraConfig(target_modules="all-linear", use_dora=True, use_rslora=True, bias="all",
                task_type="SEQ_CLS"),
     ["`models.actor.lora.task_type` is 'SEQ_CLS'; flowgraph's LoRA takes only None, "
      "'CAUSAL_LM'",
      "`models.actor.lora.bias` is 'all'; flowgraph's LoRA takes only 'none'",
      "`models.actor.lora`: the LoraConfig sets `use_rslora=True`, which flowgraph's LoRA "
      "does not apply",
      "`models.actor.lora`: the LoraConfig sets `use_dora=True`, which flowgraph's LoRA "
      "does not apply"]),
    (LoraConfig(target_modules=".*proj"), ["the LoraConfig's `target_modules='.*proj'` does "
                                           "not name modules"]),
    ({"r": 8, "lora_alpha": 16, "use_dora": True}, ["unknown key `use_dora` in models.actor.lora"]),
    ({"r": 8, "bias": "lora_only"}, ["`models.actor.lora.bias` is 'lora_only'"]),
    ("r=8", ["`models.actor.lora` must be a mapping, a LoraSpec or a peft LoraConfig, got str"]),
])
def test_lora_fields_flowgraph_does_not_apply_are_refused_never_dropped(
        lora: object, messages: list[str]) -> None:
    g = GraphBuilder("g")
    line = _line() + 1
    err = _raised(lambda: g.model("actor", "builtin:tiny-lm", trainable=True, lora=lora))
    assert len(err.diagnostics) == len(messages)
    for d, message in zip(err.diagnostics, messages, strict=True):
        assert message in d.message, d.message
        assert (d.pos.file, d.pos.line) == (__file__, line)


# --- the README's table ---------------------------------------------------------------

_RECORDS = {"trainer": TrainerSpec, "resources": ResourceSpec}


def _exists(name: str) -> bool:
    """A flowgraph name of the table is a setting or param there is."""
    parts = name.split(".")
    if parts[0] == "dims":
        return len(parts) == 2 and parts[1] in CANONICAL_DIMS
    if parts[0] in _RECORDS:
        return len(parts) == 2 and parts[1] in {f.name for f in fields(_RECORDS[parts[0]])}
    if parts[0] == "models":
        rest = parts[2:]
        if rest[:1] == ["optimizer"]:
            return len(rest) == 2 and rest[1] in {f.name for f in fields(OptimizerSpec)}
        return len(rest) == 1 and rest[0] in {f.name for f in fields(ModelSpec)}
    kind = Registry.default().get(parts[0])
    return len(parts) == 2 and kind is not None and kind.param(parts[1]) is not None


def test_the_readme_table_is_the_mapping_and_names_what_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### From TRL: the names", 1)[1].split("\n#", 1)[0]
    assert markdown_table() in section  # python -c "...; print(markdown_table())"
    missing = [t for row in TRL_NAMES for t in row.flowgraph if not _exists(t)]
    assert missing == []
    wanted = {"num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
              "beta", "epsilon", "epsilon_high", "loss_type", "scale_rewards",
              "max_prompt_length", "max_completion_length", "logging_steps", "save_steps",
              "lr_scheduler_type", "report_to", "peft_config"}
    assert wanted <= {t for row in TRL_NAMES for t in row.trl}


def test_the_tables_trl_defaults_are_trl_1_16s() -> None:
    """tests/fixtures/trl/grpo_config_defaults.json: scripts/trl_names_fixture.py, run in
    the venv that has TRL 1.16."""
    assert TRL["trl"] == "1.16.0"
    for row in TRL_NAMES:
        for name, default in zip(row.trl, row.defaults, strict=True):
            if default == ABSENT:
                assert name not in TRL["defaults"]
            elif default == TRAINER_ARG:
                assert name in TRL["trainer_args"]
            else:
                assert TRL["defaults"].get(name) == default, name
