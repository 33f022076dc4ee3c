"""The combination matrix (issue 40, point 8): what users meet together holds together.

A cell is one value of each factor: the target (local, fsdp on 2 ranks, Ray with 2
workers), the rollout (`generate`, an `agent_rollout` over an env class, over a
black-box openai-client agent program), the models' dtype, the rollouts' timing (in
step, one step stale, partial rollouts), LoRA, and where the run is launched from (the
graph's folder with a relative path, another folder, a Python script). Each cell:

1. checks (`flowgraph check` / `flowgraph.check` as launched); a cell flowgraph cannot
   run must be refused there, with the code `REFUSED` names, and goes no further;
2. runs 2 steps, a checkpoint after each, killed (SIGKILL to the whole process group) as
   soon as step 0's checkpoint is published, and resumes;
3. its two steps are the numbers of the uninterrupted run: the cell's graph run on the
   local target in this process (targets give the local numbers in float32, tests/
   compilers/test_fsdp.py and test_ray.py; so the reference costs no launch of its own),
   or for bf16 on 2 workers the cell launched once more, uninterrupted (bf16 rounds a
   batch split over two workers otherwise than the whole batch on one).

The default suite runs a pairwise-covering subset (`PAIRWISE`: every pair of two
factors' values meets in at least one cell, refused pairs in a refused cell; 12 cells;
`python -m pytest -m pairwise` runs it alone), `python -m pytest -m matrix` every cell
(hours).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import flowgraph
from flowgraph.compilers import read_metrics
from flowgraph.compilers.checkpoint.store import latest_checkpoint
from flowgraph.testing.targets import assert_same_numbers

ROOT = Path(__file__).resolve().parents[2]

FACTORS: dict[str, tuple[str, ...]] = {
    "target": ("local", "fsdp", "ray"),
    "rollout": ("generate", "env", "agent"),
    "dtype": ("float32", "bfloat16"),
    "timing": ("sync", "stale", "partial"),
    "lora": ("off", "on"),
    "launch": ("graph_dir", "other_dir", "python"),
}
"""Each factor's values, the cheapest first (the covering subset prefers them)."""

GRAPHS = {
    "generate": (ROOT / "graphs" / "grpo.yaml",
                 ("dims.Bp=4", "dims.N=2", "nodes.update_actor.params.mini_batch_size=8",
                  "trainer.val_before_train=false")),
    "env": (ROOT / "tests" / "plugins" / "agent_turns.yaml", ()),
    "agent": (ROOT / "graphs" / "agent_calculator_openai.yaml",
              ("dims.Bp=4", "dims.N=2", "nodes.update.params.mini_batch_size=8",
               "models.actor.path=builtin:tiny-lm-sft", "trainer.val_before_train=false",
               "trainer.eval_every=0")),
}
"""Each rollout's graph, cut to a few sequences a step: `generate` is the shipped GRPO,
`env` the multi-turn env the target tests run (tests/plugins/agent_turns.yaml), `agent`
the shipped black-box agent (an openai client talking to the run's endpoint) on the
untrained built-in (the calculator's warm-up trains for minutes; any model's episodes
go through the endpoint alike)."""

MODELS = {"generate": ("actor", "ref"), "env": ("actor",), "agent": ("actor",)}
"""The models of each rollout's graph (a dtype is set on each)."""

LORA = "{r: 8, alpha: 16, target_modules: all-linear}"

REFUSED: dict[tuple[tuple[str, str], ...], str] = {
    (("rollout", "generate"), ("timing", "partial")): "FG124",
}
"""Combinations flowgraph cannot run, each refused at check with its code: partial
rollouts resume an episode at its next turn, and `generate` has no turns."""


@dataclass(frozen=True)
class Cell:
    target: str
    rollout: str
    dtype: str
    timing: str
    lora: str
    launch: str

    @property
    def id(self) -> str:
        return "-".join(getattr(self, f) for f in FACTORS)

    def values(self) -> dict[str, str]:
        return {f: getattr(self, f) for f in FACTORS}

    def refused(self) -> str | None:
        """The code `check` must refuse this cell with, or None: it runs."""
        values = self.values()
        for pairs, code in REFUSED.items():
            if all(values[f] == v for f, v in pairs):
                return code
        return None

    def overrides(self, run_dir: Path) -> list[str]:
        _, small = GRAPHS[self.rollout]
        out = [*small, "trainer.steps=2", "trainer.checkpoint_every=1",
               f"trainer.run_dir={run_dir}"]
        if self.dtype != "float32":
            out += [f"models.{m}.dtype={self.dtype}" for m in MODELS[self.rollout]]
        if self.timing in ("stale", "partial"):
            out.append("trainer.max_staleness=1")
        if self.timing == "partial":
            out.append("trainer.partial_rollouts=true")
        if self.lora == "on":
            out.append(f"models.actor.lora={LORA}")
        return out

    def target_args(self) -> list[str]:
        return [] if self.target == "local" else ["--target", self.target, "--nproc", "2"]


def every_cell() -> list[Cell]:
    return [Cell(*values) for values in itertools.product(*FACTORS.values())]


def _pairs(cell: Cell) -> set[tuple[tuple[str, str], tuple[str, str]]]:
    """The pairs of factor values `cell` exercises: a refused cell only its refused pair
    (nothing else of it runs)."""
    items = list(cell.values().items())
    code = cell.refused()
    if code is not None:
        refused = next(p for p in REFUSED if REFUSED[p] == code)
        return {(refused[0], refused[1])}
    return {(a, b) for a, b in itertools.combinations(items, 2)}


CELLS = every_cell()
PAIRWISE = {cell for cell in CELLS if cell.id in (
    "local-generate-bfloat16-sync-on-graph_dir",
    "local-generate-float32-stale-on-python",
    "local-env-bfloat16-partial-on-other_dir",
    "local-agent-float32-sync-on-graph_dir",
    "local-agent-bfloat16-stale-off-other_dir",
    "fsdp-generate-float32-sync-on-other_dir",
    "fsdp-env-float32-stale-off-graph_dir",
    "fsdp-agent-bfloat16-partial-off-python",
    "ray-generate-bfloat16-stale-off-other_dir",
    "ray-env-float32-sync-off-python",
    "ray-agent-float32-partial-on-graph_dir",
    "ray-generate-bfloat16-partial-on-other_dir",  # refused: FG124
)}
"""A pairwise-covering subset (`test_the_covering_subset_covers_every_pair` proves it
covers): 11 cells that run and one refused, chosen for the least launch time (each target
meets each value of a three-valued factor, so at least three cells a target; the local
cells are the cheap ones, Ray's the dear ones, and a bf16 cell on 2 workers launches once
more for its reference)."""


def _params() -> Iterator[Any]:
    for cell in CELLS:
        marks = [pytest.mark.matrix]
        if cell in PAIRWISE:
            marks.append(pytest.mark.pairwise)
        yield pytest.param(cell, id=cell.id, marks=marks)


pytestmark = pytest.mark.multiprocess


class Launch:
    """How `cell` is launched: the command line from the graph's folder or another one,
    or a Python script calling flowgraph.check and flowgraph.run."""

    def __init__(self, cell: Cell, workdir: Path) -> None:
        self.cell, self.workdir = cell, workdir
        self.graph, _ = GRAPHS[cell.rollout]

    def check(self, run_dir: Path) -> tuple[bool, str]:
        """(accepted, what check printed)."""
        overrides = self.cell.overrides(run_dir)
        nproc = None if self.cell.target == "local" else 2
        if self.cell.launch == "python":
            result = flowgraph.check(self.graph, overrides=overrides, nproc=nproc,
                                     target=self.cell.target)
            return result.ok, str(result)
        cwd, graph = self._where()
        args = ["check", graph, *self.cell.target_args(), *overrides]
        done = subprocess.run([sys.executable, "-m", "flowgraph", *args], cwd=cwd,
                              capture_output=True, text=True, timeout=300)
        return done.returncode == 0, done.stdout + done.stderr

    def start(self, run_dir: Path, *, resume: bool = False) -> subprocess.Popen[str]:
        """The run as its own process group (killed as a whole)."""
        overrides = self.cell.overrides(run_dir)
        if self.cell.launch == "python":
            script = self.workdir / "launch.py"
            script.write_text(
                "import sys\nimport flowgraph\n\n"
                "if __name__ == '__main__':\n"
                f"    flowgraph.run({str(self.graph)!r}, target={self.cell.target!r}, "
                f"nproc={None if self.cell.target == 'local' else 2!r}, "
                f"overrides={overrides!r}, resume={resume!r})\n")
            args, cwd = [sys.executable, str(script)], self.workdir
        else:
            cwd, graph = self._where()
            args = [sys.executable, "-m", "flowgraph", "run", graph, *self.cell.target_args(),
                    *overrides, *(["--resume"] if resume else [])]
        return subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def _where(self) -> tuple[Path, str]:
        if self.cell.launch == "graph_dir":
            return self.graph.parent, self.graph.name
        return self.workdir, str(self.graph)


def _finish(proc: subprocess.Popen[str], what: str) -> str:
    """`proc`'s output once it exited 0 (its group killed after, whatever it left)."""
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        _kill_group(proc)
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the process group `proc` leads (its ranks, Ray's processes) if any live."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _kill_after_first_checkpoint(proc: subprocess.Popen[str], run_dir: Path) -> None:
    deadline = time.monotonic() + 600
    while latest_checkpoint(run_dir) is None:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"the run ended (exit {proc.returncode}) before its first "
                        f"checkpoint:\n{out[-4000:]}")
        assert time.monotonic() < deadline, "no checkpoint after 600 s"
        time.sleep(0.05)
    _kill_group(proc)


@pytest.mark.parametrize("cell", list(_params()))
def test_cell_checks_runs_and_resumes_after_kill_9_to_the_same_numbers(
        tmp_path: Path, cell: Cell) -> None:
    launch = Launch(cell, tmp_path)
    killed = tmp_path / "killed"
    accepted, report = launch.check(killed)
    code = cell.refused()
    if code is not None:
        assert not accepted and code in report, \
            f"expected check to refuse with {code}:\n{report}"
        return
    assert accepted, f"check refused a cell that should run:\n{report}"
    _kill_after_first_checkpoint(launch.start(killed), killed)
    assert [r["step"] for r in read_metrics(killed)] in ([0], [0, 1])
    _finish(launch.start(killed, resume=True), "the resumed run")
    assert_same_numbers(read_metrics(killed), _uninterrupted(cell, launch, tmp_path / "whole"))


def _uninterrupted(cell: Cell, launch: Launch, run_dir: Path) -> list[dict[str, Any]]:
    """The uninterrupted run's rows: on the local target in this process, but for bf16
    on 2 workers, launched as the cell is (bf16 rounds a batch split over two workers
    otherwise than one whole: targets give the local numbers in float32)."""
    if cell.dtype != "float32" and cell.target != "local":
        _finish(launch.start(run_dir), "the uninterrupted run")
        rows = read_metrics(run_dir)
    else:
        with open(os.devnull, "w") as out:
            rows = flowgraph.run(launch.graph, overrides=cell.overrides(run_dir),
                                 tensorboard=False, out=out).rows
    assert [r["step"] for r in rows] == [0, 1]
    return rows


def test_the_covering_subset_covers_every_pair() -> None:
    """Every pair of two factors' values meets in a cell of the subset (a refused pair in
    its refused cell), each named cell exists, and 11 of them run."""
    assert len(PAIRWISE) == 12, "a cell of PAIRWISE names no cell"
    assert set().union(*(_pairs(c) for c in PAIRWISE)) == set().union(
        *(_pairs(c) for c in CELLS))
    assert len([c for c in PAIRWISE if c.refused() is None]) == 11
