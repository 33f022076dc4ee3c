"""The layers hold: every module imports only its own layer and the layers below it.

From the bottom:

1. core       `flowgraph/` (graph IR, checker, passes, plan, `flowgraph.runtime`,
              `flowgraph.testing`): no torch on import, and none of the layers above.
2. nodes      `nodes/`, installed as `flowgraph.nodes`: the node implementations.
3. compilers  `compilers/`, installed as `flowgraph.compilers`: the executors.
4. entry      what a user calls, which starts the executors: the `flowgraph` command
              (`flowgraph/cli.py`, `flowgraph/__main__.py`) and the package's Python
              face (`flowgraph/__init__.py`, `flowgraph/api.py`: `flowgraph.compile`,
              `flowgraph.run`). Nothing below imports them.

An import is every `import` and `from ... import` anywhere in a file (inside functions
and under `if TYPE_CHECKING:` too), relative ones resolved, and every call of
`importlib.import_module`, `__import__` or `importlib.util.find_spec` with a literal
module name. The registry's `impl="flowgraph.nodes.update:ppo_actor_update"` strings
are data, not imports: the executors and `flowgraph.testing` load them through
`flowgraph.runtime.context.Impl`, as they load a plugin's.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
ENTRY = frozenset({"flowgraph", "flowgraph.__main__", "flowgraph.api", "flowgraph.cli"})
RANKS = {"core": 0, "nodes": 1, "compilers": 2, "entry": 3}
IMPORT_CALLS = frozenset({"import_module", "__import__", "find_spec"})


def _modules() -> dict[str, Path]:
    """Module name -> file, for every .py file of the packages pyproject installs."""
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    modules = {}
    for package, folder in package_dirs.items():
        for file in (ROOT / folder).rglob("*.py"):
            parts = file.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            modules.setdefault(name, file)
    return modules


MODULES = _modules()


def layer(module: str) -> str | None:
    """The layer of a flowgraph module; None for anything else (stdlib, torch...)."""
    if module in ENTRY:
        return "entry"
    for package in ("flowgraph.compilers", "flowgraph.nodes"):
        if module == package or module.startswith(package + "."):
            return package.removeprefix("flowgraph.")
    return "core" if module.startswith("flowgraph.") else None


def _resolve(name: str) -> str:
    """The module that `name` (a module, or a name in one) lives in."""
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, imported name) for every import in `source`, the source of `module`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and _is_import_call(node.func):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append((node.lineno, arg.value))
    return found


def _is_import_call(func: ast.expr) -> bool:
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in IMPORT_CALLS


def violations() -> list[str]:
    found = []
    for module, file in sorted(MODULES.items()):
        here = layer(module)
        assert here is not None, module
        seen = {(line, _resolve(name))
                for line, name in imports(file.read_text(), module, file.name == "__init__.py")}
        for line, target in sorted(seen):
            there = layer(target)
            if there is not None and RANKS[there] > RANKS[here]:
                found.append(f"{file.relative_to(ROOT)}:{line}: {module} ({here}) imports "
                             f"{target} ({there})")
    return found


DISTRIBUTED = ("torch.distributed", "DTensor", "full_tensor", "to_local", "all_reduce",
               "all_gather", "reduce_scatter", "broadcast_object", "barrier", "vllm",
               "dp_rank", "dp_size")
"""What only the worker layer (`compilers/`) may touch: nodes ask `NodeContext` for
the services instead (`ctx.workers`, `ctx.optimizer_step`, `ctx.rollout_engine`), and
an update kind's share of a data-parallel batch is the update loop's
(`flowgraph.compilers.update_loop`)."""


def node_collectives() -> list[str]:
    found = []
    for module, file in sorted(MODULES.items()):
        if layer(module) != "nodes":
            continue
        tree = ast.parse(file.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom)
                     else [node.attr] if isinstance(node, ast.Attribute)
                     else [node.id] if isinstance(node, ast.Name)
                     else [node.arg] if isinstance(node, ast.arg | ast.keyword) and node.arg
                     else [node.value] if isinstance(node, ast.Constant)  # getattr(x, "...")
                     and isinstance(node.value, str) and node.value != "vllm" else [])
            for name in names:
                hit = next((d for d in DISTRIBUTED if name == d or name.startswith(d + ".")
                            or name.endswith("." + d)), None)
                if hit:
                    found.append(f"{file.relative_to(ROOT)}:{node.lineno}: {name}")
    return found


def test_nodes_are_pure() -> None:
    """No collective, sharded tensor, rollout engine or data-parallel rank in `nodes/`
    (the string "vllm" names a backend the node asks `ctx.rollout_engine` for)."""
    bad = node_collectives()
    assert not bad, "distributed code in nodes/ (give it to the worker layer):\n" + "\n".join(bad)


def test_no_module_imports_a_layer_above_its_own() -> None:
    bad = violations()
    assert not bad, "imports across the layers (tests/test_boundaries.py):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("source", "module", "expected"),
    [
        ("import flowgraph.nodes.reward", "flowgraph.runtime.evaluation",
         "flowgraph.nodes.reward"),
        ("def f():\n    from flowgraph.compilers.targets.local import Impl",
         "flowgraph.testing.contracts", "flowgraph.compilers.targets.local"),
        ("from ..nodes import data as nd", "flowgraph.checker.data", "flowgraph.nodes.data"),
        ("from . import models", "flowgraph.nodes.data", "flowgraph.nodes.models"),
        ("from flowgraph import nodes", "flowgraph.checker.data", "flowgraph.nodes"),
        ("if TYPE_CHECKING:\n    from flowgraph.compilers import Run", "flowgraph.plan",
         "flowgraph.compilers"),
        ("importlib.import_module('flowgraph.compilers.targets.ray.driver')", "flowgraph.plan",
         "flowgraph.compilers.targets.ray.driver"),
        ("from flowgraph import GraphBuilder", "flowgraph.nodes.data", "flowgraph"),
    ],
)
def test_every_form_of_import_is_seen(source: str, module: str, expected: str) -> None:
    assert [_resolve(name) for _, name in imports(source, module)] == [expected]


def test_registry_strings_are_data_not_imports() -> None:
    source = 'KindSpec(name="gae", impl="flowgraph.nodes.advantage:gae")'
    assert imports(source, "flowgraph.kinds") == []


@pytest.mark.parametrize(
    ("module", "expected"),
    [("flowgraph.plan", "core"), ("flowgraph.runtime.context", "core"),
     ("flowgraph.testing.contracts", "core"), ("flowgraph.nodes", "nodes"),
     ("flowgraph.nodes.update", "nodes"), ("flowgraph.compilers.targets.local", "compilers"),
     ("flowgraph.cli", "entry"), ("flowgraph.api", "entry"), ("flowgraph", "entry"),
     ("torch.nn", None)],
)
def test_layers(module: str, expected: str | None) -> None:
    assert layer(module) == expected


# --- cycles and private names ---------------------------------------------------------


def import_graph() -> dict[str, set[str]]:
    """Module -> the flowgraph modules it imports (every form of import, as above), and
    the packages whose `__init__` those imports run (`with_packages`)."""
    graph: dict[str, set[str]] = {}
    for module, file in MODULES.items():
        seen = {_resolve(name)
                for _, name in imports(file.read_text(), module, file.name == "__init__.py")}
        graph[module] = {m for m in seen if m in MODULES and m != module}
    return with_packages(graph)


def with_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """`graph` (module -> the modules it imports) with the package `__init__`s each import
    runs: importing `a.b.c` runs `a/__init__` and `a/b/__init__` first, so a module that
    imports `flowgraph.runtime.update` depends on `flowgraph.runtime` (and on all that
    its `__init__` imports) too.

    Except the packages the importer is itself inside: Python began their `__init__`
    before the importer's first line, so importing a sibling runs nothing new. That is
    how the top-level package is treated, with no rule of its own: every module here is
    inside `flowgraph` (`flowgraph.nodes` and `flowgraph.compilers` too), and whichever
    is imported first, `flowgraph/__init__` (the entry layer: it imports the API) has
    already started; a module that imports `flowgraph` itself (`from flowgraph import
    GraphBuilder`) depends on it as on any module, through its own import."""
    out = {}
    for module, targets in graph.items():
        parts = module.split(".")
        inside = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        run = {".".join(t.split(".")[:i]) for t in targets
               for i in range(1, t.count(".") + 1)}
        out[module] = targets | {p for p in run if p in graph and p not in inside}
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (its modules in import order) per strongly connected group of modules."""
    import networkx as nx

    g = nx.DiGraph([(a, b) for a, targets in graph.items() for b in targets])
    found = []
    for group in nx.strongly_connected_components(g):
        if len(group) > 1:
            cycle = nx.find_cycle(g.subgraph(group))
            found.append([a for a, _ in cycle] + [cycle[0][0]])
    return sorted(found)


def test_no_import_cycles() -> None:
    """No module imports, directly or not, a module that imports it (an import inside a
    function or under TYPE_CHECKING counts: it is a dependency all the same)."""
    bad = [" -> ".join(c) for c in cycles(import_graph())]
    assert not bad, "import cycles:\n" + "\n".join(bad)


def test_cycles_are_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_a_cycle_through_a_package_init_is_found() -> None:
    """`f.spec` imports `f.run.update`, which runs `f/run/__init__`, which imports
    `f.run.context`, which imports `f.spec`: no import names `f.run` itself."""
    graph = {"f": {"f.spec"}, "f.spec": {"f.run.update"}, "f.run": {"f.run.context"},
             "f.run.update": set(), "f.run.context": {"f.spec"}}
    assert cycles(graph) == []
    assert cycles(with_packages(graph)) == [["f.spec", "f.run", "f.run.context", "f.spec"]]


def test_a_package_own_modules_and_the_top_package_run_no_init_again() -> None:
    """A package's `__init__` importing its modules, and they each other, is no cycle:
    the package's `__init__` began before any of them; nor is the top package's
    `__init__` importing a module that imports a sibling."""
    graph = {"f": {"f.api"}, "f.api": {"f.run.context"}, "f.run": {"f.run.context"},
             "f.run.context": {"f.run.update"}, "f.run.update": set()}
    assert cycles(with_packages(graph)) == []
    assert with_packages(graph)["f.api"] == {"f.run", "f.run.context"}


def private_imports() -> list[str]:
    """A private name (`_x`) imported from another module; a private module (`_agg`) may
    be imported by its own package's modules only."""
    found = []
    for module, file in sorted(MODULES.items()):
        package = module.rpartition(".")[0]
        for line, name in imports(file.read_text(), module, file.name == "__init__.py"):
            owner = _resolve(name)
            if owner not in MODULES or owner == module:
                continue
            leaf = name.rpartition(".")[2]
            private_name = name != owner and leaf.startswith("_") and not leaf.startswith("__")
            private_module = owner.rpartition(".")[2].startswith("_") and \
                not owner.endswith("__init__")
            bad = private_name or (private_module and owner.rpartition(".")[0] != package)
            if bad:
                found.append(f"{file.relative_to(ROOT)}:{line}: {module} imports {name}")
    return found


def test_no_private_name_crosses_a_module() -> None:
    bad = private_imports()
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def graph_reads(source: str) -> list[int]:
    """Lines that read an attribute `graph` (an executor reaching into the plan's graph
    record)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "graph":
            lines.append(node.lineno)
    return sorted(lines)


def test_executors_read_the_plan_not_its_graph() -> None:
    """An executor runs what the plan holds: the nodes' wiring, params and kind facts
    from `NodePlan`, the run's settings from `ExecutionPlan.trainer` / `models` / `data`
    / `plugins` / `resources`. The plan holds no copy of the graph, and no executor
    reaches for one (an attribute `graph` anywhere under `compilers/`)."""
    from dataclasses import fields

    from flowgraph.plan import ExecutionPlan

    assert "graph" not in {f.name for f in fields(ExecutionPlan)}
    assert not hasattr(ExecutionPlan, "graph")
    bad = [f"{file.relative_to(ROOT)}:{line}"
           for module, file in sorted(MODULES.items())
           if module.startswith("flowgraph.compilers.")
           for line in graph_reads(file.read_text())]
    assert not bad, "executors reading `.graph`:\n" + "\n".join(bad)


def test_graph_reads_are_found() -> None:
    assert graph_reads("x = plan.graph.trainer\ny = 1\nz = self.graph") == [1, 3]


# --- the rooms of compilers/ ------------------------------------------------------------

TARGET_ROOMS = ("local", "fsdp", "ray")
"""The targets, each a strategy of its own (`compilers/targets/<room>`)."""
RUN_ENTRIES = frozenset({"flowgraph.compilers", "flowgraph.compilers.debug",
                         "flowgraph.compilers.builtin_training"})
"""The core modules that start a target: `run` (every target), `debug` and the built-ins'
training (the local target, one node at a time / on a recipe)."""
BELOW_TARGETS = ("flowgraph.compilers.checkpoint.", "flowgraph.compilers.vllm.")
"""Rooms the targets and the loop build on, which know of no target or rollout strategy."""


def room(module: str) -> str | None:
    """The room of a module under `compilers/`: `core` (its top level), `targets`
    (`targets/` itself: what the distributed targets share), a target (`local`, `fsdp`,
    `ray`), `rollouts`, `checkpoint` or `vllm`; None outside `compilers/`."""
    if not (module + ".").startswith("flowgraph.compilers."):
        return None
    parts = module.split(".")[2:]
    if not parts or (len(parts) == 1 and not (ROOT / "compilers" / parts[0]).is_dir()):
        return "core"
    if parts[0] == "targets" and len(parts) > 1:
        name = parts[1].removesuffix(".py")
        return name if name in TARGET_ROOMS else "targets"
    return parts[0]


def room_rule(module: str, target: str) -> str | None:
    """Why `module` may not import `target` (both under `compilers/`), or None."""
    here, there = room(module), room(target)
    if here is None or there is None or here == there:
        return None
    if here == "rollouts" and there == "ray":
        return None  # the rollout pool runs on Ray: its workers and calls
    if here in TARGET_ROOMS and there in TARGET_ROOMS:
        return "a target imports another target (share it through compilers/targets/)"
    if here == "core" and there in (*TARGET_ROOMS, "targets") and module not in RUN_ENTRIES:
        return "the target-agnostic core imports a target"
    if target == "flowgraph.compilers.targets.process_groups" and here not in TARGET_ROOMS:
        return "process groups are the distributed targets' own"
    if module.startswith(BELOW_TARGETS) and there in (*TARGET_ROOMS, "targets", "rollouts"):
        return "checkpoint/ and vllm/ are below the targets and rollouts"
    return None


def room_violations() -> list[str]:
    found = []
    for module, file in sorted(MODULES.items()):
        for line, name in imports(file.read_text(), module, file.name == "__init__.py"):
            target = _resolve(name)
            why = room_rule(module, target)
            if why:
                found.append(f"{file.relative_to(ROOT)}:{line}: {module} imports {target}: {why}")
    return found


def test_rooms_of_compilers_hold() -> None:
    """Targets are strategies: none imports another, and the core that runs them (the
    interpreter, the loop, the worker) imports none, only the entries that start a run
    do; process groups belong to the distributed targets; checkpoints and the vLLM
    engine know of no target."""
    bad = room_violations()
    assert not bad, "imports across the rooms of compilers/:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("module", "expected"),
    [("flowgraph.compilers", "core"), ("flowgraph.compilers.loop", "core"),
     ("flowgraph.compilers.targets.local", "local"),
     ("flowgraph.compilers.targets.fsdp.launch", "fsdp"),
     ("flowgraph.compilers.targets.ray", "ray"),
     ("flowgraph.compilers.targets.process_groups", "targets"),
     ("flowgraph.compilers.checkpoint.store", "checkpoint"),
     ("flowgraph.compilers.checkpoint", "checkpoint"),
     ("flowgraph.plan", None)],
)
def test_rooms(module: str, expected: str | None) -> None:
    assert room(module) == expected


def test_room_rules_are_found() -> None:
    assert room_rule("flowgraph.compilers.targets.ray.driver",
                     "flowgraph.compilers.targets.fsdp.multinode")
    assert room_rule("flowgraph.compilers.loop", "flowgraph.compilers.targets.local")
    assert room_rule("flowgraph.compilers.worker", "flowgraph.compilers.targets.process_groups")
    assert room_rule("flowgraph.compilers.checkpoint.store", "flowgraph.compilers.targets.local")
    assert room_rule("flowgraph.compilers", "flowgraph.compilers.targets.local") is None
    assert room_rule("flowgraph.compilers.targets.ray.target",
                     "flowgraph.compilers.targets.shared_run_dir") is None


# --- module size --------------------------------------------------------------------------

LONG = 450
"""Lines past which a module says at its top why it is one (STYLE 20)."""
SAYS_WHY = "past ~450 lines"


def long_modules() -> list[str]:
    """Modules past `LONG` lines whose docstring does not say why they are one."""
    found = []
    for _, file in sorted(MODULES.items()):
        source = file.read_text()
        lines = source.count("\n")
        doc = ast.get_docstring(ast.parse(source)) or ""
        if lines > LONG and SAYS_WHY not in " ".join(doc.split()):
            found.append(f"{file.relative_to(ROOT)}: {lines} lines")
    return found


def test_a_long_module_says_why_it_is_one() -> None:
    """A module past ~450 lines holds one job that does not split well, and says so at
    its top ("One module past ~450 lines, on purpose: ..."); else it is split."""
    bad = long_modules()
    assert not bad, "long modules without a reason at their top:\n" + "\n".join(bad)
