"""Preemption and one run per run dir (issue #25, point 3): SIGTERM / SIGINT finish the
running node, save a checkpoint and exit 143 / 130 with the resume command — on the local
and fsdp targets — and resuming gives the numbers of the uninterrupted run; a second
signal stops at once; a second run on a run dir is refused naming the holder, a dead
holder's lock is taken over; the rollout producer process ends with its trainer."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import flowgraph
from flowgraph.compilers import RunOptions, read_metrics, run
from flowgraph.compilers.checkpoint import latest_checkpoint
from flowgraph.compilers.interpreter import Interpreter
from flowgraph.errors import FlowgraphError, Stopped
from flowgraph.passes import compile_graph
from flowgraph.testing.targets import assert_same_numbers

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "tests" / "plugins"
DPO = ROOT / "graphs" / "dpo.yaml"
STEPS = ("trainer.steps=3", "trainer.checkpoint_every=0", "trainer.eval_every=0")
FAULTS = (PLUGINS / "faults.yaml").read_text().replace("fg_runtime_faults", "fg_plugin_faults")

pytestmark = pytest.mark.faults


@pytest.fixture(autouse=True)
def _plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))


def _dpo(run_dir: Path, *, resume: bool = False) -> list[dict[str, Any]]:
    result = compile_graph(DPO, overrides=[f"trainer.run_dir={run_dir}", *STEPS])
    assert result.plan is not None
    with open(os.devnull, "w") as out:
        return run(result.plan, RunOptions(resume=resume, tensorboard=False, out=out)).rows


def _signal_in(monkeypatch: pytest.MonkeyPatch, node: str, step: int, signum: int) -> None:
    """`signum` arrives while node `node` of step `step` runs."""
    real = Interpreter.run_node

    def run_node(self: Interpreter, name: str, env: Any, at: int, **kw: Any) -> float:
        if (name, at) == (node, step):
            os.kill(os.getpid(), signum)
        return real(self, name, env, at, **kw)

    monkeypatch.setattr(Interpreter, "run_node", run_node)


def test_a_stop_drops_a_step_before_its_update_or_finishes_it_and_resumes_exactly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(a) SIGTERM in a node before step 1's update: the step is dropped (its batch drawn
    again on resume), step 0 is checkpointed; (b) SIGINT during step 1's update: the step
    finishes and is checkpointed; (c) the rows resumed are the uninterrupted run's."""
    full = _dpo(tmp_path / "full")
    run_dir = tmp_path / "stopped"
    _signal_in(monkeypatch, "ref_rejected", 1, signal.SIGTERM)  # a lookup: before `update`
    with pytest.raises(Stopped) as exc:
        _dpo(run_dir)
    assert exc.value.signum == signal.SIGTERM
    assert str(exc.value) == (
        f"stopped by SIGTERM; the last checkpoint is step 0; continue with: flowgraph run "
        f"{DPO} --resume trainer.run_dir={run_dir}")
    assert [r["step"] for r in read_metrics(run_dir)] == [0]

    monkeypatch.undo()
    _signal_in(monkeypatch, "update", 1, signal.SIGINT)
    with pytest.raises(Stopped, match=r"^stopped by SIGINT; the last checkpoint is step 1;"):
        _dpo(run_dir, resume=True)
    found = latest_checkpoint(run_dir)
    assert found is not None and found[0] == 1
    monkeypatch.undo()
    assert_same_numbers(_dpo(run_dir, resume=True), full)
    assert not (run_dir / ".lock").exists()


def _cli(tmp_path: Path, *args: str, **kw: Any) -> subprocess.Popen[str]:
    """`flowgraph run ARGS` in a process of its own, the plugins importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(PLUGINS), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])}
    return subprocess.Popen([sys.executable, "-m", "flowgraph", "run", *args], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


@pytest.mark.parametrize(("signals", "code", "told"), [
    ("SIGINT", 130, "stopped by SIGINT; the last checkpoint is step 1; continue with: "),
    ("SIGTERM,SIGTERM", 143, "stopped at once by SIGTERM (a second signal, or "
                             "trainer.stop_grace_s = 120 s passed); no checkpoint was "
                             "written yet; start again with: ")])
def test_the_cli_exits_130_or_143_with_the_resume_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        signals: str, code: int, told: str) -> None:
    """A signal in step 1's last node: the step finishes and is saved (130); a second
    signal stops at once, the node unfinished, nothing saved (143)."""
    from flowgraph.cli import main

    monkeypatch.chdir(tmp_path)
    Path("g.yaml").write_text(FAULTS.replace("kind: prompt_score", "kind: signalling_score"))
    args = ["trainer.steps=3", "nodes.score.params.at=1",
            f"nodes.score.params.signals={signals}", "trainer.run_dir=run"]
    assert main(["run", "g.yaml", *args]) == code
    err = capsys.readouterr().err
    assert f"flowgraph: {told}flowgraph run g.yaml --resume {' '.join(args)}\n" in err, err
    assert "Traceback" not in err, err
    assert not Path("run/.lock").exists()


def test_one_run_per_run_dir_and_a_dead_holders_lock_is_taken_over(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen(["sleep", "60"])
    try:
        start = Path(f"/proc/{holder.pid}/stat").read_text().rpartition(")")[2].split()[19]
        (run_dir / ".lock").write_text(
            f'{{"pid": {holder.pid}, "host": "{socket.gethostname()}", "start": "{start}"}}')
        result = compile_graph(_faults(tmp_path),
                               overrides=[f"trainer.run_dir={run_dir}", "trainer.steps=1"])
        assert result.plan is not None
        with pytest.raises(FlowgraphError, match=(
                f"is in use by another run: pid {holder.pid} on host {socket.gethostname()} "
                "holds")):
            flowgraph.run(result.plan, tensorboard=False)
    finally:
        holder.kill()
        holder.wait()
    with open(tmp_path / "out.txt", "w") as out:
        run(result.plan, RunOptions(tensorboard=False, out=out))
    note = (tmp_path / "out.txt").read_text()
    assert f"taking over the stale lock of pid {holder.pid} on host " in note, note
    assert [r["step"] for r in read_metrics(run_dir)] == [0]
    assert not (run_dir / ".lock").exists()


def _faults(tmp_path: Path) -> Path:
    graph = tmp_path / "g.yaml"
    graph.write_text((PLUGINS / "faults.yaml").read_text())
    return graph
