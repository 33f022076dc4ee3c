"""What a plan's workers ask of the machines, checked before any of them starts (issue
#29, point 2). Ray: each pool's bundles against the alive nodes (`check_fits`, on plain
node lists here), and a real run asking for GPUs the embedded CPU cluster lacks, which
stops at once with the shortfall instead of waiting on a placement group. fsdp: the ranks
a machine runs on cuda against the CUDA devices it sees.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from flowgraph.compilers import RunOptions
from flowgraph.compilers.targets.ray.cluster import ClusterShort, Node, check_fits
from flowgraph.errors import FlowgraphError
from flowgraph.passes import compile_graph
from flowgraph.plan import ExecutionPlan

ROOT = Path(__file__).resolve().parents[2]
DPO = ROOT / "graphs" / "dpo.yaml"


def _graph(tmp_path: Path, **pool: Any) -> Path:
    """graphs/dpo.yaml with its models in one declared pool `trainer` of `pool`'s settings."""
    doc = yaml.safe_load(DPO.read_text())
    doc["resources"] = {"pools": {"trainer": {"size": 2, "models": ["policy", "ref"],
                                              **pool}}}
    path = tmp_path / "dpo_pool.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _plan(tmp_path: Path, **pool: Any) -> ExecutionPlan:
    result = compile_graph(_graph(tmp_path, **pool), target="ray")
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]
    return result.plan


def _node(addr: str, labels: dict[str, str] | None = None, **res: float) -> Node:
    return (addr, {"memory": 1e9, f"node:{addr}": 1.0, **res}, labels or {})


TWO_CPU_NODES = [_node("10.0.0.1", CPU=4), _node("10.0.0.2", CPU=4)]


@pytest.mark.parametrize(("pool", "nodes"), [
    ({"cpus": 4}, TWO_CPU_NODES),  # one worker on each node
    ({"cpus": 2, "strategy": "strict_pack"}, TWO_CPU_NODES),
    ({"cpus": 1, "strategy": "strict_spread"}, TWO_CPU_NODES),
    ({"gpus": 1, "custom_resources": {"TPU": 0.5}},
     [_node("a", CPU=2, GPU=2, TPU=1)]),
    ({"label_selector": {"zone": "in(a, b)", "spot": "!true"}},
     [_node("x", {"zone": "c"}, CPU=8), _node("y", {"zone": "b"}, CPU=2)]),
])
def test_a_plan_the_cluster_holds_passes(tmp_path: Path, pool: dict[str, Any],
                                         nodes: list[Node]) -> None:
    check_fits(_plan(tmp_path, **pool), nodes)


@pytest.mark.parametrize(("pool", "nodes", "message"), [
    ({"gpus": 2}, TWO_CPU_NODES,
     "pool `trainer` asks 2 worker(s) × {CPU: 1, GPU: 2}: the largest node has {GPU: 0} "
     "(2 node(s): 10.0.0.1 {GPU: 0}, 10.0.0.2 {GPU: 0}); lower "
     "resources.pools.trainer.gpus (declaring the pool), run on cpu (`resources.device: "
     "cpu`) or add GPU nodes"),
    ({"cpus": 6}, TWO_CPU_NODES,
     "pool `trainer` asks 2 worker(s) × {CPU: 6}: the largest node has {CPU: 4} (2 node(s): "
     "10.0.0.1 {CPU: 4}, 10.0.0.2 {CPU: 4}); lower resources.pools.trainer.cpus or add "
     "nodes with more cores"),
    ({"cpus": 3, "strategy": "strict_pack"}, TWO_CPU_NODES,
     "pool `trainer` asks 2 worker(s) × {CPU: 3}: all on one node, which none can hold "
     "(2 node(s): 10.0.0.1 {CPU: 4}, 10.0.0.2 {CPU: 4}); lower resources.pools.trainer.cpus "
     "or add nodes with more cores; or set resources.pools.trainer.strategy to `pack` or "
     "`spread`"),
    ({"strategy": "strict_spread"}, [_node("solo", CPU=16)],
     "pool `trainer` asks 2 worker(s) × {CPU: 1}: each on its own node, and 1 can hold one "
     "(1 node(s): solo {CPU: 16}); lower resources.pools.trainer.cpus or add nodes with more "
     "cores; or set resources.pools.trainer.strategy to `pack` or `spread`"),
    ({"custom_resources": {"TPU": 1}}, [_node("a", CPU=8, TPU=1)],
     "pool `trainer` asks 2 worker(s) × {CPU: 1, TPU: 1}: the nodes hold 1 such worker(s) "
     "(1 node(s): a {TPU: 1}); start nodes with `ray start --resources '{\"TPU\": 1}'` or change "
     "resources.pools.trainer.custom_resources"),
    ({"label_selector": {"zone": "a"}}, [_node("x", {"zone": "b"}, CPU=8)],
     "pool `trainer` asks 2 worker(s) × {CPU: 1} on nodes labelled {zone: a}: no node is "
     "(1 node(s): x {CPU: 8}, labels [{'zone': 'b'}]); fix "
     "resources.pools.trainer.label_selector or start nodes with `ray start --labels`"),
])
def test_a_shortfall_is_one_message_naming_the_pool_and_the_fix(
        tmp_path: Path, pool: dict[str, Any], nodes: list[Node], message: str) -> None:
    with pytest.raises(ClusterShort) as info:
        check_fits(_plan(tmp_path, **pool), nodes)
    assert str(info.value) == f"the Ray cluster cannot hold the plan's workers: {message}"


def test_pools_that_fit_alone_but_not_together_are_told_in_all(tmp_path: Path) -> None:
    """Two pools of 2 workers × 3 CPUs: each fits the 8 cores, both do not."""
    doc = yaml.safe_load(DPO.read_text())
    doc["resources"] = {"pools": {"p": {"size": 2, "models": ["policy"], "cpus": 3},
                                  "r": {"size": 2, "models": ["ref"], "cpus": 3}}}
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(doc))
    plan = compile_graph(path, target="ray").plan
    assert plan is not None
    with pytest.raises(ClusterShort, match=r"the pools ask \{CPU: 12\} in all and the cluster "
                                           r"has \{CPU: 8\} \(2 node\(s\)"):
        check_fits(plan, [_node("a", CPU=4), _node("b", CPU=4)])


@pytest.mark.cluster
@pytest.mark.multiprocess
def test_a_plan_asking_more_gpus_than_the_cluster_has_stops_at_once(tmp_path: Path) -> None:
    """4 GPUs a worker on the embedded CPU cluster: one message before any worker starts
    (before, the placement group waited forever, Ray's autoscaler line every 35 s)."""
    graph = _graph(tmp_path, size=1, gpus=4)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "flowgraph", "run", str(graph), "--target", "ray",
         "trainer.steps=1", f"trainer.run_dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240)
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("flowgraph: error: the Ray cluster cannot hold the plan's workers: pool `trainer` "
            "asks 1 worker(s) × {CPU: 1, GPU: 4}: the largest node has {GPU: 0}"
            in proc.stderr), proc.stderr
    assert ("lower resources.pools.trainer.gpus (declaring the pool), run on cpu "
            "(`resources.device: cpu`) or add GPU nodes") in proc.stderr
    assert "Traceback" not in proc.stderr
    assert took < 120, f"took {took:.0f} s"  # Ray's start-up; no placement wait


@pytest.mark.parametrize(("nnodes", "message"), [
    (1, "the plan runs 4 rank(s) on this machine on cuda, 4 GPU(s) in all, and it sees 1 "
        "CUDA device(s); lower --nproc N (or spread the ranks over more machines with "
        "--nnodes M), or compile for cpu (`resources.device: cpu`)"),
    (2, "the plan runs 2 rank(s) on this machine on cuda, 2 GPU(s) in all, and it sees 1 "
        "CUDA device(s)"),
])
def test_fsdp_ranks_on_cuda_need_as_many_visible_devices(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nnodes: int, message: str) -> None:
    """Before, each rank took `cuda:LOCAL_RANK` and the third failed deep in torch."""
    import torch

    from flowgraph.compilers.targets.fsdp.launch import launch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # the machine
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    plan = compile_graph(DPO, target="fsdp", nproc=4, device="cuda",
                         overrides=[f"trainer.run_dir={tmp_path / 'run'}"]).plan
    assert plan is not None
    opts = RunOptions(nnodes=nnodes, node_rank=0, rdzv_endpoint="127.0.0.1:1")
    with pytest.raises(FlowgraphError) as info:
        launch(plan, opts)
    assert str(info.value).startswith(message)
    assert not (tmp_path / "run").exists()  # before the run dir, before any rank


@pytest.mark.cluster
@pytest.mark.multiprocess
def test_a_pool_s_resources_strategy_and_labels_reach_ray(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`reserve` on a real cluster: the placement group has the pool's bundles (custom
    resources too) and strategy, the actors take them; a label selector no node matches
    leaves it unplaced (`placed` gives up after its bounded wait), one that matches the
    node's id places it."""
    import ray
    from ray.util import placement_group_table, remove_placement_group

    from flowgraph.compilers.targets.ray import cluster as ray_cluster
    from flowgraph.compilers.targets.ray.calls import reserve
    from flowgraph.plan import Label

    plan = _plan(tmp_path, strategy="spread", custom_resources={"flowgraph_test": 0.5})
    pool = plan.pool("trainer")
    ray.init(num_cpus=2, resources={"flowgraph_test": 1}, include_dashboard=False,
             configure_logging=False)
    try:
        node = ray.get_runtime_context().get_node_id()
        pg, places = reserve(replace(pool, label_selector=(Label("ray.io/node-id", node),)))
        table = placement_group_table(pg)
        assert (table["strategy"], table["state"]) == ("SPREAD", "CREATED")
        assert table["bundles"] == {0: {"CPU": 1.0, "flowgraph_test": 0.5},
                                    1: {"CPU": 1.0, "flowgraph_test": 0.5}}
        assert [(p["num_cpus"], p["num_gpus"], p["resources"]) for p in places] == [
            (1, 0, {"flowgraph_test": 0.5})] * 2
        remove_placement_group(pg)
        monkeypatch.setattr(ray_cluster, "PLACE_TIMEOUT_S", 3.0)
        with pytest.raises(ray_cluster.ClusterLost, match="could not be placed within 3 s"):
            reserve(replace(pool, label_selector=(Label("ray.io/node-id", f"!{node}"),)))
    finally:
        ray.shutdown()
