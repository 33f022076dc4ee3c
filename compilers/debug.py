"""Try nodes one batch at a time, from Python: `flowgraph.debug(graph)`.

    dbg = flowgraph.debug(graph)          the plan, for the local target; nothing loads yet
    out = dbg.run_until("reward")         a fresh batch through `reward` and the nodes it
                                          reads from: every node's outputs by name
    out["reward"]["scores"]
    dbg.run_node("reward", inputs={"responses": ...})   one node again, some inputs given,
                                          the others from the last batch

It is the training loop's own machinery, not a second executor: the local target
(`LocalTarget`: the worker's implementations, tokenizers, models) and the interpreter
run the nodes, the data sources draw the batch (`Batches`), every tensor is held to its
edge's contract (strict mode), and a node's error is the run's message. What a run does
around the nodes (steps, checkpoints, metrics, evaluation) does not happen; an update
node does take its optimizer step on the batch. Models load at the first call.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, TextIO

from flowgraph.compilers.builtin_training import ensure_builtins
from flowgraph.compilers.interpreter import Env
from flowgraph.compilers.loop import TrainingLoop
from flowgraph.compilers.targets.local import LocalTarget
from flowgraph.compilers.worker import ExecOptions, pick_device, quiet_hf
from flowgraph.document import did_you_mean
from flowgraph.errors import UsageError
from flowgraph.plan import ExecutionPlan

DEBUG_PASSES_OFF = ("asynchronous", "dce", "hoist")
"""Passes a debugging plan is compiled without: every node kept (even one no update
reads), each computed on the batch (none once before the loop), in one synchronous step."""


class Debugger:
    """One batch at a time through the nodes of a local `plan` (compiled without
    `DEBUG_PASSES_OFF`)."""

    def __init__(self, plan: ExecutionPlan, out: TextIO | None = None) -> None:
        if plan.target != "local":
            raise UsageError(f"a debugging handle runs a plan of the local target, not "
                             f"{plan.target}: compile the graph with target='local'")
        self.plan, self.out = plan, out
        self.env: Env = {}
        """The last batch's values: (node, port) -> tensor or list."""
        self.step = 0
        self.run_dir = Path(tempfile.mkdtemp(prefix="flowgraph-debug-"))
        """Where a node's error leaves its full traceback."""
        self._loop: TrainingLoop | None = None
        order = [n for s in plan.stages for n in s.nodes]
        self.order = [n for n in order if plan.node(n).category != "data"]
        """The nodes, in the order a step runs them."""

    @property
    def loop(self) -> TrainingLoop:
        """The local target, its models loaded and data sources opened (at first use)."""
        if self._loop is None:
            quiet_hf()
            ensure_builtins(self.plan.models, self.out)
            options = ExecOptions(self.run_dir, pick_device(self.plan.resources.device),
                                  strict=True, tensorboard=False, out=self.out)
            loop = TrainingLoop(self.plan, LocalTarget(self.plan, options), options)
            loop.setup()
            self._loop = loop
        return self._loop

    def run_until(self, name: str) -> dict[str, dict[str, Any]]:
        """Draw the next batch and run node `name` and every node it reads from, in step
        order: each data source's and node's outputs, by name and port."""
        needed = self._upstream(self._known(name))
        self.env = {}
        loop = self.loop
        loop.batches.draw(self.env, {})
        loop.interpreter.run([n for n in self.order if n in needed], self.env, self.step,
                             strict=True, metrics={})
        self.step += 1
        return self.outputs()

    def run_node(self, name: str, inputs: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
        """Run node `name` once on the last batch, the ports in `inputs` replaced by the
        values given (held to their contracts); its outputs by port. Without a batch yet,
        `run_until(name)` draws one first."""
        placed = self.plan.node(self._known(name))
        given = dict(inputs or {})
        ports = [i.port for i in placed.inputs]
        for port in given:
            if port not in ports:
                raise UsageError(f"node `{name}` has no input `{port}`; "
                                 f"{did_you_mean(port, ports)}")
        if any(i.ref not in self.env for i in placed.inputs if i.port not in given):
            self.run_until(name)
        env = {**self.env, **{i.ref: given[i.port] for i in placed.inputs if i.port in given}}
        self.loop.interpreter.run_node(name, env, self.step, strict=True, metrics={})
        return {p.port: env[(name, p.port)] for p in placed.outputs if (name, p.port) in env}

    def outputs(self) -> dict[str, dict[str, Any]]:
        """The last batch's values by node (or data source) and port."""
        found: dict[str, dict[str, Any]] = {}
        for (node, port), value in self.env.items():
            found.setdefault(node, {})[port] = value
        return found

    def _known(self, name: str) -> str:
        names = [n.name for n in self.plan.nodes]
        if name not in names:
            raise UsageError(f"the graph has no node `{name}`; {did_you_mean(name, names)}")
        return name

    def _upstream(self, name: str) -> set[str]:
        """`name` and every node whose outputs reach it."""
        seen, todo = set(), [name]
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo += [i.ref[0] for i in self.plan.node(node).inputs]
        return seen
