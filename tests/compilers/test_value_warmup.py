"""Value warm-up (VAPO, VC-PPO; issue 40, point 9.7): an update's `start_step` skips it
before step k, so a PPO graph trains only its critic for its first k steps — the actor's
weights, optimizer and LR schedule untouched — and both from step k on."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

import flowgraph
from flowgraph.compilers.checkpoint.store import latest_checkpoint

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"


def test_a_warm_up_graph_trains_only_the_critic_for_k_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = flowgraph.run(GRAPHS / "ppo.yaml", overrides=[
        "dims.Bp=8", "trainer.steps=3", "trainer.eval_every=0",
        "trainer.val_before_train=false", "trainer.checkpoint_every=1",
        "nodes.update_actor.params.mini_batch_size=8",
        "nodes.update_critic.params.mini_batch_size=8",
        "nodes.update_actor.params.start_step=2"], run_dir="runs/w",
        tensorboard=False, out=io.StringIO())
    trained = [("actor/pg_loss" in r, "critic/vf_loss" in r) for r in result.rows]
    assert trained == [(False, True), (False, True), (True, True)], result.rows
    # the LR schedule starts at the first update (its warm-up too), as verl's critic_warmup
    assert [r["actor/lr"] for r in result.rows if "actor/lr" in r] == \
        [result.rows[2]["actor/lr"]]
    found = latest_checkpoint(Path("runs/w"))
    assert found is not None and found[0] == 2
    at = {s: Path("runs/w") / "checkpoints" / f"step_{s}" for s in (1, 2)}
    optim = {(m, s): torch.load(at[s] / f"optim.{m}.pt", weights_only=True)
             for m in ("actor", "critic") for s in (1, 2)}
    assert not optim["actor", 1]["state"] and optim["actor", 2]["state"]  # no step before 2
    assert optim["critic", 1]["state"]
