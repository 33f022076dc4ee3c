"""The error hierarchy of flowgraph: every error class of the core, the nodes and the
executors is declared here.

Every error a user can cause derives from `FlowgraphError`; the CLI turns these into
a message and an exit code, never a traceback. Internal invariants use plain
exceptions (a bug in flowgraph should show its traceback).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from flowgraph.diagnostics import Diagnostic


DEBUG_ENV = "FLOWGRAPH_DEBUG"
"""Set (to 1) by `flowgraph run --debug`, in every process of a run (fsdp ranks, Ray
workers): a node's error then carries its full traceback."""


class FlowgraphError(Exception):
    """Base class of every user-facing error."""

    def _render_traceback_(self) -> list[str]:
        """What IPython and Jupyter show of it: the message, without the frames of
        flowgraph's own code (the message names the user's file, line or node)."""
        return f"{type(self).__name__}: {self}".splitlines()


class UsageError(FlowgraphError):
    """A command was called wrongly (unknown option, missing file, bad override)."""


class GraphFileError(FlowgraphError):
    """A graph file could not be read or parsed into a document."""


class GraphError(FlowgraphError):
    """A graph failed its checks; carries every diagnostic, not just the first."""

    def __init__(self, diagnostics: tuple[Diagnostic, ...]) -> None:
        self.diagnostics = diagnostics
        errors = [d for d in diagnostics if d.severity == "error"]
        super().__init__("\n".join([f"{len(errors)} error(s) in the graph:",
                                    *(d.summary("  ") for d in errors)]))


class CompileError(FlowgraphError):
    """A graph that does not compile; `diagnostics` says why, each at its file:line."""

    def __init__(self, diagnostics: Sequence[Diagnostic]) -> None:
        self.diagnostics = tuple(diagnostics)
        errors = [d for d in self.diagnostics if d.is_error]
        super().__init__("\n".join(["the graph does not compile:",
                                    *(d.summary() for d in errors)]))


class IRError(FlowgraphError, ValueError):
    """An IR record was built with values that break its invariants."""


class PlanError(FlowgraphError, ValueError):
    """A plan was built, or read from JSON, with values that break its invariants."""


class PlanFileError(PlanError):
    """A plan file cannot be read as a plan: missing, too large, not UTF-8, not JSON,
    nested too deeply, or written in another format version."""


class DimError(FlowgraphError):
    """A dimension string does not parse (`"B T--1"`) or cannot be evaluated."""


class RegistryError(FlowgraphError):
    """A node kind was declared wrongly or registered twice with different contracts."""


class PluginError(FlowgraphError):
    """A plugin module listed under `plugins:` could not be imported."""


class ToolSchemaError(FlowgraphError):
    """A tool that cannot be offered to the policy: its JSON schema cannot be built from
    its hints and docstring, its settings are wrong (a timeout that is not a positive,
    finite number), or two tools of an environment share a name. The message names the
    function and its file:line, and says what to add."""


def at_step(step: int) -> str:
    """`at step 3`, or `in the prologue` (step -1: the plan's once-stage before the loop)."""
    return "in the prologue" if step < 0 else f"at step {step}"


class NonFiniteError(FlowgraphError):
    """NaN or infinity in a reward, advantage, loss or gradient."""

    def __init__(self, node: str, step: int, what: str) -> None:
        self.node, self.step, self.what = node, step, what
        super().__init__(f"non-finite {what} in node `{node}` {at_step(step)}")


class ContractViolation(FlowgraphError):
    """A tensor broke its edge's contract at run time."""


class RewardFnError(FlowgraphError):
    """A user's reward function raised: the message names the function, the row and its
    data source; the function's own exception is the cause (its frame is reported)."""


class SandboxError(FlowgraphError):
    """The Python sandbox (`flowgraph.agent.sandbox`) could not start its process, or its
    limits are invalid. The code's own errors are never this: they are output."""


class EnvError(FlowgraphError):
    """An agent environment flowgraph cannot run, or one whose own code (a TRL env's
    `reset` or `get_reward`, a verl tool's `release`, a SkyRL env's `step`) raised: the
    message names the object and its file:line; the env's own exception is the cause
    (its frame is reported)."""


class McpServerError(FlowgraphError):
    """An MCP server an agent rollout declares (`mcp_servers`) is not a valid declaration,
    did not start or list its tools (the message names the server, its command and the
    tail of its stderr), or failed a call: it exited, or answered with an error."""


class NodeError(FlowgraphError):
    """A node's implementation failed; the message names node, kind and step."""


class RankFailed(FlowgraphError):
    """A rank of an fsdp run died or raised; the message names rank, node and step."""


class WorkerLost(FlowgraphError):
    """A worker died or hung; the driver restarts the worker groups from a checkpoint."""


class Stopped(FlowgraphError):
    """A run stopped on SIGTERM or SIGINT (preemption, Ctrl-C), its work saved where it
    could be; `flowgraph run` exits with 128 + the signal's number (143, 130), and
    `flowgraph.run` raises it, its message saying how to continue (`resume=True`) — for
    Ctrl-C as a `KeyboardInterrupt` that carries the same (`flowgraph.api`)."""

    def __init__(self, signum: int, message: str, *, run_dir: Path | None = None) -> None:
        self.signum = signum
        self.run_dir = run_dir
        """The run's folder: its metrics so far, and the checkpoint to continue from."""
        super().__init__(message)


class StopUnsaved(Stopped):
    """A stop (SIGTERM, SIGINT) whose checkpoint could not be written: the workers that
    hold the weights were gone (on SLURM, a signal to every process of the job); the
    message says what was lost, the run's stop message the last checkpoint."""


class Interrupted(BaseException):
    """A second SIGTERM/SIGINT, or the end of `trainer.stop_grace_s`: stop at once. A
    BaseException, so that no `except Exception` in a node's code swallows it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signum)


class NodeTimeout(BaseException):
    """Raised inside a node that ran past its `timeout_s` (or the local target's
    `trainer.step_timeout_s`); the worker reports it as the node's error, with the line it
    was stuck at. A BaseException, so that the node's own `except Exception` cannot
    swallow it."""
