"""One mask type (issue 40, point 9.3): every built-in gives a mask as `int {binary}`
(`MASK_DTYPE`) — a filter's passed-through masks were `mask`, so the README's
`response_mask: Int[Tensor, "b T"]` got FG203 after `filter` — a custom kind takes one
annotated `Int[...]` or `Bool[...]`, and FG203's hint names only outputs that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flowgraph.checker import check_graph
from flowgraph.contracts import MASK_DTYPE
from flowgraph.frontend import load_graph
from flowgraph.registry import Registry

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"

BREVITY = '''
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from flowgraph import node_kind

@node_kind("brevity_{annotation}", outputs=["scores"], category="reward")
def brevity(response_mask: {annotation}[Tensor, "b T"], scale: float = 0.01
            ) -> Float[Tensor, " b"]:
    return -scale * response_mask.sum(-1).float()
'''


def test_every_built_in_gives_a_mask_as_one_type() -> None:
    masks = [(k.name, p.name, p.spec.dtype) for k in Registry.default().kinds.values()
             for p in k.outputs if "binary" in p.spec.constraints]
    assert ("filter", "response_mask", MASK_DTYPE) in masks
    assert ("generate", "response_mask", MASK_DTYPE) in masks
    assert {dtype for _, _, dtype in masks} == {MASK_DTYPE}, masks


def _after_filter(tmp_path: Path, annotation: str) -> list[str]:
    """graphs/dapo.yaml with the README's `brevity` reward wired after its `filter`
    (`keep`) and into the advantage: the checker's errors, with their hints."""
    (tmp_path / "brevity.py").write_text(BREVITY.replace("{annotation}", annotation))
    # a kind per annotation: one process registers each name with one contract
    text = (GRAPHS / "dapo.yaml").read_text()
    text = text.replace("nodes:\n", "plugins: [brevity.py]\nnodes:\n  brev:\n"
                        f"    kind: brevity_{annotation}\n"
                        "    inputs: {response_mask: keep.response_mask}\n", 1)
    text = text.replace("inputs: {scores: keep.scores,", "inputs: {scores: brev.scores,")
    (tmp_path / "dapo.yaml").write_text(text)
    graph, diags = load_graph(tmp_path / "dapo.yaml")
    assert graph is not None, diags
    return [f"{d.code}: {d.message} | {d.hint}" for d in check_graph(graph).errors]


@pytest.mark.parametrize("annotation", ["Int", "Bool"])
def test_a_custom_kind_takes_a_filtered_mask_as_int_or_bool(
        tmp_path: Path, annotation: str) -> None:
    assert _after_filter(tmp_path, annotation) == []


def test_a_mask_where_a_port_takes_floats_is_answered_with_the_annotation(
        tmp_path: Path) -> None:
    (found,) = _after_filter(tmp_path, "Float")
    assert found == (
        "FG203: edge `keep.response_mask -> brev.response_mask`: `response_mask` takes float, "
        "`keep.response_mask` gives int | a mask is int {binary} (every built-in gives one "
        "so): a custom kind takes it annotated `Int[Tensor, \"b T\"]`, or "
        "`Bool[Tensor, \"b T\"]` to get it as bool")


def test_a_dtype_hint_names_only_outputs_that_exist() -> None:
    """Group ids where scores go: the hint names float outputs of this graph (one value
    per row, as the port takes), the same port name first — never a made-up one."""
    graph, _ = load_graph(GRAPHS / "grpo.yaml", ["nodes.adv.inputs.scores=gen.index"])
    assert graph is not None
    (found,) = [d for d in check_graph(graph).errors if d.code == "FG203"]
    assert found.hint is not None
    assert found.hint.startswith("this input takes real values (log-probs, scores, values); "
                                 "wire an output that gives float: `reward.scores`"), found.hint
    outputs = {f"{n.name}.{p.name}" for n in graph.nodes
               for p in Registry.default().kinds[n.kind].outputs}
    named = re.findall(r"`(\w+\.\w+)`", found.hint)
    assert named and set(named) <= outputs, named
