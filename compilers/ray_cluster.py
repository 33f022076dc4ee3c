"""What a Ray run does when the cluster it joined (`--address`) loses a part.

* The head: Ray's driver waits `RAY_gcs_rpc_server_reconnect_timeout_s` (60 s) for a
  lost GCS, then logs `Failed to connect to GCS ... The program will terminate` and ends
  the process where it stands, no Python code run. `HeadWatch` knocks at the head's
  GCS address every second; when it has not answered for `LOST_MARGIN_S` less than
  that, it says what was lost, the last checkpoint and the command that resumes the
  run (`lost`), and ends the driver itself (exit 1).
* A node: its workers die (`WorkerLost`) and the driver restarts the worker groups,
  which must be placed again on what the cluster has left; `placed` waits for a
  placement group `PLACE_TIMEOUT_S` at most, then stops with what was asked and what
  the cluster has.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowgraph.errors import FlowgraphError

if TYPE_CHECKING:
    from flowgraph.compilers.options import RunOptions
    from flowgraph.plan import ExecutionPlan

LOST_MARGIN_S = 5.0
"""The head counts as lost this long before Ray would end the driver."""
PLACE_TIMEOUT_S = 300.0
"""The longest wait for a pool's placement group (its bundles) to be placed."""
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


def placed(pg: Any, pool: str, bundles: list[dict[str, Any]]) -> None:
    """Wait for placement group `pg` (pool `pool`'s `bundles`) `PLACE_TIMEOUT_S` at most."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        ray.get(pg.ready(), timeout=PLACE_TIMEOUT_S)
    except GetTimeoutError:
        have = {k: v for k, v in ray.available_resources().items()
                if k in ("CPU", "GPU") or k.startswith("accelerator")}
        raise ClusterLost(
            f"pool `{pool}`'s {len(bundles)} workers ({bundles[0]} each) could not be "
            f"placed within {PLACE_TIMEOUT_S:g} s: the cluster has {have or 'nothing'} "
            f"free ({len(ray.nodes())} node(s) known, "
            f"{sum(n['Alive'] for n in ray.nodes())} alive); a node may be lost, or the "
            "plan asks for more than the cluster has") from None


def how_to_go_on(plan: ExecutionPlan, opts: RunOptions) -> str:
    """The last checkpoint and the command that continues the run from it."""
    from flowgraph.compilers.checkpoint import latest_checkpoint
    from flowgraph.compilers.signals import resume_command

    done = latest_checkpoint(Path(plan.trainer.run_dir))
    again = resume_command(plan, opts)
    return (f"the last checkpoint is step {done[0]}; once the cluster is whole again, "
            f"continue with: {again}" if done else
            f"no checkpoint was written; once the cluster is whole again, start again "
            f"with: {again}")


@contextmanager
def watched(plan: ExecutionPlan, opts: RunOptions) -> Iterator[None]:
    """The body, the head of the cluster joined at `opts.address` watched (`HeadWatch`);
    a `ClusterLost` raised in it says how to go on."""
    import ray

    if not opts.address:  # an embedded cluster lives and dies with this process
        yield
        return
    gcs = ray.get_runtime_context().gcs_address

    def lost(seconds: float) -> str:
        return (f"lost the Ray head of `{opts.address}`: its GCS at {gcs} gave no answer "
                f"for {seconds:g} s; the run stopped; {how_to_go_on(plan, opts)}")

    try:
        with HeadWatch(gcs, lost):
            yield
    except ClusterLost as exc:
        raise ClusterLost(f"{exc}; {how_to_go_on(plan, opts)}") from None
