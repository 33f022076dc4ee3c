"""Write tests/fixtures/verl/policy_losses.pt: verl 0.9.1's policy losses and rollout
correction on seeded inputs, the reference for `flowgraph.nodes.policy_losses`
(tests/nodes/test_policy_losses.py; the tests never import verl).

Each of vanilla, gspo, cispo, gpg, clip_cov, kl_cov (`core_algos.get_policy_loss_fn`),
with clip ratios 0.2 / 0.28 and each loss's own params, under the loss_agg_modes
token-mean, seq-mean-token-mean and seq-mean-token-sum-norm, on 8 responses of 12 tokens
(a contiguous mask and one with holes, float32 and float64), with and without
rollout-correction weights (`rollout_corr_helper.compute_rollout_correction_weights`:
token TIS at 2.0, sequence TIS at 2.0, token IcePop in [0.5, 2.0]) applied as verl's
actor applies them. clip_cov draws tokens from the global RNG: it is seeded before each
call, as the test seeds it before ours.

Run (verl is not a dependency of flowgraph; see scripts/verl_fixtures.py):

    python scripts/verl_policy_loss_fixtures.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import verl
from verl.trainer.ppo import core_algos as ca
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
from verl.workers.config import ActorConfig
from verl.workers.config.actor import PolicyLossConfig
from verl_fixtures import B, T, masks  # the same 8 x 12 masks as core_algos.pt

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "verl" / "policy_losses.pt"
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
OWN = {"vanilla": {}, "gspo": {}, "cispo": {}, "gpg": {},
       "clip_cov": {"clip_cov_ratio": 0.1, "clip_cov_lb": -1.0, "clip_cov_ub": 5.0},
       "kl_cov": {"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.5}}
"""Each loss's own params: large ratios, so that the covariance rules pick tokens."""
CORRECTIONS = {"none": None, "token_tis": ("token", 2.0, None),
               "sequence_tis": ("sequence", 2.0, None), "token_icepop": ("token", 2.0, 0.5)}


def config(loss: str) -> ActorConfig:
    return ActorConfig(strategy="fsdp", rollout_n=4, ppo_mini_batch_size=8,
                       ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2,
                       clip_ratio_high=0.28, clip_ratio_c=3.0,
                       policy_loss=PolicyLossConfig(loss_mode=loss, **OWN[loss]))


def case(mask: torch.Tensor, dtype: torch.dtype, g: torch.Generator) -> dict[str, Any]:
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    old = -randn(B, T).abs() - 0.1
    inputs = {"old_log_prob": old, "log_prob": old + 0.3 * randn(B, T),
              "advantages": randn(B, T), "rollout_log_prob": old + 0.5 * randn(B, T),
              "response_mask": mask.to(dtype)}
    out: dict[str, Any] = {}
    for correction, how in CORRECTIONS.items():
        weights = None
        if how is not None:
            level, upper, lower = how
            threshold = upper if lower is None else f"{lower}_{upper}"
            weights, _ = compute_rollout_correction_weights(
                inputs["old_log_prob"] - inputs["rollout_log_prob"], inputs["response_mask"],
                rollout_is=level, rollout_is_threshold=threshold)
            out[f"weights/{correction}"] = weights
        for loss in OWN:
            for mode in MODES:
                torch.manual_seed(1234)
                pg_loss, metrics = ca.get_policy_loss_fn(loss)(
                    inputs["old_log_prob"], inputs["log_prob"], inputs["advantages"],
                    inputs["response_mask"], mode, config(loss), rollout_is_weights=weights)
                out[f"{loss}/{mode}/{correction}"] = {"loss": pg_loss, "metrics": metrics}
    return {"inputs": inputs, "outputs": out}


def main() -> None:
    g = torch.Generator().manual_seed(0)
    cases = {f"{name}-{str(dtype).removeprefix('torch.')}": case(m, dtype, g)
             for name, m in masks().items() for dtype in (torch.float32, torch.float64)}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"verl": verl.__version__, "torch": torch.__version__, "own": OWN,
                "corrections": CORRECTIONS, "cases": cases}, OUT)
    print(f"wrote {OUT} ({len(cases)} cases, verl {verl.__version__})")


if __name__ == "__main__":
    main()
