"""`flowgraph plot RUN_DIR [RUN_DIR ...] -o curves.png`: learning curves from metrics.jsonl.

Six panels over steps — reward, KL, losses, response length, stage seconds and the
held-out metrics — each drawing the verl names of its table below that the runs have.
One run: a colour per metric. Several runs: a colour per run and a line style per
metric, one legend. Held-out values (`val/...`, every `trainer.eval_every` steps) are
drawn with markers. matplotlib's Agg backend renders off-screen: no display needed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from flowgraph.errors import FlowgraphError, UsageError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["PANELS", "Panel", "RunCurves", "figure", "load_run", "plot_runs"]


@dataclass(frozen=True, slots=True)
class Panel:
    """One subplot: a title and the metric names it draws, when present."""

    title: str
    keys: tuple[str, ...] = ()
    prefix: str = ""
    """Also draw every metric whose name starts with this (e.g. `timing_s/`)."""

    def metrics(self, names: set[str]) -> list[str]:
        listed = [k for k in self.keys if k in names]
        found = sorted(n for n in names if self.prefix and n.startswith(self.prefix)
                       and n not in listed)
        return listed + found


PANELS = (
    Panel("reward", ("critic/score/mean", "critic/rewards/mean", "rewards/accuracies",
                     "rewards/margins")),
    Panel("KL", ("actor/reward_kl_penalty", "actor/kl_loss", "actor/ppo_kl",
                 "val/log_ratio_to_ref")),
    Panel("losses", ("actor/pg_loss", "critic/vf_loss", "actor/dpo_loss")),
    Panel("response length (tokens)", ("response_length/mean", "val/response_length/mean")),
    Panel("stage seconds", prefix="timing_s/"),
    Panel("held-out", ("val/score/mean", "val/accuracy", "val/rewards/accuracies",
                       "val/diversity/distinct_1", "val/diversity/distinct_2",
                       "val/diversity/repetition_2")),
)
"""The figure, left to right, top to bottom."""

_STYLES = ("-", "--", ":", "-.")


@dataclass(frozen=True, slots=True)
class RunCurves:
    """The (step, value) series of one run dir."""

    name: str
    series: dict[str, tuple[list[int], list[float]]]


def load_run(run_dir: Path, name: str | None = None) -> RunCurves:
    """Read `run_dir/metrics.jsonl`; a half-written last line (a live run) is skipped."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        where = "does not exist" if not run_dir.exists() else "has no metrics.jsonl"
        raise UsageError(f"`{run_dir}` {where}: give a run dir (`trainer.run_dir` of "
                             "a `flowgraph run`)")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    series: dict[str, tuple[list[int], list[float]]] = {}
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines):
                break
            raise UsageError(f"{path}:{i}: not a JSON object: {exc.msg}") from exc
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float, str)):
                steps, values = series.setdefault(key, ([], []))
                steps.append(int(row["step"]))
                values.append(_number(value))
    if not series:
        raise UsageError(f"{path} holds no step rows yet")
    return RunCurves(name or run_dir.name, series)


def _number(value: float | str) -> float:
    try:
        return float(value)  # "nan" and "inf" are how metrics.jsonl writes non-finite values
    except ValueError:
        return math.nan


def figure(run_dirs: Sequence[Path]) -> Figure:
    """The panels for these runs, one figure (not yet rendered)."""
    from matplotlib.figure import Figure

    if not run_dirs:
        raise UsageError("plot needs at least one RUN_DIR")
    runs = [load_run(d, name) for d, name in zip(run_dirs, _names(run_dirs), strict=True)]
    fig = Figure(figsize=(16, 9), layout="constrained")
    axes = fig.subplots(2, 3).flatten()
    for ax, panel in zip(axes, PANELS, strict=True):
        _draw(ax, panel, runs)
    fig.suptitle(" vs ".join(r.name for r in runs))
    return fig


def plot_runs(run_dirs: Sequence[Path], output: Path) -> Path:
    """Draw the panels for these runs into `output` (PNG, SVG or PDF, by suffix)."""
    fig = figure(run_dirs)
    try:
        fig.savefig(output, dpi=110)
    except (OSError, ValueError) as exc:
        raise FlowgraphError(f"cannot write `{output}`: {exc}") from exc
    return output


def _names(run_dirs: Sequence[Path]) -> list[str]:
    """Dir names, or whole paths where two runs share a name (runs/a/run, runs/b/run)."""
    short = [d.name for d in run_dirs]
    return [d.name if short.count(d.name) == 1 else str(d) for d in run_dirs]


def _draw(ax: Axes, panel: Panel, runs: list[RunCurves]) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    names = set().union(*(r.series for r in runs))
    keys = panel.metrics(names)
    if not keys:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes,
                color="grey")
        return
    for r, run in enumerate(runs):
        for k, key in enumerate(keys):
            if key not in run.series:
                continue
            steps, values = run.series[key]
            colour = f"C{k % 10}" if len(runs) == 1 else f"C{r % 10}"
            style = "-" if len(runs) == 1 else _STYLES[k % len(_STYLES)]
            short = key.removeprefix(panel.prefix) if panel.prefix else key
            label = short if len(runs) == 1 else f"{run.name} · {short}"
            marker = "o" if key.startswith("val/") or len(steps) == 1 else None
            ax.plot(steps, values, style, color=colour, marker=marker, markersize=4,
                    linewidth=1.3, label=label)
    ax.legend(fontsize="small")
