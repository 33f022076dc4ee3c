"""What the fsdp and ray executors share: process groups, sharding, slicing, checkpoints.

Sharding (FSDP2). A model is wrapped with `fully_shard` per transformer block and once
more around its backbone (embeddings, final norm): those run once per forward on every
worker, so their collectives line up. The heads (a causal LM's `lm_head`, a critic's
`value_head`) stay replicated: the chunked log-prob calls the LM head once per chunk of
valid tokens, a number that differs between workers. Gradients are summed over the
workers, not averaged (the update node weighs each worker's loss by its share of the
whole mini-batch): FSDP's reduce-scatter with a divide factor of 1 and a plain sum
(gloo has no pre-scaled sum), the replicated ones by `DataParallel.clip_grad_norm`
before the norm is taken.
A parameter that two of these parts share — a tied `lm_head.weight` is the backbone's
`embed_tokens.weight` — stays replicated too, one Parameter for all its users: sharded
in the backbone it would become a DTensor while the head kept the old tensor, two
copies with the gradient split between them. Its gradient is the sum over its uses, as
in one process, summed over the workers like a head's. (It costs what an untied
model's head costs: V·H replicated.)

Slicing. A data-parallel node's batch is cut into `world` contiguous parts of whole
units (a unit is a group of N samples of one prompt where the plan says the split is
group-aligned, else one row); every part is padded to the same number of rows by
repeating its last row, so every worker runs the same number of forward passes, and
the padding is dropped when the outputs are gathered.

Checkpoints. `torch.distributed.checkpoint` (DCP) writes each worker's shards; a
checkpoint can be loaded by any number of workers (DCP reshards), and `flowgraph
export` reads it back whole in one process. A checkpoint of the local target (whole
tensors) loads into sharded models too: each worker keeps its shard of every tensor.

Notation: n rows of a batch, W workers (world size), u rows per unit.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import TCPStore  # torch.distributed's, undeclared there

from flowgraph.compilers.build import torch_dtype
from flowgraph.compilers.checkpoint.store import is_sharded
from flowgraph.errors import FlowgraphError
from flowgraph.ir import ModelSpec
from flowgraph.plan import ExecutionPlan, ModelPlacement
from flowgraph.runtime.context import Workers

# --- process groups ---------------------------------------------------------------------


def backend_for(device: str) -> str:
    """nccl for CUDA tensors and gloo for CPU ones on a GPU worker: the collectives on CPU
    tensors (the workers' flags and sums, the gradient norm's squares, the shards FSDP2
    offloads to host memory when they are made whole for a weight sync or an export) go
    over gloo, as torchtitan does for CPU offload."""
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def init_group(rank: int, world: int, device: str, *, addr: str | None = None,
               port: int | None = None, timeout_s: float = 1800.0) -> None:
    """Join the default process group, its store at `addr:port` (None: MASTER_ADDR and
    MASTER_PORT, as torch's launcher sets them). Rank 0 serves the store on `addr` only
    (`listening_store`), never on every interface as torch's own store would; under a
    `torchrun` that shares its agent's store with the ranks, that one is used."""
    if dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    if addr is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(backend_for(device), rank=rank, world_size=world,
                                timeout=timeout)
        return
    if addr is not None:  # as torch's launcher would: for what reads them later
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = (listening_store(addr, port, world, timeout) if rank == 0 else
             TCPStore(addr, port, world, False, timeout=timeout))
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world,
                            timeout=timeout)


def listening_store(addr: str, port: int, world: int | None,
                    timeout: timedelta) -> TCPStore:
    """The server of a TCPStore listening on `addr` alone (127.0.0.1 on one machine, the
    address the user named across machines): torch's binds every interface, so it is
    handed a socket bound here (`master_listen_fd`)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise FlowgraphError(f"cannot listen on {addr}:{port}: {exc.strerror or exc}"
                             ) from None
    return TCPStore(addr, port, world, True, timeout=timeout,
                         master_listen_fd=sock.detach())


class DataParallel(Workers):
    """`NodeContext.workers` of a data-parallel node: each service a collective over
    `group` (the default group when None) that every worker calls at the same point."""

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def all(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def sum(self, values: Mapping[str, float]) -> dict[str, float]:
        names = sorted(values)
        t = torch.tensor([values[k] for k in names], dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return dict(zip(names, t.tolist(), strict=True))

    def max(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def inference(self, model: Any) -> AbstractContextManager[Any]:
        return torch.no_grad() if is_sharded(model) else torch.inference_mode()

    def clip_grad_norm(self, model: Any, max_norm: float) -> float:
        """The sharded parameters (DTensors) hold a slice of the summed gradient on
        each worker; the replicated ones (heads, tied embeddings) their worker's part,
        summed here first. The norm adds the slices' squares over the workers, then the
        replicated ones' once (`parameters()` lists a tied parameter once)."""
        self._sum_replicated(model)
        params = [p for p in model.parameters() if p.grad is not None]
        sharded = [p.grad.to_local() for p in params if hasattr(p.grad, "to_local")]
        replicated = [p.grad for p in params if not hasattr(p.grad, "to_local")]
        squares = torch.zeros(1, dtype=torch.float64)
        for g in sharded:
            squares += g.double().square().sum().cpu()
        dist.all_reduce(squares, group=self.group)
        for g in replicated:
            squares += g.double().square().sum().cpu()
        norm = float(squares.sqrt().float())
        coef = max_norm / (norm + 1e-6)  # torch's clip_grad_norm_ formula
        if max_norm > 0 and coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
        return norm

    def _sum_replicated(self, model: nn.Module) -> None:
        params = [p for p in model.parameters() if p.requires_grad
                  and not hasattr(p, "to_local")]
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        for p, part in zip(params, flat.split([g.numel() for g in grads]), strict=True):
            p.grad = part.view_as(p).to(p.dtype)


# --- sharding ---------------------------------------------------------------------------


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the longest `nn.ModuleList` of the model."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise FlowgraphError(f"cannot shard `{type(model).__name__}`: no transformer blocks "
                             "(an nn.ModuleList) found")
    longest: nn.ModuleList = max(lists, key=len)
    return list(longest)


def shard_model(model: nn.Module, device: str, spec: ModelSpec | None = None) -> nn.Module:
    """FSDP2 over the default group: per block, then the backbone; heads, and the
    parameters shared between any two of these parts, replicated. A trained model in
    mixed precision (`dtype: bfloat16`) keeps fp32 shards, all-gathers them as bf16 and
    reduces its gradients in fp32 (`MixedPrecisionPolicy`); `offload.params` keeps the
    shards and their gradients in host memory (`CPUOffloadPolicy`, pinned on CUDA)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model.to(device)
    backbone = cast(nn.Module, getattr(model, "backbone", None)
                    or getattr(model, "base_model", model))
    units = [*blocks(model), *([backbone] if backbone is not model else [])]
    shared = shared_params(model, units)
    policies: dict[str, Any] = {}
    if spec is not None and spec.trainable and spec.precision.mixed:
        policies["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch_dtype(spec.precision.compute),
            reduce_dtype=torch_dtype(spec.precision.master))
    if spec is not None and spec.offload is not None and spec.offload.params:
        policies["offload_policy"] = CPUOffloadPolicy(pin_memory=device.startswith("cuda"))
    for unit in units:
        fully_shard(unit, ignored_params=shared, **policies)
        unit.set_gradient_divide_factor(1.0)  # type: ignore[operator]  # summed, see above
        unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]  # gloo: no PREMUL_SUM
    return model


def place(placed: ModelPlacement, spec: ModelSpec, model: nn.Module, world: int, device: str
          ) -> nn.Module:
    """A model as the plan places it on a group of `world` workers: FSDP2 where it says
    `full_shard` (heads and tied embeddings replicated; `spec`'s precision and offload),
    else whole on every worker."""
    if world > 1 and placed.sharding == "full_shard":
        return shard_model(model, device, spec)
    return model


def shared_params(model: nn.Module, units: Sequence[nn.Module]) -> set[nn.Parameter]:
    """The parameters of `model` reached from more than one part: a part is one of
    `units` (the innermost that holds a name) or the rest of the model."""
    prefixes = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    names = sorted((prefixes[id(u)] + "." for u in units), key=len, reverse=True)
    parts: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        part = next((prefix for prefix in names if name.startswith(prefix)), "")
        parts.setdefault(id(p), set()).add(part)
    return {p for p in model.parameters() if len(parts[id(p)]) > 1}


# --- slicing ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Slices:
    """Worker w takes rows `bounds[w]` (possibly short or empty), padded to `rows`."""

    bounds: tuple[tuple[int, int], ...]
    rows: int

    @staticmethod
    def of(n: int, world: int, unit: int = 1) -> Slices:
        unit = unit if unit > 0 and n % unit == 0 else 1
        per = -(-(n // unit) // world) * unit  # ceil(units / W) units
        bounds = tuple((min(w * per, n), min((w + 1) * per, n)) for w in range(world))
        return Slices(bounds, max(per, 1))

    def index(self, worker: int) -> torch.Tensor:
        """Row indices for `worker`, padded with its last row (row 0 when it has none)."""
        lo, hi = self.bounds[worker]
        rows = list(range(lo, hi)) or [0]
        rows += [rows[-1]] * (self.rows - len(rows))
        return torch.tensor(rows, dtype=torch.int64)

    def real(self, worker: int) -> int:
        lo, hi = self.bounds[worker]
        return hi - lo


@dataclass(frozen=True)
class Cut:
    """A data-parallel node's inputs for `world` workers, as the plan dispatches each
    edge: `split` / `reshard` inputs cut into slices (whole groups of N rows where an
    edge is group-aligned; padded so every worker runs as many rows), the rest whole on
    every worker (`local`, `gather`, `broadcast`)."""

    slices: Slices | None
    """None: the plan cuts no input; every worker gets the whole batch."""
    shared: bool
    """A batch goes whole to every worker by `broadcast` (an update's inputs): each
    worker takes its share of every mini-batch (it is told its rank)."""
    parts: Callable[[int], dict[str, Any]]
    """Worker w's slice of each cut input."""


def cut(plan: ExecutionPlan, name: str, inputs: dict[str, Any], world: int) -> Cut:
    """Node `name`'s `inputs` as the plan dispatches them to `world` workers."""
    ports, aligned, shared = [], False, False
    for wired in plan.node(name).inputs:
        edge = plan.edge(wired.src, f"{name}.{wired.port}")
        if edge.dispatch in ("split", "reshard"):
            ports.append(wired.port)
            aligned |= edge.group_aligned
        shared |= edge.dispatch == "broadcast" and edge.batched
    if not ports:
        return Cut(None, shared, lambda w: {})
    n = next((d.value for d in plan.dims if d.name == "N"), 1)
    slices = Slices.of(len(inputs[ports[0]]), world, n if aligned else 1)
    return Cut(slices, shared, lambda w: {p: take(inputs[p], slices.index(w)) for p in ports})


def take(value: Any, rows: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor):
        return value[rows.to(value.device)]
    return [value[int(i)] for i in rows]


def join_outputs(plan: ExecutionPlan, name: str, first: dict[str, Any], slices: Slices,
                 parts: Callable[[str, Any], Sequence[Any]]) -> dict[str, Any]:
    """The whole-batch outputs of node `name` run on slices. `first` holds one worker's
    outputs; `parts(port, value)` every worker's value of an output the plan says is
    batched (`OutputPlan.batched`: an all-gather, or the Ray results), concatenated
    here without each worker's padding: an output with k rows per input row (a
    rollout's n samples) keeps k rows per real row. An output without a batch axis is
    the same on every worker and is taken as it is."""
    batched = {o.port for o in plan.node(name).outputs if o.batched}
    whole = {}
    for port, value in first.items():
        if port not in batched or not _rows(value):
            whole[port] = value
            continue
        kept = []
        for w, part in enumerate(parts(port, value)):
            kept.append(part[: len(part) // slices.rows * slices.real(w)])
        whole[port] = (torch.cat(kept) if isinstance(value, torch.Tensor)
                       else [x for part in kept for x in part])
    return whole


def _rows(value: Any) -> bool:
    """A value with rows to concatenate (a 0-d tensor or a scalar has none)."""
    if isinstance(value, torch.Tensor):
        return value.dim() > 0
    return isinstance(value, list)


def all_gather(value: Any, world: int) -> list[Any]:
    """Every worker's `value` (same shape on each, padding included), in rank order."""
    if isinstance(value, torch.Tensor):
        out = [torch.empty_like(value) for _ in range(world)]
        dist.all_gather(out, value.contiguous())
        return out
    objs: list[Any] = [None] * world
    dist.all_gather_object(objs, value)
    return objs


_LOST_PEER = re.compile(
    r"gloo/transport|Connection (?:reset|closed) by peer|Broken pipe|DistNetworkError|"
    r"DistBackendError|NCCL (?:communicator was aborted|Watchdog)|[Tt]imed out waiting")
"""What a collective raises on a worker whose peer died or hung (gloo's broken
connection, a collective's timeout, NCCL's watchdog): the cause is that peer."""


def lost_peer(error: str) -> bool:
    """A worker's error (`ExceptionType: message`) says it lost a peer, not why."""
    return _LOST_PEER.search(error) is not None


def status_file(run_dir: Path, rank: int) -> Path:
    return run_dir / ".ranks" / f"rank_{rank}"


_STATUS = re.compile(r"^step (?P<step>-?\d+) node (?P<node>\S+)(?: pid (?P<pid>\d+))?$")


def write_status(run_dir: Path, rank: int, step: int, node: str) -> None:
    """Where a worker is: read back when it dies to name the node and step (and its
    pid, for an operator or a test that has to stop one worker)."""
    path = status_file(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"step {step} node {node} pid {os.getpid()}\n")


def read_status(run_dir: Path, rank: int) -> tuple[int, str] | None:
    try:
        m = _STATUS.match(status_file(run_dir, rank).read_text().strip())
    except OSError:
        return None
    return (int(m["step"]), m["node"]) if m else None


def status_pid(run_dir: Path, rank: int) -> int | None:
    """The pid a worker's status file names (`write_status`), None without one."""
    try:
        m = _STATUS.match(status_file(run_dir, rank).read_text().strip())
    except OSError:
        return None
    return int(m["pid"]) if m and m["pid"] else None
