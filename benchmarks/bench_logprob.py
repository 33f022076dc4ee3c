"""Benchmark: chunked LM-head log-probs (`head_logprob`) vs log_softmax + gather.

Run:  python benchmarks/bench_logprob.py                  (V=32000, B=8, T=1024, H=256)
      python benchmarks/bench_logprob.py --chunk-size 512 --threads 2

Random hidden states (B, T, H) and a random bias-free LM head (H -> V), all B·T tokens
valid. Two modes: `infer` (no grad: old/ref log-probs) and `train` (forward and
backward into the hidden states and the head, as the update node does). Each
(variant, mode) runs in its own subprocess, so one measurement cannot inherit another's
heap. The child warms up once, then resets the kernel's peak-RSS counter (`echo 5 >
/proc/self/clear_refs`, Linux) and reads `VmHWM - VmRSS` around one timed run: the
peak extra resident memory of the computation itself, whatever allocates it (torch,
oneDNN, glibc). Time is the median of `--repeats` further runs.

Prints, per mode, the peak extra MiB of both variants, their ratio (target: chunked
≤ 1/4 of plain) and the time ratio chunked / plain; exits 1 if a ratio misses the target.

Notation: B sequences, T response length, H hidden size, V vocabulary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from flowgraph.nodes.logprob import head_logprob

TARGET = 0.25


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}; this benchmark needs Linux")


def _plain(lm_head: nn.Linear, hidden: Tensor, labels: Tensor) -> Tensor:
    log_p = torch.log_softmax(lm_head(hidden).float(), dim=-1)  # (B, T, V)
    return log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _run_once(
    args: argparse.Namespace, lm_head: nn.Linear, hidden: Tensor, labels: Tensor, mask: Tensor
) -> None:
    train = args.mode == "train"
    h = hidden.detach().requires_grad_(train)
    with torch.set_grad_enabled(train):
        if args.variant == "plain":
            log_p = _plain(lm_head, h, labels)
        else:
            log_p = head_logprob(lm_head, h, labels, mask, args.chunk_size)["log_prob"]
        if train:
            log_p.sum().backward()
            lm_head.zero_grad(set_to_none=True)


def child(args: argparse.Namespace) -> None:
    """Measure one (variant, mode); print a JSON line."""
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    lm_head = nn.Linear(args.hidden, args.vocab, bias=False)
    hidden = torch.randn(args.batch, args.length, args.hidden, generator=gen)
    labels = torch.randint(0, args.vocab, (args.batch, args.length), generator=gen)
    mask = torch.ones(args.batch, args.length, dtype=torch.int64)
    _run_once(args, lm_head, hidden, labels, mask)  # warm-up: thread pools, kernels
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = _status_kib("VmRSS")
    _run_once(args, lm_head, hidden, labels, mask)
    peak_mib = (_status_kib("VmHWM") - base) / 1024
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        _run_once(args, lm_head, hidden, labels, mask)
        times.append(time.perf_counter() - start)
    print(json.dumps({"peak_mib": peak_mib, "time_s": statistics.median(times)}))


def measure(args: argparse.Namespace, variant: str, mode: str) -> dict[str, float]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--variant",
        variant,
        "--mode",
        mode,
        *(
            f"--{k.replace('_', '-')}={getattr(args, k)}"
            for k in ("vocab", "batch", "length", "hidden", "chunk_size", "threads", "repeats")
        ),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="infer,train")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=("plain", "chunked"), help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("infer", "train"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    n = args.batch * args.length
    print(
        f"V={args.vocab} B={args.batch} T={args.length} H={args.hidden} "
        f"chunk={args.chunk_size} threads={args.threads}; one (n, V) float32 logits "
        f"tensor = {n * args.vocab * 4 / 2**20:.0f} MiB"
    )
    ok = True
    for mode in args.modes.split(","):
        plain, chunked = measure(args, "plain", mode), measure(args, "chunked", mode)
        ratio = chunked["peak_mib"] / plain["peak_mib"]
        ok &= ratio <= TARGET
        print(
            f"{mode:5s}  peak extra: plain {plain['peak_mib']:7.0f} MiB, chunked "
            f"{chunked['peak_mib']:6.0f} MiB, ratio {ratio:.3f} (target <= {TARGET}: "
            f"{'met' if ratio <= TARGET else 'MISSED'})  time: plain {plain['time_s']:.2f} s, "
            f"chunked {chunked['time_s']:.2f} s, ratio {chunked['time_s'] / plain['time_s']:.2f}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
