"""Nothing users see changes: every shipped graph gives the numbers it gave before the
executors were restructured (`tests/fixtures/targets/metrics.json`, recorded by
`scripts/record_target_metrics.py` from 0e898a2: 3 steps, an evaluation and
checkpoints on the way). The local target runs every case here; fsdp(2) and ray(2)
run them under the `slow` marker (the default suite compares those targets with the
local run in test_fsdp.py and test_ray.py). On the machine that recorded them the
numbers are equal bit for bit (`python scripts/record_target_metrics.py --check`);
the tolerance is for other CPUs, whose kernels round differently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import flowgraph
from flowgraph.testing.targets import assert_same_numbers

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "targets" / "metrics.json").read_text())
COMMON = ("trainer.steps=3", "trainer.eval_every=2", "trainer.checkpoint_every=2")
CASES = {
    **{g: (g, ()) for g in FIXTURE if "+" not in g},
    "grpo+async": ("grpo", ("trainer.max_staleness=1",)),
    "grpo+tied": ("grpo", ("models.actor.path=builtin:tiny-tied",
                           "models.ref.path=builtin:tiny-tied")),
}
"""As scripts/record_target_metrics.py runs them."""
OWN = {"remax": ("trainer.eval_every=0",)}


def _overrides(case: str, run_dir: Path) -> list[str]:
    graph, extra = CASES[case]
    return [*COMMON, *OWN.get(graph, ()), *extra, f"trainer.run_dir={run_dir}"]


def test_every_case_of_the_fixture_is_run() -> None:
    assert sorted(CASES) == sorted(FIXTURE)
    assert all(sorted(FIXTURE[c]) == ["fsdp", "local", "ray"] for c in FIXTURE)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_local_target_gives_the_recorded_numbers(case: str, tmp_path: Path) -> None:
    graph, _ = CASES[case]
    with open(os.devnull, "w") as out:
        rows = flowgraph.run(ROOT / "graphs" / f"{graph}.yaml",
                             overrides=_overrides(case, tmp_path / "run"), out=out,
                             tensorboard=False).rows
    assert_same_numbers(rows, FIXTURE[case]["local"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("target", ["fsdp", "ray"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fsdp_and_ray_give_the_recorded_numbers(case: str, target: str, tmp_path: Path
                                                ) -> None:
    graph, _ = CASES[case]
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "flowgraph", "run", f"graphs/{graph}.yaml", "--target", target,
         "--nproc", "2", *_overrides(case, run_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows: list[dict[str, Any]] = [json.loads(line) for line in
                                  (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert_same_numbers(rows, FIXTURE[case][target], rel=1e-5)
