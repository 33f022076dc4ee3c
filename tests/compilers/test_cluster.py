"""Two machines simulated on one (issue #29, points 1 and 3): two `flowgraph run --target
fsdp --nnodes 2 --node-rank R --rdzv-endpoint 127.0.0.1:PORT` launches.

* run dirs that are not one folder are refused on both nodes, before any model loads,
  with one message (never a checkpoint published without node 1's shards);
* a node that never comes is named after `--rdzv-timeout`, with a progress line meanwhile;
* a rank killed on one node is named on both, each with the command that resumes it,
  every launch flag in it; resumed, the run has the local run's numbers.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from flowgraph.compilers import _dist, read_metrics
from flowgraph.compilers.checkpoint import latest_checkpoint
from flowgraph.testing.targets import assert_same_numbers

pytestmark = [pytest.mark.cluster, pytest.mark.multiprocess]

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


@pytest.mark.parametrize(("rank", "told"), [
    (0, "node 1 did not join the rendezvous at 127.0.0.1:{port} within --rdzv-timeout 3 s "
        "(1 of 2 joined: node 0); start `flowgraph run` with --node-rank 1 and the same "
        "--nnodes 2 --rdzv-endpoint 127.0.0.1:{port} there"),
    (1, "node 0 did not answer at 127.0.0.1:{port} within --rdzv-timeout 3 s: start it "
        "(--node-rank 0) with --rdzv-endpoint 127.0.0.1:{port}")])
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
    status = _dist.status_file(run_dir, rank)
    while not done.wait(0.01):
        try:
            m = re.match(r"step (\d+) node (\S+) pid (\d+)", status.read_text())
        except OSError:
            continue
        if m and int(m[1]) >= at_step:
            os.kill(int(m[3]), signal.SIGKILL)
            killed.append((int(m[1]), m[2]))
            return


def test_a_rank_killed_on_one_node_is_named_on_both_then_resumed_to_the_local_numbers(
        tmp_path: Path, local_reference: Any) -> None:
    """Rank 1 SIGKILLed at step 3: node 0 names it too (not its own rank's broken
    connection); each node's resume command, run as printed, finishes the run."""
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
        again.append(command.split()[2:])
    procs = [subprocess.Popen([sys.executable, "-m", "flowgraph", "run", *args], cwd=tmp_path,
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for args in again]
    (code0, out0, err0), (code1, out1, err1) = _both(*procs)
    assert code0 == code1 == 0, err0 + err1
    assert "run finished: run/metrics.jsonl" in out0
    assert "run finished: the ranks of node 1 are done; node 0 wrote run/metrics.jsonl" in out1
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert_same_numbers(rows, local_reference("dpo"))
