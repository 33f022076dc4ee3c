"""A custom kind that annotates its mask `Bool[Tensor, "b T"]` gets generate's int64 0/1
mask as bool — in strict mode too, where each input is held to its port's contract
(issue 40, point 9.3: one mask type, taken as the annotation says)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

import flowgraph

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"

SHORTEST = '''
import torch
from jaxtyping import Bool, Float
from torch import Tensor
from flowgraph import node_kind

@node_kind("shortest", outputs=["scores"], category="reward")
def shortest(response_mask: Bool[Tensor, "b T"]) -> Float[Tensor, " b"]:
    assert response_mask.dtype == torch.bool, response_mask.dtype
    return -(response_mask.sum(-1).float())
'''


def test_a_bool_annotated_mask_arrives_as_bool(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("shortest.py").write_text(SHORTEST)
    Path("grpo.yaml").write_text((GRAPHS / "grpo.yaml").read_text())
    result = flowgraph.run("grpo.yaml", overrides=[
        "plugins=[shortest.py]", "dims.Bp=2", "trainer.steps=1", "trainer.eval_every=0",
        "trainer.val_before_train=false", "nodes.update_actor.params.mini_batch_size=16",
        "nodes.short={kind: shortest, inputs: {response_mask: gen.response_mask}}",
        "nodes.adv.inputs.scores=short.scores"], run_dir="runs/b", strict=True,
        tensorboard=False, out=io.StringIO())
    (row,) = result.rows
    assert row["critic/score/mean"] == -row["response_length/mean"], row
