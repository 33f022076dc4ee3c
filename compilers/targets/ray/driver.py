"""The ray driver: `flowgraph run --target ray` starts or joins a Ray cluster
(`--address`) and runs the training loop with a `RayTarget` (the room's overview:
`flowgraph.compilers.targets.ray`)."""

from __future__ import annotations

import importlib.util
import os
import secrets
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flowgraph.compilers.loop import TrainingLoop
from flowgraph.compilers.options import RunOptions
from flowgraph.compilers.signals import REAP_MARK, child_pids, reap_with_parent, run_guard
from flowgraph.compilers.targets.ray.calls import namespace, run_name
from flowgraph.compilers.targets.ray.cluster import watched
from flowgraph.compilers.targets.ray.target import RayTarget
from flowgraph.compilers.worker import ExecOptions
from flowgraph.errors import DEBUG_ENV, FlowgraphError
from flowgraph.plan import ExecutionPlan
from flowgraph.registry import plugin_source
from flowgraph.runtime.metrics import serving
from flowgraph.spelling import ENTRY_ENV, Word, option

NAMESPACE_WAIT_S = 5.0
"""The longest wait for a dead run's actors to leave the run's namespace (`--address`)."""

try:
    import ray
    import ray._private.ray_constants as ray_constants
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise FlowgraphError(f"{option('target', 'ray')} needs Ray: pip install 'ray>=2.40' "
                         f"({exc})") from exc


# --- the driver ------------------------------------------------------------------------------


# --- entry point ------------------------------------------------------------------------------


def cluster_cpus(plan: ExecutionPlan) -> int:
    """Logical CPUs the embedded cluster offers: the plan's bundles (its rollout pool's
    too), at least the cores."""
    rollout = plan.asynchronous.pool if plan.asynchronous is not None else None
    need = sum(b.cpu for p in (*plan.pools, *([rollout] if rollout else [])) for b in p.bundles)
    return max(need, os.cpu_count() or 1)


def start_ray(plan: ExecutionPlan, address: str | None) -> None:
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    env = _runtime_env(plan)
    if address:
        try:
            _answers(address)
            ray.init(address=address, log_to_driver=True, runtime_env=env,
                     namespace=namespace(plan))
        except (OSError, RuntimeError, ValueError) as exc:  # ConnectionError is an OSError
            raise FlowgraphError(
                f"cannot join the Ray cluster at `{address}`: {exc}. Is `ray start --head` "
                "running there (its address, or `auto` on a machine of the cluster)? Or "
                f"leave out {option('address', Word('ADDR'))} for a local cluster") from None
        _namespace_free(plan, address)
        return
    _unjoined_address()
    _private_token()
    before = child_pids()
    mark = os.environ[REAP_MARK] = f"{os.getpid()}-{time.time_ns()}"  # inherited by them all
    with _loopback_node():
        # `local`: a cluster of its own, whatever `RAY_ADDRESS` or the `ray_current_cluster`
        # file in Ray's temp dir (left by a `ray start` that died) says; with no address
        # Ray would join what they name and refuse this call's `num_cpus`
        ray.init(address="local", num_cpus=cluster_cpus(plan), include_dashboard=False,
                 log_to_driver=True, configure_logging=False, runtime_env=env,
                 namespace=namespace(plan), _node_ip_address="127.0.0.1")
    reap_with_parent(child_pids() - before, mark)  # a killed driver takes the cluster along


def _unjoined_address() -> None:
    """A note when `RAY_ADDRESS` names a cluster and no `--address` was given: the run
    starts its own cluster (one is joined only with `--address`; `--address auto` joins
    the one `RAY_ADDRESS` names, as in a `ray job submit` job, which Ray gives it)."""
    named = os.environ.get("RAY_ADDRESS", "").strip()
    if not named or named == "local":
        return
    print(f"flowgraph: note: RAY_ADDRESS={named} is set and {option('address', Word('ADDR'))} "
          f"is not: this run starts a Ray cluster of its own on this machine; to join that "
          f"cluster, add {option('address', 'auto')}", file=sys.stderr, flush=True)


@contextmanager
def _loopback_node() -> Iterator[None]:
    """The embedded cluster's node at 127.0.0.1, so that every server of Ray's (GCS,
    raylet and object manager, dashboard and runtime-env agents, metrics, each worker's
    gRPC server) listens there alone, as Ray does when its node's address is 127.0.0.1.
    `ray.init` replaces a loopback `_node_ip_address` with the machine's outward address
    unless Ray runs no cluster of several machines (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`,
    which Ray reads once, when imported): that setting is off while `ray.init` starts the
    node, and as it was afterwards (a later `--address` run in this process joins as
    usual). The node's processes take their address from their command line."""
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def _namespace_free(plan: ExecutionPlan, address: str) -> None:
    """Stop when the run's namespace on the cluster joined holds live actors: another
    run's whose run dir has the same name (one run dir is one run: its lock). A dead
    driver's actors are Ray's to end, which it does within a second (measured 0.1 s);
    they are waited for `NAMESPACE_WAIT_S` at most."""
    deadline = time.monotonic() + NAMESPACE_WAIT_S
    while held := ray.util.list_named_actors():  # this job's namespace
        if time.monotonic() > deadline:
            raise FlowgraphError(
                f"the Ray cluster at `{address}` runs actors of another run in namespace "
                f"`{namespace(plan)}` ({', '.join(sorted(held)[:3])}): a run's Ray names "
                f"come from its run dir's name, `{run_name(plan)}`; give this run a run dir "
                f"of another name, e.g. {option('run_dir', f'runs/{run_name(plan)}-2')}")
        time.sleep(0.5)


def _private_token() -> None:
    """Ray (2.5x) enables token authentication on a cluster `ray.init` starts and, when
    it finds no token, writes one to `~/.ray/auth_token` readable by everyone (0644).
    Write it first, readable by its owner alone (0600); tighten one left readable."""
    told = os.environ.get("RAY_AUTH_MODE", "token").lower() != "token" or any(
        k in os.environ for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"))
    if told or importlib.util.find_spec("ray._private.authentication") is None:
        return  # the user's token, or a Ray without token authentication
    path = Path.home() / ".ray" / "auth_token"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # as `ray get-auth-token --generate` makes one


def _runtime_env(plan: ExecutionPlan) -> dict[str, Any] | None:
    """What the job's workers need wherever they run: the plugin files and packages
    next to the graph (`py_modules`, uploaded with the job) and `--debug`."""
    env: dict[str, Any] = {}
    told = {k: os.environ[k] for k in (DEBUG_ENV, ENTRY_ENV) if k in os.environ}
    if told:  # `--debug`; the voice of the workers' messages (`flowgraph.spelling`)
        env["env_vars"] = told
    sources = [plugin_source(p.module, folder) for p in plan.plugins
               for folder in plan.plugin_paths]
    modules = sorted({str(s) for s in sources if s is not None})
    if modules:
        env["py_modules"] = modules
    return env or None


def _answers(address: str) -> None:
    """Raise OSError when nothing listens at a `host:port` address: `ray.init` would
    retry such an address for minutes before it gives up."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # `auto`, `ray://...`: Ray resolves those itself
    with socket.create_connection((host.strip("[]"), int(port)), timeout=5):  # [::1]:6379
        pass


def run_ray(plan: ExecutionPlan, opts: RunOptions) -> None:
    """`flowgraph run --target ray`: start or join a cluster (`opts.address`) and drive
    the plan. Prometheus metrics as `run_plan` serves them, from the driver."""
    run_dir = Path(plan.trainer.run_dir).resolve()
    with serving(plan, opts.metrics_port, opts.metrics_host, hold=opts.metrics_hold,
                 target="ray", out=opts.out) as exporter, run_guard(plan, opts) as stop:
        target = None
        try:
            start_ray(plan, opts.address)
            stop.take_signals()  # ray.init's SIGTERM handler would end the driver
            options = ExecOptions(run_dir, "cpu", opts.strict, opts.resume, opts.out,
                                  opts.tensorboard, exporter, stop=stop,
                                  allow_changed=opts.allow_changed)
            with watched(plan, opts):  # a lost head or node: what to do, not Ray's exit
                target = RayTarget(plan, options)
                loop = TrainingLoop(plan, target, options)
                loop.setup()
                loop.run()
        finally:  # workers first: the endpoint is held after this block
            if target is not None:
                target.stop()
            if opts.shutdown and not opts.address and ray.is_initialized():
                ray.shutdown()
