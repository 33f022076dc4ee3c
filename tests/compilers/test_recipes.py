"""The launch recipes under deploy/ run as written, on two "nodes" of this machine.

deploy/slurm/*.sbatch run under a fake `sbatch` / `srun` / `scontrol`
(tests/fixtures/fake_slurm.py: each node of the allocation is a loopback address, each
srun task a local process with its node's SLURM_* variables); deploy/ray/submit.sh
submits to a Ray head and a second Ray node started here with `ray start`. Each run is
GRPO at small batches for 2 steps, and its metrics are the local run's.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flowgraph.compilers import read_metrics
from flowgraph.testing.targets import assert_same_numbers

ROOT = Path(__file__).resolve().parents[2]
GRAPH = ROOT / "graphs" / "grpo.yaml"
FAKE_SLURM = ROOT / "tests" / "fixtures" / "fake_slurm.py"
SMALL = ("dims.Bp=4", "dims.N=4", "nodes.update_actor.params.mini_batch_size=8",
         "trainer.val_before_train=false")
"""GRPO at small batches (tests/compilers/conftest.py's SMALL["grpo"])."""
TWO_STEPS = (*SMALL, "trainer.steps=2")


@pytest.fixture(scope="module")
def local_rows(tmp_path_factory: pytest.TempPathFactory, local_run: Any
               ) -> list[dict[str, Any]]:
    """The local run every recipe's run must equal."""
    return list(local_run(GRAPH, tmp_path_factory.mktemp("recipes") / "local", *TWO_STEPS))


@pytest.fixture
def ray_temp() -> Iterator[str]:
    """A Ray temp dir with a short path (a node's socket paths must stay under 108
    bytes), removed after the test."""
    temp = tempfile.mkdtemp(prefix="fg-ray-")
    yield temp
    shutil.rmtree(temp, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _environment(tmp_path: Path, **values: str) -> dict[str, str]:
    """This environment with the fake SLURM commands, `ray` run by this Python (a node's
    workers run the Python that started it: this flowgraph, not another installed one)
    and this Python's scripts first on PATH, and the recipe's variables `values`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("sbatch", "srun", "scontrol"):
        wrapper = bin_dir / tool
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_SLURM}" {tool} "$@"\n')
        wrapper.chmod(0o755)
    (bin_dir / "ray").write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "import sys; from '
                                 f'ray.scripts.scripts import main; sys.exit(main())" "$@"\n')
    (bin_dir / "ray").chmod(0o755)
    path = f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_"))}
    return {**env, "PATH": path, **values}


def _run(command: list[str], env: dict[str, str], timeout: float = 400
         ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{command} exited {proc.returncode}:\n" \
        f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _processes_naming(text: str) -> list[str]:
    """Command lines of the live processes that contain `text`."""
    lines = (_cmdline(int(p.name)) for p in Path("/proc").glob("[0-9]*"))
    return [line for line in lines if text in line]


def test_every_deploy_script_parses() -> None:
    scripts = [p for p in (ROOT / "deploy").rglob("*")
               if p.is_file() and p.read_text(errors="replace").startswith("#!/bin/bash")]
    assert {p.name for p in scripts} >= {"fsdp.sbatch", "ray.sbatch", "submit.sh"}
    for script in scripts:
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script}: {proc.stderr}"


@pytest.mark.cluster
@pytest.mark.multiprocess
def test_fsdp_sbatch_on_two_nodes_equals_local_and_resumes_when_requeued(
        tmp_path: Path, local_rows: list[dict[str, Any]]) -> None:
    """Step 0 as one job; the same job requeued (SLURM_RESTART_COUNT=1), now for 2 steps,
    continues from step 0's checkpoint with --resume: the rows of one local run."""
    run_dir = tmp_path / "run"
    recipe = {"GRAPH": str(GRAPH), "RUN_DIR": str(run_dir), "PROCS_PER_NODE": "1"}
    first = _run(["sbatch", "deploy/slurm/fsdp.sbatch"], _environment(
        tmp_path, **recipe, RDZV_PORT=str(_free_port()),
        OVERRIDES=" ".join((*SMALL, "trainer.steps=1"))))
    assert "2 nodes x 1 ranks, rendezvous at 127.0.0.1:" in first.stdout
    # node 0's launcher names the rows; node 1's says its ranks are done
    assert first.stdout.count(f"run finished: {run_dir}/metrics.jsonl") == 1, first.stdout
    assert (f"run finished: the ranks of node 1 are done; node 0 wrote {run_dir}/"
            "metrics.jsonl") in first.stdout, first.stdout
    assert [r["step"] for r in read_metrics(run_dir)] == [0]

    again = _run(["sbatch", "deploy/slurm/fsdp.sbatch"], _environment(
        tmp_path, **recipe, RDZV_PORT=str(_free_port()), SLURM_RESTART_COUNT="1",
        OVERRIDES=" ".join(TWO_STEPS)))
    assert "the next step is 1" in again.stdout, again.stdout
    assert_same_numbers(read_metrics(run_dir), local_rows)


@pytest.mark.cluster
@pytest.mark.multiprocess
def test_ray_sbatch_starts_a_two_node_cluster_runs_and_stops_it(
        tmp_path: Path, ray_temp: str, local_rows: list[dict[str, Any]]) -> None:
    """A head and a second Ray node of 1 CPU each: the two workers of the pool run one
    on each. Afterwards no process of the cluster is left and its token file is gone."""
    port, temp, token = _free_port(), ray_temp, tmp_path / "token"
    # The two nodes share this machine: the head's dashboard agent gets a port of its own
    # (another cluster here may hold Ray's 52365).
    start_args = f"--temp-dir={temp} --dashboard-agent-listen-port={_free_port()}"
    proc = _run(["sbatch", "--cpus-per-task=1", "deploy/slurm/ray.sbatch"], _environment(
        tmp_path, GRAPH=str(GRAPH), RUN_DIR=str(tmp_path / "run"), NPROC="2",
        RAY_PORT=str(port), RAY_DASHBOARD_PORT=str(_free_port()), RAY_TOKEN_FILE=str(token),
        RAY_START_ARGS=start_args, OVERRIDES=" ".join(TWO_STEPS)))
    assert "Ray nodes joined: 2 of 2" in proc.stdout, proc.stdout
    assert "SLURM KillWait is 30 s; trainer.stop_grace_s=25" in proc.stdout, proc.stdout
    assert "srun: error" not in proc.stderr, proc.stderr  # the nodes stopped as asked
    assert_same_numbers(read_metrics(tmp_path / "run"), local_rows)
    assert not token.exists()
    assert not _processes_naming(temp), "the cluster's processes outlived the job"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


WAIT_FOR_CLUSTER = """
import sys, time, urllib.error, urllib.request
import ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
deadline = time.monotonic() + 120
while sum(node["Alive"] for node in ray.nodes()) < 2:
    assert time.monotonic() < deadline, "the second Ray node did not join within 120 s"
    time.sleep(0.5)
while True:  # the job API (which answers 401 without the token)
    try:
        urllib.request.urlopen(sys.argv[2] + "/api/version", timeout=5).close()
        break
    except urllib.error.HTTPError:
        break
    except OSError:
        assert time.monotonic() < deadline, "the dashboard did not answer within 120 s"
        time.sleep(0.5)
"""
"""Wait until the cluster at argv[1] has 2 live nodes and its job API (argv[2]) answers."""


def _srun_steps(batch: int) -> list[int]:
    """The pids of the `srun` steps the batch job `batch` (the fake sbatch) runs."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (name) state ppid ...": the name may hold spaces
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    below = {batch}
    while more := {pid for pid, ppid in parents.items() if ppid in below} - below:
        below |= more
    return [pid for pid in below if f"{FAKE_SLURM} srun" in _cmdline(pid)]


def _cmdline(pid: int) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # ended meanwhile
        return ""
    return args.replace(b"\0", b" ").decode(errors="replace")


@pytest.mark.cluster
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("target", ["fsdp", "ray"])
def test_sbatch_stopped_by_sigterm_saves_and_a_new_job_continues_with_resume(
        target: str, tmp_path: Path, ray_temp: str, local_run: Any) -> None:
    """fsdp: what `#SBATCH --signal` sends before the time limit, SIGTERM to the job's
    srun steps (every node's launcher); ray: a plain `scancel`, SIGTERM to the batch
    script and every srun step: the Ray nodes hold out until the driver has saved. The
    run checkpoints after its step, prints the recipe's resume command and exits 143
    (ray: the cluster stopped, its steps without `srun: error`); a new job with
    RESUME=1 continues: one local run's rows."""
    overrides, temp = (*SMALL, "trainer.steps=8"), ray_temp
    recipe = {"fsdp": {"PROCS_PER_NODE": "1"}, "ray": {
        "NPROC": "2", "RAY_DASHBOARD_PORT": str(_free_port()),
        "RAY_START_ARGS": f"--temp-dir={temp} --dashboard-agent-listen-port={_free_port()}",
        "RAY_TOKEN_FILE": str(tmp_path / "token")}}[target]

    def job(**more: str) -> subprocess.Popen[str]:
        env = _environment(tmp_path, GRAPH=str(GRAPH), RUN_DIR=str(tmp_path / "run"),
                           RDZV_PORT=str(_free_port()), RAY_PORT=str(_free_port()),
                           OVERRIDES=" ".join(overrides), **recipe, **more)
        return subprocess.Popen(["sbatch", "--cpus-per-task=1", f"deploy/slurm/{target}.sbatch"],
                                env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    first, seen = job(), []
    assert first.stdout is not None
    for line in first.stdout:
        seen.append(line)
        if line.startswith("step 2/"):
            steps = _srun_steps(first.pid) + ([first.pid] if target == "ray" else [])
            # fsdp: its one srun step (a task per node); ray: the batch script and the
            # nodes' steps
            assert len(steps) >= (1 if target == "fsdp" else 2), "no srun step found"
            for pid in steps:
                os.kill(pid, signal.SIGTERM)
    assert first.wait(timeout=120) == 143, "".join(seen[-40:])
    assert any("stopped by SIGTERM; the last checkpoint is step" in s for s in seen), seen
    assert any(f"continue with: RESUME=1 GRAPH={GRAPH} RUN_DIR={tmp_path / 'run'} " in s
               and f"sbatch {ROOT / 'deploy' / 'slurm' / target}.sbatch (a new job; it runs "
               "flowgraph run " in s for s in seen), seen
    if target == "ray":  # fsdp: each node's launcher exits 143, which srun reports
        assert not any(s.startswith("srun: error") for s in seen), seen
    assert not _processes_naming(temp), "the cluster's processes outlived the job"

    again = job(RESUME="1")
    out, _ = again.communicate(timeout=400)
    assert again.returncode == 0, out[-5000:]
    assert "resuming from checkpoint" in out
    assert_same_numbers(read_metrics(tmp_path / "run"),
                        local_run(GRAPH, tmp_path / "local", *overrides))


@pytest.fixture
def two_ray_nodes(tmp_path: Path, ray_temp: str) -> Iterator[dict[str, str]]:
    """A Ray head and a second Ray node (1 CPU each) with token authentication, as
    `ray start` runs them; the environment that reaches them (RAY_API: the job API)."""
    port, dashboard, temp = _free_port(), _free_port(), ray_temp
    token = tmp_path / "token"
    token.write_text(os.urandom(32).hex())
    token.chmod(0o600)
    env = _environment(tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    # Each node its own temp dir, as on two machines: a node's runtime-env agent sets up
    # the job's working dir afresh in it, under the feet of the driver running there.
    common = ["--num-cpus=1", "--disable-usage-stats", "--block"]
    head = subprocess.Popen(
        ["ray", "start", "--head", f"--port={port}", f"--dashboard-port={dashboard}",
         f"--dashboard-agent-listen-port={_free_port()}", f"--temp-dir={temp}/0", *common],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    nodes = [head]
    try:
        _wait_for_port(port, head)
        nodes.append(subprocess.Popen(
            ["ray", "start", f"--address=127.0.0.1:{port}", f"--temp-dir={temp}/1", *common],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        api = f"http://127.0.0.1:{dashboard}"
        _run([sys.executable, "-c", WAIT_FOR_CLUSTER, f"127.0.0.1:{port}", api], env)
        yield {**env, "RAY_API": api}
    finally:
        for node in nodes:  # `ray start --block` stops its node's processes on SIGTERM
            node.terminate()
        for node in nodes:
            node.wait(timeout=60)
    assert not _processes_naming(temp), "a Ray node's processes outlived `ray start`"


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "`ray start --head` ended"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"no Ray head on port {port} after {timeout} s")


@pytest.mark.cluster
@pytest.mark.multiprocess
def test_ray_job_submit_runs_on_the_cluster_it_was_submitted_to(
        tmp_path: Path, two_ray_nodes: dict[str, str], local_rows: list[dict[str, Any]]
        ) -> None:
    """deploy/ray/submit.sh: `ray job submit --working-dir . -- flowgraph run ...
    --address auto`; the driver joins the 2-node cluster (its 2 workers need both
    nodes' CPU), the job succeeds, its rows are the local run's."""
    run_dir = tmp_path / "run"
    env = {**two_ray_nodes, "GRAPH": "graphs/grpo.yaml", "RUN_DIR": str(run_dir),
           "NPROC": "2", "OVERRIDES": " ".join(TWO_STEPS)}
    proc = _run(["bash", "deploy/ray/submit.sh"], env)
    assert "succeeded" in proc.stdout, proc.stdout
    assert f"run finished: {run_dir}/metrics.jsonl" in proc.stdout
    assert_same_numbers(read_metrics(run_dir), local_rows)


def test_ray_job_submit_refuses_a_relative_run_dir(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", "deploy/ray/submit.sh"], cwd=ROOT, capture_output=True,
                          text=True, env=_environment(tmp_path, RUN_DIR="runs/grpo"))
    assert proc.returncode == 2
    assert "RUN_DIR=runs/grpo is relative; give an absolute path" in proc.stderr
