"""The Python sandbox tool: output comes back, the code's errors are output, every limit
holds in the child (never the trainer), and nothing the code started outlives the call."""

from __future__ import annotations

import asyncio
import os
import pwd
import signal
import sys
import time
import tracemalloc
from collections.abc import Callable

import pytest

from flowgraph.agent.sandbox import PythonSandbox, process_limit_applies, python
from flowgraph.errors import SandboxError

FAST = PythonSandbox(timeout_s=5)


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie awaiting its reaper."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _seconds(call: Callable[[], object]) -> float:
    """How long `call()` took."""
    start = time.monotonic()
    call()
    return time.monotonic() - start


def _gone(pids: list[int], within_s: float = 3.0) -> bool:
    """Every pid is dead (orphans are reaped by init, which may take a moment)."""
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_prints_come_back_with_stderr_in_order() -> None:
    r = FAST.run_sync("import sys\nprint('one')\nprint('two', file=sys.stderr)\nprint('three')")
    assert (r.output, r.returncode, r.timed_out, r.chars_cut) == ("one\ntwo\nthree\n", 0, False, 0)


def test_the_module_tool_is_an_async_typed_function() -> None:
    assert asyncio.run(python("print(6 * 7)")) == "42\n"
    assert asyncio.iscoroutinefunction(python)


def test_no_output_says_so() -> None:
    assert FAST.run_sync("x = 1").output == "(no output)"


def test_a_traceback_is_output_not_an_exception() -> None:
    r = FAST.run_sync("print('before')\n1 / 0")
    assert r.output.startswith("before\nTraceback (most recent call last):\n")
    assert "line 2, in <module>" in r.output and "ZeroDivisionError: division by zero" in r.output
    assert r.output.endswith("\n[exit status 1]") and r.returncode == 1


@pytest.mark.parametrize(("code", "status"), [
    ("import sys; sys.exit(3)", "[exit status 3]"),
    ("import os; os.kill(os.getpid(), 11)", "[killed by signal SIGSEGV]"),
    ("input()", "EOFError: EOF when reading a line\n[exit status 1]"),  # stdin is closed
])
def test_how_a_run_ended_is_its_last_line(code: str, status: str) -> None:
    assert FAST.run_sync(code).output.endswith(status)


@pytest.mark.faults
def test_an_infinite_loop_is_killed_at_the_timeout_with_its_children() -> None:
    code = ("import os, subprocess, time\n"
            "p = subprocess.Popen(['sleep', '100'])\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    time.sleep(100)\n"
            "print(p.pid, pid, flush=True)\n"
            "while True:\n"
            "    pass\n")
    start = time.monotonic()
    r = PythonSandbox(timeout_s=1.0, cpu_s=30).run_sync(code)
    # not before the time limit; the upper bound only bounds a hang: the CPU limit
    # (30 s) would have ended the loop otherwise (SIGKILL and timed_out say which did)
    assert 1.0 <= time.monotonic() - start < 30
    assert r.timed_out and r.returncode == -signal.SIGKILL
    assert r.output.endswith("[killed: ran past the 1 s time limit]")
    pids = [int(p) for p in r.output.split()[:2]]
    assert _gone(pids)


@pytest.mark.faults
def test_children_left_behind_die_when_the_code_ends() -> None:
    from flowgraph.agent.sandbox import KILL_GRACE_S

    code = "import subprocess\nprint(subprocess.Popen(['sleep', '100']).pid)"
    plain = _seconds(lambda: FAST.run_sync("print(1)"))  # side by side: the same load
    start = time.monotonic()
    r = FAST.run_sync(code)
    # the sleep holds the output pipe; the sandbox still returns when the code ends,
    # without waiting the KILL_GRACE_S it gives a pipe that stays open
    assert time.monotonic() - start < plain + KILL_GRACE_S
    assert not r.timed_out and r.returncode == 0
    assert _gone([int(r.output)])


@pytest.mark.faults
def test_a_process_that_leaves_the_group_outlives_it_but_never_hangs_the_call() -> None:
    """What the README says the sandbox does not stop: `setsid()` escapes the group kill.
    It holds the output pipe; the sandbox stops reading KILL_GRACE_S after the code ends."""
    from flowgraph.agent.sandbox import KILL_GRACE_S

    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    print('child', os.getpid(), flush=True)\n"
            "    time.sleep(100)\n"
            "time.sleep(0.5)\n"
            "print('parent done')\n")
    plain = _seconds(lambda: FAST.run_sync("print(1)"))  # side by side: the same load
    start = time.monotonic()
    r = FAST.run_sync(code)
    elapsed = time.monotonic() - start
    child = int(r.output.split()[1])
    escaped = _alive(child)
    if escaped:  # ours to end: the test started it
        os.kill(child, signal.SIGKILL)
    assert r.output == f"child {child}\nparent done\n" and not r.timed_out
    # the grace waited, then the call returns: not after the child's 100 s (the bound
    # leaves a second grace of slack over the plain run measured beside it)
    assert escaped and KILL_GRACE_S <= elapsed < plain + 0.5 + 2 * KILL_GRACE_S


@pytest.mark.faults
def test_cancelling_the_call_kills_the_group() -> None:
    """An episode timeout in the rollout cancels the tool's coroutine."""
    code = ("import subprocess\np = subprocess.Popen(['sleep', '100'])\n"
            "print(p.pid, flush=True)\np.wait()")
    found: list[str] = []

    async def main() -> None:
        task = asyncio.ensure_future(FAST.run(code))
        while not found:
            await asyncio.sleep(0.05)
            found.extend(d for d in os.listdir("/tmp") if d.startswith("flowgraph-sandbox-")
                         and _holds(f"/tmp/{d}/main.py", code))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert not os.path.exists(f"/tmp/{found[0]}")
    sleeps = [p for p in os.listdir("/proc") if p.isdigit() and _is_sleep_100(p)]
    assert _gone([int(p) for p in sleeps])


def _holds(path: str, text: str) -> bool:
    try:
        with open(path) as f:
            return f.read() == text
    except OSError:
        return False


def _is_sleep_100(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read() == b"sleep\x00100\x00" and _alive(int(pid))
    except OSError:
        return False


@pytest.mark.faults
def test_the_cpu_limit_kills_a_busy_loop_before_the_wall_clock() -> None:
    r = PythonSandbox(timeout_s=10, cpu_s=1).run_sync("while True:\n    pass")
    assert not r.timed_out and r.returncode == -signal.SIGXCPU
    assert r.output == "[killed: used up its CPU time limit]"


@pytest.mark.faults
@pytest.mark.parametrize("code", ["x = bytearray(4 << 30)",
                                  "x = []\nwhile True:\n    x.append(' ' * (1 << 20))"])
def test_a_memory_bomb_fails_in_the_child(code: str) -> None:
    r = PythonSandbox(memory_mb=256).run_sync(code)
    assert "MemoryError" in r.output and r.returncode == 1


BOUNDED_FORKS = ("import os, time\n"
                 "pids = []\n"
                 "for i in range(30):\n"
                 "    try:\n"
                 "        pid = os.fork()\n"
                 "    except OSError as e:\n"
                 "        print('fork failed at', i, 'errno', e.errno)\n"
                 "        break\n"
                 "    if pid == 0:\n"
                 "        time.sleep(100)\n"
                 "        os._exit(0)\n"
                 "    pids.append(pid)\n"
                 "else:\n"
                 "    print('forked 30')\n"
                 "print(*pids)\n")
"""A fork bomb with a bound: as root, where RLIMIT_NPROC does not hold, it must not take
the machine down."""


def _nobody_sandbox() -> PythonSandbox:
    """As root: a sandbox that runs as `nobody`, with a Python that user can read."""
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user `nobody` to drop root to")
    exe = next((p for p in (sys.executable, "/usr/bin/python3")
                if all(os.stat(d).st_mode & 0o001 for d in _parents(p))), None)
    if exe is None:
        pytest.skip("no Python that `nobody` may run")
    return PythonSandbox(processes=5, user="nobody", executable=exe)


def _parents(path: str) -> list[str]:
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    return [os.sep.join(parts[:i]) or os.sep for i in range(1, len(parts))]


@pytest.mark.faults
def test_a_fork_bomb_hits_the_process_limit() -> None:
    box = _nobody_sandbox() if os.getuid() == 0 else PythonSandbox(processes=5)
    assert process_limit_applies(box.user)
    r = box.run_sync(BOUNDED_FORKS)
    first, pids = r.output.splitlines()
    *_, failed_at, _, errno = first.split()
    assert first.startswith("fork failed at") and int(errno) == 11, r.output  # EAGAIN
    # the limit is the user's task count at the start plus 5: processes of the user
    # that end meanwhile (the last test's children, reaped late) give back room
    assert int(failed_at) < 30 and len(pids.split()) == int(failed_at)
    assert _gone([int(p) for p in pids.split()])


@pytest.mark.faults
@pytest.mark.skipif(os.getuid() != 0, reason="the root case: RLIMIT_NPROC does not hold")
def test_as_root_the_process_limit_does_not_hold_but_the_group_dies() -> None:
    """Linux exempts root from RLIMIT_NPROC (README: give the sandbox a `user`)."""
    assert not process_limit_applies()
    r = PythonSandbox(processes=5).run_sync(BOUNDED_FORKS)
    first, pids = r.output.splitlines()
    assert first == "forked 30" and len(pids.split()) == 30
    assert _gone([int(p) for p in pids.split()])


def test_as_another_user_the_trainers_files_are_out_of_reach(tmp_path: object) -> None:
    if os.getuid() != 0:
        pytest.skip("switching users needs root")
    box = _nobody_sandbox()
    secret = "/root/.flowgraph-sandbox-test"
    with open(secret, "w") as f:
        f.write("secret")
    os.chmod(secret, 0o600)
    try:
        r = box.run_sync(f"import os\nprint(os.getuid())\nopen({secret!r}).read()")
    finally:
        os.unlink(secret)
    assert r.output.startswith(f"{pwd.getpwnam('nobody').pw_uid}\n")
    assert "PermissionError" in r.output


@pytest.mark.faults
def test_a_huge_print_is_cut_in_the_middle_and_never_held_whole() -> None:
    code = "import sys\nsys.stdout.write('x' * 20_000_000)\nprint('END')"
    tracemalloc.start()
    try:
        r = PythonSandbox(max_output_chars=1000).run_sync(code)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # 20,000,004 characters written; 500 kept at the head, 500 at the tail
    assert r.chars_cut == 20_000_004 - 1000
    assert r.output == f"{'x' * 500}\n[... {r.chars_cut} characters cut ...]\n{'x' * 496}END\n"
    assert peak < 2_000_000, peak  # the parent read 20 MB in bounded chunks


@pytest.mark.faults
def test_an_endless_flood_is_cut_and_killed() -> None:
    # The CPU limit is set far past the wall clock's: by default it equals the timeout,
    # and on a loaded machine the child could use its 1 s of CPU before the parent,
    # waiting to be scheduled, saw 1 s pass, so the status would name the CPU limit.
    r = PythonSandbox(timeout_s=1, cpu_s=30, max_output_chars=100).run_sync(
        "while True:\n    print('y' * 1000)")
    assert r.timed_out and r.chars_cut > 1000
    assert r.output.startswith("y" * 50 + "\n[... ")
    assert r.output.endswith("\n[killed: ran past the 1 s time limit]")


@pytest.mark.faults
def test_files_go_to_a_temporary_directory_that_is_removed() -> None:
    code = ("import os, tempfile\n"
            "open('out.txt', 'w').write('data')\n"
            "print(os.getcwd(), os.path.abspath('out.txt'), tempfile.gettempdir())\n")
    r = FAST.run_sync(code)
    cwd, written, tmp = r.output.split()
    assert os.path.basename(cwd).startswith("flowgraph-sandbox-")
    assert written == os.path.join(cwd, "out.txt") and tmp == cwd
    assert not os.path.exists(cwd)


@pytest.mark.faults
def test_a_file_past_the_size_limit_fails_in_the_child() -> None:
    r = PythonSandbox(file_mb=1).run_sync("open('big', 'wb').write(b'0' * (2 << 20))")
    assert "OSError: [Errno 27] File too large" in r.output and r.returncode == 1


def test_the_trainers_environment_is_not_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOWGRAPH_FAKE_SECRET", "hunter2")
    monkeypatch.setenv("PYTHONPATH", "/tmp/planted")
    r = FAST.run_sync("import os, sys\nprint(dict(os.environ))\nprint(sys.path)\n"
                      "print(sys.flags.isolated)")
    assert "hunter2" not in r.output and "FLOWGRAPH_FAKE_SECRET" not in r.output
    env, path, isolated = r.output.splitlines()
    assert set(eval(env)) == {"PATH", "LANG", "HOME", "TMPDIR", "OMP_NUM_THREADS",
                              "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}
    assert "/tmp/planted" not in path and "''" not in path and isolated == "1"


def test_32_concurrent_calls_run_at_once() -> None:
    """Each call notes when it started and waits until a common moment 3 s away: run at
    once, all 32 start before it; one after another, only the first would (the second
    starts when the first has waited), in a pool of k, k of them."""
    until = time.time() + 3.0

    async def main() -> list[str]:
        return await asyncio.gather(*[python(
            f"import time\nstart = time.time()\ntime.sleep(max(0.0, {until!r} - start))\n"
            f"print({i}, start)") for i in range(32)])

    outputs = asyncio.run(main())
    assert [int(o.split()[0]) for o in outputs] == list(range(32))
    started = [float(o.split()[1]) for o in outputs]
    assert sum(s < until for s in started) == 32, started


@pytest.mark.parametrize(("limits", "message"), [
    ({"timeout_s": 0}, "timeout_s=0; every limit is a positive number"),
    ({"memory_mb": -1, "processes": 0}, "memory_mb=-1, processes=0; every limit"),
    ({"open_files": 3}, "open_files=3; Python needs about 16 file descriptors"),
])
def test_bad_limits_are_refused(limits: dict[str, float], message: str) -> None:
    with pytest.raises(SandboxError, match=message):
        PythonSandbox(**limits)  # type: ignore[arg-type]


def test_a_sandbox_that_cannot_start_raises() -> None:
    with pytest.raises(SandboxError, match="cannot start /no/such/python"):
        PythonSandbox(executable="/no/such/python").run_sync("print(1)")
    with pytest.raises(SandboxError, match="no user 'no-such-user-xyz'"):
        PythonSandbox(user="no-such-user-xyz").run_sync("print(1)")


def test_run_sync_inside_an_event_loop_says_await() -> None:
    async def main() -> None:
        FAST.run_sync("print(1)")

    with pytest.raises(SandboxError, match=r"await sandbox\.run"):
        asyncio.run(main())


def test_the_function_builds_a_tool_schema() -> None:
    from transformers.utils import get_json_schema

    assert get_json_schema(python)["function"] == {
        "name": "python",
        "description": "Run Python 3 code in a fresh process and return what it printed.",
        "parameters": {"type": "object", "required": ["code"], "properties": {"code": {
            "type": "string",
            "description": "A complete Python program; print the values you need to see."}}},
        "return": {"type": "string"}}


def test_sandbox_makes_a_tool_with_its_limits() -> None:
    from flowgraph.agent import tools
    from flowgraph.agent.sandbox import KILL_GRACE_S, sandbox

    t = sandbox(timeout_s=3, memory_mb=512)
    assert isinstance(t, tools.Tool) and t.name == "python" and t.is_async
    assert t.timeout_s == 3 + KILL_GRACE_S
    assert "3 s, 512 MiB of memory" in t.schema()["function"]["description"]
    assert t.schema()["function"]["parameters"]["required"] == ["code"]
    assert asyncio.run(t.fn(code="print('hi')")) == "hi\n"
