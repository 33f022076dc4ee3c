"""Benchmark the distributed targets: orchestration overhead, Ray transfers, recovery.

    python benchmarks/bench_dist.py                 # all three, tiny PPO, 12 steps each
    python benchmarks/bench_dist.py --steps 30 --only overhead

(a) Orchestration overhead per step on graphs/ppo.yaml (tiny built-in model): step wall
    time minus the time spent inside node implementations, as a share of the step
    (`perf/orchestration_frac` of metrics.jsonl; fsdp: rank 0, which counts slicing and
    all-gathers as orchestration; ray: the driver, which counts object-store transfers
    and the slowest worker's compute as inside), median over the steps after the first
    two, for local, fsdp(2) and ray(2 workers per pool).
(b) Ray transfer cost: a tensor of S MB sent from the driver to an actor and a scalar
    back (`ray.put` + a task), median of 5, reported per MB for S in 1, 16, 64.
(c) Recovery: a GRPO run under ray whose worker is SIGKILLed after step 2; the time from
    the driver noticing to the next completed step (`perf/recovery_s`), and the total
    wall time from the kill.

These machines are shared: read the ratios, and the load average printed first.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PPO, GRPO = ROOT / "graphs" / "ppo.yaml", ROOT / "graphs" / "grpo.yaml"


def _rows(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run(target: str, steps: int, run_dir: Path) -> float:
    cmd = [sys.executable, "-m", "flowgraph", "run", str(PPO), "--target", target,
           "--nproc", "2", f"trainer.steps={steps}", f"trainer.run_dir={run_dir}"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def overhead(steps: int) -> None:
    print(f"(a) orchestration overhead, graphs/ppo.yaml, {steps} steps (median of steps >= 2)")
    with tempfile.TemporaryDirectory() as tmp:
        for target in ("local", "fsdp", "ray"):
            run_dir = Path(tmp) / target
            wall = _run(target, steps, run_dir)
            rows = _rows(run_dir)[2:]
            frac = statistics.median(r["perf/orchestration_frac"] for r in rows)
            step = statistics.median(r["timing_s/step"] for r in rows)
            print(f"  {target:5s}  step {step * 1e3:7.1f} ms  orchestration {frac:6.1%} "
                  f"({frac * step * 1e3:6.1f} ms)  run wall {wall:5.1f} s")


def transfers() -> None:
    import ray
    import torch

    print("(b) Ray transfer, driver -> actor (put + task), median of 5")
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        @ray.remote
        class Sink:
            def take(self, t: torch.Tensor) -> float:
                return float(t[0])

        sink = Sink.remote()  # type: ignore[attr-defined]
        ray.get(sink.take.remote(torch.zeros(8)))
        for mb in (1, 16, 64):
            t = torch.ones(mb * (1 << 20) // 4)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                ray.get(sink.take.remote(ray.put(t)))
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            print(f"  {mb:3d} MB  {med * 1e3:7.2f} ms  = {med * 1e3 / mb:6.3f} ms/MB "
                  f"({mb / med / 1024:5.2f} GB/s)")
    finally:
        ray.shutdown()


def recovery() -> None:
    print("(c) recovery: SIGKILL a worker of graphs/grpo.yaml under ray after step 2")
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        proc = subprocess.Popen(
            [sys.executable, "-m", "flowgraph", "run", str(GRPO), "--target", "ray", "--nproc",
             "2", "trainer.steps=8", "trainer.checkpoint_every=2", f"trainer.run_dir={run_dir}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while len(_rows(run_dir)) < 3:
            if proc.poll() is not None:
                sys.exit("the run ended early")
            time.sleep(0.1)
        pids = json.loads((run_dir / ".ranks" / "workers.json").read_text())
        killed = time.perf_counter()
        os.kill(pids["actor_rollout_ref"][1], signal.SIGKILL)
        done = len(_rows(run_dir))
        while not any("perf/recovery_s" in r for r in _rows(run_dir)):
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        since_kill = time.perf_counter() - killed
        proc.wait()
        rec = [r["perf/recovery_s"] for r in _rows(run_dir) if "perf/recovery_s" in r]
        print(f"  rows before the kill {done}; driver noticed -> next completed step "
              f"{rec[0] if rec else float('nan'):.1f} s; kill -> next completed step "
              f"{since_kill:.1f} s; steps in metrics.jsonl: "
              f"{[int(r['step']) for r in _rows(run_dir)]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--only", choices=("overhead", "transfers", "recovery"))
    args = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores")
    if args.only in (None, "overhead"):
        overhead(args.steps)
    if args.only in (None, "transfers"):
        transfers()
    if args.only in (None, "recovery"):
        recovery()


if __name__ == "__main__":
    main()
