"""Benchmark: asynchronous rollouts on ray's rollout pool against the synchronous run.

Run:  python benchmarks/bench_async_pool.py                 (3 rounds of 30 steps)
      python benchmarks/bench_async_pool.py --rounds 1 --steps 20 --T 64

The GRPO of `bench_vs_trl.py` (`grpo`: 8 prompts × 4 samples, up to `--T` new tokens,
the tiny random Llama, one optimizer step a rollout) on `--target ray` with one CPU
worker per pool, two ways, alternating in each round (sync, async, async, sync, …) so a
slow spell of a shared machine hits both:

* `sync`: `trainer.max_staleness: 0`: the `actor_rollout_ref` worker generates, then
  trains, step after step;
* `async`: `trainer.max_staleness: 1`: the rollout pool's worker (`resources.rollout_cpus:
  1`) generates step k+1 while the `actor_rollout_ref` worker trains step k; the
  trained weights go to it after every update.

A step's time is the driver's, from one step's console line to the next (the update,
the wait for a rollout, the weights sent to the rollout pool, the row written); the
first `--warmup` steps are left out. Printed: each run's steps/s, the median step
time of each way, the async / sync steps/s ratio (goal ≥ 1.3) and the mean
`async/overlap_frac` (the share of the trainer's work that generation overlapped).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_vs_trl as trl_bench  # noqa: E402 - the shared GRPO graph and workspace


class _StepClock:
    """The run's console: the time each step's line arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def write(self, text: str) -> int:
        if text.startswith("step "):
            self.times.append(time.perf_counter())
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def run(way: str, steps: int, T: int, ws: dict[str, str], root: Path, warmup: int
        ) -> dict[str, Any]:
    import flowgraph

    setting = trl_bench.Setting("grpo", "grpo", steps, 8, 4, T)
    graph = trl_bench.flowgraph_grpo(setting, ws, root / way,
                                     staleness=1 if way == "async" else 0)
    clock = _StepClock()
    rows = flowgraph.run(graph, target="ray", nproc=1, overwrite=True, out=clock,
                         tensorboard=False).rows
    gaps = [b - a for a, b in itertools.pairwise(clock.times[warmup:])]
    overlap = [r["async/overlap_frac"] for r in rows[warmup:] if "async/overlap_frac" in r]
    return {"step_s": statistics.median(gaps), "steps_per_s": len(gaps) / sum(gaps),
            "overlap": statistics.mean(overlap) if overlap else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--T", type=int, default=32, help="new tokens at most per response")
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ws = trl_bench.workspace(root)
        results: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
        for i in range(args.rounds):
            order = ("sync", "async") if i % 2 == 0 else ("async", "sync")
            for way in order:
                r = run(way, args.steps, args.T, ws, root / f"round{i}", args.warmup)
                results[way].append(r)
                print(f"round {i} {way:>5}: {r['steps_per_s']:.2f} steps/s, median step "
                      f"{r['step_s'] * 1000:.0f} ms, overlap_frac {r['overlap']:.2f}",
                      flush=True)
    sync = statistics.mean(r["steps_per_s"] for r in results["sync"])
    asyn = statistics.mean(r["steps_per_s"] for r in results["async"])
    print(f"ray, one CPU worker per pool, GRPO Bp=8 N=4 T={args.T}, {args.steps} steps "
          f"x {args.rounds} rounds: sync {sync:.2f} steps/s, async {asyn:.2f} steps/s, "
          f"async/sync {asyn / sync:.2f}x (goal >= 1.3x); mean overlap_frac "
          f"{statistics.mean(r['overlap'] for r in results['async']):.2f}")


if __name__ == "__main__":
    main()
