"""The interpreter: runs a plan's nodes over an environment of values.

In the style of torch.fx's Interpreter, three verbs:

    run(names, env, step)      each node of `names` in order, its seconds added up in
                               `timing_s/<node>`
    run_node(name, env, step)  one node: its inputs held to their contracts (strict
                               mode), its call, its outputs checked and stored in `env`
    call_node(name, env, step) the node's inputs read from `env` and handed to the
                               target's `dispatch`, which runs it (in this process, on
                               this rank's slice, or on a Ray pool)

`env` maps `(node, port)` to a tensor or a list. Two plan facts change how a node runs:
a node of the prologue (`hoist`) is looked up by row in what the prologue kept
(`Prologue`) instead of running at a step, and a node with others fused into its
forward (`NodePlan.fused`) runs over all their rows stacked, each getting its own rows
back. A NaN in any float output stops the step naming node and step.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from flowgraph.errors import FlowgraphError, NodeError, NonFiniteError, at_step
from flowgraph.plan import ExecutionPlan
from flowgraph.runtime.strict import RuntimeContracts

Env = dict[tuple[str, str], Any]
PROLOGUE = -1
"""The step number nodes see while the prologue runs."""


class Dispatch(Protocol):
    """A target's way of running one node: `(outputs, seconds inside the node)`."""

    def __call__(self, name: str, inputs: dict[str, Any], step: int, params: dict[str, Any],
                 metrics: dict[str, float]) -> tuple[dict[str, Any], float]: ...


class Interpreter:
    """Runs nodes of `plan`; `dispatch` (the target's) calls each one."""

    def __init__(self, plan: ExecutionPlan, dispatch: Dispatch) -> None:
        self.plan, self.dispatch = plan, dispatch
        self.placed = {n.name: n for n in plan.nodes}
        """Each node's (and data source's) plan: wiring, params, kind facts, contracts."""
        self.consumed = {i.ref for n in plan.nodes for i in n.inputs}
        self.fused_into = {f: n.name for n in plan.nodes for f in n.fused}
        """A node fused into another's forward (pass `fusion`) -> that node, which runs it."""
        self.contracts = RuntimeContracts.of(plan)
        self.prologue = Prologue(self)
        self.before_node: Callable[[str], None] | None = None
        """Called before each node `run` runs: the training loop's stop check (SIGTERM)."""

    def run(self, names: list[str], env: Env, step: int, *, strict: bool,
            metrics: dict[str, float], split: str = "train") -> None:
        for name in names:
            if self.before_node is not None:
                self.before_node(name)
            seconds = self.run_node(name, env, step, strict=strict, metrics=metrics,
                                    split=split)
            metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + seconds

    def run_node(self, name: str, env: Env, step: int, *, strict: bool,
                 metrics: dict[str, float], split: str = "train") -> float:
        """Run one node on `env` and store its outputs there; seconds spent in it. A
        prologue node's outputs for the batch's rows are read from what the prologue
        kept (no time). A node with others fused into its forward runs over the rows
        of all of them stacked and stores each one's rows; those nodes then do nothing
        (their outputs are stored already)."""
        if name in self.prologue.kept and step != PROLOGUE:
            self.store(name, self.prologue.rows(name, env, split), env, step, strict)
            return 0.0
        if name in self.fused_into:
            return 0.0
        group = (name, *self.placed[name].fused)
        if strict:
            for member in group:
                self.check_inputs(member, env, step)
        params = self.params(name, evaluation=split != "train")
        if len(group) == 1:
            outputs, seconds = self.call_node(name, env, step, params, metrics)
            self.store(name, outputs, env, step, strict)
            return seconds
        inputs, rows, source = self._stacked(group, env)
        outputs, seconds = self.dispatch(name, inputs, step, params, metrics)
        parts = [{port: value[i] for port, value in _unstack(outputs, rows).items()}
                 for i in range(len(rows))]
        for member, i in zip(group, source, strict=True):
            self.store(member, parts[i], env, step, strict)
        return seconds

    def call_node(self, name: str, env: Env, step: int, params: dict[str, Any],
                  metrics: dict[str, float]) -> tuple[dict[str, Any], float]:
        """The target runs node `name` on its inputs in `env`; nothing is stored."""
        return self.dispatch(name, self.inputs(name, env), step, params, metrics)

    def inputs(self, name: str, env: Env) -> dict[str, Any]:
        """Node `name`'s inputs in `env`, by port, as their ports take them."""
        return {i.port: _as_taken(env[i.ref], i.spec) for i in self.placed[name].inputs}

    def check_inputs(self, name: str, env: Env, step: int) -> None:
        """Every input of `name` against its port's contract (strict mode)."""
        for wired in self.placed[name].inputs:
            if wired.spec is not None:
                self.contracts.check_edge(wired, name, wired.spec.tensor_spec(),
                                          _as_taken(env[wired.ref], wired.spec), step)

    def params(self, name: str, *, evaluation: bool = False) -> dict[str, Any]:
        """The node's params as the plan resolved them (at evaluation: a rollout's held-out
        sampling, `NodePlan.eval_params`), its Python objects in place."""
        return self.plan.live_params(name, evaluation=evaluation)

    def store(self, name: str, outputs: dict[str, Any], env: Env, step: int,
              strict: bool) -> None:
        """`outputs` into `env`: each held to its contract (strict), none non-finite."""
        placed = self.placed[name]
        for p in placed.outputs:
            if p.port not in outputs:
                if p.optional or (name, p.port) not in self.consumed:
                    continue
                raise NodeError(f"while executing node `{name}` (kind {placed.kind}) "
                                f"{at_step(step)}: it returned no output `{p.port}`")
            value = outputs[p.port]
            if strict and p.spec is not None:
                self.contracts.check_output(name, p.port, p.spec.tensor_spec(), value, step,
                                            placed.where)
            # Every float output, declared `finite` or not: a NaN reward from a user's
            # plugin must stop the run as surely as one from a built-in node.
            if isinstance(value, torch.Tensor) and value.is_floating_point() \
                    and not bool(torch.isfinite(value).all()):
                raise NonFiniteError(name, step, f"output `{p.port}`")
            env[(name, p.port)] = value

    def _stacked(self, group: tuple[str, ...], env: Env
                 ) -> tuple[dict[str, Any], list[int], list[int]]:
        """The first node's inputs holding the rows of the whole group, in order; the
        rows of each distinct input set, and which one each node reads (a node with
        the same inputs as an earlier one shares its rows)."""
        wired = [dict(self.placed[m].wiring()) for m in group]  # port -> ref, in any order
        keys = [tuple(sorted(w.items())) for w in wired]
        distinct = list(dict.fromkeys(keys))
        sources = [wired[keys.index(k)] for k in distinct]
        ports = [i.port for i in self.placed[group[0]].inputs]
        rows = [len(env[w[ports[0]]]) for w in sources]
        inputs = {port: join([env[w[port]] for w in sources]) for port in ports}
        return inputs, rows, [distinct.index(k) for k in keys]


class Prologue:
    """The plan's `once` stage: its nodes run over every row of a split before the
    loop, their outputs kept by (split, uid) and looked up by row at every step."""

    def __init__(self, interpreter: Interpreter) -> None:
        self.interpreter = interpreter
        plan = interpreter.plan
        self.names = [n for s in plan.stages if s.once for n in s.nodes]
        """Nodes run before the loop, over the whole dataset, in this order."""
        self.kept: dict[str, dict[tuple[str, int], dict[str, Any]]] = {
            n: {} for n in self.names}
        """Prologue node -> (split, uid) -> that row's outputs."""
        self.done: set[str] = set()

    def run(self, split: str, datasets: Callable[[str], Any], rows: int, strict: bool
            ) -> float:
        """The prologue over every row of `split` (once per split and process): each data
        source's rows (`datasets(source)`) in file order, in batches of `rows`, through
        the prologue nodes that read it, in the listed order. Seconds spent."""
        if not self.names or split in self.done:
            return 0.0
        t0, ip = time.perf_counter(), self.interpreter
        for d in ip.plan.data:
            names = [n for n in self.names if self.source(n) == d.name]
            dataset = datasets(d.name)
            if not names or dataset is None:
                continue
            for i, batch in enumerate(dataset.batches(rows)):
                env = {(d.name, port): value for port, value in batch.items()}
                uids = batch["uid"].tolist()
                for name in names:
                    with torch.no_grad():
                        ip.run_node(name, env, PROLOGUE, strict=strict or i == 0,
                                    metrics={}, split=split)
                    kept = self.kept[name]
                    for j, uid in enumerate(uids):
                        kept[(split, uid)] = {p.port: env[(name, p.port)][j]
                                              for p in ip.placed[name].outputs
                                              if (name, p.port) in env}
        self.done.add(split)
        return time.perf_counter() - t0

    def rows(self, name: str, env: Env, split: str) -> dict[str, Any]:
        """A prologue node's outputs for the rows of this batch."""
        uids = env[(self.source(name), "uid")].tolist()
        kept = self.kept[name]
        missing = [u for u in uids if (split, u) not in kept]
        if missing:
            raise FlowgraphError(f"prologue node `{name}` has no outputs for rows {missing[:5]} "
                                 f"of the {split} data: the prologue ran over other data")
        first = kept[(split, uids[0])]
        return {port: torch.stack([kept[(split, u)][port] for u in uids])
                if isinstance(first[port], torch.Tensor) else [kept[(split, u)][port]
                                                               for u in uids]
                for port in first}

    def source(self, name: str) -> str:
        """The one data source whose rows a prologue node's inputs come from."""
        sources = self._sources(name)
        if len(sources) != 1:
            raise FlowgraphError(f"prologue node `{name}` reads {len(sources)} data sources "
                                 f"({', '.join(sorted(sources)) or 'none'}); a node computed "
                                 "once per row reads the rows of exactly one")
        return next(iter(sources))

    def _sources(self, name: str) -> set[str]:
        ip, out = self.interpreter, set()
        for wired in ip.placed[name].inputs:
            source = wired.ref[0]
            out |= {source} if ip.placed[source].category == "data" else self._sources(source)
        return out


def _as_taken(value: Any, spec: Any) -> Any:
    """A 0/1 mask (int64) as bool where its port takes bool: a custom kind annotated
    `Bool[Tensor, ...]` (`TensorSpec.converts`; `check` let no other value reach one)."""
    if spec is None or spec.dtype != "bool" or not isinstance(value, torch.Tensor):
        return value
    return value.bool()


def join(values: list[Any]) -> Any:
    """One port's rows of several parts, in order: tensors concatenated, lists chained."""
    if isinstance(values[0], torch.Tensor):
        return torch.cat(values)
    return [row for value in values for row in value]


def _unstack(outputs: dict[str, Any], rows: list[int]) -> dict[str, list[Any]]:
    """Each output's rows cut back into parts of `rows` rows (`join`'s inverse)."""
    bounds = list(itertools.accumulate(rows, initial=0))
    return {port: [value[a:b] for a, b in itertools.pairwise(bounds)]
            for port, value in outputs.items()}
