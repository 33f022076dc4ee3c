"""Asynchronous rollouts (`trainer.max_staleness`): the plan's cut, the checker's rules,
and the update's old log-probs taken from the rollout. The producer's runs (a process of
its own, the loop) are tests/compilers/rollouts/test_process.py's; the buffer's rules
test_buffer.py's."""

import json
from pathlib import Path
from typing import Any

import pytest

from flowgraph.errors import PlanError
from flowgraph.passes import PassPipeline, compile_graph
from flowgraph.plan import ExecutionPlan, gib, plan_from_json, plan_summary, plan_to_json

ROOT = Path(__file__).resolve().parents[2]
GRPO = ROOT / "graphs" / "grpo.yaml"
SMALL = ("dims.Bp=4", "dims.N=4", "nodes.update_actor.params.mini_batch_size=16",
         "trainer.val_before_train=false", "trainer.eval_every=0")
"""GRPO at 16 rows a step, one optimizer step a rollout."""
ASYNC = (*SMALL, "trainer.max_staleness=1")


def _plan(*overrides: str, disable: tuple[str, ...] = ()) -> ExecutionPlan:
    result = compile_graph(GRPO, overrides=list(overrides),
                           pipeline=PassPipeline.default(disabled=disable))
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]
    return result.plan


def test_the_plan_cuts_the_step_at_the_rollout() -> None:
    plan = _plan(*ASYNC)
    assert plan.asynchronous is not None
    # the reference is frozen and GRPO's advantage reads only rewards: both run ahead
    assert plan.asynchronous.producer == ("train", "gen", "ref_logprob", "reward", "adv")
    assert plan_from_json(plan_to_json(plan)) == plan
    assert "async      producer train, gen, ref_logprob, reward, adv runs up to 1 step(s) " \
           "ahead of consumer update_actor" in plan_summary(plan)
    # the producer process holds its own actor and reference, the actor's shared copy,
    # and its largest node's working memory, beside the trainer
    (main,) = plan.memory
    weights = {i.owner: i.bytes for i in main.items if i.what == "weights"}
    assert weights["actor (rollout process)"] == 2 * weights["actor"]
    assert weights["ref (rollout process)"] == weights["ref"]
    assert any(i.owner.endswith("(rollout process)") and not i.transient
               and i.what == "activations" for i in main.items)
    assert main.total_bytes > _plan(*SMALL).memory[0].total_bytes
    assert _plan(*ASYNC, disable=("asynchronous",)).asynchronous is None
    assert _plan(*SMALL).asynchronous is None
    data = json.loads(plan_to_json(plan))
    data["asynchronous"]["producer"].append("update_actor")
    with pytest.raises(PlanError, match="the asynchronous producer runs `update_actor`, an "
                                        "update"):
        plan_from_json(json.dumps(data))


def test_on_ray_the_producer_gets_a_rollout_pool_of_its_own() -> None:
    """Target ray: the producer's models (the actor, trained; its frozen reference) are
    copied whole onto the rollout pool, one worker of `resources.rollout_cpus` cores,
    beside the trainer's pools; the summary shows it and the verifier holds it to the
    cut. The local and fsdp plans have none."""
    result = compile_graph(GRPO, target="ray", nproc=2,
                           overrides=[*ASYNC, "resources.rollout_cpus=3"])
    plan = result.plan
    assert plan is not None and plan.asynchronous is not None
    pool = plan.asynchronous.pool
    assert pool is not None and not plan.asynchronous.own_process
    assert (pool.name, pool.size, pool.bundles[0].cpu) == ("rollouts", 1, 3)
    assert [(m.name, m.trainable, m.sharding) for m in pool.models] == [
        ("actor", True, "none"), ("ref", False, "none")]
    assert plan_from_json(plan_to_json(plan)) == plan
    summary = plan_summary(plan)
    assert "  rollouts           1 worker(s) on cpu, each {CPU: 3}, placed PACK, beside the " \
           "trainer's pools" in summary, summary
    assert "runs the asynchronous producer: train, gen, ref_logprob, reward, adv" in summary
    # its memory: a copy's weights (no gradients, no optimizer) and the working memory
    # of the producer's model nodes on the whole batch; FG401 when it does not fit
    trainer, rollouts = plan.memory
    assert (trainer.pool, rollouts.pool) == ("actor_rollout_ref", "rollouts")
    assert sorted((i.what, i.owner) for i in rollouts.items if not i.transient) == [
        ("weights", "actor"), ("weights", "ref")]
    assert rollouts.peak_node in ("gen", "ref_logprob")
    over = compile_graph(GRPO, target="ray", nproc=4, overrides=[
        *ASYNC, f"resources.memory_gib={rollouts.total_bytes / (1 << 30) * 0.9}"])
    assert [d.message for d in over.diagnostics if d.code == "FG401"] == [
        f"plan needs {gib(rollouts.total_bytes)} on the device of the rollout pool `rollouts`, "
        f"declared {gib(rollouts.total_bytes * 0.9)}"]
    from flowgraph.compilers.targets.ray.driver import cluster_cpus

    assert cluster_cpus(plan) >= 2 + 3  # the trainer's two workers and the rollout pool's
    data = json.loads(plan_to_json(plan))
    data["asynchronous"]["pool"]["models"] = data["asynchronous"]["pool"]["models"][:1]
    with pytest.raises(PlanError, match="the rollout pool `rollouts` does not host model "
                                        "`ref`, which the producer's node `ref_logprob` runs"):
        plan_from_json(json.dumps(data))
    declared = compile_graph(GRPO, target="ray", overrides=[
        *ASYNC, "resources.pools={rollouts: {size: 1, models: [actor, ref]}}"])
    assert [(d.code, d.message) for d in declared.diagnostics if d.is_error] == [
        ("FG403", "pool name `rollouts` is reserved for the rollout pool of asynchronous "
                  "rollouts (trainer.max_staleness > 0) on ray")]
    for target in ("local", "fsdp"):
        other = compile_graph(GRPO, target=target, nproc=None if target == "local" else 2,
                              overrides=list(ASYNC)).plan
        assert other is not None and other.asynchronous is not None
        assert other.asynchronous.pool is None and "  rollouts " not in plan_summary(other)
    synchronous = compile_graph(GRPO, target="ray", overrides=list(SMALL)).plan
    assert synchronous is not None and "  rollouts " not in plan_summary(synchronous)


def test_old_log_probs_from_the_rollout_rewire_the_update() -> None:
    plan = _plan(*ASYNC, "trainer.old_log_prob=rollout")
    update = plan.node("update_actor")
    assert dict(update.wiring())["old_log_prob"] == ("gen", "rollout_log_prob")
    assert "old_logprob" in plan.dropped
    assert plan_from_json(plan_to_json(plan)) == plan  # no other node rewired
    assert any("`update_actor` takes its old log-probs from `gen.rollout_log_prob`" in r
               for r in plan.rewrites)


def test_the_checker_refuses_staleness_without_a_rollout_and_warns_where_it_compounds(
        ) -> None:
    dpo = compile_graph(ROOT / "graphs" / "dpo.yaml", overrides=["trainer.max_staleness=1"])
    assert [d.code for d in dpo.diagnostics if d.is_error] == ["FG120"]
    two_steps = compile_graph(GRPO, overrides=[*ASYNC, "nodes.update_actor.params."
                                               "mini_batch_size=8"])
    warned = [d for d in two_steps.diagnostics if d.code == "FG121"]
    assert len(warned) == 1 and warned[0].node == "update_actor" and two_steps.plan is not None
    typo = compile_graph(GRPO, overrides=["trainer.admission=later"])
    assert [(d.code, d.hint) for d in typo.diagnostics] == [("FG004", "use one of block, drop")]


def _run(run_dir: Path, *overrides: str) -> list[dict[str, Any]]:
    import os

    import flowgraph

    plan = compile_graph(GRPO, overrides=[f"trainer.run_dir={run_dir}", *ASYNC,
                                          *overrides]).plan
    assert plan is not None
    with open(os.devnull, "w") as out:
        rows: list[dict[str, Any]] = flowgraph.run(plan, tensorboard=False, out=out).rows
    return rows


def test_old_log_probs_from_the_rollout_measure_the_policy_that_sampled(tmp_path: Path
                                                                        ) -> None:
    """`old_log_prob: recompute` with one optimizer step: π_old is the policy the update
    starts from, the ratio is 1 and ppo_kl 0 at every step; `rollout`: π_old is the
    one that sampled, one update behind from step 2 on (step 0 learns at lr 0)."""
    recompute = _run(tmp_path / "recompute", "trainer.steps=3")
    rollout = _run(tmp_path / "rollout", "trainer.steps=3", "trainer.old_log_prob=rollout")
    assert all(r["actor/ppo_kl"] == 0.0 for r in recompute)
    assert abs(rollout[0]["actor/ppo_kl"]) < 1e-6 and abs(rollout[2]["actor/ppo_kl"]) > 1e-6


