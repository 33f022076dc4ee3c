"""The `flowgraph` command: small subcommands over typed options.

    flowgraph check FILE... [--format text|json|github] [--nproc N] [--data]
    flowgraph compile FILE --target local|fsdp|ray [--nproc N] [-o plan.json]
    flowgraph run FILE [KEY=VALUE...] [--resume [--allow-changed KEY] | --overwrite] [--strict]
                  [--metrics-port PORT]
    flowgraph run PLAN.json [trainer.run_dir=DIR] [trainer.steps=N]
    flowgraph plot RUN_DIR [RUN_DIR...] [-o curves.png]
    flowgraph env [--target local|fsdp|ray] [--gpu]
    flowgraph export RUN_DIR --model NAME -o DIR [--adapter-only]
    flowgraph viz FILE|PLAN.json -o out.mmd|out.dot|out.svg
    flowgraph schema [-o FILE] [--plugin MODULE]

Exit codes: 0 success (warnings allowed); 1 failure: a graph or plan with errors, a run
that failed, a target or tool that is not ready; 2 usage (a wrong command line, an
override a plan cannot take) or an input file that cannot be read (`UsageError`,
`GraphFileError`, `PlanFileError`); 130 interrupted. No input file can make it print a
Python traceback. Modules behind each subcommand are imported only when it runs, so
`check` starts fast and never imports torch for graphs made of built-in kinds.

One module past ~450 lines, on purpose: the command's one parser and its subcommands'
small handlers.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO, cast

from flowgraph.choices import TARGETS
from flowgraph.compilers.options import RDZV_TIMEOUT_S
from flowgraph.diagnostics import Diagnostic
from flowgraph.errors import (
    FlowgraphError,
    GraphFileError,
    PlanFileError,
    Stopped,
    UsageError,
)
from flowgraph.ir import ParamValue, to_python
from flowgraph.plan import plan_summary, plan_to_json

if TYPE_CHECKING:
    from flowgraph.plan import ExecutionPlan
    from flowgraph.registry import KindSpec, Registry

EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        sys.stderr.write(f"flowgraph: error: {message}\n")
        raise SystemExit(EXIT_USAGE)


def _lines_of(cache: dict[str, list[str] | None]) -> Callable[[str], list[str] | None]:
    def read(file: str) -> list[str] | None:
        if file not in cache:
            try:
                cache[file] = Path(file).read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError):
                cache[file] = None
        return cache[file]

    return read


def _use_color(stream: TextIO) -> bool:
    return stream.isatty() and "NO_COLOR" not in os.environ


def _unreadable(diags: Sequence[Diagnostic]) -> bool:
    return any(d.code in ("FG001", "FG008") for d in diags)


# --- check ---------------------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> int:
    from flowgraph.checker import check_graph
    from flowgraph.diagnostics import render_github, render_json
    from flowgraph.frontend import load_graph

    files, overrides = split_overrides(args.files)
    if not files:
        raise UsageError("check needs at least one graph FILE")
    all_diags: list[Diagnostic] = []
    status = EXIT_OK
    for file in files:
        graph, diags = load_graph(file, overrides)
        if graph is not None:
            diags += list(check_graph(graph, dp=args.nproc, target=args.target).diagnostics)
        if graph is not None and args.data and not any(d.is_error for d in diags):
            from flowgraph.checker.data import check_data  # pyarrow: only with --data
            from flowgraph.nodes.models import load_tokenizer  # torch

            diags += check_data(graph, load_tokenizer)
        all_diags += diags
        if graph is None and _unreadable(diags):
            status = max(status, EXIT_USAGE)
        elif any(d.is_error for d in diags):
            status = max(status, EXIT_ERRORS)
    out = sys.stdout
    if args.format == "json":
        print(render_json(all_diags), file=out)
    elif args.format == "github":
        if all_diags:
            print(render_github(all_diags), file=out)
    else:
        _print_text(all_diags, files, out)
    return status


def split_overrides(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """Positional `key=value` words are overrides, the rest are files."""
    files = [a for a in args if "=" not in a or Path(a).exists()]
    return files, [a for a in args if a not in files]


def _print_text(diags: list[Diagnostic], files: list[str], out: TextIO) -> None:
    from flowgraph.diagnostics import render_text

    if diags:
        print(render_text(diags, _lines_of({}), color=_use_color(out)), file=out)
    errors = sum(d.is_error for d in diags)
    warnings = sum(d.severity == "warning" for d in diags)
    verdict = "ok" if not errors else "failed"
    print(f"{verdict}: {len(files)} file(s), {errors} error(s), {warnings} warning(s)", file=out)


# --- compile -------------------------------------------------------------------------


def cmd_compile(args: argparse.Namespace) -> int:
    from flowgraph.passes import PassPipeline, compile_graph

    pipeline = PassPipeline.default(disabled=tuple(args.disable_pass))
    if args.print_passes:
        print(pipeline.describe())
        return EXIT_OK
    if not args.file:
        raise UsageError("compile needs a graph FILE (or --print-passes)")
    result = compile_graph(args.file, target=args.target, nproc=args.nproc,
                           overrides=args.overrides, pipeline=pipeline,
                           dump_after=tuple(args.dump_after), dump=sys.stderr)
    return _finish_compile(result, args)


def _finish_compile(result: object, args: argparse.Namespace) -> int:
    from flowgraph.diagnostics import render_text
    from flowgraph.passes import CompileResult

    assert isinstance(result, CompileResult)
    if result.diagnostics:
        print(render_text(result.diagnostics, _lines_of({}), color=_use_color(sys.stderr)),
              file=sys.stderr)
    if result.plan is None:
        return EXIT_USAGE if _unreadable(result.diagnostics) else EXIT_ERRORS
    if args.output:
        try:
            Path(args.output).write_text(plan_to_json(result.plan), encoding="utf-8")
        except OSError as exc:
            raise FlowgraphError(f"cannot write `{args.output}`: {exc.strerror or exc}") from exc
    print(plan_summary(result.plan))
    if args.output:
        print(f"plan written to {args.output}")
    return EXIT_OK


# --- run, export ---------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from flowgraph.errors import DEBUG_ENV

    if not args.debug:
        return _run(args)
    os.environ[DEBUG_ENV] = "1"  # every process of the run reads it: fsdp ranks, Ray workers
    try:
        return _run(args)
    finally:
        del os.environ[DEBUG_ENV]


def _run(args: argparse.Namespace) -> int:
    from flowgraph.api import load_plan, with_run_settings
    from flowgraph.compilers import RunOptions, run
    from flowgraph.compilers.targets.fsdp.launch import torchrun_rank

    if args.file.endswith(".json"):  # a plan: run as it is, into another run_dir or longer
        plan = load_plan(args.file)
        given = [f"--{k.replace('_', '-')}" for k in ("target", "nproc")
                 if getattr(args, k) not in (None, getattr(plan, k))]
        if args.disable_pass:
            given.append("--disable-pass")
        if given:
            raise UsageError(
                f"`{args.file}` is a plan compiled for target {plan.target}, nproc "
                f"{plan.nproc}; it runs as it is: drop {', '.join(given)}, or edit the plan, "
                "or run the graph")
        plan = with_run_settings(plan, args.overrides)
        plan_file: Path | None = Path(args.file)
    else:
        compiled = _compile_for_run(args)
        if isinstance(compiled, int):
            return compiled
        plan, plan_file = compiled, None
    run(plan, RunOptions(
        strict=args.strict, resume=args.resume, overwrite=args.overwrite,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host, metrics_hold=args.metrics_hold, address=args.address,
        nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
        rdzv_timeout=args.rdzv_timeout,
        overrides=tuple(args.overrides), plan_file=plan_file,
        allow_changed=tuple(args.allow_changed),
        disabled=() if plan_file else tuple(args.disable_pass)))
    metrics = f"{plan.trainer.run_dir}/metrics.jsonl"
    if (torchrun_rank() or 0) > 0:
        return EXIT_OK  # a rank torchrun started: rank 0 says it
    if args.node_rank > 0:  # rank 0 writes the metrics, on node 0
        print(f"run finished: the ranks of node {args.node_rank} are done; node 0 wrote "
              f"{metrics}")
    else:
        print(f"run finished: {metrics}")
    return EXIT_OK


def _compile_for_run(args: argparse.Namespace) -> ExecutionPlan | int:
    """The graph compiled for the run, or the exit code when it does not compile."""
    from flowgraph.diagnostics import render_text
    from flowgraph.passes import PassPipeline, compile_graph

    target, nproc = args.target or "local", args.nproc
    if target == "fsdp" and nproc is None and "WORLD_SIZE" in os.environ:
        nproc = int(os.environ["WORLD_SIZE"])  # started by torchrun: check for its ranks
    result = compile_graph(args.file, target=target, nproc=nproc, overrides=args.overrides,
                           pipeline=PassPipeline.default(disabled=tuple(args.disable_pass)),
                           dump=sys.stderr)
    if result.diagnostics:
        print(render_text(result.diagnostics, _lines_of({}), color=_use_color(sys.stderr)),
              file=sys.stderr)
    if result.plan is None:
        return EXIT_USAGE if _unreadable(result.diagnostics) else EXIT_ERRORS
    from flowgraph.checker.data import unmet_columns  # before the models load (FG512)

    assert result.program is not None
    unmet = [d for d in unmet_columns(result.program.graph) if d.is_error]
    if unmet:
        print(render_text(unmet, _lines_of({}), color=_use_color(sys.stderr)), file=sys.stderr)
        return EXIT_ERRORS
    return result.plan


def cmd_export(args: argparse.Namespace) -> int:
    from flowgraph.compilers.export import export_model

    out = export_model(Path(args.run_dir), args.model, Path(args.output), step=args.step,
                       force=args.force, adapter_only=args.adapter_only)
    what = "the LoRA adapter of " if args.adapter_only else ""
    print(f"exported {what}`{args.model}` to {out}")
    return EXIT_OK


# --- plot, env -----------------------------------------------------------------------


def cmd_plot(args: argparse.Namespace) -> int:
    from flowgraph.plot import plot_runs

    out = plot_runs([Path(d) for d in args.run_dirs], Path(args.output))
    print(f"curves of {len(args.run_dirs)} run(s) written to {out}")
    return EXIT_OK


def cmd_env(args: argparse.Namespace) -> int:
    from flowgraph.environment import check_environment

    checks = check_environment(args.target, gpu=args.gpu)
    for check in checks:
        print(check.line())
    missing = [c.name for c in checks if c.status == "missing"]
    if missing:
        print(f"not ready for --target {args.target}: {', '.join(missing)}")
        return EXIT_ERRORS
    print(f"ready for --target {args.target}")
    return EXIT_OK


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"`{text}` is not a port number (0-65535)")
    return port


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"`{text}` is not a number of seconds (> 0)")
    return value


# --- viz, schema ---------------------------------------------------------------------


def cmd_viz(args: argparse.Namespace) -> int:
    from flowgraph.viz import write_viz

    return write_viz(args.file, args.output, overrides=args.overrides, fmt=args.format)


def cmd_schema(args: argparse.Namespace) -> int:
    from flowgraph.registry import Registry
    from flowgraph.schema import schema_json

    registry = Registry.default()
    _load_plugins(registry, args.plugin)
    text = schema_json(registry)
    if not args.output:
        sys.stdout.write(text)
        return EXIT_OK
    try:
        Path(args.output).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise FlowgraphError(f"cannot write `{args.output}`: {exc.strerror or exc}") from exc
    print(f"schema written to {args.output}")
    return EXIT_OK


def cmd_kinds(args: argparse.Namespace) -> int:
    from flowgraph.frontend import SECTIONS
    from flowgraph.registry import Registry

    registry = Registry.default()
    _load_plugins(registry, args.plugin)
    if args.name is None:
        sys.stdout.write(_kinds_table(registry))
        return EXIT_OK
    kind = registry.get(args.name)
    if kind is None and args.name in SECTIONS:
        sys.stdout.write(_describe_section(args.name, SECTIONS[args.name]))
        return EXIT_OK
    if kind is None:
        close = difflib.get_close_matches(args.name, [*registry.names(), *SECTIONS], n=3)
        hint = f"; did you mean {', '.join(f'`{c}`' for c in close)}?" if close else ""
        raise UsageError(f"no kind `{args.name}`{hint} (`flowgraph kinds` lists them; "
                             "--plugin MODULE for a plugin's)")
    sys.stdout.write(_describe_kind(kind))
    return EXIT_OK


def _load_plugins(registry: Registry, modules: list[str]) -> None:
    """The `--plugin` modules: one that cannot be imported is a wrong argument (exit 2)."""
    from flowgraph.errors import PluginError

    try:
        registry.load_plugins(modules, ["."])
    except PluginError as exc:
        raise UsageError(str(exc)) from exc


def _kinds_table(registry: Registry) -> str:
    """Every kind the registry knows, by category, with its one-line doc."""
    from flowgraph.frontend import SECTIONS

    kinds = [k for k in (registry.get(n) for n in registry.names()) if k is not None]
    width = max(len(k.name) for k in kinds)
    lines = []
    for category in sorted({k.category for k in kinds}):
        lines.append(f"{category}:")
        lines += [f"  {k.name:<{width}}  {k.doc}" for k in kinds if k.category == category]
    lines.append("`flowgraph kinds KIND`: its ports and params; `flowgraph kinds SECTION` ("
                 f"{', '.join(SECTIONS)}): a graph-file section's settings.")
    return "\n".join(lines) + "\n"


def _describe_kind(kind: KindSpec) -> str:
    """A kind's contract: ports with dims and dtype, params with type, default, meaning."""
    from flowgraph.registry import loss_names, loss_spec

    lines = [f"{kind.name} ({kind.category}): {kind.doc}",
             f"  model: {kind.model}" + (f", head {kind.head}" if kind.model != "none" else "")
             + (", trains it" if kind.trains else "")]
    for title, ports in (("inputs", kind.inputs), ("outputs", kind.outputs)):
        terms = kind.terms if title == "inputs" else None
        if ports or terms is not None:
            lines.append(f"{title}:")
        lines += [f"  {p.name:<22} {p.spec.describe()}"
                  + (" (optional)" if p.optional else "") + (f"  {p.doc}" if p.doc else "")
                  for p in ports]
        if terms is not None:
            lines.append(f"  {'<any name>':<22} {terms.spec.describe()}  {terms.doc}")
    if kind.params:
        lines.append("params:")
        for p in kind.params:
            value = "required" if p.required else f"default {json.dumps(to_python(p.default))}"
            choices = f" one of {', '.join(p.choices)};" if p.choices else ""
            lines.append(f"  {p.name:<22} {'|'.join(p.types)}, {value};{choices} {p.doc}")
            if p.names == "policy_loss":
                for name in loss_names():
                    spec = loss_spec(name)
                    assert spec is not None
                    own = ", ".join(f"{q.name}={json.dumps(to_python(q.default))}"
                                    for q in spec.params)
                    lines.append(f"      {name:<10} {spec.doc}" + (f" [{own}]" if own else ""))
    return "\n".join(lines) + "\n"


def _describe_section(name: str, record: type) -> str:
    """A graph-file section's settings, each with its type, default, choices, bounds and
    meaning: their declarations (`flowgraph.settings`), as the schema has them."""
    from flowgraph.settings import declared, written_types

    doc = (record.__doc__ or "").split("\n\n")[0].replace("\n    ", " ").strip()
    lines = [f"{name}: {doc}"]
    written = written_types(record)
    for f, s in declared(record):
        types = "|".join(_WORDS[t] for t in written[f.name])
        default = cast(ParamValue, {} if written[f.name] == (dict,) and f.default == ()
                       else f.default)  # an empty mapping is written `{}`, not `[]`
        value = ("required" if f.default is dataclasses.MISSING
                 else f"default {json.dumps(to_python(default))}")
        facts = [f" one of {', '.join(s.choices)};"] if s.choices else []
        facts += [f" {op} {bound};" for op, bound in
                  ((">=", s.minimum), (">", s.above), ("<", s.below)) if bound is not None]
        lines.append(f"  {f.name:<22} {types}, {value};{''.join(facts)} {s.doc}")
    return "\n".join(lines) + "\n"


_WORDS = {int: "int", float: "float", str: "str", bool: "bool", dict: "mapping", list: "list",
          type(None): "null"}
"""A setting's value types in the words `flowgraph kinds` uses for params."""


# --- parser --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="flowgraph", description="Dataflow-graph compiler for RL post-training.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    c = sub.add_parser("check", help="check graph files: contracts, batch arithmetic")
    c.add_argument("files", nargs="+", metavar="FILE [KEY=VALUE]",
                   help="graph files, then overrides such as trainer.steps=20")
    c.add_argument("--format", choices=("text", "json", "github"), default="text")
    c.add_argument("--nproc", type=int, default=None, help="data-parallel size to check for")
    c.add_argument("--target", choices=TARGETS, default=None,
                   help="the target to check for (as `run --target`: ray takes a graph's "
                        "pools as declared)")
    c.add_argument("--data", action="store_true",
                   help="also open the local datasets and model folders: columns, ground "
                        "truth, lengths against P and T, vocabularies (imports torch)")
    c.set_defaults(func=cmd_check)

    k = sub.add_parser("compile", help="run the pass pipeline and write an execution plan")
    k.add_argument("file", nargs="?", metavar="FILE")
    k.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    k.add_argument("--target", choices=TARGETS, default="local")
    k.add_argument("--nproc", type=int, default=None)
    k.add_argument("-o", "--output", metavar="PLAN.json")
    k.add_argument("--print-passes", action="store_true", help="list the passes and exit")
    k.add_argument("--disable-pass", action="append", default=[], metavar="NAME")
    k.add_argument("--dump-after", action="append", default=[], metavar="NAME",
                   help="print the graph (YAML) after this pass")
    k.set_defaults(func=cmd_compile)

    r = sub.add_parser("run", help="train: run a graph, or a compiled plan.json as it is")
    r.add_argument("file", metavar="FILE", help="a graph file, or a plan (PLAN.json) that "
                   "`flowgraph compile -o` wrote: its target, pools and stages as they are")
    r.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="overrides of the graph; a plan takes trainer.run_dir and "
                        "trainer.steps only")
    r.add_argument("--target", choices=TARGETS, default=None,
                   help="default: local (a plan: its own)")
    r.add_argument("--nproc", type=int, default=None,
                   help="fsdp: processes in all (split over --nnodes); ray: workers per "
                        "pool (default: resources.nproc)")
    r.add_argument("--disable-pass", action="append", default=[], metavar="NAME",
                   help="compile a graph file without this pass (`compile --print-passes`)")
    r.add_argument("--nnodes", type=int, default=1, help="fsdp: machines taking part")
    r.add_argument("--node-rank", type=int, default=0, help="fsdp: this machine's rank")
    r.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="fsdp: rendezvous of a multi-machine run (node 0's address)")
    r.add_argument("--rdzv-timeout", type=_seconds, default=RDZV_TIMEOUT_S, metavar="SECONDS",
                   help="fsdp: how long the machines may take to meet at --rdzv-endpoint (a "
                        "line every 10 s while waiting) before the run stops naming those "
                        f"missing (default {RDZV_TIMEOUT_S:g})")
    r.add_argument("--address", default=None,
                   help="ray: join this cluster (default: start a local one)")
    r.add_argument("--resume", action="store_true",
                   help="continue from the run dir's latest checkpoint")
    r.add_argument("--overwrite", action="store_true",
                   help="start afresh in a run dir that holds an earlier run (its files are "
                        "removed; only a flowgraph run dir's)")
    r.add_argument("--allow-changed", action="append", default=[], metavar="KEY",
                   help="with --resume: let setting KEY (dims.Bp, "
                        "models.actor.optimizer.lr, ...) differ from the checkpoint's; "
                        "repeat for several")
    r.add_argument("--strict", action="store_true",
                   help="check every tensor on every edge at every step, not just the first")
    r.add_argument("--debug", action="store_true",
                   help="a node's error shows its full traceback (always written to "
                        "RUN_DIR/traceback.txt)")
    r.add_argument("--metrics-port", type=_port, default=None, metavar="PORT",
                   help="serve Prometheus metrics on this port (0: a free one; default: "
                        "trainer.metrics_port, else none)")
    r.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="address to serve them on (default 127.0.0.1; 0.0.0.0: every "
                        "interface)")
    r.add_argument("--metrics-hold", type=float, default=0.0, metavar="SECONDS",
                   help="keep serving this long after the run, so a scraper reads the final "
                        "values (Ctrl-C ends it)")
    r.set_defaults(func=cmd_run)

    e = sub.add_parser("export", help="save a trained model as a Hugging Face model folder")
    e.add_argument("run_dir", metavar="RUN_DIR")
    e.add_argument("--model", required=True, help="the model's name in the graph")
    e.add_argument("-o", "--output", required=True, metavar="DIR")
    e.add_argument("--step", type=int, default=None, help="default: the latest checkpoint")
    e.add_argument("--force", action="store_true",
                   help="write into DIR even when it is not empty (its files are replaced)")
    e.add_argument("--adapter-only", action="store_true",
                   help="a LoRA model: write its adapter alone (peft's adapter_config.json "
                        "and adapter_model.safetensors) instead of the merged weights")
    e.set_defaults(func=cmd_export)

    v = sub.add_parser("viz", help="draw a graph or a compiled plan: Mermaid, Graphviz DOT "
                                    "or SVG")
    v.add_argument("file", metavar="FILE", help="a graph file, or a plan (PLAN.json)")
    v.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    v.add_argument("-o", "--output", required=True, metavar="OUT.{mmd,dot,svg}")
    v.add_argument("--format", choices=("mmd", "dot", "svg"), default=None,
                   help="default: from the output's extension")
    v.set_defaults(func=cmd_viz)

    pl = sub.add_parser("plot", help="draw learning curves of runs (one figure, overlaid)")
    pl.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    pl.add_argument("-o", "--output", default="curves.png", metavar="OUT.{png,svg,pdf}",
                    help="default: curves.png")
    pl.set_defaults(func=cmd_plot)

    en = sub.add_parser("env", help="check the installed packages for a target")
    en.add_argument("--target", choices=TARGETS, default="local")
    en.add_argument("--gpu", action="store_true",
                    help="require a CUDA device (and give GPU install commands)")
    en.set_defaults(func=cmd_env)

    s = sub.add_parser("schema", help="print a JSON Schema for graph files (for editors)")
    s.add_argument("-o", "--output", metavar="SCHEMA.json", help="write it here, not to stdout")
    s.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="also describe the kinds this module declares (repeatable)")
    s.set_defaults(func=cmd_schema)

    kd = sub.add_parser("kinds", help="list the node kinds, or print one's ports and params "
                                             "(or a graph-file section's settings)")
    kd.add_argument("name", nargs="?", metavar="KIND", help="the kind to describe")
    kd.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                    help="also the kinds this module or .py file declares (repeatable)")
    kd.set_defaults(func=cmd_kinds)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from flowgraph.api import not_in_a_worker

    not_in_a_worker(sys._getframe(1).f_globals, "flowgraph.cli.main")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse stops taking positionals after an option; `compile FILE --target ray k=v`
    # and `check FILE --data k=v` still mean k=v is an override (check's files and
    # overrides share one list, which `split_overrides` divides).
    late = [e for e in extra if "=" in e and not e.startswith("-")]
    into = next((name for name in ("overrides", "files") if hasattr(args, name)), None)
    if late and into is not None:
        setattr(args, into, [*getattr(args, into), *late])
        extra = [e for e in extra if e not in late]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "nproc", None) is not None and args.nproc < 1:
        parser.error("--nproc must be >= 1")
    try:
        return int(args.func(args))
    except Stopped as exc:  # SIGTERM / SIGINT: the work saved, the command to go on
        print(f"flowgraph: {exc}", file=sys.stderr)
        return 128 + exc.signum
    except (UsageError, GraphFileError, PlanFileError) as exc:
        print(f"flowgraph: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except FlowgraphError as exc:  # the command ran and failed: a run, a graph, a plan
        print(f"flowgraph: error: {exc}", file=sys.stderr)
        return EXIT_ERRORS
    except KeyboardInterrupt:
        print("flowgraph: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
