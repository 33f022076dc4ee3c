"""Benchmark: vectorised ``flowgraph.nodes.advantage.gae`` vs verl's per-time-step loop.

Run:  python benchmarks/bench_gae.py            (B=256, T=1024 and 4096, float32, 2 threads)
      python benchmarks/bench_gae.py --lengths 512 --repeats 5

The batch looks like an RL post-training batch: responses of random length
(right padding), a few masked spans in the middle (tool observations), some
leading masked tokens, a small per-token KL-style reward plus a ±1 outcome
reward on each response's last token, and critic values in [-1, 1].

For every T it prints the median (and min) wall time of verl's
``compute_gae_advantage_return`` ported op for op (``verl_gae``: the loop over T
with verl's mask-skipping updates, stack, returns = A + V, verl's masked_whiten;
float32) and of the vectorised ``gae``, the ratio of the medians (target ≥ 10× at
T=1024), the max abs difference between the two float32 results on valid tokens
(verl leaves masked positions non-zero), and the max error of ``gae`` against the
same loop run in float64 for γλ = 1 and γλ = 0.95 (must be < 1e-5; the script
exits 1 otherwise). Timings on a shared machine are noisy: compare medians from
runs at low load (the first line prints the load average).

Notation:
    B  number of responses in the batch
    T  response length in tokens
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import Tensor

from flowgraph.nodes.advantage import gae

ERROR_BUDGET = 1e-5


def make_batch(batch: int, length: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """(token_level_rewards, values, response_mask), float32, (B, T)."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.arange(length)
    ends = torch.randint(length // 4, length + 1, (batch, 1), generator=gen)
    starts = torch.randint(0, 4, (batch, 1), generator=gen)
    mask = (pos >= starts) & (pos < ends)
    for _ in range(2):  # two masked spans per response, up to T/32 tokens each
        hole_start = torch.randint(0, length, (batch, 1), generator=gen)
        hole_len = torch.randint(1, max(2, length // 32), (batch, 1), generator=gen)
        mask &= ~((pos >= hole_start) & (pos < hole_start + hole_len))
    mask_f = mask.float()
    rewards = -0.01 * torch.randn(batch, length, generator=gen).abs() * mask_f
    last = (mask_f * pos).argmax(dim=1)
    outcome = torch.randint(0, 2, (batch,), generator=gen).float() * 2 - 1
    rewards[torch.arange(batch), last] += outcome
    values = torch.rand(batch, length, generator=gen) * 2 - 1
    return rewards, values, mask_f


def verl_masked_whiten(values: Tensor, mask: Tensor) -> Tensor:
    """verl ``torch_functional.masked_whiten``: masked mean, Bessel-corrected masked var."""
    mean = (values * mask).sum() / mask.sum()
    centred = values - mean
    var = (centred**2 * mask).sum() / mask.sum()
    var = var * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_gae_loop_raw(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> Tensor:
    """The loop of verl ``compute_gae_advantage_return``, op for op: un-whitened advantages.

    Masked steps keep the running value and advantage (``x·m + (1 − m)·x_prev``), so
    masked positions carry the next valid token's advantage; nothing is zeroed.
    """
    next_value: Tensor | float = 0.0
    last_adv: Tensor | float = 0.0
    reversed_adv = []
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * last_adv
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last_adv = adv_t * mask[:, t] + (1 - mask[:, t]) * last_adv
        reversed_adv.append(last_adv)
    return torch.stack(reversed_adv[::-1], dim=1)


def verl_gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """verl ``compute_gae_advantage_return``: (whitened advantages, returns), as verl returns them.

    The timed reference: loop over T, stack, returns = A + V, masked_whiten(A, m).
    verl leaves masked positions non-zero; compare on valid tokens only.
    """
    with torch.no_grad():
        advantages = verl_gae_loop_raw(rewards, values, mask, gamma, lam)
        returns = advantages + values
        advantages = verl_masked_whiten(advantages, mask)
    return advantages, returns


def time_ms(fn: Callable[[], object], repeats: int, warmup: int) -> tuple[float, float]:
    """(median, min) wall time in ms over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times), 1e3 * min(times)


def max_error(batch: tuple[Tensor, Tensor, Tensor], gamma: float, lam: float) -> float:
    """Max abs error of float32 ``gae`` against verl's loop in float64 on valid tokens.

    Taken over the whitened advantages, the raw advantages and the returns.
    """
    rewards, values, mask = batch
    with torch.no_grad():
        raw64 = verl_gae_loop_raw(rewards.double(), values.double(), mask.double(), gamma, lam)
    white64 = verl_masked_whiten(raw64, mask.double())
    ret64 = raw64 + values.double()
    white, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    raw, _ = gae(rewards, values, mask, gamma=gamma, lam=lam, whiten=False)
    valid = mask.double()
    return max(
        float(((white.double() - white64) * valid).abs().max()),
        float(((raw.double() - raw64) * valid).abs().max()),
        float(((ret.double() - ret64) * valid).abs().max()),
    )


def run(batch_size: int, length: int, repeats: int, gamma: float, lam: float) -> bool:
    batch = make_batch(batch_size, length, seed=length)
    rewards, values, mask = batch
    loop_ms, loop_min = time_ms(lambda: verl_gae(*batch, gamma, lam), max(3, repeats // 4), 1)
    vec_ms, vec_min = time_ms(lambda: gae(*batch, gamma=gamma, lam=lam), repeats, 3)
    white_loop, ret_loop = verl_gae(*batch, gamma, lam)
    white, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    diff_adv = ((white - white_loop) * mask).abs().max().item()
    diff_ret = ((ret - ret_loop) * mask).abs().max().item()
    err_1 = max_error(batch, 1.0, 1.0)
    err_95 = max_error(batch, 1.0, 0.95)
    ok = max(err_1, err_95) < ERROR_BUDGET
    print(f"B={batch_size} T={length} float32 gamma={gamma} lam={lam} valid={mask.mean():.0%}")
    print(f"  verl loop (per time step)    {loop_ms:9.1f} ms median  {loop_min:9.1f} ms min")
    print(f"  vectorised gae               {vec_ms:9.2f} ms median  {vec_min:9.2f} ms min")
    print(f"  speed-up (medians)           {loop_ms / vec_ms:9.1f}x")
    print(f"  max |diff| vs float32 loop   advantages {diff_adv:.2e}  returns {diff_ret:.2e}")
    verdict = "ok" if ok else f"FAIL (budget {ERROR_BUDGET:.0e})"
    print(f"  max error vs float64 loop    γλ=1: {err_1:.2e}  γλ=0.95: {err_95:.2e}  {verdict}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=20, help="timed runs of gae (loop: 1/4)")
    parser.add_argument("--gamma", type=float, default=1.0)
    parser.add_argument("--lam", type=float, default=0.95)
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads (timings need otherwise idle cores)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load}")
    results = [run(args.batch, t, args.repeats, args.gamma, args.lam) for t in args.lengths]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
