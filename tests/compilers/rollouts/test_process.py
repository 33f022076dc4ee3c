"""The producer in a process of its own (`ProcessProducer`, target local), run end to
end on GRPO one step stale: the numbers of the same schedule run in the loop
(`InlineProducer`), exact resume from a checkpoint holding the buffer, a user's error in
the producer reported as any node's, the drop admission, and a LoRA actor's adapters
published to the producer."""

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import flowgraph
from flowgraph.compilers import read_metrics
from flowgraph.compilers.checkpoint.store import latest_checkpoint
from flowgraph.compilers.rollouts.process import CLOSE_S
from flowgraph.errors import FlowgraphError
from flowgraph.passes import compile_graph
from flowgraph.plan import ExecutionPlan
from flowgraph.testing.targets import assert_same_numbers

ROOT = Path(__file__).resolve().parents[3]
GRPO = ROOT / "graphs" / "grpo.yaml"
ASYNC = ("dims.Bp=4", "dims.N=4", "nodes.update_actor.params.mini_batch_size=16",
         "trainer.val_before_train=false", "trainer.eval_every=0", "trainer.max_staleness=1")
"""GRPO at 16 rows a step, one optimizer step a rollout, one step stale."""

def _run(run_dir: Path, *overrides: str, overlap: bool = True, resume: bool = False
         ) -> list[dict[str, Any]]:
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
    with pytest.raises(FlowgraphError) as exc:
        flowgraph.run(plan, tensorboard=False)
    text = str(exc.value)
    assert text.startswith("while executing node `reward` (kind compute_score, model actor, "), text
    assert " at step 0: " in text and "KeyError" in text, text
    assert f"at {tmp_path / 'rewards.py'}:2 in compute_score" in text, text


def test_drop_admission_never_trains_on_a_rollout_staler_than_allowed(tmp_path: Path) -> None:
    """Also: the producer, S + 1 rollouts ahead when the run ends, is gone when it returns,
    though what it sent was never read (rollouts of 64 rows, ~45 kB each: two overfill
    a pipe, and a process that exits waits for what it queued to be read)."""
    rows = _run(tmp_path / "drop", "trainer.steps=4", "trainer.admission=drop",
                "dims.Bp=16", "nodes.update_actor.params.mini_batch_size=64")
    assert len(rows) == 4
    assert all(0 <= r["async/staleness"] <= 1 and "async/dropped" in r for r in rows)
    assert not [p for p in multiprocessing.active_children() if p.name == "flowgraph-rollouts"]


@pytest.mark.slow
def test_sigterm_to_a_run_whose_producer_ran_ahead_exits_143_with_a_checkpoint(
        tmp_path: Path) -> None:
    """`flowgraph run` stopped by SIGTERM after step 1 while its producer process holds
    rollouts the trainer will not read (`drop`: S + 1 ahead; GRPO's 128 rows, ~88 kB
    each): it saves, exits 143 within `trainer.stop_grace_s`, and nothing is left
    running. (It hung: the producer waited at its exit for its queue to be read, the
    trainer at its own for the producer; partial rollouts meet it the same way.)"""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowgraph", "run", str(GRPO), "trainer.steps=20",
         "trainer.max_staleness=1", "trainer.admission=drop", "trainer.eval_every=0",
         "trainer.val_before_train=false", "trainer.stop_grace_s=60",
         f"trainer.run_dir={run_dir}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        while len(read_metrics(run_dir)) < 2:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60 + CLOSE_S)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "stopped by SIGTERM; the last checkpoint is step" in err, err[-3000:]
    assert latest_checkpoint(run_dir) is not None


def test_a_lora_actor_publishes_its_adapters_to_the_producer(tmp_path: Path) -> None:
    """After the first publication only what updates change goes to the producer: a LoRA
    actor's adapters (its reference is the base: adapters off in the producer's copy).
    The producer process's numbers are the in-loop schedule's, step after step."""

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
