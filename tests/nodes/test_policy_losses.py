"""Every built-in policy loss and the rollout correction equal verl 0.9.1's own
functions (`core_algos.get_policy_loss_fn`, `rollout_corr_helper`) on the same inputs:
scripts/verl_policy_loss_fixtures.py wrote their numbers (verl is not needed here).

A loss here returns the per-token loss; the update weighs it by the rollout-correction
weights and aggregates it, as verl's functions do inside — that whole path is compared.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from flowgraph.kinds import POLICY_LOSSES
from flowgraph.nodes._agg import agg_loss
from flowgraph.nodes.policy_losses import rollout_is_weights
from flowgraph.runtime.context import Impl
from flowgraph.testing import assert_policy_loss_honours_contract

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "verl" / "policy_losses.pt"
DATA = torch.load(FIXTURES, weights_only=False)
CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-5,
                                                                          "atol": 1e-6}


def _ours(name: str, x: dict[str, torch.Tensor], mode: str, weights: torch.Tensor | None
          ) -> tuple[torch.Tensor, dict[str, float]]:
    fn = Impl.load_function(POLICY_LOSSES[name].impl)
    accepts = inspect.signature(fn).parameters
    params = {**{k: v for k, v in CLIP.items() if k in accepts}, **DATA["own"][name]}
    torch.manual_seed(1234)  # clip_cov's draw, as the fixture seeded verl's
    pg_losses, metrics = fn(x["old_log_prob"], x["log_prob"], x["advantages"],
                            x["response_mask"], **params)
    if weights is not None:
        pg_losses = pg_losses * weights
    return agg_loss(pg_losses, x["response_mask"], mode), metrics


@pytest.mark.parametrize("correction", list(DATA["corrections"]))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(DATA["own"]))
@pytest.mark.parametrize("case", sorted(DATA["cases"]))
def test_policy_loss_equals_verls(case: str, name: str, mode: str, correction: str) -> None:
    data = DATA["cases"][case]
    x, expected = data["inputs"], data["outputs"][f"{name}/{mode}/{correction}"]
    weights = None
    how = DATA["corrections"][correction]
    if how is not None:
        weights, _ = rollout_is_weights(x["old_log_prob"], x["rollout_log_prob"],
                                        x["response_mask"], *how)
        torch.testing.assert_close(weights, data["outputs"][f"weights/{correction}"],
                                   **_tolerance(weights.dtype))
    loss, metrics = _ours(name, x, mode, weights)
    assert loss.dtype == expected["loss"].dtype
    torch.testing.assert_close(loss, expected["loss"], **_tolerance(loss.dtype))
    theirs = {k.removeprefix("actor/"): v for k, v in expected["metrics"].items()}
    assert set(metrics) == set(theirs)
    for key, value in theirs.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_every_builtin_loss_is_held_to_verl() -> None:
    assert set(DATA["own"]) == set(POLICY_LOSSES)


def _per_sequence(old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                  advantages: torch.Tensor, response_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """A planted bug: (B,) where a policy loss returns (B, T)."""
    return -(advantages * (log_prob - old_log_prob).exp()).mean(-1), {}


def _unguarded(old_log_prob: torch.Tensor, log_prob: torch.Tensor,
               advantages: torch.Tensor, response_mask: torch.Tensor
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """A planted bug: each row's loss divided by its token count, unguarded (0/0 on the
    all-zero rows of an agent rollout's failed episodes)."""
    lengths = response_mask.sum(-1, keepdim=True)
    return -advantages * log_prob * response_mask / lengths, {}


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_builtin_loss_honours_the_policy_loss_contract(name: str) -> None:
    assert_policy_loss_honours_contract(name, max_examples=10)


def test_a_loss_of_the_wrong_shape_or_dividing_by_an_empty_row_is_caught_naming_it() -> None:
    here = Path(__file__).name
    with pytest.raises(AssertionError, match=rf"policy loss `_per_sequence` \(\S*{here}:\d+\) "
                                             r"returned losses of shape \(\d+,\); a policy "
                                             r"loss returns one loss per response token"):
        assert_policy_loss_honours_contract(_per_sequence)
    with pytest.raises(AssertionError, match=r"policy loss `_unguarded`, B=\d+ T=\d+, with "
                                             r"all-zero mask rows: the per-token losses are "
                                             r"not all finite"):
        assert_policy_loss_honours_contract(_unguarded)


def test_a_loss_of_the_wrong_shape_fails_the_update_naming_the_loss() -> None:
    """At run time: before, a (B,) loss died in the aggregation (`The size of tensor a
    (4) must match ...`) naming no loss — or, with B = T, broadcast and trained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from flowgraph.nodes.update import ppo_actor_update

    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2))
    b, p, t = 4, 3, 4  # B = T: the shapes broadcast, so only the check stops it
    update = ppo_actor_update(
        prompts=torch.randint(0, 32, (b, p)), prompt_mask=torch.ones(b, p, dtype=torch.long),
        responses=torch.randint(0, 32, (b, t)), response_mask=torch.ones(b, t, dtype=torch.long),
        advantages=torch.randn(b, t), old_log_prob=-torch.rand(b, t),
        policy_loss=_per_sequence)
    with pytest.raises(ValueError, match=r"^policy loss `_per_sequence` \(\S+:\d+\) returned "
                                         r"losses of shape \(4,\); a policy loss returns one "
                                         r"loss per response token, \(B, T\) = \(4, 4\)"):
        update.loss(lm, update.batch)
