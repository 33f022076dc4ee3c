"""The update loop trains any update kind: a plugin's new loss runs through it as the
built-in kinds do (tests/nodes/test_update.py) — micro-batches that accumulate to the
one-shot step, one optimizer step per mini-batch, the loop's metrics under the kind's
scope, the loss's held-out metrics in evaluation mode — called directly and from a
graph file run by the local executor.

The plugin's loss is the sequence-level negative log-likelihood, the mean over
sequences of −Σ_t log π(y_t | x, y_<t) (seq-mean-token-sum of SFT's per-token loss).

Notation: B sequences, P prompt length, T response length.
"""

from __future__ import annotations

import copy
import importlib
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from flowgraph.compilers.update_loop import evaluate, train
from flowgraph.runtime import NodeContext
from flowgraph.runtime.update import Update

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = '''
"""A plugin's update kind: its loss and its batch; the update loop does the rest."""
from dataclasses import dataclass

from flowgraph import KindSpec, register_kind
from flowgraph.kinds import MINI_BATCH, SEQUENCE_INPUTS
from flowgraph.nodes.logprob import logprob
from flowgraph.runtime.update import Update


@dataclass(frozen=True, slots=True)
class SequenceNLL:
    """mean_b −Σ_t m_bt log π(y_bt | x_b, y_b<t): one number per sequence, averaged."""

    packing: bool = False

    def __call__(self, model, mb):
        log_prob = logprob(model, mb["prompts"], mb["prompt_mask"], mb["responses"],
                           mb["response_mask"], packing=self.packing)["log_prob"]
        loss = -(log_prob * mb["response_mask"]).sum(-1).mean()
        return loss, {"seq_nll/loss": loss.item()}

    def denominator(self, mb):
        return float(len(mb["prompts"]))  # a mean over sequences

    def held_out(self, model, batch):
        return self(model, batch)[1]


def sequence_nll_update(*, prompts, prompt_mask, responses, response_mask, packing=False):
    batch = {"prompts": prompts, "prompt_mask": prompt_mask, "responses": responses,
             "response_mask": response_mask}
    return Update(batch, SequenceNLL(packing))


KIND = register_kind(KindSpec(
    "sequence_nll_update", "update", "Sequence-level NLL of the responses.",
    inputs=SEQUENCE_INPUTS, params=MINI_BATCH, model="required", trains=True,
    impl=f"{__name__}:sequence_nll_update", source=__name__))
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("plugin")
    (folder / "seq_nll_plugin.py").write_text(PLUGIN)
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module("seq_nll_plugin")
    finally:
        sys.path.remove(str(folder))


def _model() -> torch.nn.Module:
    from flowgraph.nodes.models import load_model

    torch.manual_seed(0)
    return load_model("builtin:tiny-lm", trainable=True)


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 2, 4, 1])
    return {"prompts": torch.randint(3, 500, (4, 3), generator=g),
            "prompt_mask": torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 1], [1, 1, 1]]),
            "responses": torch.randint(3, 500, (4, 5), generator=g),
            "response_mask": (torch.arange(5) < lengths[:, None]).long()}


def _ctx(model: torch.nn.Module, **kw: Any) -> NodeContext:
    return NodeContext("update", "sequence_nll_update", step=0, seed=0, model=model,
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.5), **kw)


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_a_plugin_loss_accumulates_to_the_one_shot_step(plugin: Any) -> None:
    """m = 1 (four micro-batches of one sequence, each weighing 1/4 of the pair-free
    mean) lands on the parameters of m = 4; one optimizer step per mini-batch of 2."""
    update = plugin.sequence_nll_update(**_batch())
    assert isinstance(update, Update)
    params = plugin.KIND.param_values({"mini_batch_size": 4})
    one_shot, split = _model(), _model()
    a, b = _ctx(one_shot), _ctx(split)
    train(a, update, params)
    train(b, update, {**params, "micro_batch_size": 1})
    assert (_params(one_shot) - _params(split)).abs().max() < 1e-6
    assert b.metrics["seq_nll/loss"] == pytest.approx(a.metrics["seq_nll/loss"], abs=1e-5)
    assert set(a.metrics) == {"seq_nll/loss", "actor/grad_norm", "actor/lr"}
    counted = _ctx(_model())
    counted.optimizer = torch.optim.Adam(counted.model.parameters(), lr=1e-3)
    train(counted, update, {**params, "mini_batch_size": 2, "ppo_epochs": 2})
    first = next(iter(counted.model.parameters()))
    assert counted.optimizer.state[first]["step"].item() == 4  # 2 epochs x 2 mini-batches


def test_held_out_the_loop_reports_the_loss_s_metrics_without_a_step(plugin: Any) -> None:
    model = _model()
    before = copy.deepcopy(model)
    ctx = _ctx(model)
    evaluate(ctx, plugin.sequence_nll_update(**_batch()))
    assert torch.equal(_params(model), _params(before))
    assert set(ctx.metrics) == {"seq_nll/loss"} and math.isfinite(ctx.metrics["seq_nll/loss"])


def test_an_implementation_that_returns_no_update_is_refused() -> None:
    ctx = _ctx(_model())
    with pytest.raises(TypeError, match=r"returned dict; an update kind's implementation "
                                        r"returns flowgraph.runtime.update.Update"):
        train(ctx, {}, {})  # type: ignore[arg-type]


def test_a_plugin_update_kind_runs_from_a_graph_file(tmp_path: Path) -> None:
    """sft.yaml with the plugin's kind in place of sft_update: two mini-batches a step,
    its metrics logged, held out too; micro-batches of 8 give the same numbers."""
    from flowgraph.compilers import RunOptions, run
    from flowgraph.passes import compile_graph

    # a kind of its own name: the module fixture's plugin holds the first in this process
    (tmp_path / "seq_nll_graph.py").write_text(PLUGIN.replace('"sequence_nll_update"',
                                                              '"sequence_nll_graph"'))
    text = (ROOT / "graphs" / "sft.yaml").read_text()
    assert "kind: sft_update" in text
    text = text.replace("kind: sft_update", "kind: sequence_nll_graph").replace(
        "      loss_mask: train.loss_mask\n", "").replace(
        "params: {mini_batch_size: 32, loss_agg_mode: token-mean}", "params: {mini_batch_size: 16}")
    (tmp_path / "g.yaml").write_text("plugins: [seq_nll_graph.py]\n" + text)
    rows = []
    for micro in ("null", "8"):
        result = compile_graph(tmp_path / "g.yaml", overrides=[
            f"trainer.run_dir={tmp_path / micro}", "trainer.steps=2", "trainer.eval_every=2",
            "trainer.checkpoint_every=0", f"nodes.update.params.micro_batch_size={micro}"])
        assert result.plan is not None, result
        with open(os.devnull, "w") as out:
            rows.append(run(result.plan, RunOptions(tensorboard=False, out=out)).rows)
    whole, micro_batches = rows
    assert {"seq_nll/loss", "actor/grad_norm", "actor/lr"} <= set(whole[0])
    assert "val/seq_nll/loss" in whole[-1]
    for name in ("seq_nll/loss", "actor/grad_norm", "val/seq_nll/loss"):
        assert micro_batches[-1][name] == pytest.approx(whole[-1][name], rel=1e-5), name
