"""The training loop: steps, the resample loop, the async buffer, evaluation,
checkpoint cadence, logging and recovery — the same on every target.

    loop = TrainingLoop(plan, target, opts)
    loop.setup()        the worker's implementations and tokenizers, the datasets, then
                        the target places the models (cheap and likely failures first)
    loop.run()          the prologue, then per step `train_step`: the batch drawn and
                        the step's nodes run by the interpreter (`run_step`), the
                        evaluation when due, the metrics row, a checkpoint when due

The loop holds no model and calls no node itself: the interpreter runs nodes, and the
target (`flowgraph.compilers.target.Target`: local, fsdp, ray) dispatches each one,
writes and reads checkpoints and recovers from a lost worker. The batches and the
resample loop: `flowgraph.compilers.batches`; metrics of a step:
`flowgraph.compilers.metrics`; evaluation: `flowgraph.compilers.evaluation`; the buffer
of asynchronous rollouts and the producer that fills it (in the loop, a process of its
own, ray's rollout pool): `flowgraph.compilers.rollouts`.

One module past ~450 lines: a step's order (draw, run, evaluate, log, save) and what a
stop or a lost worker does in the middle of it (save, restart, say what was lost) are one
sequence, read top to bottom; split, each half would need the other's state.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flowgraph.compilers.batches import Batches
from flowgraph.compilers.build import load_data
from flowgraph.compilers.checkpoint.integrity import disk_full
from flowgraph.compilers.checkpoint.resume import (
    check_settings,
    fresher_rollouts,
    recorded_settings,
)
from flowgraph.compilers.checkpoint.store import (
    intact_checkpoint,
    latest_checkpoint,
    load_buffer,
    remove_partial,
    rng_state,
    set_rng_state,
)
from flowgraph.compilers.evaluation import evaluate
from flowgraph.compilers.interpreter import Env, Interpreter
from flowgraph.compilers.metrics import data_positions, phase_seconds, step_metrics
from flowgraph.compilers.rollouts.buffer import Rollouts
from flowgraph.compilers.rollouts.inline import InlineProducer
from flowgraph.compilers.rollouts.process import ProcessProducer
from flowgraph.compilers.target import Target
from flowgraph.compilers.worker import ExecOptions
from flowgraph.errors import FlowgraphError, NonFiniteError, Stopped, StopUnsaved, WorkerLost
from flowgraph.plan import ExecutionPlan, plan_to_json
from flowgraph.runtime.metrics import MetricsLog
from flowgraph.runtime.trackers import open_trackers, writing


class TrainingLoop:
    """Runs `plan` for `trainer.steps` steps through `target`."""

    def __init__(self, plan: ExecutionPlan, target: Target, opts: ExecOptions) -> None:
        self.plan, self.target, self.opts = plan, target, opts
        self.interpreter = Interpreter(plan, target.dispatch)
        steps = [n for s in plan.stages if not s.once for n in s.nodes
                 if plan.node(n).category != "data"]
        cut = plan.asynchronous
        self.producer = [n for n in steps if cut is not None and n in cut.producer]
        """An asynchronous plan's producer nodes, in the order they run (none: synchronous)."""
        self.consumer = [n for n in steps if n not in self.producer]
        """The step nodes run on the batch a rollout brings (all of them: synchronous)."""
        self.order = steps
        """Nodes run at every step, stage by stage."""
        self.prologue = self.interpreter.prologue.names
        self.batches = Batches(self.interpreter, {}, self.prologue)
        self.rollouts: Rollouts | None = None
        """The buffer of an asynchronous plan, from `run()` on."""
        self.start_step = 0
        self.prologue_seconds = 0.0
        self.generations: list[dict[str, Any]] = []
        """The last evaluation's responses (`HeldOut.table`), logged as `validation`."""
        self.saved_step = -1
        """The last step a checkpoint holds (-1: none needed yet)."""
        self.changed = False
        """The running step's update ran: a stop waits for the step's end."""
        self.snapshot: tuple[Any, ...] = ()
        """What `begin_step` keeps to drop the running step."""
        self.interpreter.before_node = self.before_node

    @property
    def strict(self) -> bool:
        """Every tensor on every edge checked at every step (`trainer.strict`, `--strict`);
        else the first step's only."""
        return self.plan.trainer.strict or self.opts.strict

    @property
    def node_state(self) -> dict[str, dict[str, Any]]:
        """State nodes keep across steps (a KL controller's), checkpointed."""
        return self.target.worker.node_state

    def setup(self) -> None:
        """Cheap and likely failures first: model paths, implementations, tokenizers and
        datasets (a missing column) — then the model weights and optimizers."""
        self.target.worker.prepare()
        self.batches.data.update(load_data(self.plan, self.target.worker.tokenizers))
        self.target.start()

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> list[dict[str, float]]:
        """The training loop; returns the metric rows this process produced. A fault a
        target can recover from (`WorkerLost`: a Ray worker died or hung) goes to the
        target's `recover`, which says the checkpoint to go on from. A full disk (or a
        file-size limit) is one message naming the file and the last checkpoint."""
        try:
            return self._run()
        except OSError as exc:
            full = disk_full(exc, latest_checkpoint(self.opts.run_dir))
            if full is None:
                raise
            raise full from None

    def _run(self) -> list[dict[str, float]]:
        trainer = self.plan.trainer
        self.prepare_run_dir()
        cut = self.plan.asynchronous
        if cut is not None:
            self.rollouts = self.make_rollouts()
        step = self.start_step = self.restore() if self.opts.resume else 0
        self.saved_step = step - 1  # restored (or nothing to save before step 0)
        log = self.open_log()
        log.truncate_after(step - 1)
        rows: list[dict[str, float]] = []
        try:
            self.stop_check()
            self.before_loop()
            if self.rollouts is not None and step < trainer.steps:
                self.rollouts.start(step)
            while step < trainer.steps:
                self.stop_check()
                try:
                    metrics, saved = self.train_step(step, log)
                except WorkerLost as exc:
                    if self.target.stop_requested() is not None:
                        raise  # a run that stops is not restarted: `unsaved`
                    step = self.start_step = self.recover(exc, step)
                    log.truncate_after(step - 1)
                    continue
                except _Abandoned:
                    self.abandon(step)
                    raise
                rows.append(metrics)
                self.target.completed(saved)
                self.saved_step = step if saved else self.saved_step
                step += 1
                self.stop_check(save=step - 1)
        except WorkerLost as exc:
            raise self.unsaved(exc, step) from None
        finally:
            if self.rollouts is not None:
                self.rollouts.close()
            log.close()
        return rows

    def make_rollouts(self) -> Rollouts:
        """The buffer of an asynchronous plan, with the producer where the plan says: a
        rollout pool (ray), a process of its own (local), or this loop (fsdp)."""
        cut = self.plan.asynchronous
        assert cut is not None
        args = (self.plan, self.batches, self.target.worker, self.producer, self.opts)
        if cut.pool is not None:
            from flowgraph.compilers.rollouts.pool import PoolProducer  # imports Ray

            return Rollouts(self.plan, PoolProducer(*args, trainer=self.target))
        return Rollouts(self.plan, ProcessProducer(*args) if cut.own_process
                        else InlineProducer(*args))

    # -- preemption ---------------------------------------------------------------------

    def stop_check(self, save: int | None = None) -> None:
        """A stop the processes agree on (SIGTERM, SIGINT; `flowgraph.compilers.signals`)
        ends the run here, after a checkpoint of step `save` when that is not saved yet."""
        signum = self.target.stop_requested()
        if signum is None:
            return
        if save is not None and save > self.saved_step:
            self.save(save)
            self.saved_step = save
        raise Stopped(signum, "stopped")

    def unsaved(self, exc: WorkerLost, step: int) -> FlowgraphError:
        """`exc`, or when the run stops, `StopUnsaved`: the steps lost since the last save."""
        if (signum := self.target.stop_requested()) is None:
            return exc
        lost = range(self.saved_step + 1, step)  # completed, not saved
        said = "" if not lost else f"; step {lost[0]} was trained and is lost" if len(
            lost) == 1 else f"; steps {lost[0]} to {lost[-1]} were trained and are lost"
        return StopUnsaved(signum, f"the workers holding the weights were gone ({exc}){said}")

    def begin_step(self) -> None:
        """What a step dropped before it changed any weights must restore to be run again
        exactly: the RNG, the data cursors, the nodes' state. An asynchronous step is
        never dropped (its rollout came from the buffer): it finishes."""
        self.changed = self.rollouts is not None
        if not self.changed:
            self.snapshot = (rng_state(), copy.deepcopy(self.batches.cursors()),
                             copy.deepcopy(self.node_state))

    def before_node(self, name: str) -> None:
        """Before each node of a step: an agreed stop drops the step (`abandon`) unless an
        update started (its weights change): then the step finishes."""
        if self.changed:
            return
        signum = self.target.stop_requested()
        if signum is not None:
            raise _Abandoned(signum, f"step dropped before node `{name}`")
        self.changed = self.interpreter.placed[name].trains

    def abandon(self, step: int) -> None:
        """Step `step` stopped before any update: back to where it began, and the last
        completed step checkpointed (when it is not yet)."""
        rng, cursors, state = self.snapshot
        set_rng_state(rng)
        for d, cursor in cursors.items():
            self.batches.data[d].train.load_state_dict(cursor)
        for name, node_state in state.items():
            self.node_state[name].clear()
            self.node_state[name].update(node_state)
        if step - 1 > self.saved_step:
            self.save(step - 1)
            self.saved_step = step - 1

    def before_loop(self) -> None:
        """The prologue over the training rows, and the held-out rows when the run
        evaluates; its time goes in the first row (`timing_s/prologue`)."""
        self.prologue_seconds = self.run_prologue("train")
        if self.plan.trainer.eval_every or self.plan.trainer.val_before_train:
            self.prologue_seconds += self.run_prologue("eval")

    def run_prologue(self, split: str) -> float:
        return self.batches.run_prologue(split, self.strict)

    def train_step(self, step: int, log: MetricsLog) -> tuple[dict[str, float], bool]:
        """One turn of the loop: the step, the evaluation when due, the row logged, a
        checkpoint when due; (the row, whether a checkpoint was written)."""
        trainer = self.plan.trainer
        before: dict[str, float] = {}
        self.generations = []
        self.begin_step()
        if trainer.val_before_train and step == 0 and trainer.eval_every != 1:
            before = self.evaluate(step)  # the model before any update: the baseline
        metrics = self._guarded_step(step)
        if self.rollouts is not None:  # the update is done: its weights go to the producer
            self.rollouts.advance(step)
        metrics.update(before)
        if trainer.eval_every and (step + 1) % trainer.eval_every == 0:
            metrics.update(self.evaluate(step))
        if step == self.start_step:  # the prologue, what the data load dropped: first row
            if self.prologue:
                metrics["timing_s/prologue"] = self.prologue_seconds
            metrics.update({f"data/{name}/{count}": float(getattr(s.train, count))
                            for name, s in self.batches.data.items()
                            for count in ("filtered_overlong", "same_pairs", "empty_pairs")
                            if getattr(s.train, count, 0)})
        log.write(step, metrics)
        if self.generations:
            log.table(step, "validation", self.generations)
        every = trainer.checkpoint_every
        due = bool(every and (step + 1) % every == 0) or step == trainer.steps - 1
        if due:
            self.save(step)
        return metrics, due

    def _guarded_step(self, step: int) -> dict[str, float]:
        strict = self.strict or step == self.start_step
        try:
            return self.run_step(step, strict=strict)
        except NonFiniteError as exc:
            if self.plan.trainer.on_nonfinite != "skip":
                raise
            print(f"step {step}: skipped the batch: {exc}", file=self.opts.out)
            return {"skipped": 1.0}

    # -- one step -----------------------------------------------------------------------

    def run_step(self, step: int, *, strict: bool) -> dict[str, float]:
        """Draw the batch and run the step's nodes (`produce`); with asynchronous
        rollouts, take the producer's outputs for the step from the buffer and run the
        consumer's nodes. The step's metrics: the nodes', verl's batch metrics, where
        the time went."""
        t0 = time.perf_counter()
        env: Env = {}
        metrics: dict[str, float] = {}
        if self.rollouts is None:
            self.batches.produce(env, step, strict, metrics, self.order)
            metrics.update(data_positions(self.batches.cursors()))
        else:  # the producer's outputs from the buffer, then the consumer's nodes
            env = self.rollouts.take(step, metrics)
            t1, generated = time.perf_counter(), self.rollouts.generating_s()
            self.batches.look_up(env, step, strict)
            self.interpreter.run(self.consumer, env, step, strict=strict, metrics=metrics)
            work = time.perf_counter() - t1
            overlapped = self.rollouts.generating_s() - generated
            metrics["async/overlap_frac"] = min(overlapped / work, 1.0) if work > 0 else 0.0
        seconds = {k.removeprefix("timing_s/"): v for k, v in metrics.items()
                   if k.startswith("timing_s/")}
        waited = 0.0
        if self.rollouts is not None and self.rollouts.overlaps:
            # generation overlapped the step: what the step waited for it is its cost
            seconds = {n: s for n, s in seconds.items() if n in self.consumer}
            waited = metrics["perf/rollout_wait_s"]
        metrics.update(step_metrics(self.plan, env))
        wall = time.perf_counter() - t0
        metrics["timing_s/step"] = wall
        metrics.update(phase_seconds(self.plan, seconds, wall, waited))
        metrics["perf/orchestration_frac"] = (metrics["phase_s/orchestration"] / wall
                                              if wall else 0.0)
        tokens = metrics.get("perf/tokens", 0.0)
        if tokens:
            metrics["perf/throughput"] = tokens / wall
        exporter = self.opts.exporter
        for worker, timings, memory in self.target.report(step, metrics):
            if exporter is not None:
                exporter.observe_worker(timings, worker)
                for device, used in memory:
                    exporter.set_memory(worker, device, used)
        return metrics

    def evaluate(self, step: int) -> dict[str, float]:
        """`val/...` metrics on the held-out data (`flowgraph.compilers.evaluation`)."""
        metrics, self.generations = evaluate(self.batches, self.prologue + self.order, step,
                                             self.target.worker.tokenizers, self.strict,
                                             self.target.evaluate)
        return metrics

    # -- checkpoints --------------------------------------------------------------------

    def run_state(self, step: int) -> dict[str, Any]:
        """What a checkpoint holds besides weights and optimizers (JSON-able)."""
        cursors = (self.rollouts.data_cursors(step) if self.rollouts is not None
                   else self.batches.cursors())
        return {"step": step, "cursors": cursors, "node_state": self.node_state,
                "plan": self.plan.name, "settings": recorded_settings(self.plan)}

    def save(self, step: int) -> None:
        buffered = self.rollouts.buffered(step) if self.rollouts is not None else None
        state = self.run_state(step)
        if buffered is not None:  # the buffer is then in the checkpoint: see restore_state
            state["buffered"] = len(buffered)
        self.target.save(step, state, buffered)

    def say(self, text: str) -> None:
        """A line for the user, from the process that writes the run's artefacts."""
        if self.target.writes:
            print(text, file=self.opts.out or sys.stdout, flush=True)

    def restore(self) -> int:
        """Load the newest intact checkpoint, after checking that the settings that
        shaped it are this run's (`flowgraph.compilers.checkpoint.resume`); return the next step
        to run (0 when none). A checkpoint of any target loads on any other."""
        found = intact_checkpoint(self.opts.run_dir, self.say)
        if found is None:
            self.say(f"resuming: `{self.opts.run_dir}` holds no checkpoint yet; from step 0")
            return 0
        step, folder = found
        state = json.loads((folder / "state.json").read_text())
        for line in check_settings(folder, state, recorded_settings(self.plan),
                                   self.opts.allow_changed):
            self.say(f"resuming with a changed setting: {line}")
        steps, cut = self.plan.trainer.steps, self.plan.asynchronous
        past = "" if step + 1 == steps else f", past trainer.steps = {steps}"
        self.say(f"resuming from checkpoint `{folder}` (after step {step}): " + (
            f"the next step is {step + 1}" if step + 1 < steps else f"nothing to train: the "
            f"run finished at step {step}{past}; give trainer.steps above {step + 1} to train on"))
        note = (fresher_rollouts(step, steps, cut.staleness, int(state.get("buffered", 0)))
                if cut is not None and cut.admission == "block" else None)
        if note is not None:
            self.say(note)
        self.target.load(folder)
        return self.restore_state(folder)

    def restore_state(self, folder: Path) -> int:
        """Cursors and node state of the checkpoint in `folder`; the next step."""
        state = json.loads((folder / "state.json").read_text())
        for d, cursor in state["cursors"].items():
            self.batches.data[d].train.load_state_dict(cursor)
        if state.get("buffered") and self.rollouts is None:
            raise FlowgraphError(f"checkpoint `{folder}` holds {state['buffered']} buffered "
                                 "rollout(s) of an asynchronous run; a synchronous run "
                                 "cannot train them (trainer.max_staleness)")
        if self.rollouts is not None:  # a synchronous run's checkpoint holds no buffer
            self.rollouts.load(load_buffer(folder) if "buffered" in state else [],
                               state["cursors"])
        for name, node_state in state["node_state"].items():
            self.node_state.setdefault(name, {}).update(node_state)
        return int(state["step"]) + 1

    def recover(self, exc: WorkerLost, step: int) -> int:
        """After `exc` at `step`, the target recovers (or re-raises): the step to run
        next, from the checkpoint it reloaded, or 0 with fresh data and node state."""
        folder = self.target.recover(exc, step)
        if folder is not None:
            next_step = self.restore_state(folder)
        else:  # nothing saved yet: start over with fresh models and data
            for d in self.batches.data.values():
                d.train.load_state_dict({"epoch": 0, "position": 0})
            for state in self.node_state.values():
                state.clear()
            if self.rollouts is not None:
                self.rollouts.load([], None)
            next_step = 0
        if self.rollouts is not None:
            self.rollouts.start(next_step)
        return next_step

    # -- run artefacts ------------------------------------------------------------------

    def prepare_run_dir(self) -> None:
        """The run dir with its plan, what a killed writer left removed (the process
        that writes the run's artefacts does it; the others wait for it)."""
        if self.target.writes:
            run_dir = self.opts.run_dir
            run_dir.mkdir(parents=True, exist_ok=True)
            remove_partial(run_dir)
            with writing(run_dir / "plan.json"):
                (run_dir / "plan.json").write_text(plan_to_json(self.plan))
        self.target.barrier()

    def open_log(self) -> MetricsLog:
        if not self.target.writes:
            return _Silent(self.opts.run_dir)
        trackers = open_trackers(self.plan, self.opts.run_dir, resume=self.opts.resume,
                                 tensorboard=self.opts.tensorboard)
        return MetricsLog(self.opts.run_dir, trackers=trackers,
                          console="console" in self.plan.trainer.loggers,
                          out=self.opts.out, total_steps=self.plan.trainer.steps,
                          exporter=self.opts.exporter, worker=self.target.label,
                          log_every=self.plan.trainer.log_every)


class _Abandoned(Stopped):
    """A stop agreed on before the running step changed any weights: the step is dropped."""


class _Silent(MetricsLog):
    """The log of a process that does not write the run's artefacts (fsdp ranks > 0):
    rank 0 writes the run's one metrics.jsonl."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir, out=sys.stdout)

    def truncate_after(self, step: int) -> None:
        pass

    def write(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def table(self, step: int, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        pass
