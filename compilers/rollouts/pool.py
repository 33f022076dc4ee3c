"""Asynchronous rollouts on a pool of their own (`AsyncPlan.pool`: target ray).

`PoolProducer` starts the rollout pool: a placement group of one bundle
(`resources.rollout_cpus`, a GPU on cuda) and in it a `RolloutWorker`, a Ray actor
running the producer process's code (`producer.producer_elsewhere`): its own
copy of the models the producer's nodes run, the data at the trainer's cursors, the
producer's nodes in the trainer's order. It generates the rollouts of later steps while
the trainer's pools train (`flowgraph.compilers.rollouts` says what the buffer holds and
how admission works).

The driver asks for each rollout as soon as admission allows it, with the weights it is
to be generated with: a Ray actor runs the calls of one caller in the order they were
made, so under `block` the rollout of step j is asked for right after version
max(j − S, v0) is out (the update of step j − S − 1), and then generated while the
trainer trains; under `drop` up to S + 1 rollouts are asked for, each with the newest
weights. The trained models' weights are asked of the trainer's pools after an update
(`RayTarget.trained_weights`, whole: all of them the first time, then what updates
change) and go, as object-store references, with the call that first needs them: the
rollout worker fetches them from the trainer's worker, not through the driver, copies
them into its models, and a vLLM rollout engine takes them from there as it does from a
trained model (`flowgraph.compilers.vllm.engine`, the weight-sync probe included).

With partial rollouts (`AsyncPlan.partial`) the weights do not wait for a call that
needs them: every new version is published to the worker after its update (`publish`,
in a concurrency group of its own, so it runs beside the rollout being produced, while
`produce` calls still run one at a time in the order they were made: Ray's ordered
actor queue hands each group's calls to its thread in submission order, and nothing
orders calls across groups, so a rollout's call waits for the last `publish` call's
result, as Ray waits for any argument). The worker
keeps what it was published, and an episode takes the newest between its turns (the
worker's `refresh`, `NodeContext.newest_weights`); a rollout begins with the newest
version sent, any as new as admission asks (`block`: max(j − S, v0) or newer), never
older weights than the models hold. A `publish` that failed (its weights lost with a
trainer's worker) fails the rollouts asked for after it, whose error the driver raises.

A dead or silent rollout worker is a lost worker (`WorkerLost`): the loop recovers as for
any pool, and `start` sets up a fresh one at the checkpoint's buffer and cursors.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from flowgraph.compilers.batches import Batches
from flowgraph.compilers.checkpoint.store import Rollout
from flowgraph.compilers.rollouts.buffer import Cursors, need
from flowgraph.compilers.rollouts.inbox import Inbox
from flowgraph.compilers.rollouts.producer import ProducerNodes, producer_elsewhere
from flowgraph.compilers.target import Target
from flowgraph.compilers.targets.ray.calls import answers, ray_name, reserve
from flowgraph.compilers.targets.ray.worker import log_to, worker_log
from flowgraph.compilers.worker import ExecOptions, Worker, pick_device, quiet_hf
from flowgraph.errors import FlowgraphError
from flowgraph.plan import ROLLOUT_POOL, ExecutionPlan, PoolPlan, plan_from_json, plan_to_json

try:
    import ray
    from ray.util.placement_group import remove_placement_group
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise FlowgraphError(f"the rollout pool needs Ray: pip install 'ray>=2.40' ({exc})") from exc


WEIGHTS = "weights"
"""The rollout worker's concurrency group of `publish` (one thread): beside `produce`."""


@runtime_checkable
class TrainerPools(Protocol):
    """What the rollout pool asks of the trainer's target (`RayTarget`)."""

    def trained_weights(self, models: list[str], *, changed: bool) -> list[Any]: ...


@dataclass
class _Call:
    """A rollout asked of the worker, not yet received."""

    index: int
    span: Any
    """ObjectRef of (began, ended): when the worker produced it (`time.time()`)."""
    rollout: Any
    """ObjectRef of the `Rollout`."""
    sent: float
    """When it was asked for (`time.time()`): the worker begins it no earlier."""
    took: tuple[float, float] | None = None
    """(began, ended), once known."""


class PoolProducer:
    """The producer runs on the rollout pool (target ray), overlapping the trainer's
    pools; the trained weights go to it after every update."""

    overlaps = True
    ahead = 0

    def __init__(self, plan: ExecutionPlan, batches: Batches, worker: Worker,
                 names: list[str], opts: ExecOptions, *, trainer: Target) -> None:
        if not isinstance(trainer, TrainerPools):
            raise FlowgraphError(f"plan `{plan.name}` has a rollout pool, which runs on target "
                                 f"ray only; this run's target is {plan.target}")
        cut = plan.asynchronous
        assert cut is not None and cut.pool is not None
        self.plan, self.worker, self.names, self.opts = plan, worker, names, opts
        self.S, self.steps = cut.staleness, plan.trainer.steps
        self.block, self.partial = cut.admission == "block", cut.partial
        self.inbox = Inbox(batches, worker)
        self.origin = 0
        """The version the run started (or resumed) from."""
        self.pool: PoolPlan = cut.pool
        self.trainer: TrainerPools = trainer
        self.trained = sorted(m.name for m in self.pool.models
                              if m.trainable and m.base_of is None)
        """The trained models the producer runs: their weights follow every update."""
        self.actor: Any = None
        self.pg: Any = None
        self.calls: deque[_Call] = deque()
        self.next_index = 0
        """The index of the next rollout to ask for."""
        self.version = 0
        """The newest published version: the trainer's weights after that many updates."""
        self.weights: tuple[int, bool, list[Any]] | None = None
        """The trainer's weights asked for a version, only what updates change or not
        (object-store references)."""
        self.sent = -1
        """The version of the weights the worker was sent last (-1: none yet)."""
        self.busy = 0.0
        """The worker's seconds producing the rollouts whose span is known."""
        self.free_at = 0.0
        """When the worker finished its last call whose span is known."""
        self.publishing: Any = None
        """Partial rollouts: the ObjectRef of the last `publish` call, which the rollouts
        asked for after it wait for (a failed one fails them: never a silent wait)."""

    # -- what the buffer calls ---------------------------------------------------------

    def start(self, step: int, first: int, cursors: Cursors) -> None:
        """A fresh worker at the buffer's end (`first`), holding the weights of `step`."""
        self.origin = step
        self.close()
        state = {n: s for n, s in self.worker.node_state.items() if n in self.names}
        self.pg, places = reserve(self.pool, name=ray_name(self.plan, self.pool.name))
        # (Ray's typed overloads of `remote` omit concurrency_groups, which it takes)
        self.actor = ray.remote(  # type: ignore[call-overload]
            concurrency_groups={WEIGHTS: 1})(RolloutWorker).options(
            name=ray_name(self.plan, self.pool.name, 0), **places[0]).remote(
            (plan_to_json(self.plan), self.plan.pickled_objects()), os.getcwd(),
            [p for p in sys.path if p], str(self.opts.run_dir))
        answers(self.actor.setup.remote(self.names, str(self.opts.run_dir), self.opts.strict,
                                        cursors, state, step), None,
                "while the rollout pool's worker set up")
        self._list_worker()
        self.free_at, self.weights = time.time(), None
        self.next_index, self.version, self.sent = first, step, -1
        if self.partial:
            self._publish()
        self._ask(first - step)

    def next_rollout(self, step: int, metrics: dict[str, float]) -> Rollout:
        """The oldest rollout asked for, waited for."""
        if not self.calls:  # drop: everything asked for was dropped, the buffer is empty
            self._ask(0)
        return self.inbox.receive(self._arrival(step))

    def advance(self, step: int, held: int) -> None:
        """Version step + 1 is out: ask for the rollouts it generates; with partial
        rollouts, first send it to the worker, which may be in the middle of an episode."""
        if step + 1 < self.steps:
            self.version = step + 1
            if self.partial:
                self._publish()
            self._ask(held)

    def cursors(self) -> Cursors:
        return self.inbox.data_cursors()

    def load(self, cursors: Cursors | None) -> None:
        self.inbox.cursors = cursors

    def generating_s(self) -> float:
        self._spans()
        running = next((c for c in self.calls if c.took is None), None)
        if running is None:
            return self.busy
        began = max(running.sent, self.free_at)  # the worker runs calls in order
        return self.busy + max(time.time() - began, 0.0)

    def close(self) -> None:
        if self.actor is not None:
            ray.kill(self.actor, no_restart=True)
            self.actor = None
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        self.calls.clear()
        self.publishing = None

    # -- the worker --------------------------------------------------------------------

    def _ask(self, held: int) -> None:
        """Ask for every rollout admission allows now: `block`, those whose version is
        out (`need`); `drop`, up to S + 1 in the buffer (`held`: those received). With
        partial rollouts the weights went ahead (`publish`) and a call names the oldest
        version that may begin it (`block`: `need`; `drop`: the newest)."""
        while self._admits(held):
            weights = []
            if not self.partial and self.sent != self.version:  # with the first call
                weights = self._weights()                        # that needs them
                self.sent = self.version
            version = need(self.next_index, self.S, self.origin) if self.partial and self.block \
                else self.version
            span, rollout = self.actor.produce.options(num_returns=2).remote(
                self.next_index, version, self.publishing, *weights)
            self.calls.append(_Call(self.next_index, span, rollout, time.time()))
            self.next_index += 1

    def _publish(self) -> None:
        """Partial rollouts: the newest version's weights to the worker now, beside the
        rollout it may be producing."""
        weights = self._weights()
        self.sent = self.version
        self.publishing = self.actor.publish.remote(self.version, *weights)

    def _list_worker(self) -> None:
        """The worker's pid beside the trainer's workers' (`run_dir/.ranks/workers.json`,
        which the target wrote as its groups started), for operators and tests that
        want to signal it."""
        listed = self.opts.run_dir / ".ranks" / "workers.json"
        workers = json.loads(listed.read_text()) if listed.is_file() else {}
        workers[self.pool.name] = [answers(self.actor.pid.remote(), None)]
        listed.parent.mkdir(parents=True, exist_ok=True)
        listed.write_text(json.dumps(workers, indent=2))

    def _admits(self, held: int) -> bool:
        if self.block:
            return self.next_index < self.steps and \
                need(self.next_index, self.S, self.origin) <= self.version
        return len(self.calls) + held <= self.S

    def _weights(self) -> list[Any]:
        """The trainer's weights of the newest version: whole the first time, then what
        the updates change; references the worker's call resolves (from the trainer's
        workers, not through the driver)."""
        changed = self.sent >= 0
        if self.weights is None or self.weights[:2] != (self.version, changed):
            self.weights = (self.version, changed,
                            self.trainer.trained_weights(self.trained, changed=changed))
        return self.weights[2]

    def _arrival(self, step: int) -> Rollout:
        """The oldest rollout asked for, when it is ready."""
        timeout = self.plan.trainer.step_timeout_s or None
        call = self.calls[0]
        item: Rollout = answers(call.rollout, timeout,
                                f"in the rollout pool, producing the rollout for step {step}")
        self._spans()
        self.calls.popleft()
        return item

    def _spans(self) -> None:
        """Learn when the worker produced the rollouts it has finished (in order)."""
        for call in self.calls:
            if call.took is not None:
                continue
            ready, _ = ray.wait([call.span], timeout=0)
            if not ready:
                return
            try:
                call.took = ray.get(call.span)
            except Exception:  # the call failed: its rollout's `_arrival` says why
                return
            self.busy += call.took[1] - call.took[0]
            self.free_at = call.took[1]


class RolloutWorker:
    """The rollout pool's worker (a Ray actor; `ray.remote` wraps it when the pool starts):
    the producer's side of the run, generating one rollout a call."""

    def __init__(self, sent: tuple[str, bytes | None], cwd: str, path: list[str],
                 run_dir: str) -> None:
        """`sent`: the plan's JSON and its Python objects, pickled (`pickled_objects`)."""
        os.chdir(cwd)  # model and data paths are relative to where the run started
        log_to(worker_log(Path(run_dir), ROLLOUT_POOL, 0), f"worker 0 of pool `{ROLLOUT_POOL}`")
        quiet_hf()
        sys.path[:0] = [p for p in path if p not in sys.path]
        self.plan = plan_from_json(sent[0]).with_pickled(sent[1])
        assert self.plan.asynchronous is not None and self.plan.asynchronous.pool is not None
        self.pool = self.plan.asynchronous.pool
        self.partial = self.plan.asynchronous.partial
        self.nodes: ProducerNodes | None = None
        self.devnull = open(os.devnull, "w")  # noqa: SIM115 - the actor's life long
        """Where the producer's worker prints (the trainer's console is the driver's)."""
        self.held = -1
        """The version of the weights the models hold (-1: those loaded at setup)."""
        self.published = -1
        """The newest version sent (with a `produce` call, or published)."""
        self.fresh: dict[str, dict[str, torch.Tensor]] = {}
        """The entries sent since the models took them (model -> name -> tensor): the
        newest of each; the first version sent is whole, later ones what updates change."""
        self.cond = threading.Condition()
        """Guards the three above: `publish` runs in a thread of its own."""

    def __repr__(self) -> str:
        """The prefix of this worker's lines on the driver's console (Ray's)."""
        return f"{ROLLOUT_POOL}-0"

    def pid(self) -> int:
        return os.getpid()

    def setup(self, names: list[str], run_dir: str, strict: bool,
              cursors: dict[str, dict[str, Any]], node_state: dict[str, dict[str, Any]],
              origin: int) -> None:
        """Load the models and the data at the trainer's cursors; the run (re)starts at
        version `origin`."""
        torch.set_num_threads(max(self.pool.bundles[0].cpu, 1))
        device = pick_device(self.pool.device.split(":")[0])
        opts = ExecOptions(Path(run_dir), device, strict, out=self.devnull, tensorboard=False,
                           step_timeout_s=self.plan.trainer.step_timeout_s)
        self.nodes = producer_elsewhere(self.plan, names, opts, cursors, node_state,
                                        self.pool.models, origin)
        if self.partial:  # episodes take the newest weights between turns
            self.nodes.worker.refresh = self.refresh

    @ray.method(concurrency_group=WEIGHTS)
    def publish(self, version: int, *weights: dict[str, Any]) -> None:
        """Partial rollouts: `version`'s weights (as `produce` takes them), kept for the
        models to take between two turns of an episode (`refresh`) or when the next
        rollout begins. Runs in its own concurrency group, beside a running `produce`."""
        with self.cond:
            self._keep(version, weights)

    def refresh(self) -> int:
        """The newest weights sent into the models, when newer than those they hold
        (an episode's turns in between: `NodeContext.newest_weights`); their version."""
        with self.cond:
            if self.published > self.held:
                assert self.nodes is not None
                with torch.no_grad():
                    for m, state in self.fresh.items():
                        held = self.nodes.worker.models[m].state_dict()
                        for k, v in state.items():
                            held[k].copy_(v)
                self.fresh, self.held = {}, self.published
            return self.held

    def produce(self, index: int, version: int, after: None, *weights: dict[str, Any]
                ) -> tuple[tuple[float, float], Rollout]:
        """The rollout of `index` generated by `version`, whose weights (model -> name ->
        tensor, one dict per trainer pool) come with the first call that needs them;
        (when it began and ended, the rollout). With partial rollouts they were
        published ahead: `after` is the last `publish` call's result, so Ray starts this
        call once that one is done (calls of two concurrency groups are not ordered),
        and the rollout begins with the newest version sent, `version` or newer."""
        nodes = self.nodes
        if nodes is None:
            raise FlowgraphError("the rollout worker was used before setup")
        with self.cond:
            self._keep(version, weights)
            if self.published < version:
                raise FlowgraphError(f"internal: the rollout pool was asked for step {index}'s "
                                     f"rollout with version {version}, and sent version "
                                     f"{self.published} at most")
        began = time.time()
        metrics: dict[str, float] = {}
        item = nodes.produce(index, self.refresh(), metrics)
        item.metrics = metrics
        return (began, time.time()), item

    def _keep(self, version: int, weights: tuple[dict[str, Any], ...]) -> None:
        """Keep `version`'s weights for the models to take (`cond` held), unless a newer
        version was sent: the driver sends versions in order, the whole weights first."""
        if not weights or version <= self.published:
            return
        for m, state in (item for part in weights for item in part.items()):
            self.fresh.setdefault(m, {}).update(state)
        self.published = version
        self.cond.notify_all()
