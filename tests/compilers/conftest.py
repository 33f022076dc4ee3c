"""What the fsdp and ray tests share: the local reference runs, cached per session so
each graph's reference trains once (compare with flowgraph.testing.targets)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import flowgraph
from flowgraph.passes import compile_graph
from flowgraph.plan import ExecutionPlan

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = ROOT / "graphs"
FILES = {"agent": ROOT / "tests" / "plugins" / "agent_turns.yaml"}
"""Graphs compared across targets that are not shipped under graphs/: the agent graph
(multi-turn episodes calling a tool, tests/plugins/agent_turns_env.py)."""
SHORT = ("trainer.steps=5", "trainer.checkpoint_every=2")
"""The runs compared across targets: 5 steps, checkpoints after steps 1, 3 and 4."""
SMALL = {
    "ppo": ("dims.Bp=16", "nodes.update_actor.params.mini_batch_size=8",
            "nodes.update_critic.params.mini_batch_size=8"),
    "grpo": ("dims.Bp=4", "dims.N=4", "nodes.update_actor.params.mini_batch_size=8",
             "trainer.val_before_train=false"),
}
"""The shipped PPO and GRPO at small batches (two optimizer steps a rollout), so that
the runs compared across targets stay quick (the shipped batches are for learning)."""
EQUAL = {"ppo": (*SMALL["ppo"], *SHORT, "trainer.eval_every=5"),
         "grpo": (*SMALL["grpo"], *SHORT), "dpo": SHORT, "agent": SHORT}
"""Overrides of each graph's equal-numbers run (PPO also evaluates before its first and
after its last step)."""
MODELS = {"ppo": ("actor", "ref", "critic"), "grpo": ("actor", "ref"), "dpo": ("policy", "ref"),
          "agent": ("actor",)}
"""Each graph's models: `tied_overrides(graph)` loads them all from the tied built-in."""


def graph_file(name: str) -> Path:
    """The file of the graph `name` the target tests compare (graphs/NAME.yaml or `FILES`)."""
    return FILES.get(name, GRAPHS / f"{name}.yaml")


def tied_overrides(graph: str) -> tuple[str, ...]:
    """Overrides that run `graph` on `builtin:tiny-tied` (LM head = input embedding)."""
    return tuple(f"models.{m}.path=builtin:tiny-tied" for m in MODELS[graph])


def compile_for(graph: Path, run_dir: Path, *overrides: str, target: str = "local"
                ) -> ExecutionPlan:
    """`graph`'s plan for `target` (2 workers off the local target) writing to `run_dir`."""
    result = compile_graph(graph, target=target, nproc=None if target == "local" else 2,
                           overrides=[f"trainer.run_dir={run_dir}", *overrides])
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]
    return result.plan


def run_local(graph: Path, run_dir: Path, *overrides: str, resume: bool = False,
              target: str = "local") -> list[dict[str, Any]]:
    """A run started from this process (local: in it; a ray plan starts its own Ray
    instance and shuts it down after); its metrics.jsonl rows."""
    with open(os.devnull, "w") as out:
        return flowgraph.run(compile_for(graph, run_dir, *overrides, target=target),
                             resume=resume, tensorboard=False, out=out).rows


@pytest.fixture(scope="session")
def compile_plan() -> Any:
    """`compile_plan(graph, run_dir, *overrides, target="local")` -> ExecutionPlan."""
    return compile_for


@pytest.fixture(scope="session")
def graph_path() -> Any:
    """`graph_path(name)` -> the graph file the target tests compare (`graph_file`)."""
    return graph_file


@pytest.fixture(scope="session")
def equal_overrides() -> dict[str, tuple[str, ...]]:
    return EQUAL


@pytest.fixture(scope="session")
def tied_models() -> Any:
    """`tied_models(graph)`: the overrides that load `graph`'s models tied."""
    return tied_overrides


@pytest.fixture(scope="session")
def local_run() -> Any:
    """`local_run(graph, run_dir, *overrides, resume=False)` -> metrics rows."""
    return run_local


class LocalReference:
    """`ref("ppo")`: the rows of graphs/ppo.yaml (`graph_file`) run locally with
    `EQUAL["ppo"]`, trained once per session (`ref("ppo", tied=True)`: on the tied
    built-in, `tied_overrides`); `ref.run_dir("ppo")`: where that run lives."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache: dict[str, list[dict[str, Any]]] = {}

    def run_dir(self, name: str, *, tied: bool = False) -> Path:
        self(name, tied=tied)
        return self.root / (f"{name}-tied" if tied else name)

    def __call__(self, name: str, *, tied: bool = False) -> list[dict[str, Any]]:
        key = f"{name}-tied" if tied else name
        if key not in self.cache:
            models = tied_overrides(name) if tied else ()
            self.cache[key] = run_local(graph_file(name), self.root / key,
                                        *EQUAL[name], *models)
        return self.cache[key]


@pytest.fixture(scope="session")
def local_reference(tmp_path_factory: pytest.TempPathFactory) -> LocalReference:
    return LocalReference(tmp_path_factory.mktemp("local-reference"))
