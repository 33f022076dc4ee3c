"""A run and its process: preemption (SIGTERM, SIGINT), the run-dir lock, a node's
deadline, and child processes that end with their parent — the same on every target
(`die_with_parent`; `reap_with_parent` for those that outlive it by themselves).

    with run_guard(plan, opts) as stop:     the run dir's lock taken (`RunLock`), the
        ...                                 signal handlers installed (`Preemption`);
                                            a stop leaves as `Stopped`, with the
                                            command that resumes the run

Preemption: the first SIGTERM (what SLURM and Kubernetes send before they kill) or
SIGINT (Ctrl-C) asks the training loop to stop; the node that runs finishes, and the
loop saves a checkpoint of the last step it completed (`TrainingLoop.run`). A second
signal, or `trainer.stop_grace_s` passing, stops at once (`Interrupted`), leaving the
previous checkpoint. `flowgraph run` then exits 128 + the signal's number: 143, 130.

A node's deadline (`deadline`): `timeout_s` of its params (and on the local target
`trainer.step_timeout_s`) arms SIGALRM around its call; the node is interrupted where
it is (`NodeTimeout`) and reported like any error of its, with that line.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

from flowgraph.errors import FlowgraphError, Interrupted, NodeTimeout, Stopped, StopUnsaved
from flowgraph.spelling import Word, command, option

if TYPE_CHECKING:
    from flowgraph.compilers.options import RunOptions
    from flowgraph.plan import ExecutionPlan

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
LOCK = ".lock"
"""The run dir's lock file: the pid and host of the run that holds it (JSON)."""
STOP_FILE = ".ranks/stop"
"""Written by the fsdp launcher on a signal: its ranks stop as if they had it."""


def _name(signum: int) -> str:
    return signal.Signals(signum).name


# --- preemption --------------------------------------------------------------------------


class Preemption:
    """What this process was asked by signal: `signum` once a stop is requested (the
    loop stops at its next node boundary), `Interrupted` raised at the second."""

    def __init__(self, grace_s: float = 0.0, out: TextIO | None = None, *,
                 on_request: Callable[[int], None] | None = None) -> None:
        self.grace_s, self.out = grace_s, out
        self.on_request = on_request
        """Called at the first request (the fsdp launcher tells its ranks)."""
        self.signum: int | None = None
        self.timer: threading.Timer | None = None

    def request(self, signum: int, *, note: bool = True) -> None:
        """Ask for a stop (a signal, or what the other fsdp processes agreed on); at the
        second, stop at once. `trainer.stop_grace_s` later this process signals itself:
        that second signal stops it at once."""
        if self.signum is not None:
            raise Interrupted(signum)
        self.signum = signum
        if note:
            print(f"flowgraph: {_name(signum)}: finishing the running node, then saving a "
                  "checkpoint (a second signal stops at once)",
                  file=self.out or sys.stderr, flush=True)
        if self.on_request is not None:
            self.on_request(signum)
        if self.grace_s > 0:
            self.timer = threading.Timer(self.grace_s, os.kill, (os.getpid(), signum))
            self.timer.daemon = True
            self.timer.start()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.request(signum)

    def take_signals(self) -> None:
        """Handle SIGTERM and SIGINT again, after a library set its own handlers (`ray.init`
        sets one for SIGTERM that ends the process)."""
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                signal.signal(s, self._handle)

    @contextmanager
    def installed(self) -> Iterator[Preemption]:
        """This object handles SIGTERM and SIGINT (only the main thread can)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self.timer is not None:
                self.timer.cancel()


RESUME_WITH_ENV = "FLOWGRAPH_RESUME_WITH"
"""Set by the launch recipes (deploy/): how their job is continued, in their words
(`RESUME=1 ... sbatch deploy/slurm/ray.sbatch`), which a stopped run prints first."""
LAUNCHER_JOB_ENV = ("SLURM_JOB_ID", "RAY_JOB_ID", "RAY_JOB_CONFIG_JSON_ENV_VAR")
"""Set inside a SLURM job, or a Ray job's driver (`ray job submit`)."""


def resume_command(plan: ExecutionPlan, opts: RunOptions) -> str:
    """The command (or, from Python, the call) that continues this run: its target, size,
    passes, overrides, run dir and the settings it was allowed to change. Inside a job of
    a launch recipe (`RESUME_WITH_ENV`, in a SLURM or Ray job), the recipe's command
    first: the flowgraph command is what it runs."""
    again = _flowgraph_resume(plan, opts)
    words = os.environ.get(RESUME_WITH_ENV, "").strip()
    if words and any(os.environ.get(k) for k in LAUNCHER_JOB_ENV):
        return f"{words} (a new job; it runs {again})"
    return again


def _flowgraph_resume(plan: ExecutionPlan, opts: RunOptions) -> str:
    planned = opts.plan_file is not None or opts.called_with == "plan"
    subject = opts.called_with or str(opts.plan_file or plan.source)
    sized = [] if planned or plan.target == "local" else [
        ("target", plan.target), ("nproc", plan.nproc)]
    return command("run", subject, [
        *sized, *_launched(plan, opts), ("disable", [] if planned else list(opts.disabled)),
        ("resume", True),
        ("allow_changed", list(opts.allow_changed)),
        ("overrides", [o for o in opts.overrides if not o.startswith("trainer.run_dir=")]),
        ("run_dir", plan.trainer.run_dir)])


def _launched(plan: ExecutionPlan, opts: RunOptions) -> list[tuple[str, Any]]:
    """Where the run ran, as the command that continues it must say again: the Ray
    cluster it joined; an fsdp run's machines (this one's rank among them)."""
    from flowgraph.compilers.options import RDZV_TIMEOUT_S

    if plan.target == "ray":
        return [("address", opts.address)]
    if plan.target != "fsdp" or opts.nnodes == 1:
        return []
    return [("nnodes", opts.nnodes), ("node_rank", Word(str(opts.node_rank))),
            ("rdzv_endpoint", opts.rdzv_endpoint),
            ("rdzv_timeout", None if opts.rdzv_timeout == RDZV_TIMEOUT_S
             else Word(f"{opts.rdzv_timeout:g}"))]


def stopped(plan: ExecutionPlan, opts: RunOptions, signum: int, *, at_once: bool,
            how: str | None = None) -> Stopped:
    """The `Stopped` a signal ends the run with (`how` it stopped, if not by the run's
    own handling): what was saved, how to continue."""
    from flowgraph.compilers.checkpoint.store import latest_checkpoint

    done = latest_checkpoint(Path(plan.trainer.run_dir))
    how = how or (f"stopped at once by {_name(signum)} (a second signal, or "
                  f"trainer.stop_grace_s = {plan.trainer.stop_grace_s:g} s passed)" if at_once
                  else f"stopped by {_name(signum)}")
    saved = (f"the last checkpoint is step {done[0]}; continue with:" if done
             else "no checkpoint was written yet; start again with:")
    return Stopped(signum, f"{how}; {saved} {resume_command(plan, opts)}",
                   run_dir=Path(plan.trainer.run_dir))


@contextmanager
def run_guard(plan: ExecutionPlan, opts: RunOptions, *, lock: bool = True,
              on_request: Callable[[int], None] | None = None) -> Iterator[Preemption]:
    """The run's lock (`lock`) and signal handlers for the body; a stop it asked for
    (the loop's `Stopped`, or `Interrupted`) leaves as `stopped(...)`."""
    stop = Preemption(plan.trainer.stop_grace_s, opts.out, on_request=on_request)
    held = RunLock(Path(plan.trainer.run_dir), opts.out) if lock else None
    if held is not None:
        held.acquire()
    try:
        with stop.installed():
            yield stop
    except StopUnsaved as exc:  # the workers were gone: nothing saved
        raise stopped(plan, opts, exc.signum, at_once=False, how=(
            f"stopped by {_name(exc.signum)}, but no checkpoint could be written: {exc}")
        ) from None
    except Stopped as exc:
        raise stopped(plan, opts, exc.signum, at_once=False) from None
    except Interrupted as exc:
        raise stopped(plan, opts, exc.signum, at_once=True) from None
    finally:
        if held is not None:
            held.release()


# --- one run per run dir -------------------------------------------------------------------


class RunLock:
    """`run_dir/.lock`, created exclusively, naming the pid and host of the run that holds
    it. A lock whose process is gone (this host) is taken over with a note."""

    def __init__(self, run_dir: Path, out: TextIO | None = None) -> None:
        self.path, self.out = run_dir / LOCK, out
        self.mine = {"pid": os.getpid(), "host": socket.gethostname(),
                     "start": _start_time(os.getpid())}

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a stale lock removed, then ours; a racing run may win it
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over(self._holder())
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.mine, f)
            return
        raise FlowgraphError(f"cannot take the lock `{self.path}`: another run keeps taking it")

    def release(self) -> None:
        if self._holder() == self.mine:
            self.path.unlink(missing_ok=True)

    def _holder(self) -> dict[str, Any] | None:
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) else None

    def _take_over(self, holder: dict[str, Any] | None) -> None:
        """Remove a stale lock (its process is gone), or refuse naming who holds it."""
        if holder is None:  # being written this instant, or garbage left by a crash
            if time.time() - _mtime(self.path) < 5:
                raise FlowgraphError(f"`{self.path.parent}` is being started by another run "
                                     f"(`{self.path}` was just created)")
            holder = {}
        pid, host = holder.get("pid"), holder.get("host")
        if host == self.mine["host"] and isinstance(pid, int) and _alive(pid, holder):
            raise FlowgraphError(
                f"`{self.path.parent}` is in use by another run: pid {pid} on host {host} "
                f"holds `{self.path}`. One run per run dir: wait for it, stop it (kill "
                f"-TERM {pid} saves a checkpoint), or give another "
                f"{option('run_dir', 'runs/new')}")
        if host not in (None, self.mine["host"]):
            raise FlowgraphError(
                f"`{self.path.parent}` is in use by pid {pid} on host {host} (`{self.path}`); "
                "this host cannot tell whether it still runs. If it does not, remove "
                f"`{self.path}`; else give another {option('run_dir', 'runs/new')}")
        print(f"flowgraph: note: taking over the stale lock of pid {pid} on host {host} "
              f"(`{self.path}`): that process is gone", file=self.out or sys.stderr,
              flush=True)
        self.path.unlink(missing_ok=True)


def _alive(pid: int, holder: dict[str, Any]) -> bool:
    """Process `pid` runs, and is the one that wrote the lock (not a reused pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    start = holder.get("start")
    return start is None or start == _start_time(pid)


def _start_time(pid: int) -> str | None:
    """When `pid` started (clock ticks since boot, Linux), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


# --- a node's deadline -----------------------------------------------------------------------


@contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Raise `NodeTimeout(what)` in the body after `seconds` (0: never). SIGALRM: the main
    thread only (every target runs nodes there: the local process, fsdp ranks, the Ray
    driver and Ray workers); elsewhere the body runs without one."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: FrameType | None) -> None:
        raise NodeTimeout(what)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --- child processes ------------------------------------------------------------------------


def die_with_parent(parent: int, signum: int = signal.SIGTERM) -> None:
    """Have the kernel send `signum` to this process when its parent (pid `parent`, as
    the parent knew itself) dies (Linux `PR_SET_PDEATHSIG`): a rollout producer or fsdp
    rank whose trainer or launcher was killed ends at once instead of running on."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signum), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux: the parent's polling ends it
        return
    if os.getppid() != parent:  # it died before this (while this process started)
        os.kill(os.getpid(), signum)


def child_pids() -> set[int]:
    """This process's children (Linux /proc; elsewhere none)."""
    me = os.getpid()
    return {pid for pid, (parent, _) in _processes().items() if parent == me}


_WATCHERS: list[subprocess.Popen[bytes]] = []
"""The running watchers, held: a Popen dropped while its process runs warns."""


REAP_MARK = "FLOWGRAPH_REAP_MARK"
"""The environment variable that marks the processes a watcher takes along: set in the
driver before it starts them, so every process below it (and below them, reparented or
not) inherits it."""


def reap_with_parent(roots: set[int], mark: str = "") -> None:
    """A watcher (a process of its own) that SIGKILLs `roots` and every process below
    them once this process is gone, however it died: an embedded Ray cluster's raylet
    and GCS die with their driver, but its agents (DashboardAgent, RuntimeEnvAgent)
    then wait 60 s to report it to that GCS. With `mark` (the value of `REAP_MARK` in
    this process's environment when it started them) it also kills every process whose
    environment holds it: one started in the second before the driver died, which the
    watcher had not seen yet and whose parent died with the driver, reparented away from
    `roots` (a Ray worker still starting then waits 60 s for the dead GCS). It ends by
    itself when they are all gone (the cluster shut down). Linux only."""
    _WATCHERS[:] = [w for w in _WATCHERS if w.poll() is None]
    if not roots or not Path("/proc/self/stat").exists():
        return
    code = (f"import sys; sys.path[:0] = {[p for p in sys.path if p]!r}; "
            f"from flowgraph.compilers.signals import _reap; _reap({os.getpid()}, "
            f"{sorted(roots)!r}, {mark!r})")
    # a session of its own: a Ctrl-C or a kill of the driver's process group spares it
    _WATCHERS.append(subprocess.Popen([sys.executable, "-c", code],
                                      stdin=subprocess.DEVNULL, start_new_session=True))


def _reap(parent: int, roots: list[int], mark: str = "", interval: float = 1.0) -> None:
    """The watcher's body: note the processes below `roots` while `parent` lives; then
    kill them, and those marked `mark`."""
    seen: dict[int, str] = {}
    while os.getppid() == parent:
        tree = _below(roots)
        if not tree:
            return
        seen.update(tree)
        time.sleep(interval)
    _kill_all(seen)
    for pause in (0.0, 0.5) if mark else ():  # a second look: one may have been mid-fork
        time.sleep(pause)
        _kill_all(_marked(mark))


def _kill_all(processes: dict[int, str]) -> None:
    """SIGKILL each pid (-> start time) still that process (not a reused pid), not this."""
    for pid, start in processes.items():
        if pid != os.getpid() and _start_time(pid) == start:
            with suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _marked(mark: str) -> dict[int, str]:
    """pid -> start time of every live process whose environment holds `REAP_MARK=mark`."""
    wanted = f"{REAP_MARK}={mark}".encode()
    found = {}
    for pid, (_, start) in _processes().items():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # gone meanwhile, or another user's
            continue
        if wanted in environ.split(b"\0"):
            found[pid] = start
    return found


def _below(roots: list[int]) -> dict[int, str]:
    """pid -> start time of the live `roots` and all their descendants."""
    processes = _processes()
    found = {pid: processes[pid][1] for pid in roots if pid in processes}
    frontier = set(found)
    while frontier:
        frontier = {pid for pid, (parent, _) in processes.items()
                    if parent in frontier and pid not in found}
        found.update({pid: processes[pid][1] for pid in frontier})
    return found


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every process (Linux /proc)."""
    out = {}
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else []:
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        if fields[0] != "Z":  # a zombie is dead already
            out[int(entry.name)] = (int(fields[1]), fields[19])
    return out
