"""Sampling consistency: log-probs of a rollout scored at the temperature it was drawn at.

A rollout node (`generate`) samples at temperature τ; every node that scores those
responses with the same model at a `temperature` of its own (`logprob`,
`ppo_actor_update`, a plugin kind with that param) must divide the logits by the same τ
(verl passes the rollout temperature to the actor for this reason). Otherwise the PPO
ratio π_θ/π_old compares two different distributions and is biased from the first
step — a silent bug no loss curve shows at once. τ = 0 (greedy) is scored at 1 by
every node, so any scoring temperature is accepted there.
"""

from __future__ import annotations

from flowgraph.checker.structure import Resolved, param_value
from flowgraph.diagnostics import Diagnostic, error, warning
from flowgraph.ir import NodeSpec
from flowgraph.spelling import param_setting


def check_temperatures(table: dict[str, Resolved], out: list[Diagnostic]) -> None:
    rollouts = {name: r for name, r in table.items()
                if r.kind is not None and r.kind.category == "rollout"}
    for r in table.values():
        if r.kind is None or r.kind.category == "rollout" or r.kind.param("temperature") is None:
            continue
        if not isinstance(r.spec, NodeSpec):
            continue
        ref = r.spec.input("responses")
        source = rollouts.get(ref.node) if ref is not None else None
        if source is None or not isinstance(source.spec, NodeSpec) \
                or source.spec.model != r.spec.model:
            continue
        drawn, scored = param_value(source, "temperature"), param_value(r, "temperature")
        if not isinstance(drawn, int | float) or not isinstance(scored, int | float):
            continue
        if drawn == 0 or float(drawn) == float(scored):
            continue
        p = r.spec.params.find("temperature")
        out.append(warning(
            "FG116", f"`{r.name}` scores the responses of `{source.name}` at temperature "
            f"{scored:g}, but `{source.name}` sampled them at {drawn:g}",
            p.pos if p is not None else r.pos, node=r.name,
            edge=f"{ref.node}.{ref.port} -> {r.name}.responses" if ref else None,
            expected=f"temperature {drawn:g}", actual=f"temperature {scored:g}",
            hint=f"set {param_setting(r.name, 'temperature', drawn)} (the PPO ratio compares "
                 "log-probs of one distribution only when every node scores at the "
                 "sampling temperature)"))


def check_val_sampling(table: dict[str, Resolved], out: list[Diagnostic]) -> None:
    """A rollout's `val_n` > 1 needs `val_temperature` > 0: n greedy answers are copies."""
    for r in table.values():
        if r.kind is None or r.kind.category != "rollout" or not isinstance(r.spec, NodeSpec):
            continue
        n, temperature = param_value(r, "val_n"), param_value(r, "val_temperature")
        if isinstance(n, int) and n > 1 and temperature in (0, 0.0):
            p = r.spec.params.find("val_n")
            out.append(error(
                "FG118", f"`{r.name}` asks for {n} held-out responses a prompt "
                f"(val_n) but evaluates greedily (val_temperature 0): they would be {n} "
                f"copies of one", p.pos if p is not None else r.pos, node=r.name,
                hint=f"set nodes.{r.name}.params.val_temperature (verl's val_kwargs use "
                     f"1.0 for mean@n), or val_n: 1"))
