"""What a Ray run does when its cluster (joined with `--address`, or embedded) loses a part.

* The head: Ray's driver waits `RAY_gcs_rpc_server_reconnect_timeout_s` (60 s) for a
  lost GCS, then logs `Failed to connect to GCS ... The program will terminate` and ends
  the process where it stands, no Python code run. `HeadWatch` knocks at the head's
  GCS address every second; when it has not answered for `LOST_MARGIN_S` less than
  that, it says what was lost, the last checkpoint and the command that resumes the
  run (`lost`), and ends the driver itself (exit 1).
* The embedded cluster's node: when its raylet or GCS dies (killed, the OOM killer),
  Ray ends the driver, silently, at its next call to the raylet. `NodeWatch` waits for
  those processes (the driver's children) in threads the kernel wakes at their death,
  and says first what was lost, the last checkpoint and the resume command (exit 1).
* Too small a cluster: before any worker starts, `check_fits` compares what the plan's
  pools ask with the alive nodes (a bundle fits on one node, with the labels its pool
  selects; the whole plan within the cluster's total) and stops with the shortfall.
* A node: its workers die (`WorkerLost`; their peers on other nodes first see their
  process group broken) and the driver restarts the worker groups, which must be
  placed again: not checked against the cluster first (a lost node may come back, or
  be replaced), `placed` waits for a placement group `PLACE_TIMEOUT_S` at most, every
  `PLACE_NOTICE_S` a line with what the cluster has free and the run's lost nodes,
  then stops with the same, the last checkpoint and the resume command.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowgraph.compilers.signals import child_pids
from flowgraph.errors import FlowgraphError

if TYPE_CHECKING:
    from flowgraph.compilers.options import RunOptions
    from flowgraph.plan import ExecutionPlan, PoolPlan

LOST_MARGIN_S = 5.0
"""The head counts as lost this long before Ray would end the driver."""
PLACE_TIMEOUT_S = 300.0
"""The longest wait for a pool's placement group (its bundles) to be placed."""
PLACE_NOTICE_S = 10.0
"""How often a placement group not placed yet says what it waits for."""
RECONNECT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"


class ClusterLost(FlowgraphError):
    """A part of the Ray cluster the run needs is gone; the message says which."""


def reconnect_timeout() -> float:
    """How long Ray's driver waits for a lost GCS (Ray's own setting; default 60 s)."""
    try:
        return float(os.environ.get(RECONNECT_ENV, "60"))
    except ValueError:
        return 60.0


class HeadWatch:
    """A daemon thread that ends the driver with `lost(seconds)`'s message once the
    head at `gcs` ("host:port") has not answered for that many seconds."""

    def __init__(self, gcs: str, lost: Callable[[float], str]) -> None:
        host, _, port = gcs.rpartition(":")
        self.where = (host.strip("[]"), int(port))
        self.lost = lost
        self.limit = max(1.0, reconnect_timeout() - LOST_MARGIN_S)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="flowgraph-head-watch",
                                       daemon=True)

    def __enter__(self) -> HeadWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()

    def _answers(self) -> bool:
        try:
            with socket.create_connection(self.where, timeout=2.0):
                return True
        except OSError:
            return False

    def _watch(self) -> None:
        silent_since: float | None = None
        while not self.done.wait(1.0):
            if self._answers():
                silent_since = None
                continue
            now = time.monotonic()
            silent_since = silent_since or now
            if now - silent_since >= self.limit and not self.done.is_set():
                print(f"flowgraph: error: {self.lost(self.limit)}", file=sys.stderr,
                      flush=True)
                os._exit(1)  # the main thread waits inside Ray, which would end us anyway


NODE_PROCESSES = ("raylet", "gcs_server")
"""The embedded cluster's processes it cannot go on without (its node and head)."""


class NodeWatch:
    """The embedded cluster's raylet and GCS (this process's children), each waited for
    by a daemon thread of its own: the kernel wakes it the moment the process dies
    (killed, the OOM killer), and it says what was lost, the last checkpoint and the
    resume command before Ray, which ends the driver as soon as its next call to the
    raylet fails, would end it silently (exit 1). A race it mostly wins: Ray's exit
    comes from its own threads, without the GIL this one needs to print."""

    def __init__(self, lost: Callable[[str], str],
                 names: tuple[str, ...] = NODE_PROCESSES) -> None:
        self.lost = lost
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._wait, args=(pid, name), daemon=True,
                                         name=f"flowgraph-{name}-watch")
                        for pid, name in _children(names).items()]

    def __enter__(self) -> NodeWatch:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()

    def _wait(self, pid: int, name: str) -> None:
        # the child's death, leaving it to be reaped as it would be (reaped already:
        # ChildProcessError, dead too: it was this process's child when the watch began)
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        if not self.done.is_set():
            print(f"flowgraph: error: {self.lost(f'{name} (pid {pid})')}",
                  file=sys.stderr, flush=True)
            os._exit(1)


def _children(names: tuple[str, ...]) -> dict[int, str]:
    """This process's children running one of `names` (Linux /proc; elsewhere none)."""
    found = {}
    for pid in child_pids():
        with contextlib.suppress(OSError):  # gone meanwhile
            if (name := Path(f"/proc/{pid}/comm").read_text().strip()) in names:
                found[pid] = name
    return found


def placed(pg: Any, pool: str, bundles: list[dict[str, Any]],
           held: dict[str, list[str]] | None = None) -> None:
    """Wait for placement group `pg` (pool `pool`'s `bundles`) `PLACE_TIMEOUT_S` at most,
    saying every `PLACE_NOTICE_S` what it waits for; then remove it and stop. `held`:
    before a restart, the nodes (id -> what of the run each ran) that held the run's
    workers; one the cluster knows dead is named as lost."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import remove_placement_group

    ready, deadline = pg.ready(), time.monotonic() + PLACE_TIMEOUT_S
    waiting = f"pool `{pool}`'s {len(bundles)} workers ({_amounts(bundles[0])} each)"
    while True:
        try:
            ray.get(ready, timeout=max(0.0, min(PLACE_NOTICE_S, deadline - time.monotonic())))
            return
        except GetTimeoutError:
            pass
        free, lost = _free(held)
        if time.monotonic() >= deadline:
            remove_placement_group(pg)
            raise ClusterLost(
                f"{waiting} could not be placed within {PLACE_TIMEOUT_S:g} s: {free}" + (
                    "" if lost else "; a node may be lost, or the plan asks for more than "
                    "the cluster has")) from None
        print(f"flowgraph: waiting for the Ray cluster to place {waiting}: {free}; "
              f"up to {deadline - time.monotonic():.0f} s more", file=sys.stderr, flush=True)


def _free(held: dict[str, list[str]] | None) -> tuple[str, bool]:
    """What the cluster has free, how many of its nodes are alive, and which of the nodes
    in `held` (id -> what of the run it ran) it knows dead; whether there are such."""
    import ray

    have = {k: v for k, v in ray.available_resources().items()
            if k in ("CPU", "GPU") or k.startswith("accelerator")}
    nodes, held = ray.nodes(), held or {}
    text = (f"the cluster has {_amounts(have) if have else 'nothing'} free "
            f"({sum(n['Alive'] for n in nodes)} of {len(nodes)} known node(s) alive)")
    lost = [f"node {n['NodeID']} ({n.get('NodeManagerAddress', '?')}), which ran "
            + ", ".join(held[n["NodeID"]])
            for n in nodes if not n["Alive"] and n["NodeID"] in held]
    return text + (f"; lost: {'; '.join(lost)}" if lost else ""), bool(lost)


class ClusterShort(ClusterLost):
    """The Ray cluster has less than the plan's pools ask for; the message lists what
    (a `ClusterLost`: it says how to go on)."""


Node = tuple[str, dict[str, float], dict[str, str]]
"""A node of the cluster: its address, its resources (`{"CPU": 8, "GPU": 1}`), its labels."""
_NOT_SHOWN = ("memory", "object_store_memory")


def cluster_nodes() -> list[Node]:
    """The alive nodes of the cluster this process joined (`ray.nodes()`)."""
    import ray

    return [(str(n.get("NodeManagerAddress", "?")), dict(n.get("Resources") or {}),
             dict(n.get("Labels") or {})) for n in ray.nodes() if n.get("Alive")]


def check_fits(plan: ExecutionPlan, nodes: list[Node]) -> None:
    """Raise `ClusterShort` listing every pool of `plan` (its rollout pool too) that
    `nodes` cannot hold, and what the whole plan asks beyond the cluster's total: before
    any worker starts, instead of a placement group that waits (Ray's autoscaler line
    every 35 s) for resources no node has."""
    rollout = plan.asynchronous.pool if plan.asynchronous is not None else None
    pools = [p for p in (*plan.pools, *([rollout] if rollout else [])) if p.bundles]
    problems = [m for p in pools if (m := _pool_short(p, nodes, plan)) is not None]
    asked: dict[str, float] = {}
    for p in pools:
        for b in p.bundles:
            for k, v in b.asks().items():
                asked[k] = asked.get(k, 0) + v
    total = {k: sum(res.get(k, 0.0) for _, res, _ in nodes) for k in asked}
    over = [k for k in asked if asked[k] > total[k]]
    if over and not problems:
        problems.append(f"the pools ask {_amounts({k: asked[k] for k in over})} in all and "
                        f"the cluster has {_amounts({k: total[k] for k in over})} "
                        f"({_nodes(nodes, over)}); make the pools smaller (their `size`, "
                        "`cpus`, `gpus`) or add nodes")
    if problems:
        raise ClusterShort("the Ray cluster cannot hold the plan's workers: "
                           + "; ".join(problems))


def _pool_short(pool: PoolPlan, nodes: list[Node], plan: ExecutionPlan) -> str | None:
    """What `nodes` lack for `pool` (a bundle must fit on one node; STRICT_PACK puts
    all of them on one, STRICT_SPREAD each on its own), or None."""
    ask = pool.bundles[0].asks()
    labels = {lb.name: lb.selector for lb in pool.label_selector}
    eligible = [n for n in nodes if all(_matches(sel, n[2].get(name))
                                        for name, sel in labels.items())]
    held = _workers_held(pool, ask, [res for _, res, _ in eligible])
    if held >= pool.size:
        return None
    head = f"pool `{pool.name}` asks {pool.size} worker(s) × {_amounts(ask)}"
    if labels and not eligible:
        return (f"{head} on nodes labelled {_amounts(labels)}: no node is ({_nodes(nodes, ())}, "
                f"labels {[n[2] for n in nodes]}); fix resources.pools.{pool.name}."
                "label_selector or start nodes with `ray start --labels`")
    most = {k: max((res.get(k, 0.0) for _, res, _ in eligible), default=0.0) for k in ask}
    short = [k for k in ask if most[k] < ask[k]]
    if short:
        have = f"the largest node has {_amounts({k: most[k] for k in short})}"
    else:  # each resource alone, then: which ones run out first
        short = [k for k in ask if _workers_held(pool, {k: ask[k]},
                                                 [res for _, res, _ in eligible]) < pool.size]
        short = short or list(ask)
        have = {"strict_pack": "all on one node, which none can hold",
                "strict_spread": f"each on its own node, and {held} can hold one"}.get(
            pool.strategy, f"the nodes hold {held} such worker(s)")
    return f"{head}: {have} ({_nodes(eligible, short)}); {_fix(pool, short)}"


def _workers_held(pool: PoolPlan, ask: dict[str, float], nodes: list[dict[str, float]]
                  ) -> int:
    """How many of `pool`'s workers (each asking `ask`) the nodes' resources hold under
    its strategy (STRICT_PACK: on the one node that holds most)."""
    each = [min(int(res.get(k, 0.0) // v) for k, v in ask.items()) for res in nodes]
    if pool.strategy == "strict_pack":
        return max(each, default=0)
    if pool.strategy == "strict_spread":
        return sum(h > 0 for h in each)
    return sum(each)


def _fix(pool: PoolPlan, short: list[str]) -> str:
    """What to change in the graph, or the cluster, for `short` resources of `pool`."""
    from flowgraph.plan import ROLLOUT_POOL

    key = ("resources.rollout_cpus" if pool.name == ROLLOUT_POOL
           else f"resources.pools.{pool.name}.cpus")
    fixes = []
    if "CPU" in short:
        fixes.append(f"lower {key} or add nodes with more cores")
    if "GPU" in short:  # GPUs a pool takes by default (on cuda) or by its `gpus`
        fixes.append(f"lower resources.pools.{pool.name}.gpus (declaring the pool), run on "
                     "cpu (`resources.device: cpu`) or add GPU nodes")
    custom = {k: pool.bundles[0].asks()[k] for k in short if k not in ("CPU", "GPU")}
    if custom:
        fixes.append(f"start nodes with `ray start --resources '{_json(custom)}'` or "
                     f"change resources.pools.{pool.name}.custom_resources")
    if pool.strategy.startswith("strict") and len(short) == len(pool.bundles[0].asks()):
        fixes.append(f"or set resources.pools.{pool.name}.strategy to `pack` or `spread`")
    return "; ".join(fixes) or "add nodes"


def _matches(selector: str, value: str | None) -> bool:
    """Whether a node label's `value` (None: the node has no such label) passes Ray's
    label `selector`: `v`, `!v`, `in(a, b)`, `!in(a, b)`."""
    negated = selector.startswith("!")
    body = selector.removeprefix("!")
    inside = body[3:-1] if body.startswith("in(") else body.strip("()")
    wanted = {v.strip() for v in inside.split(",")}
    return (value not in wanted) if negated else (value in wanted)


def _amounts(values: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" if isinstance(v, (int, float)) else f"{k}: {v}"
                           for k, v in values.items()) + "}"


def _json(values: dict[str, float]) -> str:
    return "{" + ", ".join(f'"{k}": {v:g}' for k, v in values.items()) + "}"


def _nodes(nodes: list[Node], keys: list[str] | tuple[str, ...]) -> str:
    """`nodes: 10.0.0.1 {CPU: 8, GPU: 0}, ...`, each with the resources `keys` (or all but
    memory and Ray's per-node ones)."""
    if not nodes:
        return "no node"
    shown = [
        f"{addr} " + _amounts({k: res.get(k, 0.0) for k in keys} if keys else
                              {k: v for k, v in res.items()
                               if k not in _NOT_SHOWN and not k.startswith("node:")})
        for addr, res, _ in nodes[:8]]
    more = f" and {len(nodes) - 8} more" if len(nodes) > 8 else ""
    return f"{len(nodes)} node(s): " + ", ".join(shown) + more


def how_to_go_on(plan: ExecutionPlan, opts: RunOptions) -> str:
    """The last checkpoint and the command that continues the run from it (on a cluster
    joined, once it is whole again; an embedded one is started anew)."""
    from flowgraph.compilers.checkpoint.store import latest_checkpoint
    from flowgraph.compilers.signals import resume_command

    done = latest_checkpoint(Path(plan.trainer.run_dir))
    again = resume_command(plan, opts)
    when = "once the cluster is whole again, " if opts.address else ""
    return (f"the last checkpoint is step {done[0]}; {when}continue with: {again}" if done
            else f"no checkpoint was written; {when}start again with: {again}")


@contextmanager
def watched(plan: ExecutionPlan, opts: RunOptions) -> Iterator[None]:
    """The body, the head of the cluster joined at `opts.address` watched (`HeadWatch`),
    or the embedded cluster's node (`NodeWatch`); a `ClusterLost` raised in it says how
    to go on."""
    import ray

    if not opts.address:  # the embedded cluster: its node's processes, here
        def gone(what: str) -> str:
            return (f"the embedded Ray cluster lost its {what}: killed, or out of memory? "
                    f"the run stopped; {how_to_go_on(plan, opts)}")

        watch: HeadWatch | NodeWatch = NodeWatch(gone)
    else:
        gcs = ray.get_runtime_context().gcs_address

        def lost(seconds: float) -> str:
            return (f"lost the Ray head of `{opts.address}`: its GCS at {gcs} gave no "
                    f"answer for {seconds:g} s; the run stopped; {how_to_go_on(plan, opts)}")

        watch = HeadWatch(gcs, lost)
    try:
        with watch:
            yield
    except ClusterLost as exc:
        raise ClusterLost(f"{exc}; {how_to_go_on(plan, opts)}") from None
