"""The fsdp launch: the ranks started through torch's elastic launcher (or by torchrun),
the body of each rank, and the launcher's report of a failed run (the room's overview:
`flowgraph.compilers.targets.fsdp`)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import tempfile
import traceback
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from flowgraph.compilers.checkpoint.store import (
    latest_checkpoint,
)
from flowgraph.compilers.logs import tee
from flowgraph.compilers.loop import TrainingLoop
from flowgraph.compilers.options import RunOptions
from flowgraph.compilers.signals import (
    STOP_FILE,
    Preemption,
    die_with_parent,
    resume_command,
    run_guard,
)
from flowgraph.compilers.targets import process_groups
from flowgraph.compilers.targets.fsdp.multinode import Failure, Machines, meet
from flowgraph.compilers.targets.fsdp.target import FsdpTarget
from flowgraph.compilers.worker import ExecOptions
from flowgraph.errors import (
    FlowgraphError,
    Interrupted,
    RankFailed,
    Stopped,
    UsageError,
)
from flowgraph.plan import ExecutionPlan, read_run_plan, write_run_plan
from flowgraph.runtime.metrics import serving
from flowgraph.spelling import Word, inherited, option

STOPPED = ".ranks/stopped"
"""Written by rank 0 when the ranks stopped on a signal, their checkpoint saved."""
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""Set to 1 while launching: torch's agent then shares no store with the ranks."""


# --- processes -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_main(plan_json: str, run_dir: str, strict: bool, resume: bool,
              metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
              metrics_hold: float = 0.0, launcher: int = 0,
              allow_changed: tuple[str, ...] = (), stop: Preemption | None = None) -> None:
    """The body of one rank (under torch's launcher: RANK, WORLD_SIZE, LOCAL_RANK set).
    Rank 0 serves Prometheus metrics on `metrics_port` when it is given. Started by
    `launch` (pid `launcher`; no `stop` given), the rank ends with it, handles SIGTERM and
    SIGINT itself and, stopped by one, returns after rank 0 has written
    `.ranks/stopped` (the launcher reports it); started by torchrun, `run_fsdp` handles
    them and the rank raises `Stopped`. From its start (before the plan's plugins load)
    the rank's stdout and stderr also go to `run_dir/logs/rank-<R>.log` (`tee`), after a
    line saying who started when; a failure's traceback, to that log alone."""
    rank = int(os.environ["RANK"])
    with tee(rank_log(Path(run_dir), rank)) as output:
        output.note(f"flowgraph: rank {rank} of {os.environ['WORLD_SIZE']} started (host "
                    f"{socket.gethostname()}, pid {os.getpid()}, "
                    f"{datetime.now(timezone.utc).isoformat(timespec='seconds')})")
        launched = stop is None
        if stop is None:
            die_with_parent(launcher, signal.SIGTERM)  # a killed launcher: stop, saving
            stop = Preemption(0.0, open(os.devnull, "w"))  # noqa: SIM115 - launcher says it
        with stop.installed():
            try:
                _rank(plan_json, strict, resume, metrics_port, metrics_host, metrics_hold,
                      stop, allow_changed)
            except Stopped:
                if not launched:
                    raise
            except Exception:
                output.close()  # the log in order; the console names the failure already
                output.note(traceback.format_exc())
                raise


def rank_log(run_dir: Path, rank: int) -> Path:
    """Where rank `rank` (global) writes its stdout and stderr (`flowgraph.compilers.logs`)."""
    return run_dir / "logs" / f"rank-{rank}.log"


def _rank(plan_json: str, strict: bool, resume: bool, metrics_port: int | None,
          metrics_host: str, metrics_hold: float, stop: Preemption,
          allow_changed: tuple[str, ...]) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    plan = read_run_plan(Path(plan_json))
    run_dir = Path(plan.trainer.run_dir)
    device = "cpu"
    if plan.resources.device != "cpu" and torch.cuda.is_available():
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    else:  # share the cores: N ranks with all cores each would oversubscribe them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    exporting = (plan.trainer.metrics_port if metrics_port is None
                 else metrics_port) is not None
    stop.grace_s = plan.trainer.stop_grace_s
    try:
        with serving(plan, metrics_port, metrics_host, hold=metrics_hold,
                     target="fsdp", out=sys.stdout, here=rank == 0) as exporter:
            # A rank silent for trainer.step_timeout_s fails its peers' next collective:
            # the hang ends the job like a death (and names the ranks' positions).
            process_groups.init_group(rank, world, device,
                             timeout_s=plan.trainer.step_timeout_s or 1800.0)
            options = ExecOptions(run_dir, device, strict, resume, out=sys.stdout,
                                  exporter=exporter, stop=stop,
                                  allow_changed=allow_changed)
            target = FsdpTarget(plan, options, rank, world, exporting=exporting)
            loop = TrainingLoop(plan, target, options)
            loop.setup()
            loop.run()
    except Stopped:
        if rank == 0:  # every rank saved and stopped at the same node
            (run_dir / STOPPED).write_text(str(stop.signum))
        raise
    except BaseException as exc:
        where = process_groups.read_status(run_dir, rank)
        text = f"{type(exc).__name__}: {exc}" if not isinstance(exc, FlowgraphError) else str(exc)
        (run_dir / ".ranks").mkdir(parents=True, exist_ok=True)
        named = where is None or f"node `{where[1]}`" in text
        (run_dir / ".ranks" / f"error_{rank}").write_text(
            text + ("" if named or where is None
                    else f"\n(at step {where[0]}, node `{where[1]}`)"))
        (run_dir / ".ranks" / f"traceback_{rank}").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def world_size(plan: ExecutionPlan) -> int:
    """Processes in all: the size of the plan's one pool (`spmd`)."""
    (pool,) = [p for p in plan.pools if p.bundles]
    return pool.size


def _check_gpus(plan: ExecutionPlan, per_machine: int) -> None:
    """On cuda every rank of this machine takes a GPU of its own (`LOCAL_RANK`): stop
    before any rank starts when the machine sees fewer CUDA devices than it runs ranks."""
    (pool,) = [p for p in plan.pools if p.bundles]
    gpus = pool.bundles[0].gpu * per_machine
    seen = torch.cuda.device_count() if plan.device == "cuda" else gpus
    if seen >= gpus:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    raise FlowgraphError(
        f"the plan runs {per_machine} rank(s) on this machine on cuda, {gpus} GPU(s) in all, "
        f"and it sees {seen} CUDA device(s)"
        + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
        + f"; lower {option('nproc', Word('N'))} (or spread the ranks over more machines "
        f"with {option('nnodes', Word('M'))}), or compile for cpu (`resources.device: cpu`)")


def launch(plan: ExecutionPlan, opts: RunOptions, out: TextIO | None = None) -> Path:
    """Run `plan` on its pool's processes, `opts.nnodes` machines sharing them evenly;
    the run dir when it finished."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    out = out or sys.stdout
    world = world_size(plan)
    if world % opts.nnodes:
        raise FlowgraphError(f"the plan's {world} processes do not split over "
                             f"{option('nnodes', opts.nnodes)} machines")
    if opts.nnodes > 1 and opts.rdzv_endpoint is None:
        raise UsageError(f"{option('nnodes', opts.nnodes)} needs "
                         f"{option('rdzv_endpoint', Word('HOST:PORT'))}: node 0's address and "
                         "a free port, the same on every machine")
    _check_gpus(plan, world // opts.nnodes)
    first = opts.node_rank == 0  # node 0 prepared the run dir: the others share it
    run_dir = Path(plan.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ranks = run_dir / ".ranks"
    for stale in ranks.glob("*") if first and ranks.is_dir() else []:
        stale.unlink()
    endpoint = opts.rdzv_endpoint or f"127.0.0.1:{_free_port()}"
    # Node 0 serves the rendezvous on the endpoint's address alone (torch's would listen
    # on every interface); every launcher, node 0's too, joins it as a client. Several
    # machines meet there first (`meet`), before torch's rendezvous.
    rendezvous = _rendezvous_store(endpoint, opts.rdzv_timeout) if first else None
    machines = (meet(opts, run_dir, opts.out or sys.stderr, rendezvous)
                if opts.nnodes > 1 else None)
    plan_json = run_dir / ".ranks" / ("plan.json" if first else f"plan.node{opts.node_rank}.json")
    plan_json.parent.mkdir(exist_ok=True)
    write_run_plan(plan, plan_json)
    config = LaunchConfig(
        min_nodes=opts.nnodes, max_nodes=opts.nnodes, nproc_per_node=world // opts.nnodes,
        run_id=f"flowgraph-{uuid.uuid4().hex[:8]}" if opts.rdzv_endpoint is None
        else f"flowgraph-{plan.name}",
        rdzv_backend="c10d", rdzv_endpoint=endpoint,
        rdzv_configs={"is_host": False, **({"join_timeout": int(opts.rdzv_timeout)}
                                          if opts.nnodes > 1 else {})},
        local_addr="127.0.0.1" if opts.nnodes == 1 else address_towards(endpoint),
        logs_specs=DefaultLogsSpecs(log_dir=os.devnull),  # no `torchelastic_*` folder
        max_restarts=0, monitor_interval=0.1, start_method="spawn",
        signals_to_handle="SIGHUP,SIGQUIT")
    def tell_ranks(signum: int) -> None:
        (run_dir / STOP_FILE).write_text(str(signum))

    # SIGTERM and SIGINT are ours (`run_guard`), not torch's launcher's, whose handler
    # would kill the ranks before they save (and print its SignalException)
    with run_guard(plan, opts, lock=opts.node_rank == 0, on_request=tell_ranks) as stop:
        try:
            with _quiet_launcher(), _contained(), (
                    machines.watching(partial(_position, run_dir)) if machines
                    else nullcontext()):
                elastic_launch(config, rank_main)(str(plan_json), str(run_dir), opts.strict,
                                                  opts.resume, opts.metrics_port,
                                                  opts.metrics_host, opts.metrics_hold,
                                                  os.getpid(), opts.allow_changed)
        except ChildFailedError as exc:
            if stop.signum is not None:  # a rank stopped at once (a second signal)
                raise Interrupted(stop.signum) from None
            raise RankFailed(_failure_message(exc, run_dir, plan, opts, machines)) from None
        finally:
            del rendezvous  # served until here: the launchers are gone
        if (run_dir / STOPPED).exists():
            raise Stopped(int((run_dir / STOPPED).read_text()), "stopped")
    return run_dir


def _rendezvous_store(endpoint: str, timeout_s: float) -> Any:
    """The rendezvous' store, served by node 0 on the endpoint's address alone."""
    from datetime import timedelta

    host, port = _host_port(endpoint)
    try:
        return process_groups.listening_store(host, port, None,
                                     timedelta(seconds=max(timeout_s, 60.0)))
    except FlowgraphError as exc:
        raise FlowgraphError(f"{option('rdzv_endpoint', endpoint)}: {exc}; node 0 serves "
                             "the rendezvous, so the endpoint is an address of node 0 "
                             "(this machine) and a free port") from None


def address_towards(endpoint: str) -> str:
    """This machine's address on the way to the rendezvous `endpoint` (the interface a
    packet to it leaves by): where the other nodes reach this one, and so where the
    ranks' store listens when this node's rank 0 serves it (MASTER_ADDR)."""
    host, port = _host_port(endpoint)
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)  # UDP: no packet is sent, the kernel only picks the route
        return str(s.getsockname()[0])


def _host_port(endpoint: str) -> tuple[str, int]:
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
    return str(host), int(port)


@contextmanager
def _contained() -> Iterator[None]:
    """Torch's launcher, kept from leaving anything behind or listening widely: the
    traceback files of failed ranks (`pytorch-errorfile-*.pickle`) go to a temp folder
    removed after the launch, and its agent shares no store with the ranks (that one
    would listen on every interface): rank 0 serves theirs on MASTER_ADDR alone
    (`process_groups.init_group`), the agent's `local_addr`."""
    saved = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="flowgraph-launch-") as scratch, \
            inherited(SHARE_STORE_ENV, "1"):
        tempfile.tempdir = scratch
        try:
            yield
        finally:
            tempfile.tempdir = saved


def _failure_message(exc: Any, run_dir: Path, plan: ExecutionPlan, opts: RunOptions,
                     machines: Machines | None = None) -> str:
    """`rank 1 died (SIGKILL) at step 3 in node `update_actor``, with how to resume. On
    several machines, every machine's failed ranks (`Machines.gathered`): each names
    the same rank."""
    failures = [_failure(run_dir, rank, failure) for rank, failure in exc.failures.items()]
    if machines is not None:  # its own ranks it ended for another machine: as it saw them
        failures = machines.gathered([machines.ended.get(f.rank, f) for f in failures])
    # The first failure first; echoes (a peer's broken connection) only with no other.
    causes = [f for f in failures if not f.echo] or failures
    lines = [f.line for f in sorted(causes, key=lambda f: (f.time, f.rank))]
    traces = [str(run_dir / ".ranks" / f"traceback_{f.rank}") for f in causes
              if (run_dir / ".ranks" / f"traceback_{f.rank}").exists()]
    done = latest_checkpoint(run_dir)
    # --resume also without a checkpoint: the run dir already holds metrics.jsonl rows
    again = resume_command(plan, opts)
    tail = (f"the last checkpoint is step {done[0]}; continue with: {again}" if done
            else f"no checkpoint was written; start again from step 0 with: {again}")
    if traces:
        tail += f"\n(the full traceback: {', '.join(traces)})"
    logs = [str(rank_log(run_dir, f.rank)) for f in causes
            if rank_log(run_dir, f.rank).exists()]
    if logs:
        tail += f"\n(the output of the failed rank{'s' if len(logs) > 1 else ''}: " \
                f"{', '.join(logs)})"
    return "the fsdp run stopped: " + "; ".join(lines) + f"\n{tail}"


def _position(run_dir: Path, rank: int) -> tuple[int, str, int] | None:
    """Rank `rank`'s step, node and pid (its status file), None before its first node."""
    where, pid = process_groups.read_status(run_dir, rank), process_groups.status_pid(run_dir, rank)
    return None if where is None or pid is None else (*where, pid)


def _failure(run_dir: Path, rank: int, failure: Any) -> Failure:
    """A failed rank of this machine: its error, else how it ended and where it was."""
    error = run_dir / ".ranks" / f"error_{rank}"
    if error.exists():
        text = error.read_text().strip()
        return Failure(rank, f"rank {rank} failed: {text}", failure.timestamp,
                       process_groups.lost_peer(text))
    where = process_groups.read_status(run_dir, rank)
    code = failure.exitcode
    how = (f"was killed by {signal.Signals(-code).name}" if code < 0
           else f"exited with code {code}")
    at = f" at step {where[0]} in node `{where[1]}`" if where else " before its first node"
    return Failure(rank, f"rank {rank} {how}{at}", failure.timestamp, False)


@contextmanager
def _quiet_launcher() -> Iterator[None]:
    """Torch's launcher logs every failed rank's traceback, and a line for each rank it
    then stops; `_failure_message` says what failed instead, and the traceback stays in
    `run_dir/.ranks/traceback_R`."""
    loggers = [logging.getLogger(name) for name in (
        "torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def torchrun_rank() -> int | None:
    """This process's rank when torchrun started it (WORLD_SIZE and RANK set), else None."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return int(os.environ["RANK"])
    return None


def run_fsdp(plan: ExecutionPlan, opts: RunOptions) -> None:
    """`flowgraph run --target fsdp`: as a rank when torchrun started us, else launch."""
    rank = torchrun_rank()
    if rank is not None:
        first = rank == 0
        run_dir = Path(plan.trainer.run_dir)
        plan_json = run_dir / ".ranks" / f"plan.{rank}.json"
        plan_json.parent.mkdir(parents=True, exist_ok=True)
        if first:  # a previous launcher's; the others read it after the loop's barrier
            (run_dir / STOP_FILE).unlink(missing_ok=True)
        write_run_plan(plan, plan_json)
        with run_guard(plan, opts, lock=first) as stop:
            rank_main(str(plan_json), str(run_dir), opts.strict, opts.resume,
                      opts.metrics_port, opts.metrics_host, opts.metrics_hold, stop=stop,
                      allow_changed=opts.allow_changed)
        return
    launch(plan, opts)
