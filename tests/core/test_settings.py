"""Each graph-file setting is declared once (`flowgraph.settings`); the reader's keys and
checks, the records' own checks and the JSON Schema come from that declaration."""

from __future__ import annotations

from typing import Any

import pytest

from flowgraph import frontend
from flowgraph.errors import IRError
from flowgraph.frontend import load_graph
from flowgraph.ir import (
    LoraSpec,
    ModelSpec,
    OptimizerSpec,
    PoolSpec,
    ResourceSpec,
    TrainerSpec,
)
from flowgraph.schema import graph_schema
from flowgraph.settings import declared, written_types

GRAPH = """\
nodes: {}
models:
  actor:
    path: "builtin:tiny-lm"
    trainable: true
    optimizer: {lr: 1.0e-5}
    lora: {r: 8}
trainer:
  steps: 5
resources:
  nproc: 1
"""
RECORDS = [ModelSpec, OptimizerSpec, LoraSpec, TrainerSpec, ResourceSpec, PoolSpec]


@pytest.mark.parametrize("record", RECORDS)
def test_every_setting_is_declared_with_a_doc(record: type) -> None:
    settings = declared(record)
    assert settings and all(s.doc for _, s in settings)
    assert {f.name for f, _ in settings} == set(written_types(record))


@pytest.mark.parametrize(("table", "record"), [
    ("MODEL", ModelSpec), ("OPTIMIZER", OptimizerSpec), ("LORA", LoraSpec),
    ("TRAINER", TrainerSpec), ("RESOURCES", ResourceSpec), ("POOL", PoolSpec),
])
def test_the_reader_s_keys_are_the_record_s_settings(table: str, record: type) -> None:
    assert getattr(frontend, table) == written_types(record)


# (override, the error's words, its hint): each at the line of the value it is about.
@pytest.mark.parametrize(("override", "words", "hint"), [
    ("trainer.steps=-1", "`trainer.steps` is -1; it must be >= 0", None),
    ("trainer.admission=later", "`trainer.admission` is `later`; it must be one of block, "
     "drop", "use one of block, drop"),
    ("trainer.on_nonfinite=skp", "`trainer.on_nonfinite` is `skp`", "did you mean `skip`?"),
    ("resources.nproc=0", "`resources.nproc` is 0; it must be >= 1", None),
    ("resources.device=cdua", "`resources.device` is `cdua`", "did you mean `cuda`?"),
    ("models.actor.dtype=fp8", "`models.actor.dtype` is `fp8`; it must be one of float32, "
     "bfloat16, pure_bf16, float16", "use one of float32, bfloat16, pure_bf16, float16"),
    ("models.actor.optimizer.schedule=cosin", "`models.actor.optimizer.schedule` is `cosin`",
     "did you mean `cosine`?"),
    ("models.actor.lora.dropout=1.0", "`models.actor.lora.dropout` is 1.0; it must be < 1",
     None),
    ("models.actor.lora.alpha=0", "`models.actor.lora.alpha` is 0.0; it must be > 0",
     "alpha: 2*r is common (the update is scaled by alpha / r)"),
])
def test_a_value_outside_its_declaration_is_an_error(override: str, words: str,
                                                     hint: str | None) -> None:
    graph, diags = load_graph("g.yaml", [override], text=GRAPH)
    assert graph is not None
    [error] = [d for d in diags if d.is_error]
    assert (error.code, words in error.message, error.hint) == ("FG004", True, hint), error
    assert error.pos is not None and error.pos.file == "<command line>"


def test_the_error_sits_on_the_value_s_line() -> None:
    _, diags = load_graph("g.yaml", text=GRAPH.replace("  steps: 5", "  steps: -5"))
    assert [(d.code, d.pos.line if d.pos else 0) for d in diags] == [("FG004", 9)]


@pytest.mark.parametrize(("build", "words"), [
    (lambda: TrainerSpec(admission="later"), "trainer.admission is `later`; it must be one of"),
    (lambda: TrainerSpec(loggers=("console", "tensorbored")), "trainer.loggers is "
     "`tensorbored`"),
    (lambda: LoraSpec(r=0), "lora.r is 0; it must be >= 1"),
    (lambda: ResourceSpec(device="tpu"), "resources.device is `tpu`"),
    (lambda: ModelSpec("actor", "builtin:tiny-lm", dtype="fp8"), "models.actor.dtype is `fp8`"),
])
def test_a_record_built_in_python_checks_its_declared_settings(build: Any, words: str) -> None:
    with pytest.raises(IRError, match=words):
        build()


def test_the_schema_is_derived_from_the_declarations() -> None:
    schema = graph_schema()
    model = next(iter(schema["properties"]["models"]["patternProperties"].values()))
    sections = {
        TrainerSpec: schema["properties"]["trainer"],
        ResourceSpec: schema["properties"]["resources"],
        ModelSpec: model,
        OptimizerSpec: model["properties"]["optimizer"],
        LoraSpec: model["properties"]["lora"],
    }
    for record, section in sections.items():
        props = section["properties"]
        for f, s in declared(record):
            assert props[f.name]["description"] == s.doc
            if s.minimum is not None:
                assert props[f.name]["minimum"] == s.minimum
            if s.choices and f.name != "loggers":
                assert props[f.name]["enum"] == list(s.choices)
    trainer = schema["properties"]["trainer"]["properties"]
    assert trainer["loggers"]["items"]["enum"] == list(declared_choices(TrainerSpec, "loggers"))
    lora = model["properties"]["lora"]["properties"]
    assert (lora["dropout"]["minimum"], lora["dropout"]["exclusiveMaximum"]) == (0, 1)
    assert lora["alpha"]["exclusiveMinimum"] == 0


def declared_choices(record: type, name: str) -> tuple[str, ...]:
    return next(s.choices for f, s in declared(record) if f.name == name)
