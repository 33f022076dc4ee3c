"""Two machines simulated on one (issue #29, points 1 and 3): two `flowgraph run --target
fsdp --nnodes 2 --node-rank R --rdzv-endpoint 127.0.0.1:PORT` launches.

* run dirs that are not one folder are refused on both nodes, before any model loads,
  with one message (never a checkpoint published without node 1's shards); a Ray
  worker that does not see the driver's run dir is named with its node;
* a node that never comes is named after `--rdzv-timeout`, with a progress line meanwhile;
* a rank killed on one node is named on both, each with the command that resumes it,
  every launch flag in it; resumed, the run has the local run's numbers;
* a Ray head lost under a driver that joined it (`--address`) is one flowgraph message
  with the last checkpoint and the resume command, not Ray's own exit (in the default
  suite, ~25 s); so is the embedded cluster's raylet or GCS dying; a second Ray node
  killed whole is waited for, named, and the run goes on (the node started again) or
  stops with the resume command: the local run's numbers either way;
* two runs on one Ray cluster (issue #29, point 5) are told apart by their actors' and
  placement groups' names and namespaces; each worker's output is in its run's
  `logs/<pool>-<index>.log` and on the driver's console; a run dir name in use on the
  cluster is refused, and free again as soon as that run's driver is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flowgraph.compilers import RunOptions, read_metrics
from flowgraph.compilers.checkpoint.store import latest_checkpoint
from flowgraph.compilers.signals import resume_command
from flowgraph.compilers.targets import process_groups
from flowgraph.ir import TrainerSpec
from flowgraph.passes import compile_graph
from flowgraph.spelling import python_entry
from flowgraph.testing.targets import assert_same_numbers

ROOT = Path(__file__).resolve().parents[2]
DPO = ROOT / "graphs" / "dpo.yaml"
SHORT = ("trainer.steps=5", "trainer.checkpoint_every=2")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node(cwd: Path, rank: int, port: int, *args: str) -> subprocess.Popen[str]:
    """One machine's `flowgraph run` of the DPO graph on 2 processes over 2 nodes."""
    return subprocess.Popen(
        [sys.executable, "-m", "flowgraph", "run", str(DPO), "--target", "fsdp", "--nproc",
         "2", "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint",
         f"127.0.0.1:{port}", *args], cwd=cwd, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)


def _both(*procs: subprocess.Popen[str]) -> list[tuple[int, str, str]]:
    """Each process's exit code, stdout and stderr, once all have ended."""
    outputs = [p.communicate(timeout=300) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]


@pytest.mark.parametrize("python", [False, True], ids=["cli", "python"])
def test_the_resume_command_carries_every_launch_flag(tmp_path: Path, python: bool) -> None:
    plan = compile_graph(DPO, target="fsdp", nproc=2,
                         overrides=["trainer.run_dir=run"]).plan
    assert plan is not None
    opts = RunOptions(nnodes=2, node_rank=0, rdzv_endpoint="10.0.0.1:29500",
                      rdzv_timeout=30, overrides=("trainer.run_dir=run",))
    if not python:
        assert resume_command(plan, opts) == (
            f"flowgraph run {DPO} --target fsdp --nproc 2 --nnodes 2 --node-rank 0 "
            "--rdzv-endpoint 10.0.0.1:29500 --rdzv-timeout 30 --resume trainer.run_dir=run")
        return
    with python_entry():
        assert resume_command(plan, opts) == (
            f"flowgraph.run({str(DPO)!r}, target='fsdp', nproc=2, nnodes=2, node_rank=0, "
            "rdzv_endpoint='10.0.0.1:29500', rdzv_timeout=30, resume=True, "
            "run_dir='run')")


def test_a_ray_resume_command_joins_the_same_cluster() -> None:
    plan = compile_graph(DPO, target="ray", nproc=2, overrides=["trainer.run_dir=run"]).plan
    assert plan is not None
    assert resume_command(plan, RunOptions(address="10.0.0.1:6379")) == (
        f"flowgraph run {DPO} --target ray --nproc 2 --address 10.0.0.1:6379 --resume "
        "trainer.run_dir=run")


@pytest.mark.parametrize("job", ["SLURM_JOB_ID", "RAY_JOB_CONFIG_JSON_ENV_VAR", None])
def test_inside_a_recipe_s_job_the_resume_command_is_the_recipe_s(
        monkeypatch: pytest.MonkeyPatch, job: str | None) -> None:
    """deploy/'s recipes say how their job continues (FLOWGRAPH_RESUME_WITH); inside a
    SLURM job or a Ray job's driver that comes first, the flowgraph command it runs after.
    Outside a job the variable (left in a shell) is not believed."""
    from flowgraph.compilers.signals import LAUNCHER_JOB_ENV

    plan = compile_graph(DPO, target="ray", nproc=2, overrides=["trainer.run_dir=run"]).plan
    assert plan is not None
    for name in LAUNCHER_JOB_ENV:
        monkeypatch.delenv(name, raising=False)
    words = "RESUME=1 GRAPH=g.yaml RUN_DIR=/shared/run NPROC=2 sbatch deploy/slurm/ray.sbatch"
    monkeypatch.setenv("FLOWGRAPH_RESUME_WITH", words)
    if job:
        monkeypatch.setenv(job, "1234")
    again = (f"flowgraph run {DPO} --target ray --nproc 2 --address 10.0.0.1:6379 --resume "
             "trainer.run_dir=run")
    assert resume_command(plan, RunOptions(address="10.0.0.1:6379")) == (
        f"{words} (a new job; it runs {again})" if job else again)


@pytest.mark.parametrize(("error", "lost"), [
    ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
     "[127.0.0.1]:14216: Connection reset by peer.", True),
    ("DistBackendError: NCCL communicator was aborted on rank 0.", True),
    ("RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
     "1800000ms for recv operation to complete", True),
    ("NodeTimeout: the node ran past nodes.score.params.timeout_s = 30 s and was stopped "
     "here", False),
    ("non-finite output `scores` in node `score` at step 1", False)])
def test_a_peer_s_broken_connection_is_told_from_a_rank_s_own_error(error: str, lost: bool
                                                                    ) -> None:
    assert process_groups.lost_peer(error) is lost


GLOO_BROKEN = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
               "Read error [127.0.0.1]:20122: Connection reset by peer.")
AT_GEN = "while executing node `gen` (kind generate, model actor, grpo.yaml:20:3) at step 2: "


@pytest.mark.parametrize(("cause", "reported", "told"), [
    (f"{AT_GEN}{GLOO_BROKEN}\n  at _dist.py:118 in all: dist.all_reduce(t)", False,
     f"a worker lost a peer of its process group in node `gen` at step 2 ({GLOO_BROKEN})"),
    (f"{AT_GEN}{GLOO_BROKEN}", True,
     "a worker died in node `gen` at step 2 (The actor died unexpectedly before finishing "
     "this task.)"),
    (f"{AT_GEN}ValueError: no prompt", False, None),
    (f"{AT_GEN}ConnectionResetError: [Errno 104] Connection reset by peer\n  at "
     "rewards.py:5 in score: requests.post(URL)", False, None)],
    ids=["node-lost", "worker-died", "own-error", "own-network-error"])
def test_a_ray_worker_whose_peer_died_is_a_lost_worker(
        monkeypatch: pytest.MonkeyPatch, cause: str, reported: bool, told: str | None
        ) -> None:
    """Worker 0's collective broke (gloo) because worker 1 died: when Ray reports worker
    1's actor dead within `PEER_WAIT_S` (its node is up), that worker is named; when it
    does not (a node lost whole: Ray's health checks take ~15 s), the broken process
    group is the lost worker. Either way the driver recovers; a worker's own error stops
    the run as it was raised, a network error of its own too (a reward calling an API)."""
    from ray.exceptions import ActorDiedError, RayTaskError

    from flowgraph.compilers.targets.ray import calls as ray_calls
    from flowgraph.errors import NodeError, WorkerLost

    refs = ["worker-0", "worker-1"]

    def get(wanted: Any, timeout: float | None) -> Any:
        if wanted == "worker-1":
            raise ActorDiedError()
        raise RayTaskError("RayWorker.call", "", NodeError(cause))

    def wait(wanted: list[str], num_returns: int, timeout: float) -> tuple[list[str], list[str]]:
        assert (wanted, num_returns, timeout) == (refs, 2, ray_calls.PEER_WAIT_S)
        return (refs, []) if reported else (refs[:1], refs[1:])

    monkeypatch.setattr(ray_calls.ray, "get", get)
    monkeypatch.setattr(ray_calls.ray, "wait", wait)
    with pytest.raises(WorkerLost if told else NodeError) as exc:
        ray_calls.answers(refs, 30.0, ("gen", 2))
    assert str(exc.value) == (told or cause)


def test_several_nodes_need_a_rendezvous_endpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from flowgraph.cli import main

    code = main(["run", str(DPO), "--target", "fsdp", "--nproc", "2", "--nnodes", "2",
                 f"trainer.run_dir={tmp_path / 'run'}"])
    assert code == 2
    assert ("flowgraph: error: --nnodes 2 needs --rdzv-endpoint HOST:PORT: node 0's address "
            "and a free port, the same on every machine") in capsys.readouterr().err


def test_the_default_step_timeout_is_set_and_stated_in_the_readme() -> None:
    """A stopped worker ends a run by default (ray restarts it, fsdp names it): the
    default the README states is the declared one."""
    default = TrainerSpec().step_timeout_s
    assert default > 0
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Multi-node", 1)[1].split("\n## ", 1)[0]
    assert f"`trainer.step_timeout_s` is {default:g} s by default" in section


@pytest.mark.cluster
@pytest.mark.multiprocess
def test_run_dirs_that_are_not_one_folder_are_refused_on_every_node(tmp_path: Path) -> None:
    port = _port()
    results = _both(_node(tmp_path, 0, port, *SHORT, "trainer.run_dir=node0"),
                    _node(tmp_path, 1, port, *SHORT, "trainer.run_dir=node1"))
    errors = set()
    for code, out, err in results:
        assert code == 1, err
        assert "Traceback" not in err and "run finished" not in out, err
        errors |= {line for line in err.splitlines() if line.startswith("flowgraph: error:")}
    (error,) = errors  # the same one message on both
    assert ("the 2 nodes do not share one run dir: node 0 (host "
            f"{socket.gethostname()}, run dir `node0`) does not see the files of node 1; "
            "node 1 (") in error, error
    assert "put trainer.run_dir on a filesystem every node mounts" in error
    for node in (0, 1):  # no rank started: nothing written but each node's marker
        ranks = tmp_path / f"node{node}" / ".ranks"
        assert [p.name for p in ranks.iterdir()] == [f"machine_{node}"]


@pytest.mark.parametrize(("elsewhere", "told"), [
    ("empty", "does not see the driver's files and writes files the driver does not see"),
    ("copied", "writes files the driver does not see"),
], ids=["own-disk", "copied-run-dir"])
def test_a_ray_worker_without_the_driver_s_run_dir_is_named_with_its_node(
        tmp_path: Path, elsewhere: str, told: str) -> None:
    """The driver's side of the ray proof, in-process: worker 1 answers from a run dir
    on a disk of its own (empty, or holding a copy of the driver's marker, as a synced
    folder would); the driver names it with its node, worker 0 (the driver's own run
    dir) passes. With every worker on the driver's run dir, the proof passes."""
    from flowgraph.compilers.targets.ray.target import check_shared_run_dir
    from flowgraph.compilers.targets.ray.worker import DRIVER_MARKER, sees_run_dir
    from flowgraph.compilers.targets.shared_run_dir import draw_token, mark
    from flowgraph.errors import FlowgraphError

    run_dir, own = tmp_path / "run", tmp_path / "node1" / "run"
    token = draw_token()
    mark(run_dir, DRIVER_MARKER, token)
    if elsewhere == "copied":
        shutil.copytree(run_dir, own)
    shared = {("critic", 0): ("10.0.0.1", sees_run_dir(run_dir, "critic", 0, token))}
    check_shared_run_dir(run_dir, token, shared)
    seen = {**shared, ("critic", 1): ("10.0.0.2", sees_run_dir(own, "critic", 1, token))}
    with pytest.raises(FlowgraphError) as exc:
        check_shared_run_dir(run_dir, token, seen)
    assert str(exc.value) == (
        f"the driver (run dir `{run_dir}`) and its Ray workers do not share one run dir: "
        f"worker 1 of pool `critic` (node 10.0.0.2) {told}. A Ray run on several nodes "
        "writes each checkpoint from every worker into one folder: put trainer.run_dir on "
        "a filesystem every node mounts at the same path (NFS, Lustre, ...), e.g. "
        "trainer.run_dir=/shared/runs/NAME")


@pytest.mark.cluster
@pytest.mark.multiprocess
@pytest.mark.parametrize(("rank", "told"), [
    (0, "node 1 did not join the rendezvous at 127.0.0.1:{port} within --rdzv-timeout 3 s "
        "(1 of 2 joined: node 0); start `flowgraph run` with --node-rank 1 and the same "
        "--nnodes 2 --rdzv-endpoint 127.0.0.1:{port} there"),
    (1, "node 0 did not answer at 127.0.0.1:{port} within --rdzv-timeout 3 s: start it "
        "(--node-rank 0) with --rdzv-endpoint 127.0.0.1:{port}")],
    ids=["node 1 never comes", "node 0 never comes"])
def test_a_node_that_never_comes_is_named_after_the_rendezvous_timeout(
        tmp_path: Path, rank: int, told: str) -> None:
    port = _port()
    ((code, _, err),) = _both(_node(tmp_path, rank, port, "--rdzv-timeout", "3",
                                    "trainer.run_dir=run"))
    assert code == 1, err
    waiting = ("flowgraph: waiting for 2 nodes at 127.0.0.1:{port}: 1 joined (node 0)" if rank == 0
               else "flowgraph: waiting for node 0 at 127.0.0.1:{port}")
    assert waiting.format(port=port) in err, err
    assert f"flowgraph: error: {told.format(port=port)}" in err, err
    assert "Traceback" not in err and "c10d" not in err, err


def _kill_rank(run_dir: Path, rank: int, at_step: int, done: threading.Event,
               killed: list[tuple[int, str]]) -> None:
    """SIGKILL `rank` once its status file shows `at_step` or later."""
    status = process_groups.status_file(run_dir, rank)
    while not done.wait(0.01):
        try:
            m = re.match(r"step (\d+) node (\S+) pid (\d+)", status.read_text())
        except OSError:
            continue
        if m and int(m[1]) >= at_step:
            os.kill(int(m[3]), signal.SIGKILL)
            killed.append((int(m[1]), m[2]))
            return


def _killed_on_one_node(tmp_path: Path) -> list[list[str]]:
    """Rank 1 SIGKILLed at step 3: node 0 names it too (not its own rank's broken
    connection), each node with its resume command, every launch flag in it; those
    commands' arguments."""
    port, run_dir = _port(), tmp_path / "run"
    done, killed = threading.Event(), list[tuple[int, str]]()
    killer = threading.Thread(target=_kill_rank, args=(run_dir, 1, 3, done, killed))
    killer.start()
    try:
        results = _both(*(_node(tmp_path, r, port, *SHORT, "trainer.run_dir=run")
                          for r in (0, 1)))
    finally:
        done.set()
        killer.join()
    (step, node), = killed
    found = latest_checkpoint(run_dir)
    assert found is not None
    again = []
    for rank, (code, _, err) in enumerate(results):
        assert code == 1, err
        assert (f"flowgraph: error: the fsdp run stopped: rank 1 was killed by SIGKILL at "
                f"step {step} in node `{node}`\n") in err, err
        command = (f"flowgraph run {DPO} --target fsdp --nproc 2 --nnodes 2 --node-rank "
                   f"{rank} --rdzv-endpoint 127.0.0.1:{port} --resume {' '.join(SHORT)} "
                   "trainer.run_dir=run")
        assert f"the last checkpoint is step {found[0]}; continue with: {command}\n" in err
        assert "gloo" not in err and "Traceback" not in err, err
        assert re.search(r"\(the output of the failed rank: \S*run/logs/rank-1\.log\)", err)
        again.append(command.split()[2:])
    # every rank of both nodes logs into the shared run dir; node 0 shows rank 0's lines
    logs = run_dir / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["rank-0.log", "rank-1.log"]
    steps = [line for line in results[0][1].splitlines() if line.startswith("step ")]
    assert steps, results[0][1]
    assert [line for line in (logs / "rank-0.log").read_text().splitlines()
            if line.startswith("step ")] == steps
    return again


@pytest.mark.cluster
@pytest.mark.multiprocess
def test_a_rank_killed_on_one_node_is_named_on_both(tmp_path: Path) -> None:
    _killed_on_one_node(tmp_path)


@pytest.mark.cluster
@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_run_with_a_rank_killed_on_one_node_resumes_to_the_local_numbers(
        tmp_path: Path, local_reference: Any) -> None:
    """Each node's resume command, run as printed, finishes the run: every step once,
    the numbers of the uninterrupted local run."""
    procs = [subprocess.Popen([sys.executable, "-m", "flowgraph", "run", *args], cwd=tmp_path,
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for args in _killed_on_one_node(tmp_path)]
    (code0, out0, err0), (code1, out1, err1) = _both(*procs)
    assert code0 == code1 == 0, err0 + err1
    assert "run finished: run/metrics.jsonl" in out0
    assert "run finished: the ranks of node 1 are done; node 0 wrote run/metrics.jsonl" in out1
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert_same_numbers(rows, local_reference("dpo"))


@pytest.mark.cluster
@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_stopped_rank_ends_the_run_on_both_nodes_named_as_the_cause(tmp_path: Path
                                                                     ) -> None:
    """Rank 1 SIGSTOPped: after trainer.step_timeout_s its peer's collective times out;
    the machine of the stopped rank, which would wait on it for good, ends it, and both
    machines name it."""
    port, run_dir = _port(), tmp_path / "run"
    procs = [_node(tmp_path, r, port, "trainer.steps=2000", "trainer.step_timeout_s=15",
                   "trainer.run_dir=run") for r in (0, 1)]
    pid = None
    try:
        while pid is None and all(p.poll() is None for p in procs):
            where = process_groups.read_status(run_dir, 1)
            if where is not None and where[0] >= 2:
                pid = process_groups.status_pid(run_dir, 1)
            time.sleep(0.01)
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        step, node = process_groups.read_status(run_dir, 1) or (-1, "")
        results = _both(*procs)
    finally:
        for p in procs:
            p.kill()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for code, _, err in results:
        assert code == 1, err
        assert (f"flowgraph: error: the fsdp run stopped: rank 1 was stopped (SIGSTOP, or a "
                f"debugger) at step {step} in node `{node}`: its peers gave up waiting for "
                "it\n") in err, err


@pytest.fixture
def ray_head() -> Iterator[tuple[str, dict[str, str], Path]]:
    """A Ray head of its own (`ray start --head`): its address, the environment that
    joins it (token authentication off: ~/.ray/auth_token is shared with every other
    cluster of this user), its folder; every process of it killed at the end."""
    folder = Path(tempfile.mkdtemp(prefix="fgray", dir="/tmp"))  # short: Ray's sockets
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    port = _port()
    try:
        _ray_start(folder, env, "--head", f"--port={port}", "--num-cpus=4",
                   "--include-dashboard=false")
        yield f"127.0.0.1:{port}", env, folder
    finally:
        _kill_ray_node(folder)
        shutil.rmtree(folder, ignore_errors=True)


def _ray_start(folder: Path, env: dict[str, str], *args: str) -> None:
    """`ray start ARGS` of a node of this machine with its files in `folder` (the node's
    processes name it) and a dashboard agent port of its own (two nodes of one machine
    would both take Ray's 52365)."""
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "start", *args,
                    f"--temp-dir={folder}", f"--dashboard-agent-listen-port={_port()}",
                    "--disable-usage-stats"], env=env, check=True, capture_output=True,
                   timeout=120)


def _kill_ray_node(folder: Path) -> list[int]:
    """SIGKILL the Ray node whose files are in `folder`: the processes naming it (raylet,
    agents, log monitor; the head's GCS) and everything they started (its workers, whose
    command line is their Ray title); the pids killed. Nothing of another node."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (name) state ppid ...": the name may hold spaces
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    node = set(_processes_of(folder))
    while more := {pid for pid, ppid in parents.items() if ppid in node} - node:
        node |= more
    for pid in node:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return sorted(node)


def _processes_of(folder: Path, name: str = "") -> list[int]:
    """The pids of the Ray node in `folder` (whose command line names it; Linux)."""
    return [int(p.name) for p in Path("/proc").glob("[0-9]*")
            if str(folder) in (line := _cmdline(int(p.name))) and name in line]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:  # ended meanwhile
        return ""


WATCHED = """
import os, signal, subprocess, sys, time
from flowgraph.compilers.targets.ray.cluster import NodeWatch
child = subprocess.Popen(["sleep", "60"])
watch = NodeWatch(lambda what: f"lost its {what}; the last checkpoint is step 3",
                  names=("sleep",))
with watch:
    if sys.argv[1] == "killed":
        os.kill(child.pid, signal.SIGKILL)
    time.sleep(1.0)
child.kill()  # the watch is over: a shutdown of its own
child.wait()
time.sleep(0.5)
print("went on")
"""
"""An embedded cluster's node process (here `sleep`) under `NodeWatch`, killed during the
watch (argv[1] `killed`) or stopped after it."""


@pytest.mark.parametrize("when", ["killed", "after"])
def test_the_embedded_cluster_s_node_process_dying_is_said_before_the_driver_ends(
        when: str) -> None:
    """The embedded Ray cluster's raylet or GCS killed (the OOM killer) ends the driver
    with flowgraph's message and exit 1, at once (Ray would end it silently at its next
    call to the raylet); the same process ended after the watch (ray.shutdown) says
    nothing."""
    done = subprocess.run([sys.executable, "-c", WATCHED, when], capture_output=True,
                          text=True, timeout=60)
    if when == "killed":
        assert done.returncode == 1, done.stderr
        assert re.fullmatch(r"flowgraph: error: lost its sleep \(pid \d+\); the last "
                            r"checkpoint is step 3\n", done.stderr), done.stderr
        assert "went on" not in done.stdout
    else:
        assert done.returncode == 0 and done.stdout == "went on\n", done.stderr
        assert done.stderr == ""


@pytest.mark.cluster
@pytest.mark.multiprocess
def test_a_lost_ray_head_is_one_message_with_the_last_checkpoint_and_the_resume_command(
        tmp_path: Path, ray_head: tuple[str, dict[str, str], Path]) -> None:
    """The head's GCS killed at step 3: Ray would end the driver after
    RAY_gcs_rpc_server_reconnect_timeout_s (15 s here) with its own line; flowgraph
    ends it 5 s before, saying what was lost and how to go on."""
    address, env, folder = ray_head
    env["RAY_gcs_rpc_server_reconnect_timeout_s"] = "15"
    args = ("--target", "ray", "--nproc", "2", "--address", address, "trainer.steps=2000",
            "trainer.checkpoint_every=2", "trainer.run_dir=run")
    proc = subprocess.Popen([sys.executable, "-m", "flowgraph", "run", str(DPO), *args],
                            cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    metrics = tmp_path / "run" / "metrics.jsonl"
    while proc.poll() is None and len(read_metrics(tmp_path / "run")) < 3:
        time.sleep(0.2)
    (gcs,) = _processes_of(folder, "gcs_server")
    os.kill(gcs, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    found = latest_checkpoint(tmp_path / "run")
    assert found is not None and metrics.exists()
    assert f"flowgraph: error: lost the Ray head of `{address}`: its GCS at " in err, err
    assert ("gave no answer for 10 s; the run stopped; the last checkpoint is step "
            f"{found[0]}; once the cluster is whole again, continue with: flowgraph run "
            f"{DPO} --target ray --nproc 2 --address {address} --resume trainer.steps=2000 "
            "trainer.checkpoint_every=2 trainer.run_dir=run\n") in err, err
    assert "Failed to connect to GCS" not in err and "Traceback" not in err, err


def _ray_node_id(folder: Path) -> str:
    """The node id of the Ray node whose files are in `folder` (its raylet's `--node_id`)."""
    for pid in _processes_of(folder, "raylet"):
        found = re.search(r"--node_id=([0-9a-f]+)", _cmdline(pid))
        if found:
            return found[1]
    raise AssertionError(f"no raylet of a Ray node in {folder}")


def _wait_for(log: Path, text: str, proc: subprocess.Popen[str], timeout: float) -> str:
    """The driver's output (`log`) once it holds `text`; fails when the driver ends or
    `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while text not in (out := log.read_text()):
        assert proc.poll() is None, f"the driver ended before `{text}`:\n{out}"
        assert time.monotonic() < deadline, f"no `{text}` within {timeout:g} s:\n{out}"
        time.sleep(0.05)  # a step of the small runs takes ~0.3 s
    return out


PLACE_WITHIN_60_S = ("import sys; "
                     "from flowgraph.compilers.targets.ray import cluster as ray_cluster; "
                     "ray_cluster.PLACE_TIMEOUT_S = 60.0; from flowgraph.cli import main; "
                     "sys.exit(main(sys.argv[1:]))")
"""`flowgraph ARGS` whose placement groups wait 60 s at most (instead of 300 s)."""


@pytest.mark.cluster
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("back", ["while-it-waits", "after-it-stops"])
def test_a_lost_ray_node_is_named_and_the_run_goes_on_to_the_local_numbers(
        tmp_path: Path, back: str, equal_overrides: dict[str, tuple[str, ...]],
        local_reference: Any) -> None:
    """A head and a second Ray node of 1 CPU each, the pool's two workers one on each;
    after step 1 the second node is SIGKILLed whole (raylet, agents, its worker). The
    surviving worker's broken process group is a lost worker: the driver restarts the
    groups from the last checkpoint and waits for their placement group, which one
    1-CPU node cannot hold, naming the lost node and its worker once Ray has marked it
    dead. A node started again (a replaced machine) while it waits takes the worker; or,
    the wait over (60 s here), the run stops with the lost node, the last checkpoint and
    the resume command, which goes on once the node is back. Either way: every step
    once, the local run's numbers."""
    folder = Path(tempfile.mkdtemp(prefix="fgray", dir="/tmp"))  # short: Ray's sockets
    head, second, again = folder / "head", folder / "n1", folder / "n2"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    port = _port()
    address = f"127.0.0.1:{port}"
    graph, overrides = ROOT / "graphs" / "grpo.yaml", (*equal_overrides["grpo"],
                                                         "trainer.step_timeout_s=30")
    run_dir, log = tmp_path / "run", tmp_path / "driver.log"
    driver = ["-m", "flowgraph"] if back == "while-it-waits" else ["-c", PLACE_WITHIN_60_S]
    procs: list[subprocess.Popen[str]] = []

    def flowgraph(*args: str) -> subprocess.Popen[str]:
        with log.open("a") as out:
            procs.append(subprocess.Popen([sys.executable, *driver, *args], cwd=tmp_path,
                                          env=env, text=True, stdout=out,
                                          stderr=subprocess.STDOUT))
        return procs[-1]

    try:
        _ray_start(head, env, "--head", f"--port={port}", "--num-cpus=1",
                   "--include-dashboard=false")
        _ray_start(second, env, f"--address={address}", "--num-cpus=1")
        lost = _ray_node_id(second)
        proc = flowgraph("run", str(graph), "--target", "ray", "--nproc", "2", "--address",
                         address, *overrides, "trainer.run_dir=run")
        _wait_for(log, "step 0/5", proc, 300)
        (pids,) = json.loads((run_dir / ".ranks" / "workers.json").read_text()).values()
        deadline = time.monotonic() + 60
        while latest_checkpoint(run_dir) is None:  # step 1's, published
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)  # a step takes ~0.3 s: the kill comes before step 3 or 4
        killed = _kill_ray_node(second)
        (worker,) = [i for i, pid in enumerate(pids) if pid in killed]
        found = latest_checkpoint(run_dir)  # the one the run goes on from
        assert found is not None
        _wait_for(log, f"; lost: node {lost} (", proc, 120)
        if back == "after-it-stops":
            proc.wait(timeout=120)
            stopped = log.read_text()
            assert proc.returncode == 1, stopped
            command = (f"flowgraph run {graph} --target ray --nproc 2 --address {address} "
                       f"--resume {' '.join(overrides)} trainer.run_dir=run")
            go_on = (f"the last checkpoint is step {found[0]}; once the cluster is whole "
                     "again, continue with: ")
            assert re.search(
                r"flowgraph: error: pool `actor_rollout_ref`'s 2 workers \(\{CPU: 1\} each\) "
                r"could not be placed within 60 s: the cluster has \{CPU: 1\} free \(1 of 2 "
                rf"known node\(s\) alive\); lost: node {lost} \(\S+\), which ran worker "
                rf"{worker} of pool `actor_rollout_ref`; {re.escape(go_on + command)}\n",
                stopped), stopped
            _ray_start(again, env, f"--address={address}", "--num-cpus=1")
            proc = flowgraph(*command.split()[1:])
        else:
            _ray_start(again, env, f"--address={address}", "--num-cpus=1")
        proc.wait(timeout=300)
    finally:
        for started in procs:
            if started.poll() is None:
                started.kill()
                started.wait()
        for node in (again, second, head):
            _kill_ray_node(node)
        shutil.rmtree(folder, ignore_errors=True)
    out = log.read_text()
    assert proc.returncode == 0, out
    assert re.search(r"step \d+: a worker (lost a peer of its process group|died) .*; "
                     "restarting the worker groups from the last checkpoint", out), out
    assert re.search(r"flowgraph: waiting for the Ray cluster to place pool "
                     r"`actor_rollout_ref`'s 2 workers \(\{CPU: 1\} each\): the cluster has "
                     r"\{CPU: 1\} free \(1 of 2 known node\(s\) alive\); lost: node "
                     rf"{lost} \(\S+\), which ran worker {worker} of pool "
                     r"`actor_rollout_ref`; up to \d+ s more", out), out
    assert "Traceback" not in out, out
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4], "every step exactly once"
    if back == "while-it-waits":  # the restart went on from the checkpoint
        assert [r["step"] for r in rows if "perf/recovery_s" in r] == [found[0] + 1], rows
    else:
        assert (f"resuming from checkpoint `{found[1]}` (after step {found[0]})") in out, out
    assert_same_numbers(rows, local_reference("grpo"))


NAMING = ("--target", "ray", "--nproc", "1", "dims.Bp=4", "dims.N=4",
          "nodes.update_actor.params.mini_batch_size=8", "trainer.val_before_train=false")
"""A small GRPO on one Ray worker (the run's `naming_logprob` reports the cluster's names)."""


def _naming_graph(tmp_path: Path) -> Path:
    """GRPO whose `old_logprob` is tests/plugins' `naming_logprob`, which prints the
    cluster's named actors and placement groups from its worker."""
    text = (ROOT / "graphs" / "grpo.yaml").read_text().replace(
        "name: grpo\n", "name: grpo\nplugins: [fg_ray_names]\n", 1).replace(
        "  old_logprob:\n    kind: logprob\n", "  old_logprob:\n    kind: naming_logprob\n", 1)
    graph = tmp_path / "naming.yaml"
    graph.write_text(text)
    return graph


def _ray_run(graph: Path, cwd: Path, env: dict[str, str], address: str, *args: str
             ) -> subprocess.Popen[str]:
    plugins = os.pathsep.join([str(ROOT / "tests" / "plugins"), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-m", "flowgraph", "run", str(graph), *NAMING, "--address", address,
         *args], cwd=cwd, env={**env, "PYTHONPATH": plugins}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _running(proc: subprocess.Popen[str], run_dir: Path) -> None:
    """Wait until the run in `run_dir` has written its first step."""
    deadline = time.monotonic() + 240
    while len(read_metrics(run_dir)) < 1:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the first run wrote no step in 240 s"
        time.sleep(0.2)


@pytest.mark.cluster
@pytest.mark.multiprocess
def test_two_runs_on_one_cluster_are_told_apart_by_names_and_log_to_their_run_dirs(
        tmp_path: Path, ray_head: tuple[str, dict[str, str], Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Run `first` trains on while run `second` (2 steps) joins the same cluster; what
    `second`'s worker sees of the cluster names both runs apart, each in its own
    namespace; its prints are in `second/logs/actor_rollout_ref-0.log` and on its
    driver's console under the worker's name."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "plugins"))
    from fg_ray_names import NAMES

    address, env, _ = ray_head
    graph = _naming_graph(tmp_path)
    first = _ray_run(graph, tmp_path, env, address, "trainer.steps=1000",
                     "trainer.run_dir=first")
    try:
        _running(first, tmp_path / "first")
        second = _ray_run(graph, tmp_path, env, address, "trainer.steps=2",
                          "trainer.run_dir=second")
        out, err = second.communicate(timeout=300)
    finally:
        first.kill()
        first.communicate()
    assert second.returncode == 0, err
    log = (tmp_path / "second" / "logs" / "actor_rollout_ref-0.log").read_text()
    assert "naming_logprob on stderr at step 1\n" in log, log
    assert "UserWarning: naming_logprob warns at step 1\n" in log, log
    seen = json.loads(next(line for line in log.splitlines() if line.startswith(NAMES))
                      [len(NAMES):])
    for run in ("first", "second"):
        assert {"name": f"flowgraph/{run}/actor_rollout_ref/0",
                "namespace": f"flowgraph/{run}"} in seen["actors"], seen
        assert f"flowgraph/{run}/actor_rollout_ref" in seen["groups"], seen
    # Ray forwards the worker's lines to its driver, prefixed with the worker's name.
    assert re.search(r"\(actor_rollout_ref-0 pid=\d+\)\S* naming_logprob on stderr at "
                     r"step 1", out + err), out + err
    assert (tmp_path / "first" / "logs" / "actor_rollout_ref-0.log").is_file()
    assert not list((tmp_path / "second").glob("logs/*first*"))


@pytest.mark.cluster
@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_run_dir_name_in_use_on_the_cluster_is_refused_until_its_driver_dies(
        tmp_path: Path, ray_head: tuple[str, dict[str, str], Path]) -> None:
    """A second run whose run dir has the same name as a live one's (`a/run`, `b/run`)
    would take its Ray names: it is refused with the fix. Once the first driver is
    killed (-9), Ray ends its actors and the name is free for the next run at once."""
    address, env, _ = ray_head
    graph = _naming_graph(tmp_path)
    first = _ray_run(graph, tmp_path, env, address, "trainer.steps=1000",
                     "trainer.run_dir=a/run")
    try:
        _running(first, tmp_path / "a" / "run")
        twin = _ray_run(graph, tmp_path, env, address, "trainer.steps=1",
                        "trainer.run_dir=b/run")
        _, err = twin.communicate(timeout=120)
    finally:
        first.kill()
        first.communicate()
    assert twin.returncode == 1, err
    assert (f"flowgraph: error: the Ray cluster at `{address}` runs actors of another run "
            "in namespace `flowgraph/run` (flowgraph/run/actor_rollout_ref/0): a run's Ray "
            "names come from its run dir's name, `run`; give this run a run dir of another "
            "name, e.g. trainer.run_dir=runs/run-2\n") in err, err
    again = _ray_run(graph, tmp_path, env, address, "trainer.steps=1", "trainer.run_dir=c/run")
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
