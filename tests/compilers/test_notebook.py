"""A notebook's loop (issue #26, point 4): running a cell again starts a fresh dated run
(or `overwrite=True` starts afresh in the same folder, never in a folder that is not a
run dir); an interrupt stops, saves and says how to continue in Python, with no frames
in IPython; messages raised through the Python API name its arguments, the command
line's name flags; a new run leaves no earlier `traceback.txt`."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest

import flowgraph
from flowgraph.compilers.checkpoint.store import latest_checkpoint
from flowgraph.errors import FlowgraphError

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "tests" / "plugins"
FAULTS = (PLUGINS / "faults.yaml").read_text()
SIGNALLING = FAULTS.replace("fg_runtime_faults", "fg_plugin_faults").replace(
    "kind: prompt_score", "kind: signalling_score")


@pytest.fixture(autouse=True)
def _here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.chdir(tmp_path)
    Path("g.yaml").write_text(FAULTS)
    Path("s.yaml").write_text(SIGNALLING)


def _run(graph: Any, *overrides: str, **kw: Any) -> flowgraph.compilers.Run:
    return flowgraph.run(graph, overrides=["trainer.steps=2", *overrides], tensorboard=False,
                         out=io.StringIO(), **kw)


def test_running_a_cell_again_starts_a_fresh_dated_run_dir() -> None:
    """No run_dir given from Python: each run gets its own `runs/<graph>-<date>`, where
    the second run used to be refused (`already holds a run; ... --resume`)."""
    first, second = _run("g.yaml"), _run("g.yaml")
    assert first.run_dir != second.run_dir
    for run in (first, second):
        assert run.run_dir.parent == Path("runs")
        assert run.run_dir.name.startswith("faults-20"), run.run_dir
        assert [r["step"] for r in run.rows] == [0, 1]


def test_a_run_dir_that_holds_a_run_is_refused_in_python_words_or_overwritten() -> None:
    _run("g.yaml", run_dir="runs/a")
    with pytest.raises(FlowgraphError) as exc:
        _run("g.yaml", run_dir="runs/a")
    assert str(exc.value) == (
        "`runs/a` already holds a run; continue it with resume=True, start it afresh with "
        "overwrite=True, or give another directory: run_dir='runs/new'")
    Path("runs/a/traceback.txt").write_text("an earlier attempt's")
    again = _run("g.yaml", "trainer.steps=1", run_dir="runs/a", overwrite=True)
    assert [r["step"] for r in again.rows] == [0]  # the earlier rows are gone
    found = latest_checkpoint(Path("runs/a"))
    assert found is not None and found[0] == 0
    assert not Path("runs/a/traceback.txt").exists()


def test_overwrite_leaves_alone_a_folder_that_is_not_a_run_dir() -> None:
    """A folder with rows but no plan.json a run wrote, and the working directory itself,
    are not cleared: the run is refused and every file stays."""
    folder = Path("mine")
    folder.mkdir()
    (folder / "metrics.jsonl").write_text('{"step": 0}\n')
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(FlowgraphError, match=r"holds no plan\.json of a flowgraph run, so "
                                             r"overwrite=True leaves it alone"):
        _run("g.yaml", run_dir="mine", overwrite=True)
    assert (folder / "notes.txt").read_text() == "keep me"
    _run("g.yaml", run_dir=".")
    with pytest.raises(FlowgraphError, match="is the working directory"):
        _run("g.yaml", run_dir=".", overwrite=True)
    assert Path("g.yaml").exists() and Path("plan.json").exists()


def test_the_command_line_keeps_its_words(capsys: pytest.CaptureFixture[str]) -> None:
    from flowgraph.cli import main

    assert main(["run", "g.yaml", "trainer.steps=1", "trainer.run_dir=runs/c"]) == 0
    assert main(["run", "g.yaml", "trainer.steps=1", "trainer.run_dir=runs/c"]) == 1
    assert ("`runs/c` already holds a run; continue it with --resume, start it afresh with "
            "--overwrite, or give another directory: trainer.run_dir=runs/new"
            in capsys.readouterr().err)
    assert main(["run", "g.yaml", "trainer.steps=1", "trainer.run_dir=runs/c",
                 "--overwrite"]) == 0


def test_an_interrupt_saves_and_says_how_to_continue_in_python() -> None:
    """SIGINT (what a notebook's interrupt button sends) in step 1: the step finishes, is
    saved, and a KeyboardInterrupt names the call that continues the
    run; that call does."""
    args = ["nodes.score.params.at=1", "nodes.score.params.signals=SIGINT", "trainer.steps=3"]
    with pytest.raises(KeyboardInterrupt) as exc:
        _run("s.yaml", *args, run_dir="runs/s")
    assert exc.value.signum == signal.SIGINT and exc.value.run_dir == Path("runs/s")
    again = ("flowgraph.run('s.yaml', resume=True, overrides=['trainer.steps=2', "
             "'nodes.score.params.at=1', 'nodes.score.params.signals=SIGINT', "
             "'trainer.steps=3'], run_dir='runs/s')")
    assert str(exc.value) == (
        f"stopped by SIGINT; the last checkpoint is step 1; continue with: {again}")
    shown = exc.value._render_traceback_()
    assert shown == [f"KeyboardInterrupt: {exc.value}"]
    resumed = eval(again.replace("flowgraph.run(", "_run("), {"_run": flowgraph.run})
    assert [r["step"] for r in resumed.rows] == [0, 1, 2]


def test_ipython_shows_the_message_without_frames() -> None:
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    hooks = sys.displayhook, sys.excepthook
    shell = InteractiveShell.instance()
    code = ("import flowgraph, io\nflowgraph.run('s.yaml', overrides=['trainer.steps=3', "
            "'nodes.score.params.at=0', 'nodes.score.params.signals=SIGINT'], "
            "run_dir='runs/i', tensorboard=False, out=io.StringIO())")
    try:
        with capture_output() as shown:
            shell.run_cell(code)
    finally:  # the shell is this process's: leave none behind for the next tests
        InteractiveShell.clear_instance()
        sys.displayhook, sys.excepthook = hooks
    text = shown.stdout + shown.stderr
    assert "KeyboardInterrupt: stopped by SIGINT; the last checkpoint is step 0; continue with: " \
           "flowgraph.run('s.yaml', resume=True" in text, text
    assert "File " not in text and "Traceback" not in text, text


def test_other_messages_through_the_python_api_name_its_arguments() -> None:
    """Resuming with a changed setting, a plan given a size, the memory hint: the words
    of `flowgraph.run` / `flowgraph.compile`, not the command line's flags."""
    _run("g.yaml", "trainer.steps=1", run_dir="runs/r")
    with pytest.raises(FlowgraphError) as exc:
        _run("g.yaml", "dims.Bp=8", run_dir="runs/r", resume=True)
    assert "accept each change deliberately: resume=True allow_changed=['dims.Bp']" \
        in str(exc.value)
    plan = flowgraph.compile("g.yaml")
    with pytest.raises(flowgraph.FlowgraphError, match=r"compile the graph again with other "
                       r"target=\.\.\., nproc=\.\.\. or disable=\[\.\.\.\]"):
        flowgraph.run(plan, nproc=2)


def test_a_keyboard_interrupt_outside_the_runs_handling_is_a_stop_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the run starts (before its handlers are in place): the same
    KeyboardInterrupt, with the call that starts it again, not the executors' frames."""
    from flowgraph.compilers import builtin_training

    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(builtin_training, "ensure_builtins", interrupted)
    with pytest.raises(KeyboardInterrupt) as exc:
        _run("g.yaml", run_dir="runs/k")
    assert str(exc.value) == (
        "interrupted (KeyboardInterrupt) while the run started or ended; no checkpoint was "
        "written yet; start again with: flowgraph.run('g.yaml', resume=True, "
        "overrides=['trainer.steps=2'], run_dir='runs/k')")
    frames = traceback.extract_tb(exc.value.__traceback__)
    assert [f.name for f in frames if f.filename.endswith("api.py")] == ["run", "_run"]
    assert not [f for f in frames if "/flowgraph/compilers/" in f.filename], frames  # no executor's


@pytest.mark.parametrize("debug", [False, True])
def test_a_failed_run_raises_its_message_without_the_executors_frames(
        monkeypatch: pytest.MonkeyPatch, debug: bool) -> None:
    """A node's failure from Python: the `NodeError` whose message names node, step and
    line, raised from `flowgraph.run` alone (a script prints your line, two of the API's
    and the message, not 40 frames of executor); `debug=True` keeps the frames and the
    chain to the node's own exception."""
    import flowgraph.compilers as compilers
    from flowgraph.errors import NodeError

    def failing(*args: Any) -> None:
        try:
            raise ZeroDivisionError("in your reward")
        except ZeroDivisionError as exc:
            raise NodeError("while executing node `reward` at step 0: ...") from exc

    monkeypatch.setattr(compilers, "run", failing)
    with pytest.raises(NodeError) as exc:
        _run("g.yaml", run_dir="runs/f", debug=debug)
    frames = [f.name for f in traceback.extract_tb(exc.value.__traceback__)]
    if debug:
        assert frames[-1] == "failing" and isinstance(exc.value.__cause__, ZeroDivisionError)
    else:
        assert frames[-2:] == ["run", "_run"] and exc.value.__cause__ is None


def test_an_unknown_keyword_of_run_names_the_closest_or_the_setting_of_a_trl_name() -> None:
    """`flowgraph.run(..., report_to=...)` or a typo: a `UsageError` before anything
    starts, never `RunOptions`' TypeError."""
    from flowgraph.errors import UsageError

    with pytest.raises(UsageError, match=r"no argument `report_to`: `report_to` is TRL's "
                                         r"name; here: `trainer.loggers`"):
        flowgraph.run("g.yaml", report_to="wandb")
    with pytest.raises(UsageError, match=r"no argument `resum`: did you mean `resume`\?"):
        flowgraph.run("g.yaml", resum=True)
    assert not Path("runs").exists()


def test_a_new_run_removes_an_earlier_attempts_traceback() -> None:
    """An attempt that failed before its first step left only its traceback; the next run
    in that folder (not an overwrite: nothing else is there) starts without it."""
    Path("runs/t").mkdir(parents=True)
    Path("runs/t/traceback.txt").write_text("Traceback (most recent call last): ...")
    _run("g.yaml", run_dir="runs/t")
    assert not Path("runs/t/traceback.txt").exists()
    assert Path("runs/t/metrics.jsonl").exists()


SWEEP = """
import io, sys
import flowgraph

def run(steps):
    return flowgraph.run("s.yaml", overrides=[f"trainer.steps={steps}", "nodes.score.params.at=1",
                         "nodes.score.params.signals=SIGINT"], tensorboard=False,
                         out=io.StringIO(), overwrite=True, run_dir="runs/sweep")

if sys.argv[1] == "handler":
    try:
        run(3)
    except KeyboardInterrupt as exc:
        print("handler ran:", type(exc).__name__, exc.run_dir, flush=True)
        sys.exit(7)
for steps in (3, 4):  # a sweep that carries on past a failed config
    try:
        run(steps)
    except Exception as exc:
        print("swallowed", type(exc).__name__, flush=True)
print("the sweep went on", flush=True)
"""


@pytest.mark.parametrize("how", ["sweep", "handler"])
def test_ctrl_c_in_a_script_is_a_keyboard_interrupt_after_saving(how: str) -> None:
    """SIGINT in step 1 of a script's `flowgraph.run`: step 1 is saved, then a
    KeyboardInterrupt leaves the run — `except Exception:` does not catch it (the script
    ends as Ctrl-C ends one: killed by SIGINT, which a shell reports as exit status 130);
    `except KeyboardInterrupt:` does. Before, `Stopped` (an Exception) was swallowed and
    the sweep started its next run."""
    Path("sweep.py").write_text(SWEEP)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGINS), *sys.path])}
    done = subprocess.run([sys.executable, "sweep.py", how], env=env, text=True,
                          capture_output=True, timeout=240)
    found = latest_checkpoint(Path("runs/sweep"))
    assert found is not None and found[0] == 1, done.stderr  # saved, as before
    assert "swallowed" not in done.stdout and "went on" not in done.stdout, done.stdout
    if how == "handler":
        assert done.returncode == 7, done.stderr
        assert done.stdout == "handler ran: KeyboardInterrupt runs/sweep\n"
        return
    assert done.returncode == -signal.SIGINT, (done.returncode, done.stderr)
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("KeyboardInterrupt: stopped by SIGINT; the last "
                           "checkpoint is step 1; continue with: flowgraph.run("), last
