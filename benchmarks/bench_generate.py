"""Benchmark: rollout tokens/s of both `generate` backends, and the node's overhead.

Run:  python benchmarks/bench_generate.py                       (Bp=16, n=4, T=64, both)
      python benchmarks/bench_generate.py --backends hf --length 256   (long responses)
      python benchmarks/bench_generate.py --backends hf --repeats 7
      python benchmarks/bench_generate.py --compile      (vLLM with torch.compile: slow start)

The built-in tiny model (`builtin:tiny-lm`, 2 layers, hidden 128, V=512) samples n
responses to each of Bp arithmetic prompts (left-padded to P=16) at τ=1. For each
backend the node call `generate(ctx, ...)` is timed against the backend called
directly with the same inputs prepared beforehand: the hf decoding loop
(`generate.decode` on the expanded prompts, in eval mode) and vLLM's `llm.generate`
(the node's requests and sampling params). Direct and node runs alternate, after one
warm-up of each; medians are printed, and the fastest runs. On a shared machine two
runs of the same generation differ by more than 5%, so the overhead is measured
inside each node call as well: the node's own work is its time minus the time spent
in the backend call it makes (`decode` or `llm.generate`, wrapped in a timer), and
overhead = median own work / median direct time (target ≤ 5%). Tokens are the valid
response tokens (the random model seldom says EOS). The hf decoding loop is also timed
per token against transformers' `model.generate` sampling the same prompts (target: at
least as fast).

vLLM runs in its own processes; on CPU it binds its worker to one core and keeps one
for the caller. It is started with `enforce_eager=True` unless `--compile`.

Notation: Bp prompts, n samples per prompt, P prompt length, T response length.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import flowgraph.nodes.generate as generate_module
from flowgraph.compilers.worker import rollout_engine
from flowgraph.nodes.data import prompt_source
from flowgraph.nodes.generate import SamplingSpec, decode, generate, sample_seed
from flowgraph.nodes.models import load_model, load_tokenizer
from flowgraph.runtime.context import NodeContext

TARGET = 0.05


class _Timed:
    """A callable that adds up the seconds spent in the one it wraps."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def _compare(direct: Callable[[], int], node: Callable[[], int], inner: _Timed, repeats: int
             ) -> dict[str, float]:
    """Seconds of direct and node runs (alternating, after one warm-up of each), and of
    the node's own work: its run minus the time its backend call (`inner`) took."""
    direct(), node()
    times: dict[str, list[float]] = {"direct": [], "node": [], "own": []}
    tokens = 0
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = direct()
        times["direct"].append(time.perf_counter() - start)
        inner.seconds = 0.0
        start = time.perf_counter()
        node()
        times["node"].append(time.perf_counter() - start)
        times["own"].append(times["node"][-1] - inner.seconds)
    stats = {f"{name}_{how}": fn(ts) for name, ts in times.items()
             for how, fn in (("min", min), ("median", statistics.median))}
    return stats | {"tokens": tokens}


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    model, tokenizer = load_model("builtin:tiny-lm"), load_tokenizer("builtin:tiny-lm")
    batch = prompt_source("builtin:arith", tokenizer=tokenizer, max_prompt_length=16,
                          shuffle=False).train.next_batch(args.prompts)
    ctx = NodeContext("gen", "generate", step=0, seed=0,
                      dims={"N": args.n, "T": args.length}, engines=rollout_engine)
    spec = SamplingSpec(args.length, 1.0, 1.0, 0, False, (tokenizer.eos_token_id,),
                        tokenizer.pad_token_id)
    seeds = [sample_seed(0, 0, i, j) for i in range(args.prompts) for j in range(args.n)]
    return {"model": model, "tokenizer": tokenizer, "ctx": ctx, "spec": spec, "seeds": seeds,
            "prompts": batch["input_ids"], "prompt_mask": batch["attention_mask"]}


def bench_hf(s: dict[str, Any], repeats: int) -> dict[str, float]:
    n = s["ctx"].dims["N"]
    prompts = s["prompts"].repeat_interleave(n, 0)
    mask = s["prompt_mask"].repeat_interleave(n, 0)
    s["model"].eval()

    def direct() -> int:
        out = decode(s["model"], prompts, mask, s["seeds"], s["spec"])
        return int(out["response_mask"].sum())

    def node() -> int:
        out = generate(s["ctx"], s["model"], s["tokenizer"], prompts=s["prompts"],
                       prompt_mask=s["prompt_mask"])
        return int(out["response_mask"].sum())

    inner = _Timed(decode)
    generate_module.decode = inner  # the node looks `decode` up when it is called
    try:
        return _compare(direct, node, inner, repeats)
    finally:
        generate_module.decode = decode


def bench_hf_vs_transformers(s: dict[str, Any], repeats: int) -> dict[str, float]:
    """Seconds per valid response token of the hf backend's decoding loop and of
    transformers' `model.generate` (sampling at τ=1, no top-k/top-p, stopping at EOS)
    on the same expanded prompts, alternating after one warm-up of each; medians."""
    n, spec, model = s["ctx"].dims["N"], s["spec"], s["model"]
    prompts = s["prompts"].repeat_interleave(n, 0)
    mask = s["prompt_mask"].repeat_interleave(n, 0)
    model.eval()

    def ours() -> int:
        return int(decode(model, prompts, mask, s["seeds"], spec)["response_mask"].sum())

    def theirs() -> int:
        with torch.no_grad():
            out = model.generate(input_ids=prompts, attention_mask=mask, do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=spec.max_new_tokens,
                                 eos_token_id=list(spec.stop_ids), pad_token_id=spec.pad_id)
        new = out[:, prompts.shape[1]:]
        ended = torch.isin(new, torch.tensor(spec.stop_ids)).long().cumsum(-1)
        return int(((ended == 0) | ((ended == 1) & torch.isin(
            new, torch.tensor(spec.stop_ids)))).sum())

    ours(), theirs()
    per_token: dict[str, list[float]] = {"ours": [], "theirs": []}
    for _ in range(repeats):
        for name, fn in (("ours", ours), ("theirs", theirs)):
            start = time.perf_counter()
            tokens = fn()
            per_token[name].append((time.perf_counter() - start) / max(tokens, 1))
    return {name: statistics.median(ts) for name, ts in per_token.items()}


def bench_vllm(s: dict[str, Any], repeats: int, eager: bool) -> dict[str, float]:
    from vllm.inputs import TokensPrompt

    from flowgraph.compilers.vllm import engine as _vllm

    start = time.perf_counter()
    sequences, max_model_len = len(s["seeds"]), s["prompts"].shape[1] + s["spec"].max_new_tokens
    llm = _vllm.engine(s["model"], s["tokenizer"], _vllm.Memory(
        max_model_len, _vllm.kv_cache_size(s["model"], sequences, max_model_len)),
        enforce_eager=eager)
    print(f"vllm engine start: {time.perf_counter() - start:.1f} s")
    n = s["ctx"].dims["N"]
    requests = [TokensPrompt(prompt_token_ids=ids[m.bool()].tolist())
                for ids, m in zip(s["prompts"], s["prompt_mask"], strict=True)
                for _ in range(n)]
    params = [_vllm.sampling_params(seed, s["spec"]) for seed in s["seeds"]]
    inner = llm.generate = _Timed(llm.generate)  # the node's call into vLLM, timed

    def direct() -> int:
        outputs = llm.generate(requests, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    def node() -> int:
        out = generate(s["ctx"], s["model"], s["tokenizer"], prompts=s["prompts"],
                       prompt_mask=s["prompt_mask"], backend="vllm")
        return int(out["response_mask"].sum())

    try:
        return _compare(direct, node, inner, repeats)
    finally:
        _vllm.close_engines()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16, help="Bp")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--length", type=int, default=64, help="T")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--backends", default="hf,vllm")
    p.add_argument("--compile", action="store_true", help="vLLM without enforce_eager")
    args = p.parse_args()
    s = _setup(args)
    print(f"Bp={args.prompts} n={args.n} T={args.length} P=16 torch threads="
          f"{torch.get_num_threads()} repeats={args.repeats}")
    ok = True
    if "hf" in args.backends.split(","):
        r = bench_hf_vs_transformers(s, args.repeats)
        ratio = r["theirs"] / r["ours"]
        ok &= ratio >= 1.0
        print(f"hf decoding loop {1 / r['ours']:.0f} tok/s vs transformers' model.generate "
              f"{1 / r['theirs']:.0f} tok/s: {ratio:.2f}x per token (target >= 1: "
              f"{'met' if ratio >= 1.0 else 'MISSED'})")
    for backend in args.backends.split(","):
        if backend == "hf":
            r = bench_hf(s, args.repeats)
        else:
            r = bench_vllm(s, args.repeats, eager=not args.compile)
        overhead = r["own_median"] / r["direct_median"]
        ok &= overhead <= TARGET
        print(f"{backend:5s} tokens {r['tokens']:.0f}  direct {r['direct_median']:.3f} s "
              f"({r['tokens'] / r['direct_median']:.0f} tok/s)  node {r['node_median']:.3f} s "
              f"({r['tokens'] / r['node_median']:.0f} tok/s)  node's own work "
              f"{1e3 * r['own_median']:.1f} ms = overhead {overhead:.1%} (target <= "
              f"{TARGET:.0%}: {'met' if overhead <= TARGET else 'MISSED'})  [fastest runs: "
              f"direct {r['direct_min']:.3f} s, node {r['node_min']:.3f} s, "
              f"{r['node_min'] / r['direct_min'] - 1:+.1%}]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
