"""Compare runs of one graph on different targets (local, fsdp, ray): same numbers.

    from flowgraph.testing.targets import assert_same_numbers
    assert_same_numbers(read_metrics(Path("runs/ray")), read_metrics(Path("runs/local")))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

WALL_CLOCK = ("timing_s/", "phase_s/", "perf/", "agent/tool_time_s", "async/overlap_frac")
"""Prefixes of metrics that measure time, not training: never equal run to run (an
agent rollout's seconds in tools, the share of the trainer's time that overlapped
generation among them); held-out ones (`val/...`) too."""


def numbers(row: Mapping[str, Any]) -> dict[str, Any]:
    """A metrics.jsonl row without its wall-clock entries."""
    return {k: v for k, v in row.items()
            if not k.removeprefix("val/").startswith(WALL_CLOCK)}


def assert_same_numbers(rows: Sequence[Mapping[str, Any]],
                        reference: Sequence[Mapping[str, Any]], *, rel: float = 1e-4,
                        abs_floor: float = 1e-6) -> None:
    """Every non-wall-clock metric of every step within `rel` relative. Float32 sums
    taken in another order (per-worker slices, gathers) differ by ~1e-7 absolutely, so
    a value that is itself ~0 (the KL of a first step) gets the floor `abs_floor`."""
    steps, want_steps = [r["step"] for r in rows], [r["step"] for r in reference]
    assert steps == want_steps, f"steps {steps} != {want_steps}"
    for row, ref in zip(rows, reference, strict=True):
        got, want = numbers(row), numbers(ref)
        assert sorted(got) == sorted(want), \
            f"step {ref['step']}: metrics differ: {sorted(set(got) ^ set(want))}"
        far = {k: (got[k], want[k]) for k in want
               if not math.isclose(got[k], want[k], rel_tol=rel, abs_tol=abs_floor)}
        assert not far, f"step {ref['step']}: (run, reference) {far}"
