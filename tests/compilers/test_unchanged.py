"""Nothing users see changes: every shipped graph gives the numbers it gave before the
executors were restructured (`tests/fixtures/targets/metrics.json`, recorded by
`scripts/record_target_metrics.py` from 0e898a2: 3 steps, an evaluation and
checkpoints on the way). The local target runs every case here; fsdp(2) and ray(2)
run them under the `slow` marker (the default suite compares those targets with the
local run in test_fsdp.py and test_ray.py). On the machine that recorded them the
numbers are equal bit for bit (`python scripts/record_target_metrics.py --check`);
the tolerance is for other CPUs, whose kernels round differently: on an AMD EPYC the
gradient norms of ppo, grpo_lora, grpo and trl_format/grpo differ by up to 2.0e-5
relative (every other number by under 1e-6), so the targets' usual 1e-4 holds here. On
another EPYC (2026-12-07) ppo's `actor/reward_kl_penalty` at step 2, a mean of -4.8e-3
over differences of log-probs near -5, differs by 1.1e-6 absolutely (2.2e-4 relative), on
the code the fixture was recorded from as on today's: a value that small from terms that
large carries their float32 rounding, so its floor is `FLOOR`, not the targets' 1e-6."""


from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

import flowgraph
from flowgraph.testing.targets import assert_same_numbers

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "record_target_metrics", ROOT / "scripts" / "record_target_metrics.py")
assert _spec is not None and _spec.loader is not None
record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record)
"""The script that recorded the fixture: its cases and commands are the ones run here."""
FIXTURE = json.loads(record.FIXTURE.read_text())
CASES: dict[str, tuple[str, tuple[str, ...]]] = record.cases()
FLOOR = 2e-6
"""The absolute floor of a comparison with the fixture (recorded on another CPU)."""


def test_every_case_of_the_fixture_is_run() -> None:
    assert sorted(CASES) == sorted(FIXTURE)
    assert all(sorted(FIXTURE[c]) == ["fsdp", "local", "ray"] for c in FIXTURE)


def _recorded(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` as the fixture holds them (`record.as_recorded`: without the metrics added
    since it was recorded), each of those present."""
    assert all(any(record.ADDED.fullmatch(k) for k in row) for row in rows), "data positions"
    return list(record.as_recorded(rows))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_local_target_gives_the_recorded_numbers(case: str, tmp_path: Path) -> None:
    """In this process (the script runs the command: the same numbers, slower)."""
    graph, overrides = CASES[case]
    with open(os.devnull, "w") as out:
        rows = flowgraph.run(ROOT / "graphs" / f"{graph}.yaml", overrides=[
            *record.COMMON, *overrides, f"trainer.run_dir={tmp_path / 'run'}"],
            out=out, tensorboard=False).rows
    assert_same_numbers(_recorded(rows), FIXTURE[case]["local"], abs_floor=FLOOR)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("target", ["fsdp", "ray"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fsdp_and_ray_give_the_recorded_numbers(case: str, target: str) -> None:
    graph, overrides = CASES[case]
    assert_same_numbers(_recorded(record.run_case(graph, target, overrides)),
                        FIXTURE[case][target], abs_floor=FLOOR)
