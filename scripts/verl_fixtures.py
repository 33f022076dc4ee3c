"""Write tests/fixtures/verl/core_algos.pt: verl 0.9.1's own outputs on seeded inputs.

Every advantage estimator, the PPO policy loss, the value loss, agg_loss and the KL
penalties of `flowgraph.nodes` are held to these numbers by
tests/nodes/test_verl_reference.py, the LR schedules (warm-up) by
tests/compilers/test_local.py; the tests never import verl. Inputs: 8 responses of 12
tokens in groups (0 0 0 0 1 1 1 2: a singleton group too), on two masks: contiguous (a
response, then padding) and with holes (tokens masked in the middle, as tool
observations in multi-turn data are: `1 1 0 0 1 1 1 1 1 0 …`), in float32 and float64.

Run (verl is not a dependency of flowgraph; this is the only place that needs it):

    pip install -c constraints/cpu.txt --no-deps verl==0.9.1
    pip install -c constraints/cpu.txt tensordict omegaconf codetiming
    python scripts/verl_fixtures.py

Made with verl 0.9.1, torch 2.13.0 (CPU), tensordict 0.15.3, omegaconf 2.3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import verl
from omegaconf import OmegaConf
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos as ca

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "verl" / "core_algos.pt"
B, T = 8, 12
INDEX = [0, 0, 0, 0, 1, 1, 1, 2]
LENGTHS = [12, 9, 5, 1, 12, 7, 3, 10]
HOLES = [(2, 4), (5, 6), (1, 3), (7, 9), (2, 4), (3, 5), (1, 2), (4, 8)]
"""Masked spans [a, b) inside each response of the holed mask."""
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_KINDS = ("kl", "abs", "mse", "low_var_kl")


def masks() -> dict[str, torch.Tensor]:
    contiguous = torch.zeros(B, T)
    for i, n in enumerate(LENGTHS):
        contiguous[i, :n] = 1
    holes = contiguous.clone()
    for i, (a, b) in enumerate(HOLES):
        holes[i, a:b] = 0
    return {"contiguous": contiguous, "holes": holes}


def outcome_rewards(mask: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The score on each response's last valid token, 0 elsewhere (verl's reward manager)."""
    last = (mask * torch.arange(1, T + 1)).argmax(-1)
    return torch.zeros_like(mask).scatter_(1, last[:, None], scores[:, None])


def case(mask: torch.Tensor, dtype: torch.dtype, g: torch.Generator) -> dict[str, Any]:
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    m = mask.to(dtype)
    index = np.array([f"uid{i}" for i in INDEX], dtype=object)
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 1.0, 0.3], dtype=dtype)
    dense = randn(B, T)  # a reward on every token: holes must skip what they cover
    outcome = outcome_rewards(m, scores)
    values, baselines = randn(B, T), randn(B)
    inputs = {"mask": m, "index": torch.tensor(INDEX), "scores": scores, "dense": dense,
              "outcome": outcome, "values": values, "baselines": baselines}
    out: dict[str, Any] = {}
    for gamma, lam in ((1.0, 1.0), (0.99, 0.95)):
        out[f"gae/{gamma}/{lam}"] = ca.compute_gae_advantage_return(
            dense, values, m, torch.tensor(gamma, dtype=dtype), torch.tensor(lam, dtype=dtype))
        out[f"reinforce_pp/{gamma}"] = ca.compute_reinforce_plus_plus_outcome_advantage(
            dense, m, config=AlgoConfig(gamma=gamma))
    for norm in (True, False):
        out[f"grpo/{norm}"] = ca.compute_grpo_outcome_advantage(
            outcome.clone(), m, index, epsilon=1e-6, norm_adv_by_std_in_grpo=norm)
    out["rloo"] = ca.compute_rloo_outcome_advantage(outcome.clone(), m, index, epsilon=1e-6,
                                                    config=AlgoConfig())
    out["reinforce_pp_baseline"] = ca.compute_reinforce_plus_plus_baseline_outcome_advantage(
        outcome.clone(), m, index, epsilon=1e-6, config=AlgoConfig())
    out["remax"] = ca.compute_remax_outcome_advantage(dense, baselines, m, config=AlgoConfig())
    out |= losses(m, randn, inputs)
    return {"inputs": inputs, "outputs": out}


def losses(m: torch.Tensor, randn: Any, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    old, ref = -randn(B, T).abs(), -randn(B, T).abs()
    new = old + 0.4 * randn(B, T)  # ratios well inside and outside the clip range
    new[0, :3] = old[0, :3] + torch.tensor([5.0, -5.0, 30.0], dtype=old.dtype)  # dual clip, ±20
    advantages, vpreds, returns = randn(B, T), randn(B, T), randn(B, T)
    inputs |= {"old_log_prob": old, "log_prob": new, "ref_log_prob": ref,
               "advantages": advantages, "vpreds": vpreds, "returns": returns}
    out: dict[str, Any] = {}
    for mode in AGG_MODES:
        for low, high in ((0.2, 0.2), (0.2, 0.28)):  # symmetric; DAPO's clip-higher
            config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": low,
                                       "clip_ratio_high": high, "clip_ratio_c": 3.0,
                                       "global_batch_info": {}})
            out[f"policy/{mode}/{low}/{high}"] = ca.compute_policy_loss_vanilla(
                old, new, advantages, m, loss_agg_mode=mode, config=config)
        out[f"value/{mode}"] = ca.compute_value_loss(vpreds, returns, inputs["values"], m,
                                                     cliprange_value=0.5, loss_agg_mode=mode)
    one_empty = m.clone()
    one_empty[3] = 0  # a row without a valid token: the seq-mean modes leave it out
    for mode in AGG_MODES:
        out[f"agg/{mode}"] = ca.agg_loss(loss_mat=advantages, loss_mask=one_empty,
                                         loss_agg_mode=mode)
    for kind in KL_KINDS:
        out[f"kl/{kind}"] = ca.kl_penalty(new, ref, kind)
    return out


def schedules() -> dict[str, list[float]]:
    """LR factors of steps 0..total-1 from verl's schedulers (stepped once per training
    step by verl's workers)."""
    from verl.utils.torch_functional import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
    )

    out = {}
    for warmup, total in ((0, 10), (3, 10), (10, 10), (4, 7)):
        for name in ("constant", "cosine"):
            opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
            sched = (get_constant_schedule_with_warmup(opt, warmup) if name == "constant" else
                     get_cosine_schedule_with_warmup(opt, warmup, total))
            factors = []
            for _ in range(total):
                factors.append(opt.param_groups[0]["lr"])
                opt.step()
                sched.step()
            out[f"{name}/{warmup}/{total}"] = factors
    return out


def main() -> None:
    assert verl.__version__ == "0.9.1", f"made with verl 0.9.1, not {verl.__version__}"
    g = torch.Generator().manual_seed(0)
    fixtures = {f"{name}/{str(dtype).removeprefix('torch.')}": case(mask, dtype, g)
                for name, mask in masks().items() for dtype in (torch.float32, torch.float64)}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"verl": verl.__version__, "torch": torch.__version__, "cases": fixtures,
                "schedules": schedules()}, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(fixtures)} cases)")


if __name__ == "__main__":
    main()
