"""A worker of a Ray pool: a Ray actor holding one `Worker` (its pool's models), which
the driver (`flowgraph.compilers.targets.ray.target.RayTarget`) calls one node at a time.

In a pool of size > 1 the workers form a torch process group (gloo on CPU, nccl on
GPU) and shard their models with FSDP2 where the plan says `full_shard`, as the fsdp
target does; a data-parallel call carries this worker's rank, the pool's size and the
row its slice starts at. Tensors arrive by value or as object-store references.

A worker's stdout and stderr (Python's prints and warnings, C libraries' output, a
crash's last words) go to `run_dir/logs/<pool>-<rank>.log` (`log_to`), and on to Ray's
own files of the worker, which Ray forwards to the driver's console with the
worker's name as prefix (`(actor_rollout_ref-0 pid=...)`); the log begins with a line
naming the worker, its host and node, its pid and when it started, as an fsdp rank's.
"""

from __future__ import annotations

import os
import socket
import sys
from contextlib import suppress
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from flowgraph.compilers.checkpoint.store import load_weights, save_shards
from flowgraph.compilers.logs import tee
from flowgraph.compilers.targets import process_groups
from flowgraph.compilers.targets.shared_run_dir import mark, marked
from flowgraph.compilers.vllm.weight_sync import reshard, whole
from flowgraph.compilers.worker import ExecOptions, Worker, pick_device, quiet_hf
from flowgraph.errors import FlowgraphError
from flowgraph.plan import plan_from_json
from flowgraph.spelling import option

try:
    import ray
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise FlowgraphError(f"{option('target', 'ray')} needs Ray: pip install 'ray>=2.40' "
                         f"({exc})") from exc


class RayWorker:
    """One worker of a pool (a Ray actor; `ray.remote` wraps it when the group starts)."""

    def __init__(self, sent: tuple[str, bytes | None], pool: str, rank: int, cwd: str,
                 path: list[str], run_dir: str) -> None:
        """`sent`: the plan's JSON and its Python objects, pickled (`pickled_objects`)."""
        self.label = f"{pool}-{rank}"
        os.chdir(cwd)  # model and data paths are relative to where the run started
        log_to(worker_log(Path(run_dir), pool, rank), f"worker {rank} of pool `{pool}`")
        quiet_hf()
        sys.path[:0] = [p for p in path if p not in sys.path]
        self.plan = plan_from_json(sent[0]).with_pickled(sent[1])
        self.pool = self.plan.pool(pool)
        self.rank = rank
        self.group = process_groups.DataParallel() if self.pool.size > 1 else None
        self.worker: Worker | None = None

    def __repr__(self) -> str:
        """The prefix of this worker's lines on the driver's console (Ray's)."""
        return self.label

    def node(self) -> tuple[str, str, int]:
        """The Ray node this worker runs on (its id, its address) and this worker's pid."""
        return (str(ray.get_runtime_context().get_node_id()), ray.util.get_node_ip_address(),
                os.getpid())

    def endpoint(self, one_node: bool) -> tuple[str, int]:
        """(address, free port) of the pool's process-group store, which this worker (0)
        serves on that address alone: 127.0.0.1 when the whole group is on this node, else
        the node's address in the cluster (`ray start --node-ip-address`)."""
        addr = "127.0.0.1" if one_node else ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
            s.bind((addr, 0))
            port = int(s.getsockname()[1])
        return addr, port

    def pid(self) -> int:
        return os.getpid()

    def sees(self, run_dir: str, token: str) -> tuple[str, bool]:
        """This worker's part in proving that the driver and its workers share the run
        dir (`RayTarget.start`): (its node's address, whether it sees the driver's
        marker holding `token`); it writes its own marker for the driver to read."""
        return ray.util.get_node_ip_address(), sees_run_dir(Path(run_dir), self.pool.name,
                                                            self.rank, token)

    def memory(self) -> list[tuple[str, int]]:
        from flowgraph.runtime.prometheus import process_memory

        return process_memory()

    def setup(self, addr: str, port: int, run_dir: str, checkpoint: str | None) -> None:
        device = pick_device(self.pool.device.split(":")[0])
        cpus = self.pool.bundles[self.rank].cpu if self.pool.bundles else 1
        torch.set_num_threads(max(cpus, 1))
        if self.pool.size > 1:
            process_groups.init_group(self.rank, self.pool.size, device, addr=addr, port=port)
        self.worker = Worker(self.plan, ExecOptions(Path(run_dir), device), self.pool.models,
                             place=lambda placed, spec, model: process_groups.place(
                                 placed, spec, model, self.pool.size, device))
        self.worker.prepare()
        self.worker.load_models()
        if checkpoint is not None:
            self.load(checkpoint)

    def load(self, checkpoint: str) -> None:
        """Weights, optimizer and scheduler states of this pool from a checkpoint."""
        w = self._ready()
        load_weights(Path(checkpoint), w.saved_models(), w.optimizers, w.schedulers)

    def save(self, folder: str) -> None:
        w = self._ready()
        save_shards(Path(folder), w.saved_models(), w.optimizers, w.schedulers, self.rank)

    def weights(self, models: list[str], changed: bool
                ) -> dict[str, dict[str, torch.Tensor]] | None:
        """The whole weights of `models` (hosted and trained here) on CPU, for the rollout
        pool of an asynchronous run (`flowgraph.compilers.rollouts.pool`); `changed`: only
        the entries an update changes (a LoRA model's adapters; both names of a tied
        embedding). Every worker of the pool runs it (a sharded entry is made whole by a
        collective); worker 0 answers, the others None."""
        w = self._ready()
        out = {}
        for m in models:
            model = w.models[m]
            reshard(model)  # the sharded parameters, not what a forward left unsharded
            keep = {k for k, p in model.named_parameters(remove_duplicate=False)
                    if p.requires_grad} if changed else None
            out[m] = {k: whole(v).detach().to("cpu", copy=True)
                      for k, v in model.state_dict().items() if keep is None or k in keep}
        return out if self.rank == 0 else None

    def call(self, name: str, inputs: dict[str, Any], step: int, params: dict[str, Any],
             dp: dict[str, Any]) -> tuple[dict[str, Any], float, dict[str, float]]:
        """Run node `name` on `inputs` (port -> value, or the object-store reference of a
        value every worker shares); (outputs, seconds, metrics)."""
        w = self._ready()
        inputs = _values(inputs)
        metrics: dict[str, float] = {}
        if self.group is not None and "dp_size" in dp:
            dp = {**dp, "workers": self.group}
        outputs, seconds = w.call(name, inputs, step, params, metrics, **dp)
        return outputs, seconds, metrics

    def evaluate(self, name: str, inputs: dict[str, Any], step: int, params: dict[str, Any]
                 ) -> dict[str, float]:
        """Update `name`'s metrics on held-out `inputs` (as `call` takes them), no step."""
        metrics: dict[str, float] = {}
        self._ready().evaluate_update(name, _values(inputs), step, params, metrics)
        return metrics

    def _ready(self) -> Worker:
        if self.worker is None:
            raise FlowgraphError("worker used before setup")
        return self.worker


DRIVER_MARKER = "driver"
"""The driver's marker in `run_dir/.ranks` (`flowgraph.compilers.targets.shared_run_dir.mark`)."""


def worker_marker(pool: str, rank: int) -> str:
    """The marker of worker `rank` of `pool` in `run_dir/.ranks`."""
    return f"worker_{pool}-{rank}"


def sees_run_dir(run_dir: Path, pool: str, rank: int, token: str) -> bool:
    """Whether the driver's marker in `run_dir` holds `token`, as worker `rank` of `pool`
    sees it; writes the worker's own marker (one it cannot write, the driver will not
    see)."""
    seen = marked(run_dir, DRIVER_MARKER, token)
    with suppress(OSError):  # the driver's read says so
        mark(run_dir, worker_marker(pool, rank), token)
    return seen


def worker_log(run_dir: Path, pool: str, rank: int) -> Path:
    """Where worker `rank` of `pool` writes its stdout and stderr."""
    return run_dir / "logs" / f"{pool}-{rank}.log"


def log_to(log: Path, who: str) -> None:
    """This worker's stdout and stderr appended to `log`, at the file descriptors (so C
    libraries' output and a crash's traceback land there too), and copied on to the
    stderr Ray gave the process, which Ray forwards to the driver's console
    (`flowgraph.compilers.logs.tee`, merged); first a line saying `who` started where
    and when (as an fsdp rank's log begins)."""
    tee(log, merged=True).note(
        f"flowgraph: {who} started (host {socket.gethostname()}, node "
        f"{ray.util.get_node_ip_address()}, pid {os.getpid()}, "
        f"{datetime.now(timezone.utc).isoformat(timespec='seconds')})")


def _values(inputs: dict[str, Any]) -> dict[str, Any]:
    """`inputs` with every object-store reference fetched (all at once)."""
    refs = [v for v in inputs.values() if isinstance(v, ray.ObjectRef)]
    got = dict(zip(map(id, refs), ray.get(refs), strict=True)) if refs else {}
    return {port: got.get(id(value), value) for port, value in inputs.items()}
