"""FG125: a model that starts from another run's checkpoint (`models.<m>.init_from`).

Checked before launch, on the files the run will read: the run dir holds a `plan.json`
(a flowgraph run's), that plan has the model named (`init_from_model`, else this
model's name), trained (a frozen model is never saved), with this model's head (a causal
LM's weights cannot start a critic) and adapters (a LoRA model's checkpoint holds its
adapters alone), and the run has written a checkpoint. A base (`path`) other than the
source's is a warning: its weights must fit this architecture, which loading says
otherwise. Which checkpoint is the newest intact one is decided when the run starts
(`flowgraph.compilers.export.load_from_run`), as `--resume` decides it.
"""

from __future__ import annotations

from pathlib import Path

from flowgraph.checker.structure import Resolved
from flowgraph.diagnostics import Diagnostic, error, warning
from flowgraph.errors import PlanError
from flowgraph.ir import Graph, ModelSpec, NodeSpec
from flowgraph.plan import ExecutionPlan, plan_from_json
from flowgraph.runs import published_checkpoints

__all__ = ["check_init_from"]

def check_init_from(graph: Graph, table: dict[str, Resolved], out: list[Diagnostic]) -> None:
    for m in graph.models:
        if m.init_from is not None:
            _check(m, m.init_from, _head(m, table), out)


def _head(m: ModelSpec, table: dict[str, Resolved]) -> str:
    """`scalar` when a node runs `m` with a scalar head (critic, reward model), else `lm`."""
    return "scalar" if any(isinstance(r.spec, NodeSpec) and r.spec.model == m.name
                           and r.kind is not None and r.kind.head == "scalar"
                           for r in table.values()) else "lm"


def _check(m: ModelSpec, run: str, head: str, out: list[Diagnostic]) -> None:
    where, source = f"`models.{m.name}.init_from`", m.init_from_model or m.name

    def fail(message: str, hint: str) -> None:
        out.append(error("FG125", f"{where}: {message}", m.pos, node=m.name, hint=hint))

    plan = _plan(Path(run))
    if isinstance(plan, str):
        fail(plan, "give the run_dir of the run that trained the model (its plan.json is "
                   "there); a relative path is relative to the graph file's folder")
        return
    trained = [s.name for s in plan.models if s.trainable]
    spec = next((s for s in plan.models if s.name == source), None)
    if spec is None or not spec.trainable:
        what = "has no model" if spec is None else "never trained model"
        fail(f"run `{run}` {what} `{source}`, so its checkpoints hold no weights of it "
             f"(its trained models: {', '.join(trained) or 'none'})",
             f"init_from_model: {trained[0]}" if trained else "give a run that trained it")
        return
    heads = {p.name: p.head for pool in plan.pools for p in pool.models}
    if heads.get(source, "lm") != head:
        fail(f"model `{source}` of run `{run}` has a {heads.get(source, 'lm')} head and "
             f"`{m.name}` a {head} one: its weights cannot start it",
             "start a critic from a critic (values), a causal LM from a causal LM")
    elif (spec.lora is None) != (m.lora is None):
        fail(f"model `{source}` of run `{run}` was trained "
             f"{'with' if spec.lora else 'without'} lora adapters and `{m.name}` has "
             f"{'none' if m.lora is None else 'them'}: "
             + ("its checkpoints hold its adapters alone" if spec.lora else
                "its checkpoints hold no adapters"),
             f"give models.{m.name} the same lora settings as `{source}` had")
    elif not published_checkpoints(Path(run)):
        fail(f"run `{run}` has written no checkpoint yet", "train it first (its "
             "trainer.checkpoint_every), then start this run")
    elif spec.path != m.path:
        out.append(warning(
            "FG125", f"{where}: model `{source}` of run `{run}` was built on `{spec.path}`, "
            f"`{m.name}` on `{m.path}`: its weights must fit this architecture", m.pos,
            node=m.name, hint=f"set models.{m.name}.path: {spec.path}"))


def _plan(run: Path) -> ExecutionPlan | str:
    """The run's plan, or why there is none."""
    try:
        return plan_from_json((run / "plan.json").read_text())
    except FileNotFoundError:
        return f"`{run}` is not a flowgraph run dir (no plan.json)"
    except (OSError, PlanError) as exc:
        return f"the plan.json of `{run}` cannot be read: {exc}"
