"""The Python API, what the CLI calls: `compile`, `run`, `check`, `debug`, `export`.

    import flowgraph
    plan = flowgraph.compile(graph, target="ray", nproc=2)   # a Graph, a file or a path
    result = flowgraph.run(plan)                             # or run(graph, target=...)
    result.run_dir, result.rows[-1]["critic/score/mean"]
    print(flowgraph.check(graph))                            # diagnostics, every edge's shape
    flowgraph.debug(graph).run_until("reward")               # one batch, node by node
    flowgraph.export(result.run_dir, model="actor", out="actor-hf")

`compile` raises `CompileError` (its `diagnostics` are what `flowgraph check` prints)
instead of returning a plan with errors; `run` runs a plan as it is, or compiles a
graph first, and returns the run's folder and metric rows (`flowgraph.compilers.Run`);
stopped by SIGTERM it raises `Stopped`, by Ctrl-C a `KeyboardInterrupt` that says the same.
Messages raised here name these functions' arguments, not the command line's flags
(`flowgraph.spelling`). With the CLI, this module
is an entry point: the layer above the executors, the only one that starts them
(`tests/test_boundaries.py`).
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from flowgraph.document import parse_override, plain
from flowgraph.errors import (
    DEBUG_ENV,
    CompileError,
    FlowgraphError,
    GraphError,
    PlanError,
    PlanFileError,
    Stopped,
    UsageError,
)
from flowgraph.ir import Graph, TrainerSpec
from flowgraph.plan import MAX_PLAN_BYTES, ExecutionPlan, plan_from_json, verify_kinds
from flowgraph.registry import KindSpec, Registry
from flowgraph.spelling import Word, command, inherited, option, python_entry

if TYPE_CHECKING:
    from flowgraph.checker import CheckResult
    from flowgraph.compilers import Run
    from flowgraph.compilers.debug import Debugger
    from flowgraph.diagnostics import Diagnostic


def compile(graph: Graph | str | Path, *, target: str = "local", nproc: int | None = None,
            overrides: Sequence[str] = (), device: str | None = None,
            disable: Sequence[str] = ()) -> ExecutionPlan:
    """Lower a graph (built in Python, or a graph file with `overrides`) to the plan that
    `run` executes on `target` (`local`, `fsdp`, `ray`) with `nproc` data-parallel
    workers (default `resources.nproc`), without the passes named in `disable`."""
    from flowgraph.passes import PassPipeline, compile_graph

    with python_entry():
        result = compile_graph(graph, target=target, nproc=nproc, overrides=overrides,
                               device=device, pipeline=PassPipeline.default(disabled=disable))
    if result.plan is None:
        raise CompileError(result.diagnostics)
    return result.plan


def check(graph: Graph | str | Path, *, overrides: Sequence[str] = (),
          nproc: int | None = None, target: str | None = None, data: bool = False
          ) -> CheckResult:
    """What `flowgraph check` says of a graph (a Graph, or a graph file with `overrides`)
    for `nproc` data-parallel workers: every diagnostic, and every edge with its bound
    shape (print the result, or show it in a notebook; `CheckResult.edge_lines`).
    `data`: also open the local datasets and model folders (imports torch). A file that
    cannot be read into a graph raises `GraphError` with its diagnostics."""
    from flowgraph.checker import check_graph
    from flowgraph.frontend import load_graph, no_overrides_for_a_built_graph

    with python_entry():
        no_overrides_for_a_built_graph(graph, overrides)
        loaded: list[Diagnostic] = []
        if not isinstance(graph, Graph):
            built, loaded = load_graph(graph, overrides)
            if built is None:
                raise GraphError(tuple(loaded))
            graph = built
        result = check_graph(graph, dp=nproc, target=target)
        found = [*loaded, *result.diagnostics]
        if data and result.ok and not any(d.is_error for d in loaded):
            from flowgraph.checker.data import check_data
            from flowgraph.nodes.models import load_tokenizer  # imports torch

            found += check_data(graph, load_tokenizer)
        return replace(result, diagnostics=tuple(found))


def debug(graph: Graph | str | Path, *, overrides: Sequence[str] = (),
          device: str | None = None, out: TextIO | None = None) -> Debugger:
    """A handle that runs nodes of `graph` on one batch at a time, on the local target
    (`flowgraph.compilers.debug.Debugger`): `run_until("reward")` draws a batch and runs
    `reward` and what it reads from, returning every node's outputs;
    `run_node("reward", inputs={...})` runs one node again with inputs of your own.
    Compiled now (errors raise `CompileError`); models load at the first call."""
    from flowgraph.compilers.debug import DEBUG_PASSES_OFF, Debugger

    plan = compile(graph, overrides=overrides, device=device, disable=DEBUG_PASSES_OFF)
    return Debugger(plan, out)


def export(run_dir: str | Path, *, model: str, out: str | Path, step: int | None = None,
           force: bool = False, adapter_only: bool = False) -> Path:
    """Write model `model` of the run in `run_dir`, from its newest (or `step`'s)
    checkpoint, to `out` as a Hugging Face folder (`from_pretrained(out)` loads it) with
    a model card, `README.md`: the graph, its data, the metrics at that step, how to load
    it. `force`: write into a folder that is not empty; `adapter_only`: a LoRA model's
    adapter alone. What `flowgraph export` does."""
    from flowgraph.compilers.export import export_model

    with python_entry():
        return export_model(Path(run_dir), model, Path(out), step=step, force=force,
                            adapter_only=adapter_only)


def load_plan(path: str | Path) -> ExecutionPlan:
    """A plan file (`flowgraph compile -o plan.json`), checked by the plan verifier. A file
    that cannot be read as a plan (missing, over `MAX_PLAN_BYTES`, not UTF-8, not JSON,
    nested too deeply, another format version), or whose Python objects this process
    cannot rebuild (`flowgraph.objects`), is one `PlanFileError` naming it."""
    file = Path(path)
    try:
        if file.stat().st_size > MAX_PLAN_BYTES:  # before reading it all into memory
            raise PlanFileError(f"the plan `{path}` is larger than {MAX_PLAN_BYTES >> 20} MiB")
        text = file.read_bytes().decode("utf-8")
    except OSError as exc:
        raise PlanFileError(f"cannot read the plan `{path}`: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise PlanFileError(f"the plan `{path}` is not UTF-8 text (byte {exc.start}: "
                            f"{exc.object[exc.start:exc.start + 1]!r}); write it as "
                            "`flowgraph compile -o` does") from exc
    try:
        plan = plan_from_json(text)
    except PlanFileError as exc:
        raise PlanFileError(f"`{path}`: {exc}") from exc
    missing = plan.unresolved()  # a plan file holds references to Python objects, no code
    if missing:
        raise PlanFileError(f"`{path}`: {missing}")
    verify_kinds(plan, _kinds(plan))
    return plan


PLAN_RUN_SETTINGS = {"run_dir": (str, "a folder"), "steps": (int, "a whole number")}
"""The `trainer.` settings a run of a compiled plan may override, with their type: where
it writes and how long it trains. Nothing the plan was compiled from depends on them;
every other setting may (dims, params, models, the loop's schedule), so the graph is
compiled again with it."""


def with_run_settings(plan: ExecutionPlan, overrides: Sequence[str]) -> ExecutionPlan:
    """`plan` with the `trainer.run_dir=` and `trainer.steps=` overrides applied; any other
    override is a `UsageError` naming it (it would change the plan)."""
    trainer, refused = plan.trainer, []
    for i, text in enumerate(overrides):
        parsed = parse_override(text, i)
        if not isinstance(parsed, tuple):
            raise UsageError(parsed.message)
        path, node = parsed
        name = path[1] if len(path) == 2 and path[0] == "trainer" else ""
        if name not in PLAN_RUN_SETTINGS:
            refused.append(text)
            continue
        value, (want, words) = plain(node), PLAN_RUN_SETTINGS[name]
        if type(value) is not want:  # bool is an int: a type check, not isinstance
            raise UsageError(f"override `{text}`: trainer.{name} takes {words}")
        setting: dict[str, Any] = {name: value}
        try:
            trainer = replace(trainer, **setting)
        except FlowgraphError as exc:  # the setting's bounds: `trainer.steps is -1; ...`
            raise UsageError(f"override `{text}`: {exc}") from exc
    if refused:
        raise UsageError(
            f"a compiled plan runs as it is: {', '.join(refused)} would change what it runs "
            f"(it takes only {', '.join(f'trainer.{k}' for k in PLAN_RUN_SETTINGS)}); "
            "compile the graph again with them "
            f"(`{command('compile', Word('GRAPH'), [('overrides', [Word('KEY=VALUE')])])}`), "
            "or edit the plan")
    if trainer is plan.trainer:
        return plan
    return plan.with_trainer(trainer)


def _kinds(plan: ExecutionPlan) -> dict[str, KindSpec]:
    """Each node's and data source's kind, from the registry after the graph's plugins
    are imported."""
    registry = Registry.default()
    registry.load_plugins([p.module for p in plan.plugins], plan.plugin_paths)
    kinds = {}
    for n in plan.nodes:
        kind = registry.get(n.kind)
        if kind is None:
            raise FlowgraphError(f"node `{n.name}`: kind `{n.kind}` is not registered (a "
                                 "plugin the graph lists under `plugins:` declares it?)")
        kinds[n.name] = kind
    return kinds


def not_in_a_worker(caller: dict[str, Any], call: str) -> None:
    """Refuse `call` made by a script that a worker process of a run (an fsdp rank, the
    rollout producer) imports again as it starts: the run would start again inside it."""
    if caller.get("__name__") == "__mp_main__":
        raise UsageError(f"{call} was called again as a worker process of the run "
                         "imported your script: start the run under "
                         "`if __name__ == \"__main__\":` (Python's rule for scripts that "
                         "start processes)")


def run(plan: ExecutionPlan | Graph | str | Path, *, target: str | None = None,
        nproc: int | None = None, overrides: Sequence[str] = (), disable: Sequence[str] = (),
        run_dir: str | Path | None = None, debug: bool = False, **options: Any) -> Run:
    """Run a plan as it is, or compile a graph (or graph file) for `target` (default
    `local`) first; a `.json` path is a plan file. `run_dir` is where it writes (default
    its `trainer.run_dir`; where that was left at its default and the run does not
    resume, a fresh dated folder, `runs/<graph>-YYYYmmdd-HHMMSS`, so that running a cell
    again starts a new run). `debug`: a node's error carries its full traceback.
    `options` are the fields of `flowgraph.compilers.RunOptions` (`resume`, `overwrite`,
    `allow_changed`, `strict`, `out`, `tensorboard`, `metrics_port`, `address`...).

    Interrupted (Ctrl-C, a notebook's interrupt, SIGTERM) it stops at the next node, saves
    a checkpoint and raises `Stopped` (its `run_dir`, and the call that continues the run
    in its message: `flowgraph.run(..., resume=True)`); for Ctrl-C, a KeyboardInterrupt
    with the same message, `run_dir` and `signum`."""
    from flowgraph.compilers import RunOptions

    not_in_a_worker(sys._getframe(1).f_globals, "flowgraph.run")
    with python_entry():
        _known_options(options)
        options.setdefault("called_with", _called_with(plan))
        if isinstance(plan, (str, Path)) and str(plan).endswith(".json"):
            options.setdefault("plan_file", Path(plan))
            plan = load_plan(plan)
        if not isinstance(plan, ExecutionPlan):
            graph = plan
            plan = compile(plan, target=target or "local", nproc=nproc, overrides=overrides,
                           disable=disable)
            options.setdefault("disabled", tuple(disable))
            _columns_before_models(graph, overrides)
        elif disable or nproc is not None or target not in (None, plan.target):
            raise UsageError(
                f"a plan runs as compiled (target {plan.target}, {plan.nproc} per pool): edit "
                "the plan, or compile the graph again with other "
                f"{option('target', Word('...'))}, {option('nproc', Word('...'))} or "
                f"{option('disable', Word('[...]'))}")
        else:
            plan = with_run_settings(plan, overrides)
        plan = _with_run_dir(plan, run_dir,
                             fresh=not (options.get("resume") or plan.trainer.resume))
        missing = plan.unresolved()  # before anything starts: the run would need them
        if missing:
            raise PlanError(missing)
        if "allow_changed" in options:  # a list is welcome here; the options are frozen
            options["allow_changed"] = tuple(options["allow_changed"])
        opts = RunOptions(overrides=tuple(overrides), **options)
        with _debugging(debug):
            return _run(plan, opts)


def _columns_before_models(graph: Graph | str | Path, overrides: Sequence[str]) -> None:
    """A reward function that needs a column its dataset lacks (FG512, as `check(data=
    True)` reports it) stops the run here, before the models load, not at the first batch."""
    from flowgraph.checker.data import unmet_columns
    from flowgraph.frontend import load_graph

    built = graph if isinstance(graph, Graph) else load_graph(graph, overrides)[0]
    unmet = [d for d in unmet_columns(built) if d.is_error] if built is not None else []
    if unmet:
        raise CompileError(tuple(unmet))


def _known_options(options: dict[str, Any]) -> None:
    """A `UsageError` for a keyword `run` does not take, with the closest one and, for a
    TRL name (`report_to`), the setting that does it here — never a `TypeError`."""
    from dataclasses import fields

    from flowgraph.compilers import RunOptions
    from flowgraph.document import did_you_mean
    from flowgraph.trl_names import trl_hint

    known = sorted({"target", "nproc", "overrides", "disable", "run_dir", "debug"}
                   | {f.name for f in fields(RunOptions)})
    for name in options:
        if name not in known:
            raise UsageError(f"flowgraph.run takes no argument `{name}`: "
                             f"{trl_hint(name) or did_you_mean(name, known)}")


def _run(plan: ExecutionPlan, opts: Any) -> Run:
    """`flowgraph.compilers.run`; a stop or a failure (a node's, a rank's, a worker's)
    raised without flowgraph's frames and their chain — its message says all: the node,
    step and your line, and where the full traceback was written (`debug=True` keeps
    them) — and a KeyboardInterrupt outside the run's own handling (while it starts or
    ends) as the stop it would have been."""
    import signal

    from flowgraph.compilers import run as run_plan
    from flowgraph.compilers.signals import stopped

    try:
        return run_plan(plan, opts)
    except Stopped as exc:
        raise _as_raised(exc) from None
    except FlowgraphError as exc:
        if os.environ.get(DEBUG_ENV):
            raise
        raise exc.with_traceback(None) from None
    except KeyboardInterrupt:
        raise _as_raised(stopped(
            plan, opts, signal.SIGINT, at_once=True,
            how="interrupted (KeyboardInterrupt) while the run started or ended")) from None


def _as_raised(stop: Stopped) -> BaseException:
    """A stop as `flowgraph.run` raises it: SIGTERM's as `Stopped`; Ctrl-C's as a
    KeyboardInterrupt, so that a script's `except Exception:` (a sweep) does not carry on
    past the user's Ctrl-C and its `except KeyboardInterrupt:` handlers run. The type
    itself, not a subclass: CPython ends a script with Ctrl-C's status (130) only for an
    uncaught KeyboardInterrupt proper. It carries `Stopped`'s message, `run_dir` and
    `signum`, and shows in IPython as its message alone."""
    import signal

    if stop.signum != signal.SIGINT:
        return stop.with_traceback(None)
    interrupt = KeyboardInterrupt(str(stop))
    shown = [f"KeyboardInterrupt: {line}" if i == 0 else line
             for i, line in enumerate(str(stop).splitlines())]
    for name, value in (("signum", stop.signum), ("run_dir", stop.run_dir),
                        ("_render_traceback_", lambda: shown)):
        setattr(interrupt, name, value)  # attributes a KeyboardInterrupt does not declare
    return interrupt


def _called_with(plan: Any) -> str:
    """What the call that resumes a run names as its first argument."""
    if isinstance(plan, (str, Path)):
        return str(plan)
    return Word("plan" if isinstance(plan, ExecutionPlan) else "graph")


DATED = "runs/{name}-%Y%m%d-%H%M%S"
"""The run dir of a run from Python that names none (`trainer.run_dir` left at default)."""


def _with_run_dir(plan: ExecutionPlan, run_dir: str | Path | None, *, fresh: bool
                  ) -> ExecutionPlan:
    """`plan` writing to `run_dir`; with none, to a new dated folder where the plan's
    is the default one and the run starts `fresh`."""
    default = TrainerSpec.__dataclass_fields__["run_dir"].default
    if run_dir is None and (not fresh or plan.trainer.run_dir != default):
        return plan
    if run_dir is None:
        stamp = time.strftime(DATED.format(name=plan.name))
        run_dir = next(d for i in itertools.count(1)
                       if not Path(d := stamp if i == 1 else f"{stamp}-{i}").exists())
    return plan.with_trainer(replace(plan.trainer, run_dir=str(run_dir)))


def _debugging(debug: bool) -> AbstractContextManager[None]:
    """`debug`: a node's error carries its full traceback, in every process of the run."""
    return inherited(DEBUG_ENV, "1") if debug else nullcontext()
