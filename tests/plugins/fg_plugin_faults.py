"""Plugin kinds that hurt on purpose, for the tests of a node's guard (exits, interrupts,
hangs, in-place writes into inputs): `tests/compilers/test_plugin_faults.py`."""

import os
import signal
import sys
import time

from jaxtyping import Float, Int
from torch import Tensor

from flowgraph.registry import node_kind


@node_kind("exiting_score", outputs=["scores"], category="custom")
def exiting_score(ctx, input_ids: Int[Tensor, "b P"], how: str = "exit",
                  at: int = -1) -> Float[Tensor, " b"]:
    """Mean token id per prompt; at step `at` it exits the process or raises Ctrl-C."""
    if ctx.step == at and how == "exit":
        sys.exit(3)  # the plugin's exit
    if ctx.step == at:
        raise KeyboardInterrupt  # the plugin's interrupt
    return input_ids.float().mean(-1)


@node_kind("sleepy_score", outputs=["scores"], category="custom")
def sleepy_score(ctx, input_ids: Int[Tensor, "b P"], at: int = -1) -> Float[Tensor, " b"]:
    """Mean token id per prompt; hangs at step `at`, as a reward waiting on a server."""
    if ctx.step == at:
        time.sleep(60)  # the plugin's hang
    return input_ids.float().mean(-1)


@node_kind("mask_writer", outputs=["scores"], category="custom")
def mask_writer(ctx, input_ids: Int[Tensor, "b P"], at: int = -1) -> Float[Tensor, " b"]:
    """Mean token id per prompt; at step `at` it zeroes its input in place."""
    scores = input_ids.float().mean(-1)
    if ctx.step == at:
        input_ids.zero_()  # the plugin's in-place write into an input
    return scores


@node_kind("info_writer", outputs=["scores"], category="custom")
def info_writer(ctx, input_ids: Int[Tensor, "b P"], extra_info: list[dict],
                at: int = -1) -> Float[Tensor, " b"]:
    """Mean token id per prompt; at step `at` it writes into a row's `extra_info`."""
    if ctx.step == at:
        extra_info[0]["hacked"] = 128  # the plugin's in-place write into an object input
    return input_ids.float().mean(-1)


@node_kind("signalling_score", outputs=["scores"], category="custom")
def signalling_score(ctx, input_ids: Int[Tensor, "b P"], at: int = -1, signals: str = "SIGTERM",
                     group: bool = False, marker: str = "") -> Float[Tensor, " b"]:
    """Mean token id per prompt; at step `at` (once: while file `marker` does not exist)
    it sends each of `signals` (comma-separated) to its process, or as Ctrl-C does to
    its process group (`group`; an fsdp run: rank 0 alone sends)."""
    fire = ctx.step == at and os.environ.get("RANK", "0") == "0"
    if fire and marker and os.path.exists(marker):
        fire = False
    if fire and marker:
        open(marker, "w").close()
    for name in signals.split(",") if fire else []:
        if group:
            os.killpg(os.getpgid(0), getattr(signal, name))
        else:
            os.kill(os.getpid(), getattr(signal, name))
        time.sleep(0.2)  # each signal handled before the next is sent
    return input_ids.float().mean(-1)
