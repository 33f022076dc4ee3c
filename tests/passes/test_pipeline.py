"""The pipeline (flowgraph/passes/__init__.py): the numbered pass list, disabling a pass,
dumping the graph after one, a failing pass named, and wrong calls."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from flowgraph.errors import FlowgraphError, UsageError
from flowgraph.ir import Graph
from flowgraph.passes import PASSES, CompileResult, PassPipeline, Program, compile_graph
from flowgraph.plan import ExecutionPlan

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"
PlanOf = Callable[..., ExecutionPlan]


def test_describe_numbers_the_passes_and_marks_disabled_ones() -> None:
    text = PassPipeline.default(disabled=("hoist",)).describe()
    lines = text.splitlines()
    assert [line.split()[:2] for line in lines] == [
        ["1.", "validate"], ["2.", "infer_dims"], ["3.", "asynchronous"], ["4.", "on_policy"],
        ["5.", "token_budget"], ["6.", "packing"], ["7.", "dce"], ["8.", "hoist"],
        ["9.", "fusion"], ["10.", "placement"], ["11.", "schedule"], ["12.", "memory"]]
    assert [line.endswith("[disabled]") for line in lines] == [
        False, False, False, False, False, False, False, True, False, False, False, False]


@pytest.mark.parametrize(("disabled", "message"), [
    (("hoisting",), "unknown pass `hoisting`; the passes are: validate, infer_dims, asynchronous, "
                    "on_policy, "
                    "token_budget, packing, dce, hoist, fusion, placement, schedule, memory"),
    (("validate",), "pass `validate` cannot be disabled: the plan is built from its result"),
    (("schedule",), "pass `schedule` cannot be disabled: the plan is built from its result"),
    (("infer_dims",), "pass `infer_dims` cannot be disabled while `memory` runs: `memory` reads "
                      "its result (disable `memory` too)"),
])
def test_disabling_a_pass_wrongly_is_a_usage_error(disabled: tuple[str, ...], message: str
                                                   ) -> None:
    with pytest.raises(UsageError) as exc:
        PassPipeline.default(disabled=disabled)
    assert str(exc.value) == message


def test_disabling_hoist_changes_the_plan(plan_of: PlanOf) -> None:
    plan = plan_of("dpo.yaml", pipeline=PassPipeline.default(disabled=("hoist",)))
    assert not any(n.hoisted for n in plan.nodes)
    assert [s.name for s in plan.stages] == ["step.0", "step.1", "step.2"]
    assert plan.stages[1].nodes == ("ref_chosen", "ref_rejected")


def test_disabling_memory_and_infer_dims_gives_a_plan_without_them(plan_of: PlanOf) -> None:
    plan = plan_of("ppo.yaml", pipeline=PassPipeline.default(disabled=("memory", "infer_dims")))
    assert plan.memory == () and plan.dims == ()
    assert {i.shape for n in plan.nodes for i in n.inputs} == {""}


def test_dump_after_writes_the_graph_as_yaml(ppo_with_dead_nodes: Graph) -> None:
    out = io.StringIO()
    compile_graph(ppo_with_dead_nodes, dump_after=("dce",), dump=out)
    text = out.getvalue()
    assert text.startswith("# --- after pass `dce` ---\n")
    dumped = yaml.safe_load(text)
    assert "dead_rm" not in dumped["nodes"] and "update_critic" in dumped["nodes"]
    assert "# dropped: dead_rm, dead_tok\n" in text


def test_dump_after_placement_shows_the_pools() -> None:
    out = io.StringIO()
    compile_graph(GRAPHS / "ppo.yaml", target="ray", nproc=2, dump_after=("placement",), dump=out)
    assert "# pool critic: 2 x cpu, models critic (full_shard)\n" in out.getvalue()
    assert "# node values -> critic (data-parallel)\n" in out.getvalue()


@dataclass(frozen=True, slots=True)
class Broken:
    """Fails."""

    name: ClassVar[str] = "broken"
    requires: ClassVar[tuple[str, ...]] = ()

    def apply(self, program: Program) -> Program:
        raise KeyError("boom")


def test_a_failing_pass_is_named_with_the_passes_before_it() -> None:
    passes = (*(cls() for cls in list(PASSES.values())[:7]), Broken())
    with pytest.raises(FlowgraphError) as exc:
        compile_graph(GRAPHS / "ppo.yaml", pipeline=PassPipeline(passes))
    assert str(exc.value) == ("pass `broken` failed: KeyError: 'boom' (passes run before it: "
                              "validate, infer_dims, asynchronous, on_policy, token_budget, "
                              "packing, dce)")


def test_graph_errors_stop_the_pipeline_after_validate() -> None:
    result: CompileResult = compile_graph(GRAPHS / "dpo.yaml", nproc=3)
    assert result.plan is None and [d.code for d in result.diagnostics] == ["FG301"]
    assert result.program is not None and result.program.placement is None


@pytest.mark.parametrize(("kw", "message"), [
    ({"target": "slurm"}, "unknown target `slurm`; the targets are: local, fsdp, ray"),
    ({"nproc": 0}, "nproc must be >= 1, got 0"),
    ({"dump_after": ("nope",)}, "--dump-after `nope`: no such pass; the passes are: validate, "
                                "infer_dims, asynchronous, on_policy, token_budget, packing, "
                                "dce, hoist, fusion, "
                                "placement, "
                                "schedule, memory"),
])
def test_wrong_calls_are_usage_errors(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError) as exc:
        compile_graph(GRAPHS / "ppo.yaml", **kw)
    assert str(exc.value) == message
