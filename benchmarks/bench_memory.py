"""The compile-time memory estimate against the peak of live tensor bytes while the plan runs.

    python benchmarks/bench_memory.py                  # every case
    python benchmarks/bench_memory.py --only dpo-long

Each case runs in a fresh process: the plan is compiled (`ExecutionPlan.memory`, one
pool on the local target: resident weights, grads and optimizer state plus the largest
node's transient items) and run for `--steps` steps by the local target on the CPU.

How it measures: after `setup()` every tensor the garbage collector can reach (the
weights, buffers, the loaded data) is counted once by storage; `run()` then runs under
a `TorchDispatchMode` that sees the output of every aten op, registers each new storage
(keyed by its data pointer, so views and in-place results count once) with a weakref
finalizer on every tensor that holds it, and keeps the running sum of live storage
bytes. The measured peak is the setup bytes plus the largest running sum: tensor bytes
only (gradients and AdamW state included when they are allocated), no allocator slack,
no Python objects, no RSS. A tensor made without an aten op (`torch.from_numpy`) is not
seen; the data loader's are counted at setup.

Cases: every graphs/*.yaml as shipped (eval and checkpoints off), and
dpo-long, dpo.yaml on a larger tiny Llama saved to a temporary folder (hidden 256, 4
layers, MLP 1024, vocabulary 512, 1024 positions, the builtin:tiny-lm tokenizer) with
P = 64, T = 512 and pairs of exactly that many tokens, so 16 sequences of 576 tokens
make the activations dominate; and dpo-long again with eager attention, with gradient
checkpointing (eager, ckpt), and in each precision of `models.<m>.dtype` besides fp32
(dpo-long itself): `bfloat16`, bf16 compute over fp32 masters (bf16), and `pure_bf16`
(pure-bf16), the reference plain bf16 in both; and bf16 with gradient checkpointing
(bf16-ckpt). Prints the estimate, the measured
peak, their ratio and the node running at the measured peak beside the plan's peak
node. The estimate is the plan's worst case, every row P + T tokens long: goal 0.80 to
1.25 on the full-length cases; on the shipped graphs, whose responses stop early (each
forward trimmed to its longest row), it is an upper bound (goal: not under 0.80).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
OFF = ("trainer.eval_every=0", "trainer.checkpoint_every=0")
LONG_MODEL = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256,
              "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 4, "max_position_embeddings": 1024,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


class LiveBytes(TorchDispatchMode):
    """The running and peak sum of the bytes of storages created by aten ops."""

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        self.known, self.refs, self.size = known, dict[int, int](), dict[int, int]()
        self.live = self.peak = 0
        self.where, self.at_peak = "", ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._hold(t)
        return out

    def _hold(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.known:
            return
        if key not in self.refs:
            self.refs[key], self.size[key] = 0, storage.nbytes()
            self.live += storage.nbytes()
            if self.live > self.peak:
                self.peak, self.at_peak = self.live, self.where
        self.refs[key] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= self.size.pop(key)


def reachable_storages() -> dict[int, int]:
    """Data pointer -> bytes of every CPU tensor the garbage collector tracks."""
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            s = obj.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    out.pop(0, None)
    return out


def traced(run_node: Callable[..., Any], mode: LiveBytes) -> Callable[..., Any]:
    def run(name: str, *args: Any, **kwargs: Any) -> Any:
        mode.where = name
        return run_node(name, *args, **kwargs)
    return run


def measure(graph: Path, overrides: list[str], steps: int) -> dict[str, Any]:
    """In this process: the estimate and the measured peak of live CPU tensor bytes."""
    from flowgraph.compilers.loop import TrainingLoop
    from flowgraph.compilers.targets.local import LocalTarget
    from flowgraph.compilers.worker import ExecOptions
    from flowgraph.passes import compile_graph

    run_dir = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    result = compile_graph(graph, overrides=[f"trainer.steps={steps}",
                                             f"trainer.run_dir={run_dir}", *OFF, *overrides])
    if result.plan is None:
        raise SystemExit("\n".join(d.one_line() for d in result.diagnostics))
    (mem,) = result.plan.memory
    with open(os.devnull, "w") as out:
        options = ExecOptions(run_dir, "cpu", out=out, tensorboard=False)
        loop = TrainingLoop(result.plan, LocalTarget(result.plan, options), options)
        loop.setup()
        known = reachable_storages()
        mode = LiveBytes(set(known))
        ip = loop.interpreter
        ip.run_node = traced(ip.run_node, mode)  # type: ignore[method-assign]
        with mode:
            loop.run()
    items = {f"{i.what}:{i.owner}": i.bytes for i in mem.items}
    return {"estimate": mem.total_bytes, "measured": sum(known.values()) + mode.peak,
            "setup": sum(known.values()), "peak_node": mem.peak_node or "",
            "measured_node": mode.at_peak, "items": items}


def _long_model(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from flowgraph.nodes.models import load_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**LONG_MODEL)).save_pretrained(folder)
    load_tokenizer("builtin:tiny-lm").save_pretrained(folder)
    return folder


FULL_LENGTH = ("dpo-long", "eager", "bf16", "pure-bf16", "ckpt", "bf16-ckpt")
"""The cases whose rows fill the dims: the estimate counts every row at P + T tokens
(the plan's worst case); the shipped graphs' responses stop early and their forwards run
trimmed to the longest row, so there it is an upper bound."""


def _long_pairs(path: Path, rows: int = 64) -> Path:
    """Pairs of exactly P = 64 prompt and T = 512 response tokens (a digit is a token of
    the tiny-lm tokenizer; the data node appends EOS): every forward runs full length,
    where the shipped pairs, a few tokens long, would be trimmed to a fraction of it."""
    with open(path, "w") as f:
        for i in range(rows):
            digit = str(i % 10)
            f.write(json.dumps({"prompt": digit * 64, "chosen": "7" * 511,
                                "rejected": "3" * 511}) + "\n")
    return path


def cases(tmp: Path) -> dict[str, tuple[Path, tuple[str, ...]]]:
    long = str(_long_model(tmp / "long-model"))
    pairs = _long_pairs(tmp / "long-pairs.jsonl")
    size = (f"models.policy.path={long}", f"models.ref.path={long}", "dims.P=64",
            "dims.T=512", "dims.Bp=8", f"data.pairs.path={pairs}",
            "data.pairs.apply_chat_template=false")
    both = ("models.policy.{}", "models.ref.{}")
    dpo = ROOT / "graphs" / "dpo.yaml"
    shipped = {g.stem: (g, ()) for g in sorted((ROOT / "graphs").glob("*.yaml"))}
    return {
        **shipped,
        "dpo-long": (dpo, size),
        "eager": (dpo, (*size, *(m.format("attn_implementation=eager") for m in both))),
        "bf16": (dpo, (*size, *(m.format("dtype=bfloat16") for m in both))),
        "pure-bf16": (dpo, (*size, "models.policy.dtype=pure_bf16", "models.ref.dtype=bfloat16")),
        "ckpt": (dpo, (*size, "models.policy.gradient_checkpointing=true")),
        "bf16-ckpt": (dpo, (*size, *(m.format("dtype=bfloat16") for m in both),
                            "models.policy.gradient_checkpointing=true")),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--only", default=None,
                   help="one case: a shipped graph's name (ppo, grpo, ...), dpo-long, eager, bf16, "
                   "pure-bf16, ckpt or bf16-ckpt")
    p.add_argument("--items", action="store_true", help="print the estimate's items too")
    p.add_argument("--child", nargs=2, metavar=("GRAPH", "OVERRIDES"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(Path(args.child[0]), json.loads(args.child[1]), args.steps)))
        return 0
    ok = True
    print(f"{'case':12s} {'estimate MiB':>12s} {'measured MiB':>12s} {'ratio':>6s}  "
          "peak node: plan / measured")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (graph, overrides) in cases(Path(tmp)).items():
            if args.only and name != args.only:
                continue
            out = subprocess.run(
                [sys.executable, __file__, "--steps", str(args.steps), "--child", str(graph),
                 json.dumps(list(overrides))], capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            ratio = r["estimate"] / r["measured"]
            full = name in FULL_LENGTH
            ok &= ratio >= 0.8 and (ratio <= 1.25 or not full)
            print(f"{name:12s} {r['estimate'] / 2**20:12.2f} {r['measured'] / 2**20:12.2f} "
                  f"{ratio:6.2f}  {r['peak_node']} / {r['measured_node']}"
                  + ("" if full else "  (rows shorter than the dims: an upper bound)"))
            if args.items:
                print(f"          setup {r['setup'] / 2**20:.2f} MiB;", ", ".join(
                    f"{k} {v / 2**20:.2f}" for k, v in r["items"].items()))
    print("goal (full-length cases within 0.80-1.25, none under 0.80):",
          "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
