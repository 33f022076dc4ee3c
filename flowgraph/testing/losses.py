"""Property test of a policy loss (`@policy_loss`) against the signature every loss has.

    from flowgraph.testing import assert_policy_loss_honours_contract

    def test_my_loss():
        assert_policy_loss_honours_contract("my_loss")             # a declared name
        assert_policy_loss_honours_contract(my_loss, params={"beta": 0.5})

For each hypothesis example it draws B in 1..6 and T in 1..8 or 9..32 (`T_SIZES`), old
and new log-probs (<= 0; the new ones requiring grad), finite advantages and a
right-padded response mask (`masks`: in some examples with all-zero rows, as an agent
rollout's failed episodes give), and calls the loss as `ppo_actor_update` does:
`loss(old_log_prob, log_prob, advantages, response_mask, **params)` — params: the
update's clip ratios the loss takes (the update's defaults), then `params`. The loss must
return per-token losses of shape (B, T), finite everywhere (the update multiplies them by
the mask, and NaN·0 is NaN), and metrics whose values are finite numbers; the token-mean
of the losses must have a finite gradient w.r.t. `log_prob`. A failure raises
`AssertionError` naming the loss (and where it is defined), the drawn sizes and what
broke. `assert_honours_contract("ppo_actor_update", params={"policy_loss": "my_loss"})`
tests the update around it as the run does.

hypothesis (and torch) are imported when the check runs, not on import.

Notation: B sequences, T response length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from flowgraph.registry import LOSS_SHARED, Registry, loss_function, loss_spec
from flowgraph.runtime.context import Impl
from flowgraph.runtime.update import policy_loss_problem
from flowgraph.testing.contracts import T_SIZES, masks

__all__ = ["assert_policy_loss_honours_contract"]


def _function(loss: str | Callable[..., Any]) -> Callable[..., Any]:
    """The function of a loss given by name (built in, or declared by `@policy_loss`)."""
    if callable(loss):
        return loss
    spec = loss_spec(loss)
    if spec is None:
        raise ValueError(f"no policy loss `{loss}` is declared (import the module that "
                         "declares it with @policy_loss first)")
    return loss_function(loss) or Impl.load_function(spec.impl)


def _shared_defaults() -> dict[str, object]:
    """The update's clip ratios, at its defaults: what a loss that takes one gets."""
    update = Registry.default().kinds["ppo_actor_update"]
    return {p.name: p.default for p in update.params if p.name in LOSS_SHARED}


def assert_policy_loss_honours_contract(loss: str | Callable[..., Any], *,
                                        params: Mapping[str, Any] | None = None,
                                        max_examples: int = 20) -> None:
    """Raise `AssertionError` unless policy loss `loss` (a declared name, or the
    function) honours the policy-loss contract on every drawn batch."""
    import inspect

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    fn = _function(loss)
    accepts = inspect.signature(fn).parameters
    call = {k: v for k, v in _shared_defaults().items() if k in accepts} | dict(params or {})

    @st.composite
    def draws(draw: Any) -> dict[str, Any]:
        return {"B": draw(st.integers(1, 6), label="B"),
                "T": draw(st.one_of(*(st.integers(lo, hi) for lo, hi in T_SIZES)), label="T"),
                "empty": draw(st.booleans(), label="all-zero mask rows"),
                "seed": draw(st.integers(0, 2**31 - 1), label="seed")}

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(draws())
    def check(d: dict[str, Any]) -> None:
        import torch

        gen = torch.Generator().manual_seed(d["seed"])
        shape = (d["B"], d["T"])
        old = -torch.rand(shape, generator=gen) * 3.0
        log_prob = (old + torch.randn(shape, generator=gen) * 0.1).clamp(max=0.0)
        log_prob.requires_grad_(True)
        advantages = torch.randn(shape, generator=gen) * 2.0
        mask = masks(shape, prompt=False, gen=gen, empty_rows=d["empty"])
        where = f"policy loss `{getattr(fn, '__qualname__', fn)}`, B={d['B']} T={d['T']}" + \
            (", with all-zero mask rows" if d["empty"] else "")
        try:
            returned = fn(old, log_prob, advantages, mask, **call)
        except Exception as exc:  # a crash on well-formed inputs breaks the contract too
            raise AssertionError(f"{where}: raised {type(exc).__name__}: {exc}") from exc
        problem = policy_loss_problem(fn, returned, mask)
        assert problem is None, f"{where}: {problem}"
        losses, metrics = returned
        assert bool(torch.isfinite(losses).all()), \
            f"{where}: the per-token losses are not all finite: {losses}"
        bad = {k: v for k, v in metrics.items()
               if not isinstance(v, (int, float)) or not math.isfinite(v)}
        assert not bad, f"{where}: metrics that are not finite numbers: {bad}"
        (losses * mask).sum().div(max(int(mask.sum()), 1)).backward()
        grad = log_prob.grad
        assert grad is not None and bool(torch.isfinite(grad).all()), \
            f"{where}: the gradient w.r.t. log_prob is not finite: {grad}"

    check()
