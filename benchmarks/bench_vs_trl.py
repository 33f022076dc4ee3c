"""Benchmark: flowgraph against TRL at equal work — GRPO steps/s, DPO pairs/s, learning curves.

Run:  pip install -c constraints/cpu.txt -e '.[bench]'     (TRL: the benchmark only)
      python benchmarks/bench_vs_trl.py         (grpo, dpo, grpo-long, grpo-async; 3 rounds)
      python benchmarks/bench_vs_trl.py --settings grpo --rounds 3 --steps 50

Both run the same tiny random Llama (flowgraph's `builtin:tiny-lm`: hidden 128, 2
layers, 2 heads of 64, vocab 512, saved to a folder both load), the same tokenizer,
prompts and hyper-parameters, each run in a fresh process, the two alternating
(flowgraph, TRL, TRL, flowgraph, …) so a slow spell of a shared machine hits both:

* `grpo`: 8 prompts × 4 samples, at most 32 new tokens, temperature 1, no reference
  model (beta 0), group-normalised advantages, token-mean loss (TRL `loss_type="dapo"`),
  one optimizer step per rollout, AdamW lr 1e-3 constant, no weight decay, grad clip 1,
  100 steps. The reward is the share of a response's tokens equal to one target token,
  so a learner goes from ~0 to ~1 (TRL: a reward function of `completion_ids`;
  flowgraph: a kind declared in `benchmarks/_trl_bench_reward.py`).
* `grpo-long`: the same with up to 256 new tokens (padding and KV-cache cost), 10 steps.
* `grpo-async`: `grpo` three ways: flowgraph synchronous, flowgraph with asynchronous
  rollouts (`trainer.max_staleness: 1`: a producer process on one core generates step
  k+1 while the trainer, on the other, trains step k; its step time is the trainer's,
  waiting for rollouts included), and TRL; prints the async / sync ratio too.
* `dpo`: 8 pairs per step, beta 0.1, sigmoid loss, AdamW lr 1e-3 constant, 200 steps;
  the pairs prefer the sum `a+b=` → `12` to the same with a trailing zero (`120`), a
  preference the tiny model can learn (loss ~0.4 → ~0.01) without learning to add;
  TRL's defaults otherwise (it computes the reference log-probs every step, flowgraph
  once per pair: the compiler hoists them).

Printed per setting: per-step time by phase (median over the steps after the first
two), steps/s (GRPO) or pairs/s (DPO) from the summed step times of those steps, the
ratio flowgraph / TRL (> 1: flowgraph faster), the wall time of each whole run (start-up
included), peak RSS of each process, and both learning curves (mean reward or loss per
tenth of the run). Round i runs seed i on both sides, so the rounds' curves show the
run-to-run noise; the last lines compare the two sides' mean curves against it (at
every tenth, the gap between the means at most the larger spread over seeds). TRL's
step is timed from `on_step_begin` to `on_step_end` (generation, scoring, the update;
not its logging), split into the phases flowgraph reports: generation
(`_generate_single_turn`), scoring (the rest of `_generate_and_score_completions`:
decoding, rewards, log-probs, advantages) and update (the rest of the step);
flowgraph's from `metrics.jsonl` (`phase_s/<phase>`, `timing_s/step`).

Notation: Bp prompts per step, N samples per prompt, P prompt length, T response length.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TARGET_TEXT = "7"
"""The reward counts response tokens equal to this text's (single) token."""


@dataclass(frozen=True)
class Setting:
    name: str
    algo: str
    """`grpo` or `dpo`."""
    steps: int
    Bp: int
    """Prompts (GRPO) or pairs (DPO) per step."""
    N: int
    T: int
    P: int = 16
    lr: float = 1e-3
    max_staleness: int = 0
    """> 0: flowgraph also runs with asynchronous rollouts (`flowgraph-async`)."""
    seed: int = 0
    """Round i runs seed i on every side: the curves' spread over rounds is the
    run-to-run noise the two sides' difference is judged against."""

    def impls(self) -> tuple[str, ...]:
        return ("flowgraph", "flowgraph-async", "trl") if self.max_staleness else (
            "flowgraph", "trl")


SETTINGS = {
    "grpo": Setting("grpo", "grpo", 100, 8, 4, 32),
    "dpo": Setting("dpo", "dpo", 200, 8, 1, 8),
    "grpo-long": Setting("grpo-long", "grpo", 10, 8, 4, 256),
    "grpo-async": Setting("grpo-async", "grpo", 100, 8, 4, 32, max_staleness=1),
}


# --------------------------------------------------------------------------- workspace


def workspace(root: Path) -> dict[str, str]:
    """The model folder and datasets both sides read: built once, before any run."""
    from flowgraph.nodes.models import load_model, load_tokenizer

    model_dir = root / "model"
    if not model_dir.exists():
        load_model("builtin:tiny-lm").save_pretrained(model_dir)
        load_tokenizer("builtin:tiny-lm").save_pretrained(model_dir)
    tok = load_tokenizer(str(model_dir))
    target = tok(TARGET_TEXT, add_special_tokens=False).input_ids
    if len(target) != 1:
        raise SystemExit(f"the target text {TARGET_TEXT!r} is {len(target)} tokens; need 1")
    prompts = [f"{a}+{b}=" for a in range(40) for b in range(40)]
    with open(root / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
    with open(root / "pairs.jsonl", "w") as f:
        for a in range(40):
            for b in range(40):
                f.write(json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b),
                                    "rejected": f"{a + b}0"}) + "\n")
    return {"model": str(model_dir), "prompts": str(root / "prompts.jsonl"),
            "pairs": str(root / "pairs.jsonl"), "target": str(target[0])}


# --------------------------------------------------------------------------- flowgraph


def flowgraph_grpo(s: Setting, ws: dict[str, str], run_dir: Path, staleness: int = 0) -> Any:
    from flowgraph import GraphBuilder

    g = GraphBuilder("bench_grpo")
    g.dims(Bp=s.Bp, N=s.N, P=s.P, T=s.T)
    g.plugin("_trl_bench_reward")
    g.model("actor", ws["model"], trainable=True,
            optimizer={"lr": s.lr, "weight_decay": 0.0, "grad_clip": 1.0,
                       "schedule": "constant"})
    train = g.data("train", "prompts", ws["prompts"], apply_chat_template=False,
                   max_prompt_length=s.P)
    gen = g.node("gen", "generate", model="actor", prompts=train.input_ids,
                 prompt_mask=train.attention_mask, params={"temperature": 1.0})
    seq = {p: getattr(gen, p) for p in ("prompts", "prompt_mask", "responses", "response_mask")}
    old = g.node("old_logprob", "logprob", model="actor", **seq)
    reward = g.node("reward", "target_token_reward", responses=gen.responses,
                    response_mask=gen.response_mask, params={"target": int(ws["target"])})
    adv = g.node("adv", "grpo", scores=reward.scores, response_mask=gen.response_mask,
                 index=gen.index, params={"norm_by_std": True})
    g.node("update_actor", "ppo_actor_update", model="actor", **seq,
           old_log_prob=old.log_prob, advantages=adv.advantages,
           params={"loss_agg_mode": "token-mean", "mini_batch_size": s.Bp * s.N})
    g.trainer(steps=s.steps, seed=s.seed, run_dir=str(run_dir), checkpoint_every=0,
              max_staleness=staleness)
    return g.build()


def flowgraph_dpo(s: Setting, ws: dict[str, str], run_dir: Path) -> Any:
    from flowgraph import GraphBuilder

    g = GraphBuilder("bench_dpo")
    g.dims(Bp=s.Bp, P=s.P, T=s.T)
    g.model("policy", ws["model"], trainable=True,
            optimizer={"lr": s.lr, "weight_decay": 0.0, "grad_clip": 1.0,
                       "schedule": "constant"})
    g.model("ref", ws["model"])
    pairs = g.data("pairs", "preferences", ws["pairs"], apply_chat_template=False)
    refs = {}
    for side in ("chosen", "rejected"):
        refs[side] = g.node(f"ref_{side}", "sequence_logprob", model="ref",
                            prompts=pairs.prompts, prompt_mask=pairs.prompt_mask,
                            responses=getattr(pairs, side),
                            response_mask=getattr(pairs, f"{side}_mask"))
    g.node("update", "dpo_update", model="policy", prompts=pairs.prompts,
           prompt_mask=pairs.prompt_mask, chosen=pairs.chosen, chosen_mask=pairs.chosen_mask,
           rejected=pairs.rejected, rejected_mask=pairs.rejected_mask,
           ref_chosen_logps=refs["chosen"].log_prob,
           ref_rejected_logps=refs["rejected"].log_prob,
           params={"beta": 0.1, "loss_type": "sigmoid", "mini_batch_size": s.Bp})
    g.trainer(steps=s.steps, seed=s.seed, run_dir=str(run_dir), checkpoint_every=0)
    return g.build()


def run_flowgraph(s: Setting, ws: dict[str, str], out: Path, staleness: int = 0
                  ) -> dict[str, Any]:
    """flowgraph's run; `staleness` > 0: with asynchronous rollouts (a producer process
    on half the cores, overlapping the update)."""
    import flowgraph

    sys.path.insert(0, str(HERE))  # the reward kind's module, listed as a plugin
    start = time.perf_counter()
    graph = (flowgraph_grpo(s, ws, out / "run", staleness) if s.algo == "grpo"
             else flowgraph_dpo(s, ws, out / "run"))
    with open(os.devnull, "w") as quiet:
        result = flowgraph.run(graph, target="local", tensorboard=False, out=quiet)
    wall = time.perf_counter() - start
    steps = []
    for row in result.rows:
        stages = {k.removeprefix("phase_s/"): v for k, v in row.items()
                  if k.startswith("phase_s/")}
        curve = row.get("critic/score/mean", row.get("actor/dpo_loss", row.get("actor/loss")))
        steps.append({"time": row["timing_s/step"], "stages": stages, "curve": curve})
    return {"steps": steps, "wall": wall}


# --------------------------------------------------------------------------- TRL


class _Timer:
    """Adds up the seconds spent in a method it replaces, per training step."""

    def __init__(self, owner: Any, name: str, into: dict[str, float], stage: str) -> None:
        self.fn, self.into, self.stage = getattr(owner, name), into, stage
        setattr(owner, name, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.into[self.stage] = self.into.get(self.stage, 0.0) + time.perf_counter() - t0


def run_trl(s: Setting, ws: dict[str, str], out: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    start = time.perf_counter()
    torch.manual_seed(s.seed)
    tok = AutoTokenizer.from_pretrained(ws["model"])
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(ws["model"], dtype=torch.float32)
    common = dict(output_dir=str(out / "trl"), max_steps=s.steps, learning_rate=s.lr,
                  lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
                  gradient_accumulation_steps=1, logging_steps=1, save_strategy="no",
                  report_to=[], use_cpu=True, seed=s.seed, bf16=False, disable_dropout=True,
                  dataloader_num_workers=0)
    stages: dict[str, float] = {}
    steps: list[dict[str, Any]] = []
    if s.algo == "grpo":
        trainer = _trl_grpo(s, ws, model, tok, common)
        _Timer(trainer, "_generate_single_turn", stages, "generation")
        _Timer(trainer, "_generate_and_score_completions", stages, "prepare")
    else:
        trainer = _trl_dpo(s, ws, model, tok, common)
    curve_key = "reward" if s.algo == "grpo" else "loss"

    class Steps(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            stages.clear()
            self.t0 = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            took = time.perf_counter() - self.t0
            prepare, generation = stages.get("prepare", 0.0), stages.get("generation", 0.0)
            split = {"generation": generation, "scoring": prepare - generation,
                     "update": took - prepare}
            steps.append({"time": took, "stages": split, "curve": None})

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
                   **kwargs: Any) -> None:
            if logs and curve_key in logs and steps:
                steps[-1]["curve"] = float(logs[curve_key])

    trainer.add_callback(Steps())
    trainer.train()
    return {"steps": steps, "wall": time.perf_counter() - start}


def _trl_grpo(s: Setting, ws: dict[str, str], model: Any, tok: Any, common: dict[str, Any]
              ) -> Any:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    target = int(ws["target"])

    def target_token_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
        return [sum(t == target for t in ids) / max(len(ids), 1) for ids in completion_ids]

    prompts = [json.loads(line)["prompt"] for line in Path(ws["prompts"]).read_text().splitlines()]
    config = GRPOConfig(**common, per_device_train_batch_size=s.Bp * s.N,
                        num_generations=s.N, steps_per_generation=1, num_iterations=1,
                        max_completion_length=s.T, temperature=1.0, top_p=1.0, beta=0.0,
                        epsilon=0.2, loss_type="dapo", scale_rewards="group",
                        log_completions=False)
    return GRPOTrainer(model=model, reward_funcs=target_token_reward, args=config,
                       train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                       processing_class=tok)


def _trl_dpo(s: Setting, ws: dict[str, str], model: Any, tok: Any, common: dict[str, Any]
             ) -> Any:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    rows = [json.loads(line) for line in Path(ws["pairs"]).read_text().splitlines()]
    config = DPOConfig(**common, per_device_train_batch_size=s.Bp, beta=0.1,
                       loss_type=["sigmoid"], max_length=s.P + s.T)
    return DPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows),
                      processing_class=tok)


# --------------------------------------------------------------------------- driver


def child(impl: str, setting: Setting, root: Path, result: Path) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    ws = json.loads((root / "workspace.json").read_text())
    out = Path(tempfile.mkdtemp(prefix=f"{impl}-", dir=root))
    if impl == "trl":
        data = run_trl(setting, ws, out)
    else:
        data = run_flowgraph(setting, ws, out,
                             setting.max_staleness if impl == "flowgraph-async" else 0)
    data["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result.write_text(json.dumps(data))
    shutil.rmtree(out, ignore_errors=True)


def spawn(impl: str, setting: Setting, root: Path) -> dict[str, Any]:
    result = root / f"{impl}-{setting.name}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--child", impl, "--setting",
           json.dumps(asdict(setting)), "--root", str(root)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{impl} on {setting.name} failed:\n{done.stderr[-4000:]}")
    return dict(json.loads(result.read_text()))


def summary(run: dict[str, Any], per_step: int) -> dict[str, Any]:
    steady = run["steps"][2:] or run["steps"]
    total = sum(st["time"] for st in steady)
    names = sorted({k for st in steady for k in st["stages"]})
    stages = {k: statistics.median(st["stages"].get(k, 0.0) for st in steady) for k in names}
    return {"rate": per_step * len(steady) / total, "step": statistics.median(
        st["time"] for st in steady), "stages": stages, "wall": run["wall"],
        "rss": run["peak_rss_mb"], "curve": [st["curve"] for st in run["steps"]]}


def tenths(curve: list[float | None]) -> list[float]:
    values = [c for c in curve if c is not None]
    if not values:
        return []
    k = max(len(values) // 10, 1)
    return [statistics.fmean(values[i:i + k]) for i in range(0, len(values), k)]


def _line(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)


def report(setting: Setting, runs: dict[str, list[dict[str, Any]]]) -> None:
    unit = "pairs/s" if setting.algo == "dpo" else "steps/s"
    per_step = setting.Bp if setting.algo == "dpo" else 1
    label = "loss" if setting.algo == "dpo" else "reward"
    print(f"\n== {setting.name}: Bp={setting.Bp} N={setting.N} T<={setting.T} "
          f"steps={setting.steps} ==")
    best: dict[str, float] = {}
    curves: dict[str, list[list[float]]] = {}
    for impl, rounds in runs.items():
        for i, run in enumerate(rounds):
            s = summary(run, per_step)
            stages = "  ".join(f"{k} {v * 1e3:.1f}" for k, v in s["stages"].items() if v)
            print(f"{impl:15s} round {i}: {s['rate']:8.2f} {unit}  step {s['step'] * 1e3:6.1f} "
                  f"ms [{stages} ms]  wall {s['wall']:.1f} s  peak RSS {s['rss']:.0f} MB")
            best.setdefault(impl, 0.0)
            best[impl] = max(best[impl], s["rate"])
        curves[impl] = [tenths(summary(run, per_step)["curve"]) for run in rounds]
        for i, curve in enumerate(curves[impl]):
            print(f"{impl:15s} {label} by tenth of the run, seed {i}: {_line(curve)}")
    pairs = [("flowgraph", "trl")]
    if "flowgraph-async" in runs:
        pairs += [("flowgraph-async", "trl"), ("flowgraph-async", "flowgraph")]
    for a, b in pairs:
        ratios = [summary(x, per_step)["rate"] / summary(y, per_step)["rate"]
                  for x, y in zip(runs[a], runs[b], strict=True)]
        print(f"{a} / {b} {unit}: " + ", ".join(f"{r:.2f}x" for r in ratios)
              + f" (per round); best vs best {best[a] / best[b]:.2f}x")
    for a, b in pairs[:2]:
        print(tracking(a, b, curves, label))


def tracking(a: str, b: str, curves: dict[str, list[list[float]]], label: str) -> str:
    """Whether `a`'s mean curve over seeds stays within run-to-run noise of `b`'s: at
    every tenth, the gap between the two means is at most the larger of the two sides'
    spreads over seeds (largest minus smallest), floored at 0.01."""
    means, spreads = {}, {}
    for impl in (a, b):
        by_tenth = list(zip(*curves[impl], strict=False))
        means[impl] = [statistics.fmean(v) for v in by_tenth]
        spreads[impl] = [max(v) - min(v) for v in by_tenth]
    worst = ""  # the first tenth outside the noise, if any
    for k, (ma, mb) in enumerate(zip(means[a], means[b], strict=False)):
        noise = max(spreads[a][k], spreads[b][k], 0.01)
        if abs(ma - mb) > noise and not worst:
            worst = f" (first outside: tenth {k}, gap {abs(ma - mb):.3f} > {noise:.3f})"
    rounds = min(len(curves[a]), len(curves[b]))
    head = f"{label} by tenth, mean over {rounds} seed(s): {a} {_line(means[a])} | {b} " \
           f"{_line(means[b])}"
    if rounds < 2:
        return head + "\n  tracking: needs --rounds >= 2 (run-to-run noise is the seeds' spread)"
    verdict = "outside" if worst else "within"
    return head + f"\n  {a} vs {b}: {verdict} run-to-run noise{worst}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--rounds", type=int, default=3,
                    help="A B pairs per setting; round i runs seed i")
    ap.add_argument("--steps", type=int, default=None, help="override every setting's steps")
    ap.add_argument("--root", type=Path, default=None, help="workspace (default: a temp dir)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--setting", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, Setting(**json.loads(args.setting)), args.root, args.root /
              f"{args.child}-{json.loads(args.setting)['name']}.json")
        return
    root = args.root or Path(tempfile.mkdtemp(prefix="bench_vs_trl-"))
    root.mkdir(parents=True, exist_ok=True)
    (root / "workspace.json").write_text(json.dumps(workspace(root)))
    for name in args.settings:
        setting = SETTINGS[name] if args.steps is None else replace(SETTINGS[name],
                                                                    steps=args.steps)
        runs: dict[str, list[dict[str, Any]]] = {impl: [] for impl in setting.impls()}
        for i in range(args.rounds):
            order = setting.impls() if i % 2 == 0 else setting.impls()[::-1]
            for impl in order:
                runs[impl].append(spawn(impl, replace(setting, seed=i), root))
        report(setting, runs)


if __name__ == "__main__":
    main()
