"""What a step's nodes run on: the data sources' batches, the prologue's rows for them,
and the plan's resample loop.

`Batches.produce` is the one way the nodes of a step (or of an asynchronous plan's
producer) get their batch, in the training loop and in a producer process alike:

* draw every data source's next batch of Bp prompts (`draw`) and look up the rows the
  prologue kept for it (`look_up`), then run the nodes;
* with a resample loop in the plan (DAPO's dynamic sampling, `ResamplePlan`), try: each
  try draws the next batches and runs the nodes up to the filter; the filter's kept
  rows are joined over tries until `groups` groups are kept, then cut to exactly
  `groups * N` rows (the first groups kept, as verl's DAPO trainer keeps the first
  train_batch_size); short of `groups` after `max_tries` tries, the run stops. The
  other nodes then run once on the joined rows.
"""

from __future__ import annotations

import time
from typing import Any

from flowgraph.compilers.interpreter import Env, Interpreter, join
from flowgraph.errors import FlowgraphError, at_step
from flowgraph.runtime.reward_call import function_name


class Batches:
    """The data sources' splits (`flowgraph.nodes.data.Splits`) and how a step uses them."""

    def __init__(self, interpreter: Interpreter, data: dict[str, Any], prologue: list[str]
                 ) -> None:
        self.interpreter, self.data, self.prologue = interpreter, data, prologue
        self.plan = interpreter.plan
        self.rows = next(d.value for d in self.plan.dims if d.name == "Bp")
        """Prompts per batch (Bp)."""

    def dataset(self, source: str, split: str) -> Any:
        splits = self.data[source]
        return splits.train if split == "train" else splits.eval

    def cursors(self) -> dict[str, dict[str, Any]]:
        """Each data source's position in its training split (a checkpoint holds them)."""
        return {d: s.train.state_dict() for d, s in self.data.items()}

    def run_prologue(self, split: str, strict: bool) -> float:
        """The prologue over every row of `split` (once per split); seconds spent."""
        return self.interpreter.prologue.run(
            split, lambda source: self.dataset(source, split), self.rows, strict)

    def produce(self, env: Env, step: int, strict: bool, metrics: dict[str, float],
                names: list[str]) -> None:
        """Run `names` (the step's nodes, or an asynchronous plan's producer) on the next
        batches; with a resample loop, its tries up to the filter first, then the rest
        of `names` once."""
        ip, loop = self.interpreter, self.plan.resample
        if loop is None:
            self.draw(env, metrics)
            self.look_up(env, step, strict)
            ip.run(names, env, step, strict=strict, metrics=metrics)
            return
        self._tries(env, step, strict, metrics, [n for n in names if n in loop.repeat])
        ip.run([n for n in names if n not in loop.repeat], env, step, strict=strict,
               metrics=metrics)

    def draw(self, env: Env, metrics: dict[str, float], split: str = "train") -> None:
        """Every data source's next batch of `split` into `env` (the data nodes' work,
        their seconds added up in `timing_s/<source>`)."""
        for d in self.plan.data:
            t0 = time.perf_counter()
            for port, value in self.dataset(d.name, split).next_batch(self.rows).items():
                env[(d.name, port)] = value
            key = f"timing_s/{d.name}"
            metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - t0

    def look_up(self, env: Env, step: int, strict: bool, split: str = "train") -> None:
        """The prologue's outputs for the rows of the batch in `env`."""
        for name in self.prologue:
            self.interpreter.run_node(name, env, step, strict=strict, metrics={},
                                      split=split)

    def _tries(self, env: Env, step: int, strict: bool, metrics: dict[str, float],
               repeat: list[str]) -> None:
        """The tries of one step; `env` ends with the last try's tensors and the filter's
        joined outputs, `metrics` with the filter's counts (`filter/...`)."""
        ip, loop = self.interpreter, self.plan.resample
        assert loop is not None
        repeat = [n for n in repeat if n != loop.filter]
        parts: list[dict[str, Any]] = []
        kept = dropped = tries = 0
        while kept < loop.groups:
            if tries == loop.max_tries:
                raise FlowgraphError(self._exhausted(step, tries, kept, dropped))
            tries += 1
            env.clear()
            self.draw(env, metrics)
            self.look_up(env, step, strict)
            ip.run(repeat, env, step, strict=strict, metrics=metrics)
            # The filter's inputs are held to their contracts; its outputs (a variable
            # number of rows) are checked once joined.
            if strict:
                ip.check_inputs(loop.filter, env, step)
            params = {**ip.params(loop.filter), "offset": kept}
            outputs, seconds = ip.call_node(loop.filter, env, step, params, metrics)
            key = f"timing_s/{loop.filter}"
            metrics[key] = metrics.get(key, 0.0) + seconds
            new = int(outputs["index"].unique().numel())
            kept, dropped = kept + new, dropped + self._groups_in(env, loop.filter) - new
            parts.append(outputs)
        joined = {port: join([p[port] for p in parts])[:loop.rows] for port in parts[0]}
        ip.store(loop.filter, joined, env, step, strict)
        metrics.update({"filter/kept_groups": float(kept), "filter/dropped_groups":
                        float(dropped), "filter/tries": float(tries),
                        "train/num_gen_batches": float(tries)})

    def _groups_in(self, env: Env, name: str) -> int:
        ref = dict(self.plan.node(name).wiring())["index"]  # a required port of filters
        return int(env[ref].unique().numel())

    def _refused_by(self, name: str) -> str:
        """What the filter keeps by: its metric, or the user's predicate (`fn`)."""
        params = self.interpreter.params(name)
        fn = params.get("fn")
        if fn is None:
            return str(params["metric"])
        return f"`{fn}`" if isinstance(fn, str) else f"`{function_name(fn)}`"

    def _exhausted(self, step: int, tries: int, kept: int, dropped: int) -> str:
        loop = self.plan.resample
        assert loop is not None
        node = self.plan.node(loop.filter)
        return (f"node `{node.name}` (kind {node.kind}, {node.where}) {at_step(step)}: "
                f"{tries} tries (max_tries) kept {kept} of the {loop.groups} groups the "
                f"batch needs ({dropped} dropped: {self._refused_by(node.name)} refused "
                "them). The data may be too hard or too easy for the model (verl: "
                f"'Generated too many'); raise nodes.{node.name}.params.max_tries, lower "
                f"nodes.{node.name}.params.groups, or sample more per prompt (N)")
