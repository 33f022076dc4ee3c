"""Loopback by default, nothing left behind: what a run opens to the network and leaves on
the machine.

A single-host run serves every store flowgraph creates (the fsdp rendezvous, the
process groups of fsdp ranks and of Ray pool workers) on 127.0.0.1, and the embedded Ray
cluster's own servers listen there too; its token is readable by its owner alone; a
driver killed with SIGKILL takes the cluster's processes with it; an fsdp run leaves
nothing in the temp folder. The runs are real `flowgraph run` processes (grpo at its
smallest); listening sockets are read with psutil, as `ss -ltnp` would show them.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = ("dims.Bp=2", "dims.N=2", "nodes.update_actor.params.mini_batch_size=4")


def _listening(pids: Callable[[], list[int]]) -> dict[tuple[str, int], int]:
    """(address, port) -> pid of every TCP socket the processes `pids()` listen on."""
    found = {}
    for pid in pids():
        try:
            for c in psutil.Process(pid).net_connections("tcp"):
                if c.status == psutil.CONN_LISTEN:
                    found[(c.laddr.ip, c.laddr.port)] = pid
        except psutil.Error:  # gone meanwhile
            continue
    return found


def _tree(pid: int) -> list[int]:
    try:
        root = psutil.Process(pid)
        return [pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.Error:
        return []


def _loopback(addr: str) -> bool:
    """127.0.0.0/8, ::1, and 127.0.0.1 as IPv6 (`::ffff:127.0.0.1`: Ray's gRPC servers),
    which Python's `is_loopback` says is not before 3.13."""
    ip = ipaddress.ip_address(addr.split("%")[0])
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return (mapped or ip).is_loopback


def _flowgraph(args: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
    cache = os.environ.get("FLOWGRAPH_CACHE") or str(Path.home() / ".cache" / "flowgraph")
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "flowgraph", "run", str(ROOT / "graphs" / "grpo.yaml"),
             *SMALL, *args], stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "FLOWGRAPH_CACHE": cache, **env})


def _until(ready: Callable[[], bool], seconds: float, log: Path,
           why: Callable[[], str] = str) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {seconds} s: {why()}\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def test_a_store_listens_on_its_address_alone() -> None:
    """torch's TCPStore server listens on every interface (`*:port`); ours on the
    address it is given."""
    from flowgraph.compilers.targets.process_groups import listening_store

    port = _free_port()
    store = listening_store("127.0.0.1", port, None, datetime.timedelta(seconds=10))
    store.set("key", "value")
    mine = {addr for (addr, p) in _listening(lambda: [os.getpid()]) if p == port}
    assert mine == {"127.0.0.1"}
    del store


def test_a_rendezvous_endpoint_that_is_not_this_machine_is_named() -> None:
    """Node 0 serves the rendezvous on the endpoint's address: one not of this machine
    (192.0.2.0/24 is TEST-NET-1) is a message naming the flag, not a torch traceback."""
    from flowgraph.compilers.targets.fsdp.launch import _rendezvous_store
    from flowgraph.errors import FlowgraphError

    with pytest.raises(FlowgraphError) as exc:
        _rendezvous_store("192.0.2.99:29411", 60.0)
    assert str(exc.value).startswith("--rdzv-endpoint 192.0.2.99:29411: cannot listen on "
                                     "192.0.2.99:29411: ")
    assert "an address of node 0 (this machine)" in str(exc.value)


def test_a_node_is_reached_at_its_address_towards_the_rendezvous() -> None:
    """Across machines a node's stores listen on the interface its route to the
    rendezvous endpoint leaves by; towards 127.0.0.1 that is 127.0.0.1."""
    from flowgraph.compilers.targets.fsdp.launch import address_towards

    assert address_towards("127.0.0.1:29400") == "127.0.0.1"
    assert address_towards("localhost") in ("127.0.0.1", "::1")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.multiprocess
def test_an_fsdp_run_listens_on_loopback_and_leaves_no_temp_files(tmp_path: Path) -> None:
    """Every socket of the launcher and its ranks (rendezvous, process-group store, gloo,
    /metrics) is on 127.0.0.1; no `torchelastic_*` folder or `pytorch-errorfile-*`
    remains in the temp folder."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    log = tmp_path / "run.log"
    proc = _flowgraph(["--target", "fsdp", "--nproc", "2", "trainer.steps=2",
                       f"trainer.run_dir={tmp_path / 'run'}", "--metrics-port", "0"],
                      log, TMPDIR=str(temp))
    seen: dict[tuple[str, int], int] = {}
    while proc.poll() is None:
        seen.update(_listening(lambda: _tree(proc.pid)))
        time.sleep(0.2)
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert len(seen) >= 4, seen  # rendezvous, ranks' store, their gloo pairs, /metrics
    assert [a for a in seen if not _loopback(a[0])] == [], seen
    # torch's compile cache (`torchinductor_<user>`, made at import) is every torch
    # program's, kept across runs like ~/.cache: not a run's litter
    assert [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")] == []


@pytest.mark.multiprocess
def test_two_fsdp_nodes_listen_on_the_network_their_endpoint_names(tmp_path: Path) -> None:
    """`--nnodes 2` with `--rdzv-endpoint 127.0.0.1:PORT`: node 0's rendezvous, the
    ranks' store and everything else either node opens is on that network, loopback."""
    endpoint = f"127.0.0.1:{_free_port()}"
    procs = [_flowgraph(["--target", "fsdp", "--nproc", "2", "--nnodes", "2", "--node-rank",
                         str(rank), "--rdzv-endpoint", endpoint, "trainer.steps=2",
                         f"trainer.run_dir={tmp_path / 'run'}"], tmp_path / f"node{rank}.log")
             for rank in range(2)]
    seen: dict[tuple[str, int], int] = {}
    while any(p.poll() is None for p in procs):
        seen.update(_listening(lambda: [q for p in procs for q in _tree(p.pid)]))
        time.sleep(0.2)
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, (tmp_path / f"node{rank}.log").read_text()[-3000:]
    assert ("127.0.0.1", int(endpoint.rpartition(":")[2])) in seen  # node 0's rendezvous
    assert [a for a in seen if not _loopback(a[0])] == [], seen


RAY_SERVERS = {"gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent"}
"""The embedded cluster's own processes that listen (the dashboard head and the
autoscaler's monitor, `python`, too: their metrics)."""


@pytest.mark.multiprocess
def test_a_ray_run_on_one_machine_binds_loopback_keeps_its_token_and_dies_with_its_driver(
        tmp_path: Path) -> None:
    """The embedded cluster's `~/.ray/auth_token` is 0600; every socket the driver and
    its cluster listen on (GCS, raylet and object manager, Ray's agents and metrics,
    each worker's gRPC server, the pool's process-group store) is on loopback; a
    SIGKILL of the driver ends every process of the cluster within seconds (Ray's agents
    alone would wait 60 s for a dead GCS)."""
    home, run_dir, log = tmp_path / "home", tmp_path / "run", tmp_path / "run.log"
    home.mkdir()
    proc = _flowgraph(["--target", "ray", "--nproc", "2", "trainer.steps=200",
                       "trainer.checkpoint_every=0", f"trainer.run_dir={run_dir}"],
                      log, HOME=str(home))
    cluster: list[int] = []
    seen: dict[tuple[str, int], int] = {}

    def started() -> bool:
        seen.update(_listening(lambda: _tree(proc.pid)))
        return "step 1/" in log.read_text() or proc.poll() is not None

    try:
        _until(started, 240, log)
        assert proc.poll() is None, log.read_text()[-3000:]
        token = home / ".ray" / "auth_token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        workers = json.loads((run_dir / ".ranks" / "workers.json").read_text())
        cluster = _tree(proc.pid)[1:]
        seen.update(_listening(lambda: [proc.pid, *cluster]))
        named = {a: _name(pid) for a, pid in seen.items()}
        assert [(a, n) for a, n in named.items() if not _loopback(a[0])] == [], named
        assert set(named.values()) >= RAY_SERVERS, named
        assert {proc.pid, *workers["actor_rollout_ref"]} <= set(seen.values()), named
        _kill_and_outlive(proc, cluster, log)  # against Ray's 60+ s unaided
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        threading.Thread(target=_kill, args=(cluster,), daemon=True).start()


@pytest.mark.slow
def test_a_killed_run_takes_its_vllm_engine_along(tmp_path: Path) -> None:
    """vLLM's engine core and its worker (processes of their own) die within seconds of
    a SIGKILLed run; unaided they lived on (on a GPU holding the memory the resumed run
    needs)."""
    log = tmp_path / "run.log"
    proc = _flowgraph(["nodes.gen.params.backend=vllm", "trainer.steps=200",
                       "trainer.checkpoint_every=0", f"trainer.run_dir={tmp_path / 'run'}"],
                      log)
    engine: list[int] = []
    try:
        _until(lambda: "step 1/" in log.read_text() or proc.poll() is not None, 300, log)
        assert proc.poll() is None, log.read_text()[-3000:]
        engine = _tree(proc.pid)[1:]
        assert any(_name(p).startswith("VLLM") for p in engine), [_name(p) for p in engine]
        _kill_and_outlive(proc, engine, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill(engine)


def test_a_killed_driver_takes_along_what_its_watcher_had_not_seen(tmp_path: Path) -> None:
    """The watcher kills what it saw below the cluster's roots and, after the driver
    died, every process marked as the cluster's: here one started by an orphaned shell
    the moment before the kill (a Ray worker starting as its raylet died), which no scan
    saw below a root; unmarked processes live on."""
    pids = tmp_path / "pids"
    driver = textwrap.dedent(f"""
        import os, subprocess, sys, time
        from flowgraph.compilers.signals import REAP_MARK, reap_with_parent
        os.environ[REAP_MARK] = "run-1"
        root = subprocess.Popen(["sleep", "300"])
        reap_with_parent({{root.pid}}, "run-1")
        time.sleep(1.5)  # the watcher has looked
        late = subprocess.Popen("sleep 301 & echo $! > {pids}.late", shell=True)
        env = {{k: v for k, v in os.environ.items() if k != REAP_MARK}}
        other = subprocess.Popen(["sleep", "302"], env=env, start_new_session=True)
        late.wait()
        while not os.path.exists("{pids}.late"):
            time.sleep(0.05)
        with open("{pids}", "w") as f:
            f.write(f"{{root.pid}} {{open('{pids}.late').read().strip()}} {{other.pid}}")
        time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver])
    try:
        _until(lambda: pids.exists() and len(pids.read_text().split()) == 3, 60, pids)
        root, late, other = map(int, pids.read_text().split())
        assert psutil.Process(late).ppid() != root  # not below the root: the shell exited
        proc.kill()
        proc.wait()
        _until(lambda: not _alive(root) and not _alive(late), 10, pids)
        assert _alive(other)
    finally:
        proc.kill()
        _kill([int(p) for p in pids.read_text().split()] if pids.exists() else [])


def _kill_and_outlive(proc: subprocess.Popen[bytes], below: list[int], log: Path) -> None:
    """SIGKILL the run `proc`; the processes `below` it must be gone within 30 s (alone
    2 s, but once in a loaded full suite the last of a Ray cluster outlived 15 s)."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    _until(lambda: not [p for p in below if _alive(p)], 30, log,
           lambda: f"alive: {[(p, _name(p)) for p in below if _alive(p)]}")


def _name(pid: int) -> str:
    try:
        return str(psutil.Process(pid).name())
    except psutil.Error:
        return f"(gone: {pid})"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill(pids: list[int]) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
