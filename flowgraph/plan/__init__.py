"""The execution plan: what runs where, in which order, and how each edge's batch moves.

`flowgraph compile` lowers a graph to an `ExecutionPlan` and writes it as JSON; the
executors consume only the plan. Its rooms:

* `records`  the frozen records (`ExecutionPlan`, `NodePlan`, `PoolPlan`…) and their
             vocabulary, each checking itself;
* `verify`   how the records fit together (`verify`, `verify_kinds`), and the rules the
             compiler applies and the verifier checks (`dispatch_of`, `producer_side`,
             `repeated`);
* `codec`    the plan as JSON (`plan_from_json(plan_to_json(plan)) == plan`), the run's
             copy of it, and the graph's document for experiment trackers;
* `score`    which scores the run reports: those the advantage node trains on;
* `summary`  the plan as `flowgraph compile` prints it.
"""

from flowgraph.plan.codec import (
    MAX_PLAN_BYTES,
    plan_document,
    plan_from_json,
    plan_to_json,
    read_run_plan,
    write_run_plan,
)
from flowgraph.plan.records import (
    DRIVER,
    PLAN_VERSION,
    ROLLOUT_POOL,
    Amount,
    AsyncPlan,
    Bundle,
    DimValue,
    EdgePlan,
    ExecutionPlan,
    InputPlan,
    Label,
    MemoryItem,
    ModelPlacement,
    NodePlan,
    OutputPlan,
    ParamPlan,
    PoolMemory,
    PoolPlan,
    ResamplePlan,
    RunSpec,
    ScorePlan,
    SpecPlan,
    StagePlan,
    peak_of,
)
from flowgraph.plan.summary import GIB, gib, plan_summary
from flowgraph.plan.verify import (
    dispatch_of,
    producer_side,
    repeated,
    upstream_of,
    verify,
    verify_kinds,
)

__all__ = [
    "DRIVER", "GIB", "MAX_PLAN_BYTES", "PLAN_VERSION", "ROLLOUT_POOL", "Amount", "AsyncPlan",
    "Bundle", "DimValue", "EdgePlan", "ExecutionPlan", "InputPlan", "Label", "MemoryItem",
    "ModelPlacement", "NodePlan", "OutputPlan", "ParamPlan", "PoolMemory", "PoolPlan",
    "ResamplePlan", "RunSpec", "ScorePlan", "SpecPlan", "StagePlan", "dispatch_of", "gib",
    "peak_of",
    "plan_document", "plan_from_json", "plan_summary", "plan_to_json", "producer_side",
    "read_run_plan", "repeated", "upstream_of", "verify", "verify_kinds", "write_run_plan",
]
