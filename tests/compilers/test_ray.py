"""The ray target: equal numbers with the local executor, and worker faults survived.

Runs a real embedded Ray cluster (4 logical CPUs: PPO's two pools of two workers) on
the tiny built-in model. The local reference runs in-process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from flowgraph.api import load_plan
from flowgraph.compilers import RunOptions, read_metrics
from flowgraph.passes import compile_graph
from flowgraph.plan import plan_to_json
from flowgraph.testing.targets import assert_same_numbers

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = ROOT / "graphs"
SMALL = ("dims.Bp=4", "dims.N=4", "nodes.update_actor.params.mini_batch_size=8",
         "trainer.val_before_train=false")
"""GRPO at small batches (tests/compilers/conftest.py's SMALL["grpo"])."""


@pytest.fixture
def devnull() -> Any:
    with open(os.devnull, "w") as f:
        yield f


@pytest.fixture(scope="module")
def cluster() -> Any:
    from flowgraph.compilers.targets.ray.driver import start_ray

    plan = compile_graph(GRAPHS / "ppo.yaml", target="ray", nproc=2).plan
    assert plan is not None
    start_ray(plan, None)
    yield ray
    ray.shutdown()


class _Scraper:
    """The run's console (to /dev/null). Reads /metrics once the run holds its endpoint
    after the last step (`metrics_hold`), while the exporter still serves."""

    def __init__(self, sink: Any) -> None:
        self.sink, self.url, self.body = sink, "", ""

    def write(self, text: str) -> int:
        if text.startswith("metrics: "):
            self.url = text.split()[1]
        if text.startswith("serving the final metrics"):
            self.body = self._get()
        return int(self.sink.write(text))

    def flush(self) -> None:
        self.sink.flush()

    def isatty(self) -> bool:
        return False

    def scrape(self) -> str:
        assert self.body, f"nothing scraped (exporter at {self.url or 'no URL'})"
        return self.body

    def _get(self) -> str:
        import urllib.request

        with urllib.request.urlopen(self.url, timeout=10) as reply:
            return str(reply.read().decode())


def _plan(graph: str, run_dir: Path, overrides: tuple[str, ...],
          file: Path | None = None) -> Any:
    """The graph compiled for ray(2), written to a plan file and read back from it: what
    `flowgraph compile -o plan.json` then `flowgraph run plan.json` runs."""
    result = compile_graph(file or GRAPHS / f"{graph}.yaml", target="ray", nproc=2,
                           overrides=[f"trainer.run_dir={run_dir}", *overrides])
    assert result.plan is not None, result.diagnostics
    file = run_dir.parent / f"{graph}.plan.json"
    file.write_text(plan_to_json(result.plan))
    return load_plan(file)


def _proved_one_run_dir(run_dir: Path) -> None:
    """The driver and every worker proved they share the run dir before the models
    loaded: each worker's marker holds the token of the driver's."""
    ranks = run_dir / ".ranks"
    token = (ranks / "driver").read_text()
    workers = json.loads((ranks / "workers.json").read_text())
    assert {p.name: p.read_text() for p in ranks.glob("worker_*")} == {
        f"worker_{pool}-{i}": token for pool, pids in workers.items()
        for i in range(len(pids))}, workers


@pytest.mark.parametrize(("graph", "tied"), [
    pytest.param(graph, tied, id=f"{graph}-{'tied' if tied else 'untied'}",
                 marks=[pytest.mark.slow] if graph == "agent" or (tied and graph != "grpo") else [])
    for graph in ("ppo", "grpo", "dpo", "agent") for tied in (False, True)])
def test_ray_gives_the_numbers_of_the_local_run(
        graph: str, tied: bool, cluster: Any, tmp_path: Path, devnull: Any,
        local_reference: Any, local_run: Any, equal_overrides: dict[str, tuple[str, ...]],
        tied_models: Any, graph_path: Any) -> None:
    """Untied (`builtin:tiny-lm`) and tied (`builtin:tiny-tied`: the LM head is the
    input embedding) models alike (tied: GRPO in the default suite, with
    `test_a_local_checkpoint_of_a_tied_model_resumes_on_ray`; PPO's and DPO's `-m slow`);
    resumed by the local target from a ray checkpoint. `agent` (slow):
    multi-turn episodes calling a tool (tests/plugins/agent_turns.yaml),
    each worker running its half of the episodes, `agent/*` metrics included."""
    from flowgraph.compilers.targets.ray.driver import run_ray

    out = _Scraper(devnull)
    overrides = (*equal_overrides[graph], *(tied_models(graph) if tied else ()))
    run_ray(_plan(graph, tmp_path / "ray", overrides, graph_path(graph)), RunOptions(
        out=out, shutdown=False, metrics_port=0, metrics_hold=0.1 if graph == "grpo" else 0))
    rows = read_metrics(tmp_path / "ray")
    assert_same_numbers(rows, local_reference(graph, tied=tied))
    _proved_one_run_dir(tmp_path / "ray")
    # The step-3 checkpoint (DCP shards) resumed by the local target: the same step 4.
    shutil.rmtree(tmp_path / "ray" / "checkpoints" / "step_4")
    assert_same_numbers(local_run(graph_path(graph), tmp_path / "ray", *overrides,
                                  resume=True), rows)
    if graph == "ppo":
        assert "val/score/mean" in rows[-1], "held-out evaluation through the workers"
    if graph == "grpo":  # one endpoint on the driver; every worker under its own label
        body = out.scrape()
        assert 'flowgraph_training_steps_total{worker="driver"} 5.0' in body, body
        for worker in ("actor_rollout_ref/0", "actor_rollout_ref/1"):  # its own seconds
            assert (f'flowgraph_worker_stage_seconds_count{{kind="generate",stage="gen",'
                    f'worker="{worker}"}} 5.0') in body, body
        assert 'flowgraph_device_memory_bytes{device="cpu",worker="actor_rollout_ref/1"}' \
            in body


def test_a_local_checkpoint_of_a_tied_model_resumes_on_ray(
        cluster: Any, tmp_path: Path, devnull: Any, local_reference: Any,
        equal_overrides: dict[str, tuple[str, ...]], tied_models: Any) -> None:
    """GRPO on `builtin:tiny-tied`: the local run's step-3 checkpoint (whole tensors)
    loads into the two workers' shards; their step 4 is the local run's."""
    from flowgraph.compilers.targets.ray.driver import run_ray

    run_dir = tmp_path / "ray"
    shutil.copytree(local_reference.run_dir("grpo", tied=True), run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_4")
    overrides = (*equal_overrides["grpo"], *tied_models("grpo"))
    run_ray(_plan("grpo", run_dir, overrides), RunOptions(out=devnull, shutdown=False,
                                                         resume=True))
    assert_same_numbers(read_metrics(run_dir), local_reference("grpo", tied=True))
    assert (run_dir / "checkpoints" / "step_4" / "dcp").is_dir(), "written by ray"


def test_async_rollouts_on_a_rollout_pool_equal_a_local_producer_process_and_resume(
        cluster: Any, tmp_path: Path, devnull: Any, local_run: Any,
        equal_overrides: dict[str, tuple[str, ...]], tied_models: Any) -> None:
    """GRPO on the tied built-in with `trainer.max_staleness: 1`: on ray the producer runs
    on the rollout pool (one worker with its own copies of actor and reference, the
    weights of the two sharded trainer workers sent to it after every update); the local
    target runs it in a producer process, the tied weights reaching it through shared
    memory: the same numbers. A run resumed from the step-1 checkpoint (its buffer holds
    step 2's rollout) repeats steps 2-4."""
    from flowgraph.compilers.targets.ray.driver import run_ray

    overrides = (*equal_overrides["grpo"], *tied_models("grpo"), "trainer.max_staleness=1")
    plan = _plan("grpo", tmp_path / "ray", overrides)
    assert plan.asynchronous.pool is not None
    run_ray(plan, RunOptions(out=devnull, shutdown=False))
    rows = read_metrics(tmp_path / "ray")
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    overlap = [r["async/overlap_frac"] for r in rows]
    assert all(0.0 <= f <= 1.0 for f in overlap) and overlap[-1] == 0.0, overlap
    assert_same_numbers(rows, local_run(GRAPHS / "grpo.yaml", tmp_path / "local", *overrides))
    logs = sorted(p.name for p in (tmp_path / "ray" / "logs").iterdir())
    assert logs == ["actor_rollout_ref-0.log", "actor_rollout_ref-1.log", "rollouts-0.log"]

    shutil.copytree(tmp_path / "ray", tmp_path / "resumed")
    for step in (3, 4):
        shutil.rmtree(tmp_path / "resumed" / "checkpoints" / f"step_{step}")
    run_ray(_plan("grpo", tmp_path / "resumed", overrides),
            RunOptions(out=devnull, shutdown=False, resume=True))
    assert_same_numbers(read_metrics(tmp_path / "resumed"), rows)


@pytest.mark.multiprocess
@pytest.mark.parametrize("admission", ["block", pytest.param("drop", marks=pytest.mark.slow)])
def test_partial_rollouts_on_the_rollout_pool_take_each_update_between_turns(
        admission: str, cluster: Any, tmp_path: Path, devnull: Any, graph_path: Any) -> None:
    """`trainer.partial_rollouts` on ray(2): the agent graph's episodes (each tool call
    and env reply 0.5 s: a rollout outlasts the trainer's update, also when the update
    shares the cores with another xdist worker; at 0.2 s it once did not) are produced on the
    rollout pool, which is sent every new version while it produces: a step's episodes
    were sampled by two versions, so its staleness is below its max, and no token is
    more than one update old. Under `block` every rollout is trained once, in order:
    the data cursor moves by the batch (4 prompts) every step; under `drop` by the
    batches of the rollouts dropped too."""
    from flowgraph.compilers.targets.ray.driver import run_ray

    overrides = ("trainer.max_staleness=1", "trainer.partial_rollouts=true",
                 f"trainer.admission={admission}", "nodes.agent.params.env_params.slow_s=0.5")
    plan = _plan("agent", tmp_path / "ray", overrides, graph_path("agent"))
    assert plan.asynchronous.pool is not None and plan.asynchronous.partial
    run_ray(plan, RunOptions(out=devnull, shutdown=False))
    rows = read_metrics(tmp_path / "ray")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["async/staleness_max"] <= 1.0 for r in rows), rows
    assert any(r["agent/versions_per_episode"] > 1.0
               and r["async/staleness"] < r["async/staleness_max"] for r in rows), rows
    drawn = [r["data/train/position"] for r in rows]
    dropped = [r.get("async/dropped", 0.0) for r in rows]
    assert drawn == [4.0 * (k + 1 + sum(dropped[:k + 1])) for k in range(3)], (drawn, dropped)


def test_a_node_error_in_a_worker_names_the_node_and_step(
        cluster: Any, tmp_path: Path, devnull: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from flowgraph.compilers.targets.ray.driver import run_ray
    from flowgraph.errors import FlowgraphError

    monkeypatch.syspath_prepend(str(ROOT / "tests" / "plugins"))  # workers inherit sys.path
    text = (GRAPHS / "grpo.yaml").read_text().replace(
        "name: grpo\n", "name: grpo\nplugins: [fg_runtime_faults]\n", 1).replace(
        "  old_logprob:\n    kind: logprob\n",
        "  old_logprob:\n    kind: fragile_logprob\n    params: {fail_at: 1}\n", 1)
    graph = tmp_path / "fragile.yaml"
    graph.write_text(text)
    result = compile_graph(graph, target="ray", nproc=2, overrides=[
        "trainer.steps=3", f"trainer.run_dir={tmp_path / 'bad'}"])
    assert result.plan is not None, result.diagnostics
    with pytest.raises(FlowgraphError) as exc:
        run_ray(result.plan, RunOptions(out=devnull, shutdown=False))
    message = str(exc.value)
    assert "while executing node `old_logprob` (kind fragile_logprob" in message, message
    assert "at step 1: RuntimeError: fragile_logprob failed on purpose" in message, message
    # the plugin's own line, not the executor's; the traceback kept in the run dir
    assert f"at {ROOT / 'tests' / 'plugins' / 'fg_runtime_faults.py'}:" in message, message
    assert 'in fragile_logprob: raise RuntimeError("fragile_logprob failed' in message, message
    assert "Traceback" in (tmp_path / "bad" / "traceback.txt").read_text()


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(pred: Any, proc: subprocess.Popen[str], what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()[0]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _workers(run_dir: Path) -> dict[str, list[int]]:
    return json.loads((run_dir / ".ranks" / "workers.json").read_text())


def test_a_dead_and_a_hung_worker_are_restarted_from_the_last_checkpoint(tmp_path: Path
                                                                         ) -> None:
    """SIGKILL a worker at step ~3, SIGSTOP one (a hang) at step ~6: the driver notices,
    restarts the groups from the last checkpoint, and every step lands exactly once."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowgraph", "run", str(GRAPHS / "grpo.yaml"), "--target",
         "ray", "--nproc", "2", "trainer.steps=9", "trainer.checkpoint_every=2",
         "trainer.step_timeout_s=10", f"trainer.run_dir={run_dir}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    try:
        _wait(lambda: len(_rows(run_dir)) >= 3, proc, "step 2")
        first = _workers(run_dir)
        os.kill(first["actor_rollout_ref"][1], signal.SIGKILL)
        # The groups restart (new pids) and pass step 5.
        _wait(lambda: _workers(run_dir) != first and max(
            (r["step"] for r in _rows(run_dir)), default=-1) >= 5, proc, "the restart")
        hung = _workers(run_dir)["actor_rollout_ref"][0]
        os.kill(hung, signal.SIGSTOP)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    # where the driver noticed depends on timing: in a node, or saving, or reporting
    assert re.search(r"a worker died (in node `|while )", out), out
    assert "restarting the worker groups" in out, out
    # Ray's error names the worker (point 5 of issue #29); flowgraph says where its log is.
    assert ("(flowgraph/run/actor_rollout_ref/1: The actor died unexpectedly before "
            "finishing this task. Its output: logs/actor_rollout_ref-1.log in the run dir)"
            ) in out, out
    # the silent worker named, with its node, pid and log (and its peer, when it waits
    # for it in a collective: saving)
    assert re.search(r"worker 0 of pool `actor_rollout_ref` \(node [\d.]+, pid "
                     rf"{hung}; its output: logs/actor_rollout_ref-0.log in the run dir\)"
                     r"( and worker 1 of pool `actor_rollout_ref` \([^)]*\))? gave no "
                     r"answer for trainer.step_timeout_s = 10", out), out
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(9)), "every step exactly once"
    recovered = [r["perf/recovery_s"] for r in rows if "perf/recovery_s" in r]
    assert len(recovered) == 2 and all(0 < s < 120 for s in recovered), recovered


def test_an_address_where_nothing_listens_is_one_error_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Ray itself retries such an address for minutes; nothing listens on port 1. (As if
    # no cluster were up in this process: the module's cluster stays as it is.)
    from flowgraph.compilers.targets.ray.driver import start_ray
    from flowgraph.errors import FlowgraphError

    plan = compile_graph(GRAPHS / "grpo.yaml", target="ray").plan
    assert plan is not None
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail(f"ray.init({kw}) was called"))
    start = time.monotonic()
    with pytest.raises(FlowgraphError, match=r"cannot join the Ray cluster at `127\.0\.0\.1:1`"):
        start_ray(plan, "127.0.0.1:1")
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("leaves", [True, False], ids=["dead-run-leaves", "live-run"])
def test_a_run_joins_its_own_namespace_and_waits_for_a_dead_run_s_actors_to_leave_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, leaves: bool) -> None:
    """`--address`: the run joins namespace `flowgraph/<run dir's name>`. Actors already
    named there are a dead run's (Ray ends them within a second: the run goes on) or a
    live run's whose run dir has the same name (one message with the fix). No cluster:
    Ray's calls are stood in for."""
    from flowgraph.compilers.targets.ray import driver as target
    from flowgraph.errors import FlowgraphError

    plan = compile_graph(GRAPHS / "grpo.yaml", target="ray",
                         overrides=[f"trainer.run_dir={tmp_path / 'grpo-7'}"]).plan
    assert plan is not None
    joined: dict[str, Any] = {}
    held = ["flowgraph/grpo-7/actor_rollout_ref/1", "flowgraph/grpo-7/actor_rollout_ref/0"]
    answers = iter([held, []] if leaves else [])
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: joined.update(kw))
    monkeypatch.setattr(ray.util, "list_named_actors", lambda: next(answers, held))
    monkeypatch.setattr(target, "_answers", lambda address: None)
    monkeypatch.setattr(target, "NAMESPACE_WAIT_S", 0.6)
    if leaves:
        target.start_ray(plan, "10.0.0.1:6379")
        assert joined["namespace"] == "flowgraph/grpo-7"
        return
    with pytest.raises(FlowgraphError) as exc:
        target.start_ray(plan, "10.0.0.1:6379")
    assert str(exc.value) == (
        "the Ray cluster at `10.0.0.1:6379` runs actors of another run in namespace "
        "`flowgraph/grpo-7` (flowgraph/grpo-7/actor_rollout_ref/0, "
        "flowgraph/grpo-7/actor_rollout_ref/1): a run's Ray names come from its run dir's "
        "name, `grpo-7`; give this run a run dir of another name, e.g. "
        "trainer.run_dir=runs/grpo-7-2")


def test_a_plan_file_runs_as_edited_a_pool_of_another_size(
        cluster: Any, tmp_path: Path, devnull: Any, local_reference: Any,
        equal_overrides: dict[str, tuple[str, ...]]) -> None:
    """`flowgraph compile --target ray --nproc 2 -o plan.json`, the actor pool cut to one
    worker by hand: `flowgraph run plan.json` starts one worker there, two for none, and
    gives the numbers of the local run (data parallelism never changes them)."""
    import flowgraph

    run_dir = tmp_path / "ray"
    file = tmp_path / "plan.json"
    data = json.loads(plan_to_json(_plan("grpo", run_dir, equal_overrides["grpo"])))
    pool = next(p for p in data["pools"] if p["name"] == "actor_rollout_ref")
    pool["size"], pool["bundles"] = 1, pool["bundles"][:1]
    file.write_text(json.dumps(data))
    result = flowgraph.run(file, out=devnull, shutdown=False)
    workers = json.loads((run_dir / ".ranks" / "workers.json").read_text())
    assert {name: len(pids) for name, pids in workers.items()} == {"actor_rollout_ref": 1}
    assert_same_numbers(result.rows, local_reference("grpo"))


@pytest.mark.slow
def test_a_dead_rollout_pool_worker_is_restarted_and_the_numbers_hold(
        tmp_path: Path, local_run: Any) -> None:
    """SIGKILL the rollout pool's worker after step 2 of an asynchronous GRPO (`block`):
    the driver notices at its next wait for a rollout, restarts every group and the
    pool from the step-1 checkpoint (its buffer: step 2's rollout), and the run ends
    with every step once and the numbers of the local producer process."""
    run_dir = tmp_path / "run"
    overrides = ("dims.Bp=4", "dims.N=4", "nodes.update_actor.params.mini_batch_size=16",
                 "trainer.val_before_train=false", "trainer.eval_every=0",
                 "trainer.max_staleness=1", "trainer.steps=12", "trainer.checkpoint_every=2")
    # 12 steps: the pool worker is still there when step 2's row is seen (with 6, an idle
    # machine could finish the run before the kill)
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowgraph", "run", str(GRAPHS / "grpo.yaml"), "--target",
         "ray", "trainer.step_timeout_s=30", f"trainer.run_dir={run_dir}", *overrides],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    try:
        _wait(lambda: len(_rows(run_dir)) >= 3, proc, "step 2")
        first = _workers(run_dir)
        os.kill(first["rollouts"][0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "a worker died in the rollout pool" in out, out
    assert "restarting the worker groups" in out, out
    assert _workers(run_dir)["rollouts"] != first["rollouts"]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(12)), "every step exactly once"
    assert_same_numbers(rows, local_run(GRAPHS / "grpo.yaml", tmp_path / "local", *overrides))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.faults
def test_partial_rollouts_on_the_rollout_pool_resume_after_the_driver_is_killed(
        tmp_path: Path, graph_path: Any) -> None:
    """SIGKILL the driver once step 1 is logged, while the rollout pool is in the middle
    of an episode (each tool call and env reply takes 0.2 s; a step's update 0.05 s): the
    embedded cluster goes with it; the run resumed from its last checkpoint trains every
    step once, each on the next 4 prompts of the dataset."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "flowgraph", "run", str(graph_path("agent")), "--target",
            "ray", "--nproc", "1", "trainer.steps=5", "trainer.max_staleness=1",
            "trainer.partial_rollouts=true", "nodes.agent.params.env_params.slow_s=0.2",
            "trainer.checkpoint_every=1", f"trainer.run_dir={run_dir}"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=tmp_path)
    try:
        _wait(lambda: len(_rows(run_dir)) >= 2, proc, "step 1")
        proc.kill()
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(_rows(run_dir)) < 5, "the run was killed before its end"
    resumed = subprocess.run([*args, "--resume"], capture_output=True, text=True, cwd=tmp_path,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["data/train/position"] for r in rows] == [4.0, 8.0, 12.0, 16.0, 20.0]
    assert all(r["async/staleness_max"] <= 1.0 for r in rows)


def test_a_stale_cluster_address_is_not_joined_and_a_stop_without_workers_says_so(
        tmp_path: Path) -> None:
    """A `ray_current_cluster` file left by a `ray start` that died, and RAY_ADDRESS, both
    naming a dead address: the run starts its own cluster (a note says RAY_ADDRESS is not
    joined). Each worker's log begins with who it is, where and when. SIGTERM while the
    workers hang, then the workers killed (on SLURM, a signal to every process of the
    job): the driver cannot save and says so, with the last checkpoint, and exits 143."""
    temp = tempfile.mkdtemp(prefix="fg-ray-")  # short: a node's socket paths
    (Path(temp) / "ray").mkdir()
    (Path(temp) / "ray" / "ray_current_cluster").write_text("127.0.0.1:1\n")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowgraph", "run", str(GRAPHS / "grpo.yaml"), "--target",
         "ray", "--nproc", "2", *SMALL, "trainer.steps=20", "trainer.checkpoint_every=2",
         f"trainer.run_dir={run_dir}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, cwd=tmp_path, env={**os.environ, "RAY_TMPDIR": temp,
                                      "RAY_ADDRESS": "127.0.0.1:1", "RAY_DEDUP_LOGS": "0"})
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("step 2/"):
                break
        workers = [pid for pids in _workers(run_dir).values() for pid in pids]
        for pid in workers:  # hung, so that the stop is asked for while they live
            os.kill(pid, signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        for line in proc.stdout:
            seen.append(line)
            if "finishing the running node" in line:
                break
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        out = "".join(seen) + proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(temp, ignore_errors=True)
    assert proc.returncode == 143, out
    assert ("flowgraph: note: RAY_ADDRESS=127.0.0.1:1 is set and --address ADDR is not: this "
            "run starts a Ray cluster of its own") in out, out
    from flowgraph.compilers.checkpoint.store import latest_checkpoint

    last = latest_checkpoint(run_dir)
    assert last is not None
    assert re.search(r"stopped by SIGTERM, but no checkpoint could be written: the workers "
                     r"holding the weights were gone \(a worker died .*\)(; steps? [\d to]+ "
                     rf"(was|were) trained and (is|are) lost)?; the last checkpoint is step "
                     rf"{last[0]}; continue with: flowgraph run ", out), out
    header = (run_dir / "logs" / "actor_rollout_ref-1.log").read_text().splitlines()
    assert re.fullmatch(r"flowgraph: worker 1 of pool `actor_rollout_ref` started \(host "
                        rf"\S+, node [\d.]+, pid {workers[1]}, \d{{4}}-.*\)",
                        next(h for h in header if h.startswith("flowgraph:"))), header
