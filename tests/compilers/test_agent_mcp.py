"""graphs/agent_mcp.yaml, the calculator example with its tool on an MCP server
(graphs/calc_mcp.py, started as a subprocess by the run): it runs on the local target,
and it gives the numbers graphs/agent_calculator.yaml (the same function as a Python
tool) gives, on one worker and on two. (Calls, errors, timeouts and servers that die or
do not start: tests/agent/test_mcp_servers.py; FG610: graphs/broken/.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flowgraph.agent.mcp_servers import _Servers
from flowgraph.cli import main
from flowgraph.testing.targets import assert_same_numbers

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["models.actor.path=builtin:tiny-lm", "dims.Bp=4", "dims.N=2", "trainer.steps=2",
         "trainer.eval_every=0", "trainer.val_before_train=false",
         "trainer.checkpoint_every=0", "nodes.update.params.mini_batch_size=8"]
"""Two steps of 8 episodes on the untrained tiny model (no warm-up to train)."""
CALLING = ["dims.Bp=4", "dims.N=4", "trainer.steps=2", "trainer.eval_every=0",
           "trainer.val_before_train=false", "trainer.checkpoint_every=0",
           "nodes.update.params.mini_batch_size=16"]
"""Two steps of 16 episodes on the example's warm-up (builtin:tiny-lm-calc), which calls
the calculator in about half of them."""


def _run(graph: str, run_dir: Path, *overrides: str) -> list[dict[str, Any]]:
    assert main(["run", str(ROOT / "graphs" / graph), f"trainer.run_dir={run_dir}",
                 *overrides]) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


def test_the_mcp_example_runs_two_steps_on_the_local_target(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the server's folder is the graph file's, from anywhere
    rows = _run("agent_mcp.yaml", tmp_path / "run", *SMALL)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["agent/status/error"] == 0 and r["agent/status/timeout"] == 0 for r in rows)
    # the run started the server in this process, from the graph's folder (check is run)
    (server,) = [s for s in _Servers.running if s.name == "calc"]
    assert server.cwd == str(ROOT / "graphs") and server.command == ("python", "calc_mcp.py")
    assert not _Servers.running[server].exited


@pytest.mark.slow
@pytest.mark.multiprocess
def test_mcp_tools_give_the_python_tools_numbers_on_one_worker_and_on_two(
        tmp_path: Path) -> None:
    """Each fsdp rank starts its own server (measured: equal within assert_same_numbers'
    1e-4 on fsdp(2), and equal to the Python tool's local run)."""
    python = _run("agent_calculator.yaml", tmp_path / "python", *CALLING)
    local = _run("agent_mcp.yaml", tmp_path / "local", *CALLING)
    assert min(r["agent/tool_calls"] for r in local) > 0.2  # the MCP tool is called
    assert_same_numbers(local, python, rel=0.0, abs_floor=0.0)
    fsdp = _run("agent_mcp.yaml", tmp_path / "fsdp", *CALLING, "--target", "fsdp",
                "--nproc", "2")
    assert_same_numbers(fsdp, local)
