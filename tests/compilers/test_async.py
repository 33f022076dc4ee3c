"""Asynchronous rollouts (`trainer.max_staleness`): the plan's cut, the checker's rules,
and runs whose rollouts come from a producer process — the same numbers as the same
schedule run in the loop, exact resume from a checkpoint holding the buffer, a user's
error in the producer reported as any node's, and the drop admission."""

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from flowgraph.errors import FlowgraphError, PlanError
from flowgraph.passes import PassPipeline, compile_graph
from flowgraph.plan import ExecutionPlan, gib, plan_from_json, plan_summary, plan_to_json
from flowgraph.testing.targets import assert_same_numbers

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
    from flowgraph.compilers.ray import cluster_cpus

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


def _run(run_dir: Path, *overrides: str, overlap: bool = True, resume: bool = False
         ) -> list[dict[str, Any]]:
    import os

    import flowgraph

    plan = compile_graph(GRPO, overrides=[f"trainer.run_dir={run_dir}", *ASYNC,
                                          *overrides]).plan
    assert plan is not None
    with open(os.devnull, "w") as out:
        rows: list[dict[str, Any]] = flowgraph.run(_in_loop(plan, not overlap), resume=resume,
                                                   tensorboard=False, out=out).rows
    return rows


def _in_loop(plan: ExecutionPlan, in_loop: bool) -> ExecutionPlan:
    """`plan` with its producer run in the training loop (`in_loop`), as fsdp and ray
    run it, instead of a process of its own (a synchronous plan as it is)."""
    cut = plan.asynchronous
    if cut is None:
        return plan
    return replace(plan, asynchronous=replace(cut, own_process=not in_loop))


def test_a_producer_process_gives_the_numbers_of_the_same_schedule_and_resumes_exactly(
        tmp_path: Path) -> None:
    """(a) the rollouts of a producer process are those of the same schedule run in the
    loop (`block`: step k's batch from the policy of step k-1, whatever the timing);
    (b) the checkpoint after step 1 holds step 2's rollout and the cursor after it, and
    a run resumed from it repeats steps 2 and 3; (c) step 2 trains on the samples of
    step 1's policy, so its numbers are not the synchronous run's."""
    steps = ("trainer.steps=4", "trainer.checkpoint_every=2")
    apart = _run(tmp_path / "process", *steps)
    inline = _run(tmp_path / "inline", *steps, overlap=False)
    assert_same_numbers(apart, inline)
    assert [r["async/staleness"] for r in apart] == [0.0, 1.0, 1.0, 1.0]
    assert [r["async/staleness_max"] for r in apart] == [0.0, 1.0, 1.0, 1.0]
    # generating step k+1 overlaps training step k; nothing is left to generate during
    # the last step, and in the loop generation never overlaps the update
    overlap = [r["async/overlap_frac"] for r in apart]
    assert all(0.0 <= f <= 1.0 for f in overlap) and max(overlap[:3]) > 0.0, overlap
    assert overlap[3] == 0.0, overlap
    assert [r["async/overlap_frac"] for r in inline] == [0.0] * 4
    assert all(r["phase_s/generation"] == r["perf/rollout_wait_s"] for r in apart)

    folder = tmp_path / "process" / "checkpoints" / "step_1"
    buffer = torch.load(folder / "rollouts.pt", weights_only=True)
    assert [(b["index"], b["version"]) for b in buffer] == [(2, 1)]
    cursors = json.loads((folder / "state.json").read_text())["cursors"]
    assert cursors == {"train": {"epoch": 0, "position": 12}}  # 3 batches of 4 prompts drawn
    shutil.copytree(tmp_path / "process", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_3")
    resumed = _run(tmp_path / "resumed", *steps, resume=True)
    assert_same_numbers(resumed[2:], apart[2:])

    # warm-up: step 0 learns at lr 0, so step 2 is the first whose policy is stale
    sync = _run(tmp_path / "sync", "trainer.steps=3", "trainer.max_staleness=0")
    assert [r["actor/entropy"] for r in sync[:2]] == [r["actor/entropy"] for r in apart[:2]]
    assert sync[2]["actor/entropy"] != apart[2]["actor/entropy"]


def test_an_error_in_the_producer_names_node_step_and_the_users_line(tmp_path: Path) -> None:
    graph = tmp_path / "grpo.yaml"
    graph.write_text(GRPO.read_text().replace("fn: exact_match, format_score: 0.1",
                                              'fn: "rewards.py:compute_score"').replace(
        "name: grpo\n", "name: grpo\nplugins: [rewards.py]\n").replace(
        "    kind: reward\n", "    kind: compute_score\n"))
    (tmp_path / "rewards.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 1.0}['acc']  # the user's bug\n")
    result = compile_graph(graph, overrides=[f"trainer.run_dir={tmp_path / 'run'}", *ASYNC,
                                             "trainer.steps=3"])
    plan = result.plan
    assert plan is not None, [d.one_line() for d in result.diagnostics]
    import flowgraph

    with pytest.raises(FlowgraphError) as exc:
        flowgraph.run(plan, tensorboard=False)
    text = str(exc.value)
    assert text.startswith("while executing node `reward` (kind compute_score, model actor, "), text
    assert " at step 0: " in text and "KeyError" in text, text
    assert f"at {tmp_path / 'rewards.py'}:2 in compute_score" in text, text


def test_drop_admission_never_trains_on_a_rollout_staler_than_allowed(tmp_path: Path) -> None:
    rows = _run(tmp_path / "drop", "trainer.steps=4", "trainer.admission=drop")
    assert len(rows) == 4
    assert all(0 <= r["async/staleness"] <= 1 and "async/dropped" in r for r in rows)


def test_old_log_probs_from_the_rollout_measure_the_policy_that_sampled(tmp_path: Path
                                                                        ) -> None:
    """`old_log_prob: recompute` with one optimizer step: π_old is the policy the update
    starts from, the ratio is 1 and ppo_kl 0 at every step; `rollout`: π_old is the
    one that sampled, one update behind from step 2 on (step 0 learns at lr 0)."""
    recompute = _run(tmp_path / "recompute", "trainer.steps=3")
    rollout = _run(tmp_path / "rollout", "trainer.steps=3", "trainer.old_log_prob=rollout")
    assert all(r["actor/ppo_kl"] == 0.0 for r in recompute)
    assert abs(rollout[0]["actor/ppo_kl"]) < 1e-6 and abs(rollout[2]["actor/ppo_kl"]) > 1e-6


def test_a_lora_actor_publishes_its_adapters_to_the_producer(tmp_path: Path) -> None:
    """After the first publication only what updates change goes to the producer: a LoRA
    actor's adapters (its reference is the base: adapters off in the producer's copy).
    The producer process's numbers are the in-loop schedule's, step after step."""
    import os

    import flowgraph

    def run(name: str, overlap: bool) -> list[dict[str, Any]]:
        plan = compile_graph(ROOT / "graphs" / "grpo_lora.yaml", overrides=[
            f"trainer.run_dir={tmp_path / name}", "trainer.steps=4", "trainer.eval_every=0",
            "trainer.val_before_train=false", "trainer.max_staleness=1"]).plan
        assert plan is not None and plan.asynchronous is not None
        with open(os.devnull, "w") as out:
            rows: list[dict[str, Any]] = flowgraph.run(_in_loop(plan, not overlap),
                                                       tensorboard=False, out=out).rows
        return rows

    # warm-up: step 0 learns at lr 0, so step 3 is the first to sample with new adapters
    apart = run("process", True)
    assert_same_numbers(apart, run("inline", False))
