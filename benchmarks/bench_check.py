"""Benchmark `flowgraph check`: every shipped graph cold, and a synthetic 10,000-node graph.

    python benchmarks/bench_check.py            # the shipped graphs against the target
    python benchmarks/bench_check.py --profile  # plus cProfile of the 10k load+check

(a) Cold start: for every file under graphs/ (graphs/broken/ too), the median wall
    time of 5 runs of `python -m flowgraph check <file>` in a fresh process, next to
    `python -c "import yaml"` (the floor: an interpreter and PyYAML). Target: <= 0.5 s
    for each file: a graph a user writes. Then the heavy modules: checking them all
    must not import torch, transformers, ray, vllm or networkx (asserted).
(b) Scale, for reference (no target: a 10,000-node graph may take longer): a
    generated PPO-style pipeline of 10,000 nodes (chains of logprob, values,
    kl_penalty, gae and update nodes, all wired correctly) is loaded and checked
    in-process (median of 5); the same file through the CLI is shown too.

Exits 1 if a shipped graph misses the target or a heavy module was imported.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRAPHS = sorted((ROOT / "graphs").glob("**/*.yaml"))
EXAMPLES = sorted((ROOT / "graphs").glob("*.yaml"))
"""The clean examples; graphs/broken/ holds graphs that must fail."""
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "tests" / "plugins")}
"""Two broken graphs use plugin kinds from tests/plugins/broken_heads.py (no torch)."""
HEAVY = ("torch", "transformers", "ray", "vllm", "networkx")
COLD_TARGET_S = 0.5
NODES = 10_000

_SEQ = ("      prompts: gen.prompts\n      prompt_mask: gen.prompt_mask\n"
        "      responses: gen.responses\n      response_mask: gen.response_mask\n")
_HEAD = """\
version: 1
name: synthetic
dims: {Bp: 16, N: 1, P: 16, T: 8}
models:
  actor: {path: "builtin:tiny-lm", trainable: true}
  ref: {path: "builtin:tiny-lm"}
  critic: {path: "builtin:tiny-lm", trainable: true}
data:
  train: {kind: prompts, path: "builtin:arith"}
nodes:
  gen:
    kind: generate
    model: actor
    inputs:
      prompts: train.input_ids
      prompt_mask: train.attention_mask
      ground_truth: train.ground_truth
  reward:
    kind: reward
    inputs:
      responses: gen.responses
      response_mask: gen.response_mask
      ground_truth: gen.ground_truth
  tok:
    kind: token_reward
    inputs: {scores: reward.scores, response_mask: gen.response_mask}
"""


def _block(i: int, scores: str) -> str:
    """Seven nodes: log-probs, values, a KL penalty fed by the previous one, GAE, updates."""
    return (
        f"  lp_{i}:\n    kind: logprob\n    model: actor\n    inputs:\n{_SEQ}"
        f"  ref_{i}:\n    kind: logprob\n    model: ref\n    inputs:\n{_SEQ}"
        f"  val_{i}:\n    kind: values\n    model: critic\n    inputs:\n{_SEQ}"
        f"  kl_{i}:\n    kind: kl_penalty\n    inputs:\n"
        f"      token_level_scores: {scores}\n      log_prob: lp_{i}.log_prob\n"
        f"      ref_log_prob: ref_{i}.log_prob\n      response_mask: gen.response_mask\n"
        f"    params: {{kl_coef: 0.001}}\n"
        f"  adv_{i}:\n    kind: gae\n    inputs:\n"
        f"      token_level_rewards: kl_{i}.token_level_rewards\n      values: val_{i}.values\n"
        f"      response_mask: gen.response_mask\n    params: {{gamma: 1.0, lam: 0.95}}\n"
        f"  upa_{i}:\n    kind: ppo_actor_update\n    model: actor\n    inputs:\n{_SEQ}"
        f"      old_log_prob: lp_{i}.log_prob\n      advantages: adv_{i}.advantages\n"
        f"    params: {{mini_batch_size: 8}}\n"
        f"  upc_{i}:\n    kind: ppo_critic_update\n    model: critic\n    inputs:\n{_SEQ}"
        f"      values: val_{i}.values\n      returns: adv_{i}.returns\n"
        f"    params: {{mini_batch_size: 8}}\n"
    )


def synthetic_graph(nodes: int = NODES) -> str:
    """A clean graph file of exactly `nodes` nodes (at least 10): every output is used,
    and the KL penalties form one chain about nodes/7 long."""
    parts, scores = [_HEAD], "tok.token_level_scores"
    for j in range((nodes - 3) % 7):  # top up: extra KL penalties at the chain's start
        parts.append(f"  extra_kl_{j}:\n    kind: kl_penalty\n    inputs:\n"
                     f"      token_level_scores: {scores}\n      log_prob: lp_0.log_prob\n"
                     f"      ref_log_prob: ref_0.log_prob\n"
                     f"      response_mask: gen.response_mask\n")
        scores = f"extra_kl_{j}.token_level_rewards"
    for i in range((nodes - 3) // 7):
        parts.append(_block(i, scores))
        scores = f"kl_{i}.token_level_rewards"
    return "".join(parts)


def _median_wall(cmd: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, capture_output=True, cwd=ROOT, env=ENV)  # broken ones exit 1
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cold_start(runs: int = 5) -> bool:
    times = {path: _median_wall([sys.executable, "-m", "flowgraph", "check", str(path)], runs)
             for path in GRAPHS}
    floor = _median_wall([sys.executable, "-c", "import yaml"], runs)
    slowest = max(times, key=lambda p: times[p])
    missed = sorted(str(p.relative_to(ROOT)) for p, t in times.items() if t > COLD_TARGET_S)
    print(f"(a) cold start  `python -m flowgraph check <file>` on {len(times)} files under "
          f"graphs/ (median of {runs} each): {min(times.values()):.3f} to {times[slowest]:.3f} "
          f"s (slowest: {slowest.relative_to(ROOT)}), target <= {COLD_TARGET_S} s each: "
          f"{'ok' if not missed else 'MISSED by ' + ', '.join(missed)}")
    print(f"    `python -c \"import yaml\"`: {floor:.3f} s; slowest file "
          f"{times[slowest] / floor:.2f}x")
    return not missed


def heavy_modules() -> bool:
    code = ("import sys\nfrom flowgraph.cli import main\n"
            f"clean = main(['check', *{[str(p) for p in EXAMPLES]!r}])\n"
            f"main(['check', *{[str(p) for p in GRAPHS]!r}, '--format', 'github'])\n"
            "print('STATUS', clean, *sorted(sys.modules))\n")
    run = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, cwd=ROOT, env=ENV)
    _, status, *modules = run.stdout[run.stdout.index("STATUS "):].split()
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    ours = sorted(m for m in modules if m.startswith("flowgraph"))
    print(f"    modules after checking all {len(GRAPHS)}: {len(modules)} in all, {len(ours)} of "
          f"flowgraph ({', '.join(m.removeprefix('flowgraph.') for m in ours)})")
    print(f"    heavy modules imported: {heavy or 'none'} (checked: {', '.join(HEAVY)})")
    assert status == "0", f"graphs/*.yaml did not check clean (status {status})"
    assert not heavy, f"`flowgraph check` imported {heavy}"
    return not heavy


def _load_and_check(path: Path) -> tuple[float, float, float, int, int]:
    """(wall s, CPU s, wall s of the load alone, nodes, edges) of one load_graph +
    check_graph."""
    from flowgraph.checker import check_graph
    from flowgraph.frontend import load_graph

    start, cpu = time.perf_counter(), time.process_time()
    graph, diags = load_graph(path)
    loaded = time.perf_counter() - start
    assert graph is not None, [d.one_line() for d in diags]
    result = check_graph(graph)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    problems = [d.one_line() for d in (*diags, *result.diagnostics)]
    assert not problems, problems[:5]
    return elapsed, cpu, loaded, len(graph.nodes), sum(len(n.inputs) for n in graph.nodes)


def scale(path: Path, runs: int = 5) -> None:
    results = [_load_and_check(path) for _ in range(runs)]
    elapsed = statistics.median(r[0] for r in results)
    cpu = statistics.median(r[1] for r in results)
    loaded = statistics.median(r[2] for r in results)
    checked = statistics.median(r[0] - r[2] for r in results)
    _, _, _, nodes, edges = results[0]
    print(f"(b) {nodes:,} nodes, {edges:,} edges, {path.stat().st_size / 1e6:.1f} MB: "
          f"load_graph + check_graph {elapsed:.2f} s wall, {cpu:.2f} s CPU (median of "
          f"{runs}; best {min(r[0] for r in results):.2f} s), for reference (no target)")
    print(f"    of which load_graph {loaded:.2f} s, check_graph {checked:.2f} s (medians)")
    cli = _median_wall([sys.executable, "-m", "flowgraph", "check", str(path)], 1)
    print(f"    `python -m flowgraph check` on it: {cli:.2f} s (start-up included)")


def profile(path: Path) -> None:
    from flowgraph.checker import check_graph
    from flowgraph.frontend import load_graph

    prof = cProfile.Profile()
    prof.enable()
    graph, _ = load_graph(path)
    assert graph is not None
    check_graph(graph)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", action="store_true", help="cProfile the 10k check")
    parser.add_argument("--runs", type=int, default=5, help="cold-start runs per file (median)")
    args = parser.parse_args()
    ok = cold_start(args.runs)
    ok = heavy_modules() and ok
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "synthetic_10k.yaml"
        path.write_text(synthetic_graph(), encoding="utf-8")
        scale(path)
        if args.profile:
            profile(path)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
