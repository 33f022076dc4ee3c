"""The machines of a multi-node fsdp launch, met before any rank starts, and what each
one says when the run fails.

    machines = meet(opts, run_dir, out, store)
                                            every launcher (`--nnodes M --node-rank R
                                            --rdzv-endpoint HOST:PORT`) has joined within
                                            `--rdzv-timeout`, a progress line every
                                            `PROGRESS_S` meanwhile; every one sees the
                                            same run dir, else one message on each
    machines.gathered(mine)                 after a failure: every machine's failed ranks,
                                            so each names the rank that died first

Joining. Node 0's launcher serves a TCPStore at the rendezvous endpoint, on that
address alone (`fsdp._rendezvous_store`); every launcher, node 0's too, then joins
torch's c10d rendezvous there as a client.
The others wait until something answers there (a plain socket, so a node started
first prints one line a period instead of c10d's retry logs), then each adds its key
and waits for every machine's. A machine that never comes ends the wait with the
ranks missing named, instead of torch's silent join timeout.

The run dir. A checkpoint is written by every rank into one folder (DCP: a file a
rank) that rank 0 publishes whole; on disks of their own, node 1's shards would stay in
an orphaned temporary folder beside a checkpoint that misses them. So each machine
writes a marker holding a token node 0 drew into `run_dir/.ranks/machine_R`, then
reads every machine's: one that misses any stops them all, each with the same
message, before any model loads. The ray target proves the same of its workers with
the same markers and message (`mark`, `marked`, `not_one_run_dir`;
`flowgraph.compilers.targets.ray.target.RayTarget.start`).

Failures. The launcher of each machine knows only its own ranks; a rank that dies on
node 1 shows on node 0 as its ranks' broken connections. Each launcher writes what
its ranks did into `run_dir/.ranks/failed_R.json` (the shared run dir) and reads the
others' for up to `REPORT_WAIT_S`, so that every machine names the same rank.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from flowgraph.compilers.options import RunOptions
from flowgraph.compilers.targets.shared_run_dir import draw_token, mark, marked, not_one_run_dir
from flowgraph.errors import FlowgraphError
from flowgraph.spelling import Word, option

PROGRESS_S = 10.0
"""Seconds between two lines of a machine waiting for the others."""
FIRST_S = 1.0
"""A machine that waits this long says so (then every `PROGRESS_S`)."""
REPORT_WAIT_S = 15.0
"""How long a failed machine waits for the others' reports of their ranks."""
_KEY = "flowgraph/machines/"
Position = Callable[[int], tuple[int, str, int] | None]
"""Rank -> the step, node and pid its status file names (None: none yet)."""


@dataclass(frozen=True)
class Failure:
    """One failed rank, as its machine's launcher saw it."""

    rank: int
    line: str
    """`rank 1 was killed by SIGKILL at step 3 in node `update``."""
    time: float
    """When its launcher noticed (seconds since the epoch)."""
    echo: bool
    """It failed because a peer did (a broken connection, a collective's timeout): the
    cause is elsewhere."""


@dataclass
class Machines:
    """This machine among `nnodes`, met at the rendezvous endpoint."""

    store: Any
    """The TCPStore (node 0 hosts it; kept open until the run ends)."""
    rank: int
    nnodes: int
    run_dir: Path
    ended: dict[int, Failure] = field(default_factory=dict)
    """This machine's ranks that `watching` ended because another machine failed."""

    @contextmanager
    def watching(self, position: Position) -> Iterator[None]:
        """The body (the launch) with a thread that, once another machine has reported
        a failure, ends this machine's ranks (found by `position`): a rank hung or
        stopped here would keep this launcher waiting for good while the others have
        ended."""
        done = threading.Event()
        thread = threading.Thread(target=self._watch, args=(done, position), daemon=True,
                                  name="flowgraph-machines")
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _watch(self, done: threading.Event, position: Position) -> None:
        others = [self.run_dir / ".ranks" / f"failed_{r}.json" for r in range(self.nnodes)
                  if r != self.rank]
        while not done.wait(1.0):
            failed = [p for p in others if p.exists()]
            if failed:
                self._end_ranks(failed[0].stem.removeprefix("failed_"), position)
                return

    def _end_ranks(self, machine: str, position: Position) -> None:
        """SIGKILL this machine's ranks (the launcher's children among the ranks with a
        position); one found stopped (SIGSTOP, `T`) is the cause, the others echoes."""
        for status in (self.run_dir / ".ranks").glob("rank_*"):
            rank = int(status.name.removeprefix("rank_"))
            where = position(rank)
            if where is None or _parent(where[2]) != os.getpid():
                continue
            step, node, pid = where
            stopped = _state(pid) == "T"
            line = (f"rank {rank} was stopped (SIGSTOP, or a debugger) at step {step} in "
                    f"node `{node}`: its peers gave up waiting for it" if stopped
                    else f"rank {rank} was ended at step {step}: node {machine}'s ranks had "
                    "failed")
            self.ended[rank] = Failure(rank, line, time.time(), not stopped)
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def gathered(self, mine: list[Failure], wait_s: float = REPORT_WAIT_S
                 ) -> list[Failure]:
        """Every machine's failed ranks: this one's, written to the run dir, and the
        others' as far as they are written within `wait_s`."""
        ranks = self.run_dir / ".ranks"
        ranks.mkdir(parents=True, exist_ok=True)
        (ranks / f"failed_{self.rank}.json").write_text(json.dumps(
            [[f.rank, f.line, f.time, f.echo] for f in mine]))
        others = [ranks / f"failed_{r}.json" for r in range(self.nnodes) if r != self.rank]
        deadline = time.monotonic() + wait_s
        while not all(p.exists() for p in others) and time.monotonic() < deadline:
            time.sleep(0.2)
        every = list(mine)
        for path in others:
            try:
                every += [Failure(int(r), str(line), float(t), bool(e))
                          for r, line, t, e in json.loads(path.read_text())]
            except (OSError, ValueError, TypeError):  # not written (in time): its own news
                continue
        return every


def meet(opts: RunOptions, run_dir: Path, out: TextIO, served: Any) -> Machines:
    """Join the other machines at `opts.rdzv_endpoint` within `opts.rdzv_timeout` and
    prove that all see the same run dir; `served`: on node 0, the store it serves at
    the endpoint (`fsdp._rendezvous_store`), else None."""
    from torch.distributed import DistError

    host, port = endpoint(opts.rdzv_endpoint)
    deadline = time.monotonic() + opts.rdzv_timeout
    try:
        if opts.node_rank == 0:  # node 0 serves the store, and draws the token
            store = served
            store.set(f"{_KEY}token", draw_token())
        else:
            store = _joined(host, port, opts, deadline, out)
        return _meet(store, opts, run_dir, deadline, out)
    except DistError as exc:  # node 0's launcher ended while the others waited on it
        raise FlowgraphError(
            f"node 0 left the rendezvous at {opts.rdzv_endpoint} before the nodes had met "
            f"({str(exc).splitlines()[0]}); its own output says why") from None


def _meet(store: Any, opts: RunOptions, run_dir: Path, deadline: float, out: TextIO
          ) -> Machines:
    machine = opts.node_rank
    if store.add(f"{_KEY}taken/{machine}", 1) > 1:
        raise FlowgraphError(
            f"two machines were started with {option('node_rank', machine)} at "
            f"{opts.rdzv_endpoint}: give each machine its own rank, 0 to {opts.nnodes - 1}")
    store.set(f"{_KEY}host/{machine}", json.dumps([socket.gethostname(), str(run_dir)]))
    _wait_for_all(store, "host", opts, deadline, out)
    here = Machines(store, machine, opts.nnodes, run_dir)
    _prove_shared_run_dir(here, opts)
    return here


def endpoint(text: str | None) -> tuple[str, int]:
    host, sep, port = (text or "").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise FlowgraphError(f"{option('rdzv_endpoint', text)} is not HOST:PORT (node 0's "
                             "address and a free port, the same on every machine)")
    return host.strip("[]"), int(port)


def _joined(host: str, port: int, opts: RunOptions, deadline: float, out: TextIO) -> Any:
    """A machine but node 0: a client of node 0's store, once something answers there."""
    from torch._C._distributed_c10d import TCPStore

    timeout = timedelta(seconds=max(opts.rdzv_timeout, 60.0))
    said = time.monotonic() - PROGRESS_S + FIRST_S
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                break
        except OSError:
            pass
        now = time.monotonic()
        if now >= deadline:
            raise FlowgraphError(
                f"node 0 did not answer at {opts.rdzv_endpoint} within "
                f"{option('rdzv_timeout', _seconds(opts.rdzv_timeout))} s: start it "
                f"({option('node_rank', 0)}) with {option('rdzv_endpoint', opts.rdzv_endpoint)}"
                ": an address of node 0 that this machine reaches, its port open between "
                "them")
        if now - said >= PROGRESS_S:
            said = now
            print(f"flowgraph: waiting for node 0 at {opts.rdzv_endpoint} (the rendezvous "
                  f"of {opts.nnodes} nodes; up to {_seconds(opts.rdzv_timeout)} s)",
                  file=out, flush=True)
        time.sleep(0.5)
    return TCPStore(host, port, is_master=False, timeout=timeout)


def _wait_for_all(store: Any, what: str, opts: RunOptions, deadline: float,
                  out: TextIO | None = None) -> None:
    """Until every machine has set its `what` key; a progress line every `PROGRESS_S`
    to `out`, if given."""
    keys = [f"{_KEY}{what}/{r}" for r in range(opts.nnodes)]
    said = time.monotonic() - PROGRESS_S + FIRST_S
    while True:
        joined = [r for r, key in enumerate(keys) if store.check([key])]
        if len(joined) == opts.nnodes:
            return
        now = time.monotonic()
        if now >= deadline:
            missing = [r for r in range(opts.nnodes) if r not in joined]
            raise FlowgraphError(
                f"{_nodes(missing)} did not join the rendezvous at {opts.rdzv_endpoint} "
                f"within {option('rdzv_timeout', _seconds(opts.rdzv_timeout))} s "
                f"({len(joined)} of {opts.nnodes} joined: {_nodes(joined)}); start "
                f"`flowgraph run` with {option('node_rank', missing[0])} and the same "
                f"{option('nnodes', opts.nnodes)} "
                f"{option('rdzv_endpoint', opts.rdzv_endpoint)} there, check that it "
                "reaches this endpoint, or give the machines more time with "
                f"{option('rdzv_timeout', Word('SECONDS'))}")
        if out is not None and now - said >= PROGRESS_S:
            said = now
            print(f"flowgraph: waiting for {opts.nnodes} nodes at {opts.rdzv_endpoint}: "
                  f"{len(joined)} joined ({_nodes(joined)}); up to "
                  f"{_seconds(opts.rdzv_timeout)} s", file=out, flush=True)
        time.sleep(0.2)


def _prove_shared_run_dir(here: Machines, opts: RunOptions) -> None:
    """Each machine writes node 0's token into its marker and reads every machine's;
    one that misses any stops them all, with the same message on each."""
    store, token = here.store, here.store.get(f"{_KEY}token").decode()
    mark(here.run_dir, f"machine_{here.rank}", token)
    deadline = time.monotonic() + max(opts.rdzv_timeout, 60.0)
    store.set(f"{_KEY}wrote/{here.rank}", "1")
    _wait_for_all(store, "wrote", opts, deadline)
    unseen = [r for r in range(here.nnodes) if not marked(here.run_dir, f"machine_{r}", token)]
    store.set(f"{_KEY}seen/{here.rank}", json.dumps(unseen))
    _wait_for_all(store, "seen", opts, deadline)
    seen = {r: json.loads(store.get(f"{_KEY}seen/{r}")) for r in range(here.nnodes)}
    where = {r: json.loads(store.get(f"{_KEY}host/{r}")) for r in range(here.nnodes)}
    store.set(f"{_KEY}read/{here.rank}", "1")
    if here.rank == 0:  # its store serves until every machine has read
        _wait_for_all(store, "read", opts, deadline)
    if not any(seen.values()):
        return
    blind = "; ".join(f"node {r} (host {where[r][0]}, run dir `{where[r][1]}`) does not "
                      f"see the files of {_nodes(missed)}"
                      for r, missed in seen.items() if missed)
    raise not_one_run_dir(f"the {here.nnodes} nodes", blind, "a multi-node fsdp run",
                          "every rank", " on every node")


def _parent(pid: int) -> int | None:
    """The parent of process `pid` (Linux), None if it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _state(pid: int) -> str | None:
    """Process `pid`'s state letter (`T`: stopped), None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def _nodes(ranks: list[int]) -> str:
    return ("node " if len(ranks) == 1 else "nodes ") + ", ".join(map(str, ranks))


def _seconds(value: float) -> str:
    return f"{value:g}"
