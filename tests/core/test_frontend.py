"""YAML front end: positions, safe loading, unknown keys, overrides, round trip."""

from pathlib import Path

import pytest
import yaml

import flowgraph.document as document
from flowgraph.builder import GraphBuilder
from flowgraph.diagnostics import Diagnostic
from flowgraph.document import YMap, YScalar, YSeq, plain, read_document
from flowgraph.errors import GraphError
from flowgraph.frontend import graph_from_yaml, graph_to_yaml, load_graph

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = sorted((ROOT / "graphs").glob("*.yaml"))
ALL_GRAPHS = sorted((ROOT / "graphs").glob("**/*.yaml"))

SMALL = """\
name: small
dims: {Bp: 2, N: 2, P: 4, T: 4}
models:
  actor:
    path: "builtin:tiny-lm"
    trainable: true
    optimizer: {lr: 1e-5, betas: [0.9, 0.95]}
data:
  train: {kind: prompts, path: "builtin:arith", shuffle: false}
nodes:
  gen:
    kind: generate
    model: actor
    inputs: {prompts: train.input_ids, prompt_mask: train.attention_mask}
    params: {n: 2, temperature: 0.7}
trainer: {steps: 3, seed: 7}
"""


def _codes(text: str, overrides: tuple[str, ...] = ()) -> list[tuple[str, int, int]]:
    _, diags = load_graph("g.yaml", overrides, text=text)
    return [(d.code, d.pos.line if d.pos else 0, d.pos.col if d.pos else 0) for d in diags]


def test_every_element_keeps_its_position() -> None:
    graph, diags = load_graph("g.yaml", text=SMALL)
    assert graph is not None and not diags
    gen = graph.nodes[0]
    assert (gen.pos.line, gen.pos.col) == (11, 3)
    prompts = gen.input("prompts")
    assert prompts is not None and (prompts.pos.line, prompts.pos.col) == (14, 23)
    temperature = gen.params.find("temperature")
    assert temperature is not None and temperature.pos.line == 15
    assert graph.models[0].pos.line == 4
    assert graph.data[0].pos.line == 9
    assert graph.dims[1].name == "N" and graph.dims[1].pos.line == 2
    assert graph.trainer.pos.line == 16


def test_exponent_floats_are_numbers() -> None:
    # YAML 1.1 reads `1e-5` as a string; graph files read it as the number it means.
    graph, _ = load_graph("g.yaml", text=SMALL)
    assert graph is not None and graph.models[0].optimizer is not None
    assert graph.models[0].optimizer.lr == 1e-5
    assert graph.models[0].optimizer.betas == (0.9, 0.95)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("nodes: {}\ntrainer: {stesp: 3}\n", [("FG003", 2, 11)]),
        ("nodes: {}\nmodles: {}\n", [("FG003", 2, 1)]),
        ("nodes: {}\ntrainer: {steps: many}\n", [("FG004", 2, 18)]),
        ("nodes: {}\ntrainer: {steps: 1, steps: 2}\n", [("FG005", 2, 21)]),
        ("nodes:\n  a: {model: x}\n", [("FG007", 2, 3)]),
        ("nodes:\n  a: {kind: gae, inputs: {x: nodot}}\n", [("FG115", 2, 30)]),
        ("nodes: {}\nx: !!python/object/apply:os.system [echo]\n", [("FG002", 2, 4)]),
        ("nodes: {}\nx: !custom 3\n", [("FG002", 2, 4)]),
        ("nodes: [\n", [("FG001", 2, 1)]),
        ("", [("FG007", 1, 1)]),
        ("nodes: {}\ndims: {T: 0}\n", [("FG206", 2, 11)]),
        ("nodes: {}\ntrainer: {steps: 1e999}\n", [("FG004", 2, 18)]),
    ],
)
def test_document_problems_are_located(text: str, expected: list[tuple[str, int, int]]) -> None:
    assert _codes(text) == expected


def _located(diags: list[Diagnostic]) -> list[tuple[str, int, int]]:
    return [(d.code, d.pos.line, d.pos.col) for d in diags if d.pos]


def test_each_unreadable_value_is_reported_where_it_is() -> None:
    # The value is dropped; every occurrence has its own FG004.
    doc, diags = read_document("a: 2001-13-45\nb: [2001-13-45, 2001-12-14]\n", "f.yaml")
    assert _located(diags) == [("FG004", 1, 4), ("FG004", 2, 5)]
    assert doc is not None and plain(doc) == {"b": ["2001-12-14"]}


def test_exponent_floats_keep_their_positions_and_quoted_ones_stay_text() -> None:
    doc, diags = read_document("a: 1e-5\nb: [1e-5, '1e-5', 1E5, +2e3, 1e-5]\nc: {1e-5: x}\n",
                               "f.yaml")
    assert _located(diags) == [("FG004", 3, 5)]  # a number is not a name: not a key
    assert isinstance(doc, YMap)
    b = doc.get("b")
    assert isinstance(b, YSeq)
    assert [(i.value, i.pos.col) for i in b.items if isinstance(i, YScalar)] == [
        (1e-5, 5), ("1e-5", 11), (1e5, 19), (2e3, 24), (1e-5, 30)]


def test_a_merge_key_is_never_taken_for_a_value() -> None:
    _, diags = read_document("d: &d {x: 1}\ne: {y: <<, <<: *d}\nf: {<<: *d, z: <<}\n", "f.yaml")
    assert _located(diags) == [("FG002", 2, 8), ("FG002", 3, 16)]


@pytest.mark.parametrize("path", ALL_GRAPHS, ids=[str(p.relative_to(ROOT)) for p in ALL_GRAPHS])
def test_libyaml_and_the_pure_python_parser_read_the_same(path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Syntax errors are worded by each parser in its own way; code and place agree.
    text = path.read_text(encoding="utf-8")
    fast = read_document(text, "f.yaml")
    monkeypatch.setattr(document, "_Loader", yaml.SafeLoader)
    pure = read_document(text, "f.yaml")
    assert fast[0] == pure[0]
    assert [(d.code, d.pos) for d in fast[1]] == [(d.code, d.pos) for d in pure[1]]
    if not any(d.code == "FG001" for d in fast[1]):
        assert fast[1] == pure[1]


def test_unknown_key_suggests_the_close_one() -> None:
    _, diags = load_graph("g.yaml", text="nodes: {}\ntrainer: {stesp: 3}\n")
    assert diags[0].hint == "did you mean `steps`?"


def test_tags_are_never_constructed(tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    text = f'nodes: {{}}\nx: !!python/object/apply:os.system ["touch {sentinel}"]\n'
    _, diags = load_graph("g.yaml", text=text)
    assert [d.code for d in diags] == ["FG002"]
    assert not sentinel.exists()


def test_alias_bomb_and_recursive_alias_are_refused() -> None:
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi", strict=False)
    )
    assert [c for c, _, _ in _codes(bomb)] == ["FG008"]
    assert [c for c, _, _ in _codes("a: &a [*a]\n")] == ["FG008"]


def test_overrides_apply_before_the_ir_is_built() -> None:
    graph, diags = load_graph(
        "g.yaml", ["trainer.steps=20", "nodes.gen.params.temperature=0.9",
                   "nodes.gen.params.top_p=0.5", "dims.T=8"], text=SMALL)
    assert graph is not None and not diags
    assert graph.trainer.steps == 20
    assert graph.nodes[0].params.to_python() == {"n": 2, "temperature": 0.9, "top_p": 0.5}
    assert graph.dim_values()["T"] == 8


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("nodes.gne.params.n=3", "there is no `gne` under `nodes`"),
        ("trainer.steps", "is not `dotted.key=value`"),
        ("trainer.steps.x=1", "`trainer.steps` is not a mapping"),
        ("trainer.steps=!!python/name:os.system", "not plain YAML"),
    ],
)
def test_bad_overrides_are_reported(override: str, message: str) -> None:
    _, diags = load_graph("g.yaml", [override], text=SMALL)
    assert [d.code for d in diags] == ["FG006"]
    assert message in diags[0].message


@pytest.mark.parametrize("path", GRAPHS, ids=[p.name for p in GRAPHS])
def test_yaml_round_trip_gives_an_equal_graph(path: Path) -> None:
    graph, diags = load_graph(path)
    assert graph is not None and not diags
    again = graph_from_yaml(graph_to_yaml(graph))
    assert again == graph
    assert graph_to_yaml(again) == graph_to_yaml(graph)


def test_python_builder_and_yaml_give_the_same_ir() -> None:
    g = GraphBuilder("small")
    g.dims(Bp=2, N=2, P=4, T=4)
    g.model("actor", "builtin:tiny-lm", trainable=True,
            optimizer={"lr": 1e-5, "betas": [0.9, 0.95]})
    train = g.data("train", "prompts", "builtin:arith", shuffle=False)
    g.node("gen", "generate", model="actor", params={"n": 2, "temperature": 0.7},
           prompts=train.input_ids, prompt_mask=train.attention_mask)
    g.trainer(steps=3, seed=7)
    built = g.build()
    loaded, _ = load_graph("g.yaml", text=SMALL)
    assert built == loaded
    # The builder remembers the Python line that made each element.
    assert built.nodes[0].pos.file == __file__
    assert built.nodes[0].input("prompts") is not None


def test_the_builder_takes_resource_pools_as_a_graph_file_writes_them() -> None:
    """`resources(pools=...)` gives the pools of the same `resources:` in YAML (mappings
    of custom resources and labels included); a misspelt pool setting is FG003 at the
    caller's line, as any other builder key."""
    pools = {"actor_pool": {"size": 2, "models": ["actor"], "cpus": 2,
                            "custom_resources": {"TPU": 1}, "strategy": "spread",
                            "label_selector": {"zone": "a"}}}
    g = GraphBuilder("small").resources(nproc=2, pools=pools)
    loaded, diags = load_graph("g.yaml", text=SMALL + "resources:\n  nproc: 2\n  pools:\n"
                               "    actor_pool: {size: 2, models: [actor], cpus: 2, "
                               "custom_resources: {TPU: 1}, strategy: spread, "
                               "label_selector: {zone: a}}\n")
    assert not diags and g.build().resources == loaded.resources
    with pytest.raises(GraphError) as exc:
        g.resources(pools={"actor_pool": {"size": 2, "modles": ["actor"]}})
    assert "unknown key `modles` in resources.pools.actor_pool" in str(exc.value)
    assert f"{__file__}:" in str(exc.value) and "did you mean `models`?" in str(exc.value)
