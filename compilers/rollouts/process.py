"""Asynchronous rollouts in a process of their own (`AsyncPlan.own_process`: target local).

`ProcessProducer` starts the producer process: a worker with its own copy of the
models the producer's nodes run, pinned to its half of the CPU cores (on CPU), so
generating step k+1 overlaps training step k (`flowgraph.compilers.rollouts` says what
the buffer holds and how admission works). Trained weights reach it through shared
memory after every update. Rollouts come back serialised (`torch.save`), errors too: a
node's error in the producer stops the run with its message, a NaN is raised at the
step whose batch it is (`trainer.on_nonfinite: skip` skips that step).
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
import signal
import time
from pathlib import Path
from typing import Any

import torch

from flowgraph.compilers.batches import Batches
from flowgraph.compilers.checkpoint.store import Rollout
from flowgraph.compilers.rollouts.buffer import Cursors, need
from flowgraph.compilers.rollouts.inbox import Inbox
from flowgraph.compilers.rollouts.producer import producer_elsewhere
from flowgraph.compilers.signals import STOP_SIGNALS, die_with_parent
from flowgraph.compilers.worker import ExecOptions, Worker, quiet_hf
from flowgraph.errors import FlowgraphError
from flowgraph.plan import ExecutionPlan, ModelPlacement, plan_from_json, plan_to_json

POLL_S = 1.0
"""How often a wait checks that the producer process is still alive."""
CLOSE_S = 10.0
"""How long the end of a run waits for the producer process to stop by itself (an
episode it is in finishes; a vLLM engine shuts down) before it is killed."""


class ProcessProducer:
    """The producer runs in a process of its own (target local), overlapping the
    consumer; weights go to it through shared memory after every update."""

    overlaps = True
    ahead = 0

    def __init__(self, plan: ExecutionPlan, batches: Batches, worker: Worker,
                 names: list[str], opts: ExecOptions) -> None:
        cut = plan.asynchronous
        assert cut is not None
        self.plan, self.worker, self.names, self.opts = plan, worker, names, opts
        self.S, self.steps = cut.staleness, plan.trainer.steps
        self.block, self.partial = cut.admission == "block", cut.partial
        self.inbox = Inbox(batches, worker)
        self.origin = 0
        """The version the run started (or resumed) from."""
        import torch.multiprocessing as mp

        self.mp = mp.get_context("spawn")
        self.models = {m: worker.models[m] for m in sorted(_producer_models(plan, names))
                       if m in worker.optimizers}
        """The trained models the producer runs (the rollout's): published every step."""
        self.shared = {m: {k: v.detach().to("cpu", copy=True).share_memory_()
                           for k, v in model.state_dict().items()}
                       for m, model in self.models.items()}
        self.trained = {m: {k for k, p in model.named_parameters(remove_duplicate=False)
                            if p.requires_grad} for m, model in self.models.items()}
        """The entries an update changes (a LoRA model's adapters; both names of a tied
        embedding): what is published after the first time."""
        self.busy = self.mp.Array("d", [0.0, -1.0])
        """The producer's seconds spent producing so far, and when the rollout it is
        producing began (-1: none; `time.time()`), for `generating_s`."""
        self.published = self.mp.Value("q", -1, lock=False)
        self.grabbed = self.mp.Value("q", -1, lock=False)
        self.stop = self.mp.Value("b", 0, lock=False)
        self.started = self.mp.Value("b", 0, lock=False)
        """Set by the producer's first line: a process that exits before it never ran
        (Python, starting it, imports the user's script again, which may fail)."""
        self.cond = self.mp.Condition()
        self.queue = self.mp.Queue(maxsize=0 if self.block else self.S + 1)
        self.proc: Any = None
        self.own: tuple[set[int], int] | None = None
        """This process's cores and threads before the producer took half: restored at
        the end of the run."""

    def start(self, step: int, first: int, cursors: Cursors) -> None:
        self.origin = step
        state = {n: s for n, s in self.worker.node_state.items() if n in self.names}
        self._publish(step)
        cores = _halves()
        if cores is not None and self.opts.device == "cpu":
            self.own = os.sched_getaffinity(0), torch.get_num_threads()
            os.sched_setaffinity(0, cores[0])
            torch.set_num_threads(len(cores[0]))
        self.proc = self.mp.Process(
            # not a daemon: a vLLM engine starts processes of its own; it stops when
            # told (`close`) or when this process is gone
            target=_producer_main, name="flowgraph-rollouts", daemon=False,
            args=((plan_to_json(self.plan), self.plan.pickled_objects()), self.names,
                  str(self.opts.run_dir), self.opts.device, self.opts.strict, self.shared,
                  self.published, self.grabbed, self.stop, self.started, self.cond,
                  self.queue, self.busy, first, step,
                  cursors, state,
                  cores[1] if cores is not None and self.own else None, os.getpid()))
        self.proc.start()
        if self.block and self.partial and first < self.steps \
                and need(first, self.S, step) == step:
            # the uninterrupted run's producer begins this rollout as step `step` begins,
            # and an update landing during it reaches its episodes between turns: one
            # that loads its models first would see more of them land (a resumed run's)
            self._wait(lambda: self.grabbed.value >= step, f"the start at step {step}")

    def next_rollout(self, step: int, metrics: dict[str, float]) -> Rollout:
        """The producer's next rollout, waited for."""
        return self.inbox.receive(self._arrival(step))

    def advance(self, step: int, held: int) -> None:
        """Publish version step + 1; under `block`, first let the producer take version
        `step` when a rollout still to come (after the `held` ones of steps step+1, …)
        is generated by it."""
        version = step + 1
        later = step + self.S
        # (partial rollouts too: a rollout begins with `need`'s version, not a newer one
        # published while the producer was busy, so that where it begins does not depend
        # on timing: a resumed run's late producer begins as the uninterrupted run's)
        if self.block and step + held < later < self.steps \
                and need(later, self.S, self.origin) == step:
            self._wait(lambda: self.grabbed.value >= step, f"step {step}")
        if version < self.steps:
            self._publish(version)

    def cursors(self) -> Cursors:
        return self.inbox.data_cursors()

    def load(self, cursors: Cursors | None) -> None:
        self.inbox.cursors = cursors

    def generating_s(self) -> float:
        with self.busy.get_lock():
            done, since = float(self.busy[0]), float(self.busy[1])
        return done + (max(time.time() - since, 0.0) if since >= 0 else 0.0)

    def close(self) -> None:
        if self.own is not None:
            os.sched_setaffinity(0, self.own[0])
            torch.set_num_threads(self.own[1])
            self.own = None
        if self.proc is None:
            return
        with self.cond:
            self.stop.value = 1
            self.cond.notify_all()
        try:
            self.proc.join(timeout=CLOSE_S)
        finally:  # (a second signal may interrupt the join: the producer still goes)
            if self.proc.is_alive():  # in an episode it will not finish for us: it
                self.proc.kill()      # ignores SIGTERM (the trainer decides what one means)
                self.proc.join()
            self.proc = None

    # -- the channel ---------------------------------------------------------------------

    def _publish(self, version: int) -> None:
        """The trained models' weights into shared memory as `version`: all of them the
        first time, then what updates change."""
        first = self.published.value < 0
        with self.cond:
            for m, model in self.models.items():
                with torch.no_grad():
                    for k, v in model.state_dict().items():
                        if first or k in self.trained[m]:
                            self.shared[m][k].copy_(v)
            self.published.value = version
            self.cond.notify_all()

    def _arrival(self, step: int) -> Rollout:
        """The producer's next message: a rollout, or the error that stopped it."""
        import queue

        while True:
            try:
                kind, payload = self.queue.get(timeout=POLL_S)
                break
            except queue.Empty:
                self._alive(f"step {step}")
        if kind == "error":
            raise _unpack(payload)
        item: Rollout = _unpack(payload)
        return item

    def _wait(self, ready: Any, where: str) -> None:
        with self.cond:
            while not ready():
                self.cond.wait(timeout=POLL_S)
                if not ready():
                    self._alive(where)

    def _alive(self, where: str) -> None:
        if self.proc is not None and not self.proc.is_alive():
            code = self.proc.exitcode
            self.proc = None
            if not self.started.value:
                raise FlowgraphError(
                    f"the rollout producer process exited (code {code}) before it started, "
                    "its error printed above: Python starts it by importing your script "
                    "again, so a script that starts a run must do so under "
                    "`if __name__ == \"__main__\":`")
            raise FlowgraphError(
                f"the rollout producer process exited (code {code}) while the trainer waited "
                f"for it at {where}, without saying why (killed, or out of memory?)")


def _halves() -> tuple[set[int], set[int]] | None:
    """The CPU cores this process may use, cut in two (trainer, producer); None with
    fewer than two or where affinity cannot be set."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


def _producer_main(sent: tuple[str, bytes | None], names: list[str], run_dir: str,
                   device: str, strict: bool,
                   shared: dict[str, dict[str, torch.Tensor]], published: Any, grabbed: Any,
                   stop: Any, started: Any, cond: Any, out: Any, busy: Any, first: int,
                   origin: int,
                   cursors: dict[str, dict[str, Any]], node_state: dict[str, dict[str, Any]],
                   cores: set[int] | None, parent: int) -> None:
    """The producer process: a worker hosting the models the producer's nodes run (no
    optimizer, no prologue: the consumer looks its outputs up), generating the rollouts
    of steps `first`, `first` + 1, … with the versions admission allows (`parent`: the
    trainer's pid; `sent`: the plan's JSON and its Python objects, pickled)."""
    started.value = 1
    # The trainer decides what a signal means (it stops at a step's end, `close`s this
    # process); a killed trainer kills this one at once (the kernel's parent-death signal)
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    die_with_parent(parent, signal.SIGKILL)
    try:
        if cores is not None:
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
        quiet_hf()
        plan = plan_from_json(sent[0]).with_pickled(sent[1])
        assert plan.asynchronous is not None
        with open(os.devnull, "w") as devnull:
            nodes = producer_elsewhere(plan, names, ExecOptions(
                Path(run_dir), device, strict, out=devnull, tensorboard=False,
                step_timeout_s=plan.trainer.step_timeout_s), cursors, node_state,
                _hosted(plan, names), origin)
            weights = _Weights(nodes.worker, shared, published, grabbed, cond)
            partial, S = plan.asynchronous.partial, plan.asynchronous.staleness
            if partial:
                nodes.worker.refresh = weights.refresh
            block = plan.asynchronous.admission == "block"
            # drop: rollouts dropped are replaced, so the producer goes on until stopped
            for index in (range(first, plan.trainer.steps) if block
                          else itertools.count(first)):
                with cond:
                    want = need(index, S, origin) if block else None
                    while not _stopped(stop, parent) and \
                            not _admitted(published.value, want, partial):
                        cond.wait(timeout=POLL_S)
                    if _stopped(stop, parent):
                        return
                    weights.take()
                metrics: dict[str, float] = {}
                _busy(busy, True)
                item = nodes.produce(index, weights.loaded, metrics)
                _busy(busy, False)
                item.metrics = metrics
                if not _send(out, ("rollout", _pack(item)), stop, parent):
                    return
    except BaseException as exc:  # everything reaches the trainer, which reports it
        _send(out, ("error", _pack(_portable(exc))), stop, parent)
    finally:
        if _stopped(stop, parent):
            # what the queue still holds is not wanted: without this the process, at its
            # exit, waits for the trainer to read it (a rollout larger than the pipe's
            # buffer), and the trainer, at its own exit, for this process
            out.cancel_join_thread()


class _Weights:
    """The producer's side of the weights channel: what its models hold of the versions
    the trainer publishes."""

    def __init__(self, worker: Worker, shared: dict[str, dict[str, torch.Tensor]],
                 published: Any, grabbed: Any, cond: Any) -> None:
        self.worker, self.shared, self.published, self.grabbed, self.cond = \
            worker, shared, published, grabbed, cond
        self.loaded = -1
        """The version the models hold (-1: none yet)."""

    def take(self) -> None:
        """The published version into the models (`cond` held), and say so."""
        self.loaded = _take_weights(self.worker, self.shared, self.published.value,
                                    self.loaded)
        self.grabbed.value = self.loaded
        self.cond.notify_all()

    def refresh(self) -> int:
        """Partial rollouts, between two turns: the newest published weights, when newer
        than those held; their version."""
        if self.published.value > self.loaded:
            with self.cond:
                self.take()
        return self.loaded


def _admitted(published: int, want: int | None, partial: bool) -> bool:
    """Whether the published version may generate the next rollout: under `block`
    (`want`) that very version, or with partial rollouts that one or newer; under `drop`
    (None) any version."""
    if want is None or partial:
        return published >= (want or 0)
    return published == want


def _busy(busy: Any, begins: bool) -> None:
    """A rollout begins (`begins`) or ends: the producer's busy seconds (`generating_s`)."""
    with busy.get_lock():
        if begins:
            busy[1] = time.time()
        else:
            busy[0], busy[1] = busy[0] + max(time.time() - busy[1], 0.0), -1.0


def _hosted(plan: ExecutionPlan, names: list[str]) -> tuple[ModelPlacement, ...]:
    """The models the producer's nodes `names` run, and their LoRA bases, as the trainer's
    pools place them."""
    run = _producer_models(plan, names)
    bases = {m.base_of for p in plan.pools for m in p.models if m.name in run}
    return tuple(m for p in plan.pools for m in p.models if m.name in run or m.name in bases)


def _producer_models(plan: ExecutionPlan, names: list[str]) -> set[str]:
    """The models the producer's nodes run."""
    return {n.model for n in plan.nodes if n.name in names and n.loads_model
            and n.model is not None}


def _take_weights(worker: Worker, shared: dict[str, dict[str, torch.Tensor]],
                  version: int, loaded: int) -> int:
    """The published weights (`version`) into the producer's models, unless they hold
    them already (`loaded`); the version they hold."""
    if version != loaded:
        for m, state in shared.items():
            worker.models[m].load_state_dict(state)
    return version


def _stopped(stop: Any, parent: int) -> bool:
    """The trainer said stop, or is gone (this process was handed to another parent)."""
    return bool(stop.value) or os.getppid() != parent


def _send(out: Any, message: tuple[str, bytes], stop: Any, parent: int) -> bool:
    """Put `message` on the trainer's queue, waiting while it is full (`drop`'s bound)
    unless the trainer stops; whether it was sent."""
    import queue

    while not _stopped(stop, parent):
        try:
            out.put(message, timeout=POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _pack(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling (a process boundary), else its message."""
    try:
        back = pickle.loads(pickle.dumps(exc))
        return back if isinstance(back, BaseException) else FlowgraphError(str(exc))
    except Exception:
        return FlowgraphError(f"{type(exc).__name__}: {exc}")
