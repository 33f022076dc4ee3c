"""Checkpoints you can trust (issue #25): a damaged checkpoint is named and the run falls
back to the newest intact one; nothing in a checkpoint is unpickled as code; the async
buffer is never lost silently; resume refuses settings it cannot honour; a full disk is
one message with the previous checkpoint intact; a partial metrics line is dropped.

One DPO run of 2 steps (a checkpoint after each) is made once; each case damages a copy
of it and resumes for a third step."""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from flowgraph.compilers import RunOptions, read_metrics, run
from flowgraph.compilers.checkpoint.integrity import checkpoint_damage, write_manifest
from flowgraph.compilers.checkpoint.store import load_buffer
from flowgraph.errors import FlowgraphError
from flowgraph.passes import compile_graph
from flowgraph.testing.targets import numbers

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[2]
DPO = ROOT / "graphs" / "dpo.yaml"
BASE = ("trainer.checkpoint_every=1", "trainer.loggers=[console]")


def _plan(run_dir: Path, *overrides: str, graph: Path = DPO) -> Any:
    result = compile_graph(graph, overrides=[f"trainer.run_dir={run_dir}", *BASE, *overrides])
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]
    return result.plan


def _resume(run_dir: Path, *overrides: str, **options: Any) -> tuple[list[dict[str, Any]], str]:
    """Resume `run_dir` to 3 steps: the rows, and what the run said."""
    out = io.StringIO()
    rows = run(_plan(run_dir, "trainer.steps=3", *overrides),
               RunOptions(resume=True, tensorboard=False, out=out, **options)).rows
    return rows, out.getvalue()


def _numbers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [numbers(r) for r in rows]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 2-step run (checkpoints step_0, step_1) and the rows of the same run to 3 steps."""
    root = tmp_path_factory.mktemp("ckpt")
    with open(os.devnull, "w") as out:
        run(_plan(root / "two", "trainer.steps=2"), RunOptions(tensorboard=False, out=out))
        full = run(_plan(root / "three", "trainer.steps=3"),
                   RunOptions(tensorboard=False, out=out)).rows
    return {"dir": root / "two", "full": full}


@pytest.fixture()
def run_dir(made: dict[str, Any], tmp_path: Path) -> Path:
    shutil.copytree(made["dir"], tmp_path / "run")
    return tmp_path / "run"


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped bytes": ("model.policy.safetensors", _flip,
                      "`model.policy.safetensors` has changed since it was written"),
    "missing": ("optim.policy.pt", Path.unlink, "`optim.policy.pt` is missing"),
    "truncated": ("sched.policy.pt",
                  lambda p: p.write_bytes(p.read_bytes()[:100]), "`sched.policy.pt` is "
                  "truncated: 100 bytes"),
    "zero bytes": ("rng.pt", lambda p: p.write_bytes(b""), "`rng.pt` is empty: 0 bytes"),
    "garbage state": ("state.json", lambda p: p.write_text("{garbage"),
                      "`state.json` is truncated"),
    "state edited": ("state.json",
                     lambda p: p.write_text(p.read_text().replace('"step": 1', '"step": 0')),
                     "`state.json` has changed since it was written"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_newest_checkpoint_is_named_and_the_run_falls_back(
        made: dict[str, Any], run_dir: Path, case: str) -> None:
    file, damage, said = DAMAGE[case]
    newest = run_dir / "checkpoints" / "step_1"
    damage(newest / file)
    rows, out = _resume(run_dir)
    assert f"checkpoint `{newest}` is damaged: {said}" in out
    assert (f"falling back to the newest intact checkpoint, `{run_dir / 'checkpoints' / 'step_0'}`"
            in out)
    assert f"resuming from checkpoint `{run_dir / 'checkpoints' / 'step_0'}`" in out
    # step 1 again from step 0's state: the uninterrupted run's numbers, each step once
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert _numbers(rows) == _numbers(made["full"])


def test_no_intact_checkpoint_is_one_error(run_dir: Path) -> None:
    for step in (0, 1):
        (run_dir / "checkpoints" / f"step_{step}" / "optim.policy.pt").unlink()
    with pytest.raises(FlowgraphError, match=r"no intact checkpoint in .* to resume from: "
                                             r".*step_1`: `optim.policy.pt` is missing; "
                                             r".*step_0`: `optim.policy.pt` is missing"):
        _resume(run_dir)


class _Shell:
    """What a crafted `rng.pt` holds: unpickling it runs a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (self.command,)


def test_a_crafted_pickle_is_refused_never_run(run_dir: Path) -> None:
    import torch

    folder = run_dir / "checkpoints" / "step_1"
    marker = run_dir / "pwned"
    torch.save({"torch": _Shell(f"touch {marker}")}, folder / "rng.pt")
    write_manifest(folder)  # the attacker rewrote the manifest too: the hashes match
    assert checkpoint_damage(folder, 1) is None
    with pytest.raises(FlowgraphError, match=r"refused to load `.*step_1/rng.pt`: it holds "
                                             r"Python objects besides tensors"):
        _resume(run_dir)
    assert not marker.exists()
    # and weights are safetensors: no pickle in them at all
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads((folder / "model.policy.safetensors").read_bytes())


def test_resume_refuses_changed_settings_and_says_how_to_override(run_dir: Path) -> None:
    changed = ("models.policy.optimizer.lr=0.5", "dims.Bp=16")
    with pytest.raises(FlowgraphError) as exc:
        _resume(run_dir, *changed)
    message = str(exc.value)
    assert "settings that shape its state changed since it was written" in message
    assert "  dims.Bp: 8 in the checkpoint, 16 now" in message
    assert "  models.policy.optimizer.lr: 0.002 in the checkpoint, 0.5 now" in message
    assert ("--resume --allow-changed dims.Bp --allow-changed models.policy.optimizer.lr"
            in message)
    # what does not shape the state may change: steps, cadences, loggers
    rows, out = _resume(run_dir, *changed, "trainer.eval_every=3",
                        allow_changed=("dims.Bp", "models.policy.optimizer.lr"))
    assert f"resuming from checkpoint `{run_dir / 'checkpoints' / 'step_1'}`" in out
    assert "resuming with a changed setting: dims.Bp: 8 in the checkpoint, 16 now" in out
    assert [r["step"] for r in rows] == [0, 1, 2]


def _tiny_async(run_dir: Path, *overrides: str, resume: bool = False) -> str:
    plan = _plan(run_dir, "dims.Bp=2", "dims.N=2", "nodes.update_actor.params.mini_batch_size=4",
                 "trainer.val_before_train=false", "trainer.eval_every=0", *overrides,
                 graph=ROOT / "graphs" / "grpo.yaml")
    assert plan.asynchronous is not None or "trainer.max_staleness=0" in overrides
    if plan.asynchronous is not None:  # the producer in the loop (fsdp and ray do so)
        plan = replace(plan, asynchronous=replace(plan.asynchronous, own_process=False))
    out = io.StringIO()
    run(plan, RunOptions(resume=resume, tensorboard=False, out=out))
    return out.getvalue()


def test_an_async_buffer_is_never_lost_silently(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _tiny_async(run_dir, "trainer.steps=2", "trainer.max_staleness=1")
    folder = run_dir / "checkpoints" / "step_0"
    assert [r.index for r in load_buffer(folder)] == [1]
    shutil.rmtree(run_dir / "checkpoints" / "step_1")  # the last one: its buffer is empty
    # another staleness cannot train the buffered rollout at its step: refused
    for other in ("0", "2"):
        with pytest.raises(FlowgraphError, match=r"its rollout buffer holds 1 rollout\(s\) "
                                                 r"generated for trainer.max_staleness=1"):
            _tiny_async(run_dir, "trainer.steps=3", f"trainer.max_staleness={other}",
                        resume=True)
    # a buffer missing from its checkpoint: damaged, never an empty buffer
    (folder / "rollouts.pt").unlink()
    with pytest.raises(FlowgraphError, match=r"step_0`: `rollouts.pt` is missing"):
        _tiny_async(run_dir, "trainer.steps=3", "trainer.max_staleness=1", resume=True)
    with pytest.raises(FlowgraphError, match=r"has no rollout buffer `rollouts.pt`"):
        load_buffer(folder)


def test_a_partial_last_metrics_line_is_dropped_with_a_note(
        made: dict[str, Any], run_dir: Path) -> None:
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "actor/dpo_lo')  # the disk filled, or the run was killed
    rows, out = _resume(run_dir)
    assert f"note: dropped the partial last line of `{run_dir / 'metrics.jsonl'}`" in out
    assert _numbers(rows) == _numbers(made["full"])


def _limit_file_size(limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_file_size_limit_at_a_checkpoint_is_one_message_and_keeps_the_last(
        run_dir: Path) -> None:
    newest = run_dir / "checkpoints" / "step_1"
    optim = (newest / "optim.policy.pt").stat().st_size
    proc = subprocess.run(
        [sys.executable, "-m", "flowgraph", "run", str(DPO), "--resume", "trainer.steps=3",
         *BASE, f"trainer.run_dir={run_dir}"],
        capture_output=True, text=True, timeout=300, preexec_fn=lambda: _limit_file_size(
            optim - 1), env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode != 0
    assert ("flowgraph: error: no space left on device (the file-size limit, `ulimit -f`) "
            f"while writing `{run_dir / 'checkpoints' / 'step_2.tmp-'}") in proc.stderr
    assert (f"optim.policy.pt`; the last intact checkpoint is step 1 (`{newest}`)"
            in proc.stderr)
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_0", "step_1"]
    assert checkpoint_damage(newest, 1) is None


def _no_space(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_writing_metrics_is_one_message(
        run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened = Path.open

    def full_metrics(path: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = opened(path, mode, *args, **kwargs)
        if path.name == "metrics.jsonl" and "a" in mode:
            f.write = _no_space  # type: ignore[method-assign]
        return f

    monkeypatch.setattr(Path, "open", full_metrics)
    with pytest.raises(FlowgraphError) as exc:
        _resume(run_dir)
    assert str(exc.value) == (
        f"no space left on device while writing `{run_dir / 'metrics.jsonl'}`; the last "
        f"intact checkpoint is step 1 (`{run_dir / 'checkpoints' / 'step_1'}`); free some "
        "space and continue with --resume")


def test_a_full_disk_writing_tensorboard_is_one_message(
        run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils.tensorboard import SummaryWriter

    monkeypatch.setattr(SummaryWriter, "flush", _no_space)
    with pytest.raises(FlowgraphError, match=(
            f"no space left on device while writing `{run_dir / 'tensorboard'}`; the last "
            "intact checkpoint is step 1")):
        run(_plan(run_dir, "trainer.steps=3", "trainer.loggers=[tensorboard]"),
            RunOptions(resume=True, tensorboard=True, out=io.StringIO()))
    assert read_metrics(run_dir)[-1]["step"] == 2  # the row before the failed event write
    assert json.loads((run_dir / "checkpoints" / "step_1" / "state.json").read_text())[
        "step"] == 1


DCP_SAVE = """
import errno, resource, signal, sys, torch
from pathlib import Path
from flowgraph.compilers.checkpoint.store import dcp_save
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4000, 4000))
try:
    dcp_save(Path(sys.argv[1]), {"actor": torch.nn.Linear(64, 64)}, {})
except OSError as exc:
    print(exc.errno == errno.EFBIG, exc.filename)
"""


def test_a_size_limit_in_a_sharded_checkpoint_is_an_oserror_naming_its_folder(
        tmp_path: Path) -> None:
    """What the fsdp and ray targets write (DCP): torch's writer says `unexpected pos`;
    the run says a full disk, as for the local target's files."""
    proc = subprocess.run([sys.executable, "-c", DCP_SAVE, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.split() == ["True", str(tmp_path / "dcp" / "actor")], proc.stderr


def test_the_manifest_covers_every_shard_of_a_sharded_checkpoint(tmp_path: Path) -> None:
    """What the fsdp and ray targets publish: DCP shards, each in the manifest."""
    import torch

    from flowgraph.compilers.checkpoint.store import begin_checkpoint, dcp_save, publish_checkpoint

    model = torch.nn.Linear(8, 8)
    tmp = begin_checkpoint(tmp_path, 0, "tmp-fsdp")
    dcp_save(tmp, {"actor": model}, {"actor": torch.optim.AdamW(model.parameters())})
    folder = publish_checkpoint(tmp, {"step": 0})
    listed = json.loads((folder / "manifest.json").read_text())["files"]
    shards = sorted(str(p.relative_to(folder)) for p in (folder / "dcp").rglob("*")
                    if p.is_file())
    assert shards and set(shards) <= set(listed)
    assert checkpoint_damage(folder, 0) is None
    _flip(folder / shards[0])
    assert checkpoint_damage(folder, 0) == (f"`{shards[0]}` has changed since it was written "
                                            "(its sha256 differs)")


def test_the_command_line_and_python_pass_allow_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import flowgraph
    import flowgraph.compilers
    from flowgraph.cli import main

    given: list[RunOptions] = []
    monkeypatch.setattr(flowgraph.compilers, "run", lambda plan, opts: given.append(opts))
    assert main(["run", str(DPO), "--resume", "--allow-changed", "dims.Bp", "dims.Bp=16",
                 "--allow-changed", "trainer.seed", f"trainer.run_dir={tmp_path}"]) == 0
    flowgraph.run(DPO, overrides=[f"trainer.run_dir={tmp_path}"], resume=True,
                  allow_changed=["dims.Bp"])
    assert [o.allow_changed for o in given] == [("dims.Bp", "trainer.seed"), ("dims.Bp",)]
