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
import time
from pathlib import Path
from typing import Any

import pytest

import flowgraph
from flowgraph.compilers import RunOptions, read_metrics, run
from flowgraph.compilers.checkpoint.store import latest_checkpoint
from flowgraph.compilers.interpreter import Interpreter
from flowgraph.errors import FlowgraphError, Stopped
from flowgraph.passes import PassPipeline, compile_graph
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
                            env=env, text=True, **{"stdout": subprocess.PIPE,
                                                   "stderr": subprocess.PIPE, **kw})


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


def _signalling_dpo(tmp_path: Path, *params: str) -> Path:
    """graphs/dpo.yaml with a plugin node that signals at step 1 (`params` its params);
    nothing reads its output: compiled without pass `dce`, which would drop it."""
    text = DPO.read_text().replace("\nnodes:\n", (
        "\nplugins: [fg_plugin_faults]\nnodes:\n  sig:\n    kind: signalling_score\n"
        "    inputs: {input_ids: pairs.prompts}\n"
        f"    params: {{at: 1, {', '.join(params)}}}\n"), 1)
    graph = tmp_path / "dpo.yaml"
    graph.write_text(text)
    return graph


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_ctrl_c_on_fsdp_saves_on_every_rank_and_resumes_to_the_local_numbers(
        tmp_path: Path, local_reference: Any, equal_overrides: dict[str, Any]) -> None:
    """Ctrl-C (SIGINT to the launcher and both ranks): the ranks agree on the node to stop
    at and save together, the launcher exits 130 with the resume command and none of
    torch-elastic's SignalException; the resumed run has the local run's numbers."""
    marker = tmp_path / "signalled"
    graph = _signalling_dpo(tmp_path, "signals: SIGINT", "group: true", f"marker: '{marker}'")
    args = (*equal_overrides["dpo"], "trainer.run_dir=run")
    proc = _cli(tmp_path, str(graph), "--target", "fsdp", "--nproc", "2", "--disable-pass",
                "dce", *args, start_new_session=True)  # its own process group: a job's
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 130, err
    assert marker.exists()
    found = latest_checkpoint(tmp_path / "run")
    assert found is not None, err
    again = (f"flowgraph run {graph} --target fsdp --nproc 2 --disable-pass dce --resume "
             f"{' '.join(args[:-1])} trainer.run_dir=run")
    assert f"flowgraph: stopped by SIGINT; the last checkpoint is step {found[0]}; " \
           f"continue with: {again}\n" in err, err
    assert "SignalException" not in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / ".lock").exists()
    proc = _cli(tmp_path, *again.split()[2:])
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err
    assert_same_numbers(read_metrics(tmp_path / "run"), local_reference("dpo"))


@pytest.mark.multiprocess
def test_sigterm_to_the_ray_driver_saves_and_resumes_to_the_local_numbers(
        tmp_path: Path, local_reference: Any, equal_overrides: dict[str, Any]) -> None:
    """SIGTERM to the driver (its workers, in a process group of their own, get none):
    the driver stops at a node boundary, the workers save, and the resumed run has the
    local run's numbers."""
    graph = _signalling_dpo(tmp_path, "signals: SIGTERM")
    run_dir = tmp_path / "run"
    overrides = [f"trainer.run_dir={run_dir}", *equal_overrides["dpo"]]
    result = compile_graph(graph, target="ray", nproc=2, overrides=overrides,
                           pipeline=PassPipeline.default(disabled=("dce",)))
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]
    with open(os.devnull, "w") as out, pytest.raises(Stopped) as exc:
        run(result.plan, RunOptions(tensorboard=False, out=out))
    found = latest_checkpoint(run_dir)
    assert found is not None
    assert str(exc.value).startswith(
        f"stopped by SIGTERM; the last checkpoint is step {found[0]}; continue with: "
        f"flowgraph run {graph} --target ray --nproc 2 --resume")
    resumed = compile_graph(graph, target="ray", nproc=2,  # a signal no more: a change
                            overrides=[*overrides, "nodes.sig.params.at=-1"],  # allowed
                            pipeline=PassPipeline.default(disabled=("dce",)))
    assert resumed.plan is not None
    with open(os.devnull, "w") as out:
        rows = run(resumed.plan, RunOptions(resume=True, tensorboard=False, out=out,
                                            allow_changed=("nodes.sig.params.at",))).rows
    assert_same_numbers(rows, local_reference("dpo"))


REWARD = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.5)  # a slow reward: the producer is busy when its trainer dies
    return 0.0
"""


def test_the_rollout_producer_ends_with_its_killed_trainer(tmp_path: Path) -> None:
    import psutil

    graph = tmp_path / "grpo.yaml"
    graph.write_text((ROOT / "graphs" / "grpo.yaml").read_text().replace(
        "fn: exact_match, format_score: 0.1", 'fn: "rewards.py:compute_score"').replace(
        "name: grpo\n", "name: grpo\nplugins: [rewards.py]\n").replace(
        "    kind: reward\n", "    kind: compute_score\n"))
    (tmp_path / "rewards.py").write_text(REWARD)
    trainer = _cli(tmp_path, str(graph), "dims.Bp=2", "dims.N=4", "trainer.max_staleness=1",
                   "nodes.update_actor.params.mini_batch_size=8", "trainer.eval_every=0",
                   "trainer.val_before_train=false", "trainer.steps=50", "trainer.run_dir=run",
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600  # until a step is done: the producer generates
        while not read_metrics(tmp_path / "run") and time.monotonic() < deadline:
            assert trainer.poll() is None, "the run ended"
            time.sleep(0.5)
        producer, = (p for p in psutil.Process(trainer.pid).children()
                     if "resource_tracker" not in " ".join(p.cmdline()))
    finally:
        trainer.kill()
        trainer.wait()
    time.sleep(1.0)
    alive = producer.is_running() and producer.status() != psutil.STATUS_ZOMBIE
    if alive:
        producer.kill()
    assert not alive, "the producer outlived its trainer"
