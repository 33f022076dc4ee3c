"""Record what every shipped graph reports on each target, as users meet it: the
`flowgraph` command, a few steps, an evaluation and a checkpoint on the way.

The fixture `tests/fixtures/targets/metrics.json` (graph -> target -> metric rows without
wall-clock entries) was written by this script before the executors were restructured
(issue 24: "nothing users see changes"); `tests/compilers/test_unchanged.py` runs the
same commands and compares. Run from the repository root:

    python scripts/record_target_metrics.py                 # every case (~15 min, 2 cores)
    python scripts/record_target_metrics.py --only grpo     # cases whose name has `grpo`
    python scripts/record_target_metrics.py --check         # compare, write nothing
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from flowgraph.testing.targets import numbers

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "targets" / "metrics.json"
ADDED = re.compile(r"data/[^/]+/(epoch|position)")
"""Metrics added since the fixture was recorded, numbers of their own that change none
of the recorded ones: where each data source's cursor stands after a step's batch
(`data/<source>/epoch|position`). `as_recorded` leaves them out."""
COMMON = ("trainer.steps=3", "trainer.eval_every=2", "trainer.checkpoint_every=2")
"""Three steps: an evaluation and a checkpoint after step 1, the last step saved."""
GRAPHS = ("ppo", "grpo", "dpo", "rloo", "reinforce_pp", "remax", "dapo", "gspo", "drgrpo",
          "sft", "grpo_lora", "verl_format/grpo", "trl_format/grpo")
"""Every graph shipped under graphs/ (not graphs/broken/)."""
TARGETS = {"local": (), "fsdp": ("--target", "fsdp", "--nproc", "2"),
           "ray": ("--target", "ray", "--nproc", "2")}
EXTRA = {
    "grpo+async": ("grpo", ("trainer.max_staleness=1",)),
    "grpo+tied": ("grpo", ("models.actor.path=builtin:tiny-tied",
                           "models.ref.path=builtin:tiny-tied")),
}
"""Variants beside the shipped graphs: asynchronous rollouts and the tied model."""


OWN = {"remax": ("trainer.eval_every=0",)}
"""A graph's own overrides: ReMax's evaluation fails (its greedy baseline's rows do not
match the held-out batch's), so its runs do not evaluate."""


def cases() -> dict[str, tuple[str, tuple[str, ...]]]:
    out = {g: (g, OWN.get(g, ())) for g in GRAPHS}
    out.update(EXTRA)
    return out


def as_recorded(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """`rows` as the fixture holds them: without the metrics added since (`ADDED`)."""
    return [{k: v for k, v in row.items() if not ADDED.fullmatch(k)} for row in rows]


def run_case(graph: str, target: str, overrides: tuple[str, ...]) -> list[dict[str, float]]:
    """The metric rows of one run, wall-clock entries left out."""
    with tempfile.TemporaryDirectory(prefix="fg-unchanged-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "flowgraph", "run", f"graphs/{graph}.yaml",
               *TARGETS[target], *COMMON, *overrides, f"trainer.run_dir={run_dir}"]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n"
                               f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        rows = [json.loads(line) for line in
                (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        shutil.rmtree(run_dir, ignore_errors=True)
    return [numbers(row) for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="cases whose name contains this")
    parser.add_argument("--targets", nargs="*", default=list(TARGETS))
    parser.add_argument("--check", action="store_true", help="compare with the fixture")
    parser.add_argument("--missing", action="store_true", help="record only what is missing")
    args = parser.parse_args()
    recorded = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    differ = 0
    for name, (graph, overrides) in cases().items():
        if args.only not in name:
            continue
        for target in args.targets:
            if args.missing and target in recorded.get(name, {}):
                continue
            rows = run_case(graph, target, overrides)
            if args.check:
                same = as_recorded(rows) == recorded.get(name, {}).get(target)
                differ += not same
                print(f"{name:18s} {target:5s} {'same' if same else 'DIFFERENT'}", flush=True)
                continue
            recorded.setdefault(name, {})[target] = as_recorded(rows)
            print(f"{name:18s} {target:5s} {len(rows)} rows", flush=True)
            FIXTURE.parent.mkdir(parents=True, exist_ok=True)
            FIXTURE.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
