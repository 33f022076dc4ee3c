"""Run artefacts a person reads: metrics.jsonl, one line per step, the trackers' runs.

`metrics.jsonl` holds one JSON object per step with `step` and verl-compatible names
(`timing_s/gen`, `actor/pg_loss`, `critic/score/mean`, …). It is always written, whatever
`trainer.loggers` lists: on resume, rows after the checkpoint are dropped first (and a
partial last line a stopped run left, with a note), so the file ends with every step
exactly once, and `flowgraph.run(...).rows` reads it. A write that fails (a full disk)
raises an `OSError` naming the file. The
console line is the `console` logger; the rows' finite numbers also go to the
experiment trackers (TensorBoard, wandb, mlflow: `flowgraph.runtime.trackers`). Given
an `Exporter` (`flowgraph.runtime.prometheus`), every row also feeds the Prometheus
series.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from flowgraph.errors import FlowgraphError
from flowgraph.runtime.trackers import writing

if TYPE_CHECKING:
    from flowgraph.plan import ExecutionPlan
    from flowgraph.runtime.prometheus import Exporter
    from flowgraph.runtime.trackers import Tracker

KEY_METRICS = (
    "critic/score/mean",
    "critic/rewards/mean",
    "actor/pg_loss",
    "actor/ppo_kl",
    "actor/entropy",
    "critic/vf_loss",
    "actor/dpo_loss",
    "sft/loss",
    "rewards/accuracies",
    "response_length/mean",
    "perf/throughput",
)
"""Shown on the per-step console line, when present."""


def _jsonable(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


class MetricsLog:
    """Appends step rows to `run_dir/metrics.jsonl`, prints the step line (`console`),
    and mirrors the rows to `trackers` (and to Prometheus when given an exporter)."""

    def __init__(self, run_dir: Path, *, trackers: Sequence[Tracker] = (),
                 console: bool = True, out: TextIO | None = None, total_steps: int = 0,
                 exporter: Exporter | None = None, worker: str = "local",
                 log_every: int = 1) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.worker = worker
        """The exporter's `worker` label of the rows written here (`rank0`, `driver`)."""
        self.trackers = tuple(trackers)
        self.console = console
        """Print a step's line (with a progress bar under it on a terminal)."""
        self.log_every = log_every
        """Print the line of every this many steps, and of the last (`trainer.log_every`)."""
        self.out = out or sys.stdout
        self.total = total_steps
        self.exporter = exporter
        self._bar: Any = None
        if console and self.out.isatty() and total_steps:
            self._bar = _progress_bar(self.out, total_steps)

    def truncate_after(self, step: int) -> None:
        """Drop rows of steps > `step` (they are re-run after a resume), and a partial
        last line (a run stopped, or a disk filled, while writing it) with a note."""
        if not self.path.exists():
            return
        lines = [line for line in self.path.read_text(errors="replace").splitlines()
                 if line.strip()]
        rows = []
        for number, line in enumerate(lines, 1):
            try:
                rows.append((json.loads(line).get("step", -1), line))
            except (ValueError, AttributeError):
                if number < len(lines):
                    raise FlowgraphError(
                        f"`{self.path}` line {number} is not a JSON object; only a last "
                        "line may be partial. Remove or mend that line") from None
                print(f"note: dropped the partial last line of `{self.path}` (line "
                      f"{number}, {len(line)} characters: a run stopped while writing it)",
                      file=self.out, flush=True)
        with writing(self.path):
            self.path.write_text("".join(line + "\n" for s, line in rows if s <= step))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _jsonable(float(v)) for k, v in sorted(metrics.items())}}
        with writing(self.path), self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        finite = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        for tracker in self.trackers:
            tracker.log(step, finite)
        if self.exporter is not None:
            self.exporter.observe_step(step, metrics, worker=self.worker)
            self.exporter.record_memory(worker=self.worker)
        if not self.console:
            return
        shown = (step + 1) % self.log_every == 0 or step + 1 == self.total
        if self._bar is None:
            if shown:
                print(self.line(step, metrics), file=self.out, flush=True)
            return
        progress, task = self._bar
        if shown:
            progress.console.print(self.line(step, metrics), highlight=False, markup=False)
        progress.update(task, completed=step + 1)

    def table(self, step: int, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """`run_dir/<name>/step_<step>.jsonl` (one JSON object a row) and the trackers'
        tables: the validation generations (`name` = `validation`)."""
        folder = self.path.parent / name
        folder.mkdir(exist_ok=True)
        path = folder / f"step_{step}.jsonl"
        with writing(path), path.open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(dict(r)) + "\n" for r in rows)
        for tracker in self.trackers:
            tracker.table(step, f"val/{name}", rows)

    def line(self, step: int, metrics: dict[str, float]) -> str:
        """`step 3/40 [generation] 1.24s [scoring] 0.87s … | score 0.250 pg_loss -0.013`:
        the phases of the step (`phase_s/…`; each node's time is in `timing_s/<node>`)."""
        timings = " ".join(
            f"[{k.removeprefix('phase_s/')}] {v:.2f}s" for k, v in metrics.items()
            if k.startswith("phase_s/"))
        keys = " ".join(f"{k.split('/')[-2] if k.endswith('/mean') else k.split('/')[-1]} "
                        f"{metrics[k]:.4g}" for k in KEY_METRICS if k in metrics)
        total = f"/{self.total}" if self.total else ""
        step_s = metrics.get("timing_s/step", float("nan"))
        return f"step {step}{total} {timings} (step {step_s:.2f}s) | {keys}"

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        if self._bar is not None:
            self._bar[0].stop()


def _progress_bar(out: TextIO, total: int) -> tuple[Any, Any]:
    """A rich progress bar under the step lines, on a terminal only (logs stay plain)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeRemainingColumn(), console=Console(file=out))
    task = progress.add_task("training", total=total)
    progress.start()
    return progress, task


@contextmanager
def serving(plan: ExecutionPlan, port: int | None, host: str = "127.0.0.1", *, hold: float = 0.0,
            target: str = "local", out: TextIO | None = None, here: bool = True
            ) -> Iterator[Exporter | None]:
    """Prometheus `/metrics` for the block: on `port` (else `trainer.metrics_port`; 0 a
    free one), started first so a busy port fails before any model loads, kept `hold`
    seconds after a block that ends normally (a scraper reads the final values), closed
    always. None when no port is asked for, or not `here` (an fsdp rank other than 0)."""
    port = plan.trainer.metrics_port if port is None else port
    if port is None or not here:
        yield None
        return
    from flowgraph.runtime.prometheus import Exporter

    exporter = Exporter.start(plan, port, host, target=target, out=out)
    try:
        yield exporter
        exporter.hold(hold, out)
    finally:
        exporter.close()
