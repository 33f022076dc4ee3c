"""`models.<m>.init_from`: a model starts from another run's checkpoint, with a fresh
optimizer, from step 0 — value pretraining (VAPO, VC-PPO) as two graphs: one trains the
critic, the next starts its critic from it. Checked before launch (FG125), on the files
the run will read; `--resume` loads the run's own checkpoint instead.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowgraph.checker import check_graph
from flowgraph.cli import main
from flowgraph.compilers import read_metrics
from flowgraph.compilers.export import load_from_run
from flowgraph.frontend import load_graph
from flowgraph.testing.targets import assert_same_numbers

ROOT = Path(__file__).resolve().parents[2]
PPO = ROOT / "graphs" / "ppo.yaml"
SMALL = ("dims.Bp=2", "dims.N=2", "nodes.update_actor.params.mini_batch_size=4",
         "nodes.update_critic.params.mini_batch_size=4", "trainer.eval_every=0",
         "trainer.val_before_train=false")


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PPO run of 2 steps whose checkpoint (step 1) holds a trained actor and critic."""
    run = tmp_path_factory.mktemp("warm") / "run"
    assert main(["run", str(PPO), *SMALL, "trainer.steps=2", "trainer.checkpoint_every=2",
                 f"trainer.run_dir={run}"]) == 0
    return run


def _critic(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / "step_1" / "model.critic.safetensors")


def test_a_critic_starts_from_another_runs_critic_with_a_fresh_optimizer(
        warm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The second run's critic is the first run's (its step-0 values differ from a run
    without init_from, whose rollouts are the same), its actor is `path`'s, and its
    optimizer starts afresh: the run starts at step 0 and its checkpoint holds the
    critic trained on from there."""
    args = (*SMALL, "trainer.steps=1", "trainer.checkpoint_every=1")
    assert main(["run", str(PPO), *args, f"trainer.run_dir={tmp_path / 'fresh'}"]) == 0
    assert main(["run", str(PPO), *args, f"models.critic.init_from={warm}",
                 f"trainer.run_dir={tmp_path / 'init'}"]) == 0
    out = capsys.readouterr().out
    assert f"model `critic` starts from model `critic` of run `{warm}` (checkpoint step 1; " \
           "init_from), with a fresh optimizer" in out
    fresh, init = read_metrics(tmp_path / "fresh")[0], read_metrics(tmp_path / "init")[0]
    assert init["step"] == fresh["step"] == 0
    assert init["critic/score/mean"] == fresh["critic/score/mean"]  # same rollouts
    assert init["response_length/mean"] == fresh["response_length/mean"]
    assert init["critic/values/mean"] != fresh["critic/values/mean"]
    assert init["critic/advantages/mean"] != fresh["critic/advantages/mean"]  # GAE reads them
    optim = torch.load(tmp_path / "init" / "checkpoints" / "step_0" / "optim.critic.pt",
                       weights_only=False)
    assert {int(s["step"]) for s in optim["state"].values()} == {1}  # one step from fresh


def test_the_weights_loaded_are_the_checkpoints(warm: Path) -> None:
    from flowgraph.nodes.values import ValueModel

    model = ValueModel.from_pretrained("builtin:tiny-lm-sft", trainable=True)
    saved = _critic(warm)
    assert not all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert load_from_run(warm, "critic", model) == 1
    mine = model.state_dict()
    assert saved.keys() == mine.keys()
    assert all(torch.equal(mine[k], v) for k, v in saved.items())


def _graph(tmp_path: Path, models: str) -> list[str]:
    """FG125 diagnostics of ppo.yaml with `models` in place of its critic's entry."""
    text = PPO.read_text()
    start, end = text.index("  critic:\n"), text.index("\ndata:")
    path = tmp_path / "g.yaml"
    path.write_text(text[:start] + textwrap.indent(textwrap.dedent(models), "  ") + text[end:])
    graph, diags = load_graph(path)
    assert graph is not None, diags
    return [f"{d.severity}: {d.message}" for d in check_graph(graph).diagnostics
            if d.code == "FG125"]


CRITIC = """\
critic:
  path: "builtin:tiny-lm-sft"
  trainable: true
  optimizer: {lr: 2.0e-3}
"""


@pytest.mark.parametrize(("init", "expected"), [
    ("init_from: nowhere", "`models.critic.init_from`: `{tmp}/nowhere` is not a flowgraph run "
                           "dir (no plan.json)"),
    ("init_from: {warm}\ninit_from_model: value",
     "`models.critic.init_from`: run `{warm}` has no model `value`, so its checkpoints hold "
     "no weights of it (its trained models: actor, critic)"),
    ("init_from: {warm}\ninit_from_model: ref",
     "`models.critic.init_from`: run `{warm}` never trained model `ref`"),
    ("init_from: {warm}\ninit_from_model: actor",
     "`models.critic.init_from`: model `actor` of run `{warm}` has a lm head and `critic` a "
     "scalar one: its weights cannot start it"),
    ("init_from: {empty}", "`models.critic.init_from`: run `{empty}` has written no "
                           "checkpoint yet"),
    ("init_from: {warm}", None),
], ids=["not_a_run", "no_such_model", "frozen", "other_head", "no_checkpoint", "fine"])
def test_init_from_is_checked_before_launch(warm: Path, tmp_path: Path, init: str,
                                            expected: str | None) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "plan.json").write_text((warm / "plan.json").read_text())
    where = {"warm": warm, "empty": empty, "tmp": tmp_path}
    found = _graph(tmp_path, CRITIC + textwrap.indent(init.format(**where), "  ") + "\n")
    if expected is None:
        assert found == []
    else:
        assert len(found) == 1 and found[0].startswith("error: " + expected.format(**where)), \
            found


def test_a_resumed_run_goes_on_as_the_uninterrupted_one(warm: Path, tmp_path: Path) -> None:
    """`--resume` loads the run's own checkpoint (its critic trained on from the
    init_from one): 1 step, then resumed to 2, gives the numbers of 2 uninterrupted."""
    args = (*SMALL, "trainer.checkpoint_every=1", f"models.critic.init_from={warm}")
    assert main(["run", str(PPO), *args, "trainer.steps=2",
                 f"trainer.run_dir={tmp_path / 'whole'}"]) == 0
    assert main(["run", str(PPO), *args, "trainer.steps=1",
                 f"trainer.run_dir={tmp_path / 'cut'}"]) == 0
    assert main(["run", str(PPO), *args, "trainer.steps=2", "--resume",
                 "--allow-changed", "trainer.steps", f"trainer.run_dir={tmp_path / 'cut'}"]) == 0
    assert_same_numbers(read_metrics(tmp_path / "cut"), read_metrics(tmp_path / "whole"))
