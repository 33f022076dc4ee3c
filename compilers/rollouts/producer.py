"""The producer's nodes on a batch: what every strategy generates a rollout with (in the
loop, in a process of its own, on the rollout pool's worker), and the producer's side of
a run elsewhere (`producer_elsewhere`)."""

from __future__ import annotations

from typing import Any

from flowgraph.compilers.batches import Batches
from flowgraph.compilers.build import load_data
from flowgraph.compilers.checkpoint.store import Rollout
from flowgraph.compilers.interpreter import Env, Interpreter
from flowgraph.compilers.worker import ExecOptions, Worker
from flowgraph.errors import NonFiniteError
from flowgraph.plan import ExecutionPlan, ModelPlacement


class ProducerNodes:
    """The producer's nodes (`names`, in this order) run on `batches` by `worker`'s
    interpreter, one rollout a call."""

    def __init__(self, plan: ExecutionPlan, batches: Batches, worker: Worker,
                 names: list[str], opts: ExecOptions) -> None:
        self.plan, self.batches, self.worker, self.names, self.opts = \
            plan, batches, worker, names, opts
        self.origin = 0
        """The step the run started (or resumed) at: its batch is run strictly."""

    def produce(self, index: int, version: int, metrics: dict[str, float]) -> Rollout:
        """Run the producer's nodes for the batch of step `index` with the weights of
        `version`; a NaN is kept in the rollout, to be raised at its step."""
        env: Env = {}
        strict = self.plan.trainer.strict or self.opts.strict or index == self.origin
        self.worker.version = version
        try:
            self.batches.produce(env, index, strict, metrics, self.names)
        except NonFiniteError as exc:
            return Rollout(index, version, error=exc)
        finally:
            self.worker.version = None
        state = {n: dict(self.worker.node_state[n]) for n in self.names
                 if n in self.worker.node_state}
        return Rollout(index, version, env, {}, self.batches.cursors(), state)


def producer_elsewhere(plan: ExecutionPlan, names: list[str], opts: ExecOptions,
                       cursors: dict[str, dict[str, Any]],
                       node_state: dict[str, dict[str, Any]],
                       hosted: tuple[ModelPlacement, ...], origin: int) -> ProducerNodes:
    """The producer's side of the run in a process of its own (a producer process, a
    rollout pool's worker): its worker (`hosted`: the models the producer's nodes `names`
    run, whole; no optimizer, no prologue: the consumer looks its outputs up),
    interpreter and batches at the trainer's cursors, the nodes' state restored; the run
    (re)started at step `origin`."""
    worker = Worker(plan, opts, hosted, trained=frozenset())
    worker.prepare()
    batches = Batches(Interpreter(plan, worker.call), load_data(plan, worker.tokenizers), [])
    worker.load_models()
    for d, cursor in cursors.items():
        batches.data[d].train.load_state_dict(cursor)
    for name, state in node_state.items():
        worker.node_state[name].update(state)
    nodes = ProducerNodes(plan, batches, worker, names, opts)
    nodes.origin = origin
    return nodes
