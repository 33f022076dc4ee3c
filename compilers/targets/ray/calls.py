"""Calls to Ray shared by the trainer's pools (`flowgraph.compilers.targets.ray.target`) and the
rollout pool (`flowgraph.compilers.rollouts.pool`): the run's names on the cluster, a pool's
placement group, and waiting for a worker's answer (a dead or silent worker is
`WorkerLost`, a node's error comes back as it was raised)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from flowgraph.compilers.checkpoint.integrity import DISK_FULL
from flowgraph.compilers.targets import process_groups
from flowgraph.compilers.targets.ray.cluster import placed
from flowgraph.compilers.targets.ray.worker import worker_log
from flowgraph.errors import FlowgraphError, NodeError, WorkerLost
from flowgraph.plan import ExecutionPlan, PoolPlan
from flowgraph.spelling import option

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise FlowgraphError(f"{option('target', 'ray')} needs Ray: pip install 'ray>=2.40' "
                         f"({exc})") from exc

__all__ = ["answers", "namespace", "ray_name", "reserve", "run_name"]


def _where(where: tuple[str, int] | str | None) -> str:
    if isinstance(where, str):
        return f" {where}"
    return f" in node `{where[0]}` at step {where[1]}" if where else ""


BROKEN_GROUP = re.compile(r"gloo/|NCCL|DistNetworkError|DistBackendError")
"""A worker's error that names the process group's backend: its collective broke (a
peer died or hung). Narrower than `process_groups.lost_peer`: a node's own network error (a
reward calling an API: `ConnectionResetError: ... Connection reset by peer`) stays that
node's error, with the user's line, and is not retried as a lost worker."""
PEER_WAIT_S = 2.0
"""After a worker's broken process group, how long Ray may take to report the peer
that died, so that the message names it."""
_STEP = re.compile(r"^while executing node .*? at step -?\d+: ")
"""The head of a worker's node error, which `_where` says again."""


def answers(refs: Any, timeout: float | None, where: tuple[str, int] | str | None = None,
            names: list[str] | None = None) -> Any:
    """ray.get with `timeout` (the step timeout; None: no limit); a dead or silent worker
    raises WorkerLost, a node's own error comes back as it was raised in the worker.
    A worker whose collective broke because a peer died (`process_groups.lost_peer`: gloo's
    closed connection) is a lost worker too: when a whole node goes, the survivors'
    errors reach the driver before Ray (which needs its health checks, ~15 s) reports
    that node's actors dead. `where`: the node and step waited for, or what the worker
    was doing; `names`: who answers each of `refs` (a list), for the message of a
    timeout, which names those that gave no answer."""
    try:
        return ray.get(refs, timeout=timeout)
    except RayTaskError as exc:
        cause = exc.cause
        error = (str(cause) if isinstance(cause, FlowgraphError)
                 else f"{type(cause).__name__}: {cause}")
        first = error.split("\n", 1)[0]
        # a peer died: a worker lost
        if process_groups.lost_peer(first) and BROKEN_GROUP.search(first):
            _dead_among(refs, where)  # the one that died, when Ray says so soon
            raise WorkerLost(f"a worker lost a peer of its process group{_where(where)} "
                             f"({_STEP.sub('', first)})") from None
        if isinstance(cause, FlowgraphError) or (  # a full disk: the loop says it
                isinstance(cause, OSError) and cause.errno in DISK_FULL):
            raise cause from None
        raise NodeError(error) from None
    except RayActorError as exc:
        raise WorkerLost(f"a worker died{_where(where)} ({_died(exc)})") from None
    except GetTimeoutError:
        silent = _silent(refs, names)
        raise WorkerLost(f"{silent or 'a worker'} gave no answer for trainer.step_timeout_s "
                         f"= {timeout} s{_where(where)}; "
                         f"{'they are' if ' and ' in silent else 'it is'} taken for dead"
                         ) from None


def _silent(refs: Any, names: list[str] | None) -> str:
    """Who of `names` (one for each of `refs`) has not answered yet ("" when unknown)."""
    if not names or not isinstance(refs, list) or len(refs) != len(names):
        return ""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    done = set(ready)
    return " and ".join(n for ref, n in zip(refs, names, strict=True) if ref not in done)


def _dead_among(refs: Any, where: tuple[str, int] | str | None) -> None:
    """Raise WorkerLost naming the worker that died, when Ray reports one of `refs`'
    actors dead within `PEER_WAIT_S` (on a node still up, at once; a node lost whole
    takes Ray's health checks longer)."""
    refs = refs if isinstance(refs, list) else [refs]
    if not refs:
        return
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=PEER_WAIT_S)
    for ref in done:
        try:
            ray.get(ref, timeout=0)
        except RayActorError as exc:
            raise WorkerLost(f"a worker died{_where(where)} ({_died(exc)})") from None
        except RayError:  # a survivor's broken process group, as the first one
            continue


def run_name(plan: ExecutionPlan) -> str:
    """The run's name on the cluster: its run dir's (as MLflow names the run)."""
    return Path(plan.trainer.run_dir).resolve().name


def namespace(plan: ExecutionPlan) -> str:
    """The run's Ray namespace, `flowgraph/<run name>`: what an operator filters by."""
    return f"flowgraph/{run_name(plan)}"


def ray_name(plan: ExecutionPlan, pool: str, index: int | None = None) -> str:
    """`flowgraph/<run name>/<pool>`, a pool's placement group; with `index`,
    `flowgraph/<run name>/<pool>/<index>`, that worker's actor."""
    return f"{namespace(plan)}/{pool}" + (f"/{index}" if index is not None else "")


def _died(exc: Exception) -> str:
    """Why a worker died, from Ray's error: its first line, and for a flowgraph worker
    (Ray's message names the actor) which one and where its output is."""
    text = str(exc).strip()
    reason = text.splitlines()[0] if text else "actor died"
    named = re.search(r"^\s*name: flowgraph/[^\n]*/([^/\n]+)/(\d+)$", text, re.MULTILINE)
    if named is None:
        return reason
    pool, rank = named[1], int(named[2])
    return (f"{named[0].split(': ', 1)[1]}: {reason} Its output: "
            f"{worker_log(Path(), pool, rank)} in the run dir")


def reserve(pool: PoolPlan, name: str = "", held: dict[str, list[str]] | None = None
            ) -> tuple[Any, list[dict[str, Any]]]:
    """A placement group of one bundle per worker of `pool`, named `name` (`ray_name`),
    ready (`placed`: within a bounded time, else a message; `held`: the nodes that ran
    the run's workers before a restart); and each worker's actor options, which place
    it in its bundle."""
    bundles = [b.asks() for b in pool.bundles]
    labels = {lb.name: lb.selector for lb in pool.label_selector}
    pg = placement_group(bundles, strategy=pool.strategy.upper(), name=name,
                         bundle_label_selector=[labels] * len(bundles) if labels else None)
    placed(pg, pool.name, bundles, held)
    return pg, [{"num_cpus": b.cpu, "num_gpus": b.gpu,
                 "resources": {a.name: a.amount for a in b.custom},
                 "scheduling_strategy": PlacementGroupSchedulingStrategy(
                     pg, placement_group_bundle_index=i)} for i, b in enumerate(pool.bundles)]
