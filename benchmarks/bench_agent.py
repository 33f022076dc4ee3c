"""Benchmark: a slow tool must not slow an agent step down much (issue 27, point 5).

Run:  python benchmarks/bench_agent.py     (the tiny model, then Qwen2.5-0.5B's shape: ~9 min
                                           on 2 idle cores, twice that on busy ones)
      python benchmarks/bench_agent.py --model smollm2-135m-shape      (~5 min)
      python benchmarks/bench_agent.py --model tiny --repeats 5 --steps 6
      python benchmarks/bench_agent.py --episodes 64    (more episodes, the same tool)

What runs: a GRPO graph whose `agent_rollout` node (HF backend, the actor's dtype left at
its default, float32, which the rollout samples in) plays 32 episodes (8 prompts x 4
samples) of 3 turns of 8 tokens; the plugin `_agent_bench_env.py` registers a parser
that reads every sampled turn as one call of the tool `lookup`, so every episode calls it
3 times (no model here writes a tool call of its own). The calls go through the
rollout's real path: parsed, checked, run by `flowgraph.agent.episodes.Episodes` (all
episodes of a turn at once on its event loop; a sync tool in a thread of its own), their
results rendered as the next prompt's delta. The same graph runs three times over, the
tool changed only:

    instant   `lookup` returns at once                          (the reference)
    sync      `lookup` blocks 200 ms in `time.sleep`            (a thread)
    async     `lookup` awaits 200 ms in `asyncio.sleep`         (event loop)

A step is the whole training step (`timing_s/step`: rollout, advantages, the update);
step 0 (model loading, the first rollout's self-check) is left out. Runs alternate
(instant, sync, async, instant, ...) and each variant's median step time is taken over
every run and step; ratio = median step with the 200 ms tool / median step with the
instant tool (target: <= 1.5). An episode's 3 calls are one after another (each turn
reads the previous call's result), so the 200 ms tool makes a step at least 0.6 s
longer however the episodes are scheduled (lockstep turns, or each episode on its own);
were all 96 calls one after another, it would be 19.2 s longer. So the ratio cannot be
under the floor (instant step + 0.6 s) / instant step, printed too; a ratio of 1.5
needs an instant step of 1.2 s or more. To say where the time goes, the table also has
the seconds the tool adds to the median step (`+ s/step`, against the 0.6 s floor), the
rollout's seconds (`timing_s/agent`), the seconds between turns (the turn loop waiting,
after a turn's batch is sampled, for the episodes' tool calls, env replies and deltas:
timed around `Episodes.wait`) and the summed tool seconds per episode
(`agent/tool_time_s`: 3 x 0.2 s when each call took its 200 ms and no more). The runs
of a tool are minutes apart at the larger sizes, so other jobs starting or ending on the
machine change one tool's steps and not another's: how many cores other jobs wanted
during each run is printed (`Others`: the load average less this process's CPU use),
with a warning when they shared the cores (the step times then measure them; the
between-turns seconds do not).

The actor (`--model`, one or more, measured one after another; each has its default
runs x steps in `MODELS`, --repeats / --steps override them all):

    tiny                 `builtin:tiny-lm-sft` (2 layers, hidden 128): its step on CPU is
                         0.13 s (an idle machine; its turns often end at EOS before 8
                         tokens) to ~1 s (2 cores shared with other jobs), so its floor is
                         5.6 to 1.6, over the target: informational (3 runs x 4 steps)
    smollm2-135m-shape   HuggingFaceTB/SmolLM2-135M's architecture (Llama, hidden 576, 30
                         layers, 9 heads, 3 KV heads, MLP 1536, tied embeddings): the
                         smallest model of a family people fine-tune and RL-train; ~12 s
                         a step on 2 idle cores (2 runs x 3 steps, ~5 min in all)
    qwen0.5b-shape       Qwen/Qwen2.5-0.5B's architecture (Qwen2, hidden 896, 24 layers, 14
                         heads, 2 KV heads, MLP 4864, tied embeddings), the smallest model
                         the RL frameworks' examples train; ~45 s a step on 2 idle cores
                         (1 run x 3 steps, ~8 min in all, ~12 GB of memory: fp32 weights,
                         gradients, Adam's moments and the activations; its 0.6 s floor is
                         smaller than how much a step varies from run to run, 1-4 s)

The two shapes are built here (`build_shape`: the real config.json's numbers, seeded
random weights, `save_pretrained` into the run's temporary folder, loaded by path like
any local model; nothing is downloaded), with the tiny built-in tokenizer and its chat
template: the model's vocab_size is that tokenizer's 512 ids. The real models' vocabularies
(49k, 151k ids) would only make the embedding, the LM head and the softmax larger, the
step longer and the ratio smaller: the small vocabulary is the conservative choice.
Random weights rarely sample EOS (1 id in 512), so nearly every turn is its full 8 tokens
and every step does the same work. The first step's self-check (`check_rows`: the
trainer's log-probs of the rows equal the sampler's within 1e-3) passes at both shapes.

Without --model: the tiny model, then Qwen2.5-0.5B's shape. Exits 1 when the sync tool's
ratio of a measured model other than `tiny` is over the target (the tiny model's is
printed with its floor, for information; `--model tiny` alone exits 0).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TARGET = 1.5
DELAY_S = 0.2
"""What the slow `lookup` takes (_agent_bench_env.DELAY_S)."""
TOOLS = {"instant": "Instant", "sync": "Sync", "async": "Async"}
"""Each variant's env (_agent_bench_env.py), holding its `lookup` tool."""
SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "smollm2-135m-shape": ("HuggingFaceTB/SmolLM2-135M", "llama", {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
        "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}),
    "qwen0.5b-shape": ("Qwen/Qwen2.5-0.5B", "qwen2", {
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}),
}
"""Real models (hub id, architecture, their config.json but the vocabulary:
`build_shape`)."""
MODELS: dict[str, tuple[str | None, int, int]] = {
    "tiny": ("builtin:tiny-lm-sft", 3, 4),
    "smollm2-135m-shape": (None, 2, 3),
    "qwen0.5b-shape": (None, 1, 3),
}
"""--model name -> (its path, None: built by `build_shape`; default runs of each tool;
default steps a run, step 0 left out)."""
DEFAULT = ("tiny", "qwen0.5b-shape")
"""What a run without --model measures; the exit status is the second's."""
GRAPH = """\
version: 1
name: bench_agent
dims: {{Bp: {prompts}, N: 4, P: 16, T: 64}}
plugins: [_agent_bench_env.py]
models:
  actor: {{path: "{model}", trainable: true, optimizer: {{lr: 1.0e-4}}}}
data:
  train: {{kind: prompts, path: "builtin:reverse"}}
nodes:
  agent:
    kind: agent_rollout
    model: actor
    inputs: {{row: train.row}}
    params: {{env: "_agent_bench_env.py:{env}", parser: every_turn, max_turns: 3,
             max_turn_tokens: 8, max_tool_tokens: 4}}
  adv:
    kind: grpo
    inputs: {{scores: agent.scores, response_mask: agent.response_mask, index: agent.index}}
  update:
    kind: ppo_actor_update
    model: actor
    params: {{mini_batch_size: {episodes}}}
    inputs:
      prompts: agent.prompts
      prompt_mask: agent.prompt_mask
      responses: agent.responses
      response_mask: agent.response_mask
      advantages: adv.advantages
trainer: {{steps: {steps}, seed: 0, checkpoint_every: 0}}
"""


class _BetweenTurns:
    """Keeps the seconds the turn loop waits between a turn's sampling and the next:
    for the episodes' tool calls, env replies and deltas still running once the batch is
    sampled (`Episodes.wait`; tool calls start as their row ends)."""

    def __init__(self) -> None:
        from flowgraph.agent.episodes import Episodes

        name = "wait"
        real = Episodes.wait
        self.seconds: list[float] = []

        def timed(episodes: Any, *args: Any) -> None:
            start = time.perf_counter()
            try:
                real(episodes, *args)
            finally:
                self.seconds.append(time.perf_counter() - start)

        setattr(Episodes, name, timed)


def build_shape(name: str, folder: Path) -> Path:
    """A model folder (config.json, weights, tokenizer) with `SHAPES[name]`'s architecture,
    seeded random weights and the tiny built-in tokenizer (its 512 ids are the model's
    vocabulary), written with `save_pretrained` into `folder / name`: a path
    `models.actor.path` takes as it takes any local model. Nothing is downloaded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from flowgraph.nodes.models import build_tiny_tokenizer

    _, arch, fields = SHAPES[name]
    config_class, model_class = ((Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2"
                                 else (LlamaConfig, LlamaForCausalLM))
    target = folder / name
    tok = build_tiny_tokenizer(target)
    config = config_class(**fields, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_class(config)
    model.save_pretrained(target)
    return target


def run_once(folder: Path, model: str, variant: str, steps: int, episodes: int,
             between: _BetweenTurns) -> list[dict[str, Any]]:
    """The metrics rows of one run of the graph with the actor `model` (a path) and
    `variant`'s tool, each with the seconds its step spent between turns (`between`)."""
    import flowgraph

    graph = folder / f"{variant}.yaml"
    graph.write_text(GRAPH.format(prompts=episodes // 4, episodes=episodes, steps=steps,
                                  env=TOOLS[variant], model=model))
    run_dir = folder / f"run-{variant}"
    shutil.rmtree(run_dir, ignore_errors=True)
    with open(os.devnull, "w") as out:
        rows = flowgraph.run(graph, overrides=[f"trainer.run_dir={run_dir}"], out=out,
                             tensorboard=False).rows
    calls = [r["agent/tool_calls"] for r in rows]
    assert all(c == 3.0 for c in calls), f"{variant}: tool calls per episode {calls}, not 3"
    seconds, between.seconds = between.seconds, []
    assert len(seconds) == 3 * steps, f"{len(seconds)} turns in {steps} steps, not 3 a step"
    for k, row in enumerate(rows):
        row["between_turns_s"] = sum(seconds[3 * k:3 * k + 3])
    return rows


KEYS = {"step": "timing_s/step", "rollout": "timing_s/agent", "between": "between_turns_s",
        "tool": "agent/tool_time_s"}
"""Table column -> the metric (or `run_once`'s own) it shows."""


class Others:
    """How busy other jobs kept the machine during each run: the load average (1 min)
    after the run less the cores this process used over it (its CPU seconds / wall
    seconds), roughly how many cores' worth of other work wanted to run."""

    WARN = 0.75
    """Over this (cores), the line warns."""

    def __init__(self) -> None:
        self.cores: list[float] = []
        self.start = (time.perf_counter(), time.process_time())

    def lap(self) -> None:
        """One run ended."""
        wall, cpu = time.perf_counter(), time.process_time()
        own = (cpu - self.start[1]) / max(wall - self.start[0], 1e-9)
        self.cores.append(os.getloadavg()[0] - own)
        self.start = (wall, cpu)

    def line(self) -> str:
        """The cores other jobs wanted, run by run; a warning when they were many."""
        text = (f"other jobs on the {os.cpu_count()} cores (load average less this "
                f"process's use), run by run: {' '.join(f'{x:.1f}' for x in self.cores)}")
        if max(self.cores) > self.WARN:
            text += ("; WARNING: other jobs shared the cores, so the step times (and the "
                     "ratio) measure them too: rerun on an idle machine (the between-turns "
                     "column does not depend on them)")
        return text


def measure(name: str, folder: Path, args: argparse.Namespace, between: _BetweenTurns
            ) -> float:
    """Run model `name`'s graph with each tool (`repeats` x `steps`, step 0 left out),
    print its table and return its ratio (sync tool / instant tool, median steps)."""
    repeats, steps = MODELS[name][1:]
    repeats, steps = args.repeats or repeats, args.steps or steps
    start = time.perf_counter()
    path = MODELS[name][0] or str(build_shape(name, folder))
    others = Others()
    seen: dict[str, dict[str, list[float]]] = {v: {k: [] for k in KEYS} for v in TOOLS}
    for _ in range(repeats):
        for variant in TOOLS:
            for row in run_once(folder, path, variant, steps, args.episodes, between)[1:]:
                for k, metric in KEYS.items():
                    seen[variant][k].append(row[metric])
            others.lap()
    med = {v: {k: statistics.median(xs) for k, xs in d.items()} for v, d in seen.items()}
    fast = {v: min(d["step"]) for v, d in seen.items()}
    base, floor = med["instant"]["step"], 3 * DELAY_S
    about = path if MODELS[name][0] else \
        f"{SHAPES[name][0]}'s shape, random weights, vocabulary 512"
    print(f"\n== {name} ({about}): "
          f"{args.episodes} episodes x 3 tool calls; medians of "
          f"{len(seen['instant']['step'])} steps per tool ({repeats} runs x {steps - 1} "
          f"steps), and the fastest step; {time.perf_counter() - start:.0f} s in all")
    print(others.line())
    print(f"{'tool':8s} {'step s':>7s} {'fastest':>8s} {'+ s/step':>9s} {'rollout s':>10s} "
          f"{'between turns s':>16s} {'tool s/episode':>15s} {'ratio':>6s} {'fastest':>8s}")
    for v in TOOLS:
        m = med[v]
        print(f"{v:8s} {m['step']:7.3f} {fast[v]:8.3f} {m['step'] - base:9.3f} "
              f"{m['rollout']:10.3f} {m['between']:16.3f} {m['tool']:15.3f} "
              f"{m['step'] / base:6.2f} {fast[v] / fast['instant']:8.2f}")
    added = med["sync"]["between"] - med["instant"]["between"]
    print(f"the 200 ms tool adds {med['sync']['step'] - base:.2f} s (sync) and "
          f"{med['async']['step'] - base:.2f} s (async) to the median step, "
          f"{added:.2f} s of it between turns; floor {floor:.2f} s (an episode's 3 calls, "
          f"one after another; {args.episodes * floor:.1f} s were all the calls run one "
          "after another)")
    ratio = med["sync"]["step"] / base
    print(f"floor (instant step + {floor:.1f} s) / instant step: {(base + floor) / base:.2f}; "
          f"instant step + what the tool adds between turns: {(base + added) / base:.2f}")
    print(f"ratio (median step, sync 200 ms tool / instant tool): {ratio:.2f}, async "
          f"{med['async']['step'] / base:.2f} (target <= {TARGET}"
          f"{'; informational: the floor is over it' if name == 'tiny' else ''})")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", choices=list(MODELS), default=list(DEFAULT),
                        help=f"the actors to measure, one after another (default: "
                             f"{' '.join(DEFAULT)})")
    parser.add_argument("--episodes", type=int, default=32, help="a multiple of 4")
    parser.add_argument("--steps", type=int, default=None,
                        help="per run, step 0 left out (default: the model's, in MODELS)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each tool (default: the model's, in MODELS)")
    args = parser.parse_args()
    between = _BetweenTurns()
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="fg-bench-agent-") as tmp:
        folder = Path(tmp)
        shutil.copy(HERE / "_agent_bench_env.py", folder)
        for name in args.model:
            ratios[name] = measure(name, folder, args, between)
    over = [n for n, r in ratios.items() if n != "tiny" and r > TARGET]
    print("\n" + "; ".join(f"{n}: {r:.2f}" for n, r in ratios.items())
          + f" (target <= {TARGET}"
          + ("; the tiny model's is informational)" if "tiny" in ratios else ")"))
    sys.exit(1 if over else 0)


if __name__ == "__main__":
    main()
