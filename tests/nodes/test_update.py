"""Update kinds on a 1-layer random Llama: PPO actor, PPO critic, DPO, SFT — each kind's
`Update` trained by the update loop (`flowgraph.compilers.update_loop`), as the
executor does (`_train`).

The batch has responses of 5, 2, 4 and 0 valid tokens, so token-mean, seq-mean-token-sum
and seq-mean-token-mean weight micro-batches differently and the empty row exercises
the "sequences with a valid token" denominator.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

from flowgraph.choices import LOSS_AGG_MODES
from flowgraph.compilers.update_loop import train
from flowgraph.errors import FlowgraphError, NonFiniteError
from flowgraph.kinds import BUILTIN_KINDS
from flowgraph.nodes import policy_losses
from flowgraph.nodes.logprob import logprob, micro_batches, sequence_logprob
from flowgraph.nodes.update import dpo_update, ppo_actor_update, ppo_critic_update, sft_update
from flowgraph.nodes.values import ValueModel
from flowgraph.nodes.values import values as predict_values
from flowgraph.passes import compile_graph
from flowgraph.registry import policy_loss
from flowgraph.runtime import NodeContext
from flowgraph.runtime.context import Workers
from flowgraph.runtime.update import LOOP_PARAMS

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"

B, P, T, V, H = 4, 3, 5, 32, 32
ACTOR_METRICS = (
    "pg_loss",
    "pg_clipfrac",
    "pg_clipfrac_lower",
    "ppo_kl",
    "entropy",
    "grad_norm",
    "lr",
)
CONFIG = LlamaConfig(
    vocab_size=V,
    hidden_size=H,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _actor(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(CONFIG).train()


def _critic(seed: int = 0) -> ValueModel:
    torch.manual_seed(seed)
    return ValueModel(LlamaModel(CONFIG), H, seed=seed).train()


def _ctx(
    model: nn.Module, *, lr: float = 0.5, sgd: bool = True, step: int = 0, grad_clip: float = 0.0
) -> NodeContext:
    opt = (torch.optim.SGD if sgd else torch.optim.Adam)(model.parameters(), lr=lr)
    return NodeContext(
        "update",
        "ppo_actor_update",
        step=step,
        seed=7,
        model=model,
        optimizer=opt,
        grad_clip=grad_clip,
    )


def _sequences(seed: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 1], [1, 1, 1]])
    lengths = torch.tensor([5, 2, 4, 0])
    return {
        "prompts": torch.randint(3, V, (B, P), generator=g),
        "prompt_mask": prompt_mask,
        "responses": torch.randint(3, V, (B, T), generator=g),
        "response_mask": (torch.arange(T) < lengths[:, None]).long(),
    }


def _log_prob(model: nn.Module, seqs: dict[str, Tensor]) -> Tensor:
    with torch.no_grad():
        return logprob(model, **seqs)["log_prob"]


def _ppo_batch(model: nn.Module, advantages: Tensor | None = None) -> dict[str, Tensor]:
    """On-policy: old_log_prob = the model's own log-probs, so the ratio starts at 1."""
    seqs = _sequences()
    g = torch.Generator().manual_seed(3)
    if advantages is None:
        advantages = torch.randn(B, T, generator=g) * seqs["response_mask"]
    return {**seqs, "old_log_prob": _log_prob(model, seqs), "advantages": advantages}


def _params(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def _assert_metrics(ctx: NodeContext, names: tuple[str, ...]) -> None:
    missing = [n for n in names if n not in ctx.metrics]
    assert not missing, f"missing metrics {missing}; got {sorted(ctx.metrics)}"
    bad = {n: ctx.metrics[n] for n in names if not math.isfinite(ctx.metrics[n])}
    assert not bad, bad


def _train(fn: Callable[..., object], ctx: NodeContext, **kw: object) -> None:
    """What the executor does with an update node: call its kind with its inputs and the
    params it takes, then train on the `Update` in the update loop with the node's
    params (defaults filled)."""
    kind = BUILTIN_KINDS[fn.__name__]
    takes = inspect.signature(fn).parameters
    update = fn(**{k: v for k, v in kw.items() if k in takes})
    params = {k: v for k, v in kw.items() if kind.param(k) is not None}
    train(ctx, update, kind.param_values(params))


@pytest.mark.parametrize("fn", [ppo_actor_update, ppo_critic_update, dpo_update, sft_update])
def test_signature_is_exactly_the_kind_contract(fn: Callable[..., object]) -> None:
    """Its inputs and the params its loss uses: none of the loop's but `packing` (the
    loss's forwards pack too), no `ctx`; DPO, a mean over pairs, no loss_agg_mode. A
    policy loss, named in the graph, defaults to the implementation of the kind's default
    (what the compiler writes into the plan)."""
    kind = BUILTIN_KINDS[fn.__name__]
    sig = inspect.signature(fn)
    own = [p.name for p in kind.params if p.name not in LOOP_PARAMS and not p.executor]
    want = [*(p.name for p in kind.inputs), *own, "packing"]
    assert sorted(sig.parameters) == sorted(want)
    assert set(LOOP_PARAMS) <= {p.name for p in kind.params}
    assert ("loss_agg_mode" in sig.parameters) == (fn is not dpo_update)
    for p in kind.params:
        default = getattr(policy_losses, str(p.default)) if p.names == "policy_loss" \
            else p.default
        if p.name in sig.parameters:
            assert sig.parameters[p.name].default == default, p.name
    for port in kind.inputs:
        has_default = sig.parameters[port.name].default is not inspect.Parameter.empty
        assert has_default == port.optional, port.name


def test_actor_step_raises_log_probs_of_positive_advantage_tokens() -> None:
    model = _actor()
    seqs = _sequences()
    mask = seqs["response_mask"]
    # Row 0 (5 tokens) is rewarded, row 1 (2 tokens) punished, row 2 (4 tokens) neutral.
    sign = torch.tensor([1.0, -1.0, 0.0, 0.0])[:, None]
    batch = _ppo_batch(model, advantages=sign * mask)
    ctx = _ctx(model, lr=0.1)
    _train(ppo_actor_update, ctx, **batch)
    # On-policy the ratio is 1: pg_loss = −Σ m·A / Σ m = −(5 − 2)/11; nothing is clipped.
    assert ctx.metrics["actor/pg_loss"] == pytest.approx(-3 / 11, abs=1e-6)
    assert ctx.metrics["actor/pg_clipfrac"] == 0.0
    assert ctx.metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    _assert_metrics(ctx, tuple(f"actor/{n}" for n in ACTOR_METRICS))
    assert "actor/kl_loss" not in ctx.metrics
    delta = (_log_prob(model, seqs) - batch["old_log_prob"]).sum(-1)
    assert delta[0] > 0 and delta[1] < 0
    # The same batch again: the surrogate loss (now off-policy) is lower than before.
    again = _ctx(model, lr=0.0)
    _train(ppo_actor_update, again, **batch)
    assert again.metrics["actor/pg_loss"] < -3 / 11


def _accumulation_case(kind: str, mode: str) -> tuple[nn.Module, Callable[..., object], dict]:
    if kind == "critic":
        critic = _critic()
        seqs = _sequences()
        with torch.no_grad():
            v = predict_values(critic, **seqs)["values"]
        g = torch.Generator().manual_seed(5)
        returns = (v + torch.randn(B, T, generator=g)) * seqs["response_mask"]
        return (
            critic,
            ppo_critic_update,
            {**seqs, "values": v, "returns": returns, "loss_agg_mode": mode},
        )
    actor = _actor()
    batch = _ppo_batch(actor)
    g = torch.Generator().manual_seed(4)
    noise = 0.3 * torch.randn(B, T, generator=g) * batch["response_mask"]
    batch["old_log_prob"] = (batch["old_log_prob"] + noise).clamp(max=0.0)  # some clipping
    batch["ref_log_prob"] = (batch["old_log_prob"] - noise.abs()).clamp(max=0.0)
    return (
        actor,
        ppo_actor_update,
        {**batch, "entropy_coeff": 0.01, "kl_loss_coef": 0.1, "loss_agg_mode": mode},
    )


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("kind", ["actor", "critic"])
def test_micro_batches_accumulate_to_the_one_shot_mini_batch_gradient(kind: str, mode: str) -> None:
    # w_k = n_k / Σ n_j makes Σ w_k L_k the mini-batch loss: one SGD step with m = M/2
    # lands on the same parameters as with m = M (lr 0.5, so any 1/k mis-weighting of
    # the 5/2/4/0-token rows would show up at ~1e-2).
    model, update, kwargs = _accumulation_case(kind, mode)
    twin = copy.deepcopy(model)
    one_shot, split = _ctx(model), _ctx(twin)
    _train(update, one_shot, **kwargs, mini_batch_size=4, micro_batch_size=4)
    _train(update, split, **kwargs, mini_batch_size=4, micro_batch_size=2)
    assert (_params(model) - _params(twin)).abs().max() < 1e-6
    assert split.metrics.keys() == one_shot.metrics.keys()
    loss = "actor/pg_loss" if kind == "actor" else "critic/vf_loss"
    assert split.metrics[loss] == pytest.approx(one_shot.metrics[loss], abs=1e-6)


def test_micro_batches_cut_by_a_token_budget() -> None:
    """Consecutive rows while rows x (longest prompt + longest response) fits: rows of
    3+5, 2+2, 1+4, 3+0 tokens in 12 are [3+5] [2+2 1+4] [3+0]; a DPO pair puts two
    sequences in the forward."""
    lengths = torch.tensor([[3, 5], [2, 2], [1, 4], [3, 0]])
    assert [r.tolist() for r in micro_batches(lengths, max_token_len=12)] == [[0], [1, 2], [3]]
    assert [r.tolist() for r in micro_batches(lengths, max_token_len=16, per_row=2)] == \
        [[0], [1], [2], [3]]
    assert [r.tolist() for r in micro_batches(lengths, max_token_len=32)] == [[0, 1, 2, 3]]
    assert [r.tolist() for r in micro_batches(lengths, 3)] == [[0, 1, 2], [3]]
    # 3+0 and 1+4 pad to 2 x (3 + 4) = 14 tokens, not 2 x 5
    assert [r.tolist() for r in micro_batches(lengths[[3, 2]], max_token_len=12)] == [[0], [1]]
    with pytest.raises(ValueError, match=r"max_token_len=7 is less than row 0's 8 tokens"):
        micro_batches(lengths, max_token_len=7)
    # packed, a micro-batch holds valid tokens only: 8 + 4 | 5 + 3 (padded: 8 | 4 + 5 | 3)
    assert [r.tolist() for r in micro_batches(lengths, max_token_len=12, packing=True)] == \
        [[0, 1], [2, 3]]
    assert [r.tolist() for r in micro_batches(lengths, max_token_len=16, per_row=2,
                                              packing=True)] == [[0], [1], [2, 3]]


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize(("kind", "mode"), [*((k, m) for k in ("actor", "critic")
                                               for m in LOSS_AGG_MODES), ("dpo", "token-mean")])
def test_a_token_budget_accumulates_to_the_one_shot_gradient(kind: str, mode: str,
                                                             packing: bool) -> None:
    """max_token_len cuts the 3+5, 2+2, 1+4, 3+0-token rows into micro-batches of different sizes
    (at most 12 padded tokens each; 16 for two sequences a pair), trimmed to their
    longest prompt and response — or packed, one row of at most 12 (16) valid tokens:
    the step equals the (padded) one-shot step."""
    if kind == "dpo":  # a mean over pairs: no loss_agg_mode
        model = _actor()
        update, kwargs, budget = dpo_update, {**_pairs(model), "beta": 0.1}, 16
    else:
        model, update, kwargs = _accumulation_case(kind, mode)
        budget = 12
    twin = copy.deepcopy(model)
    forwards: list[int] = []
    backbone = twin.backbone if kind == "critic" else twin.model
    hook = backbone.register_forward_pre_hook(
        lambda _m, _a, kw: forwards.append(kw["input_ids"].numel()), with_kwargs=True)
    one_shot, budgeted = _ctx(model), _ctx(twin)
    _train(update, one_shot, **kwargs, mini_batch_size=4)
    _train(update, budgeted, **kwargs, mini_batch_size=4, max_token_len=budget, packing=packing)
    hook.remove()
    assert len(forwards) > 1 and max(forwards) <= budget, forwards
    # packed: 8 + 4 | 5 + 3; a pair's two sequences already fill 16 tokens, packed or not
    assert len(forwards) == {"dpo": (4, 4)}.get(kind, (3, 2))[packing], forwards
    assert (_params(model) - _params(twin)).abs().max() < 1e-6
    assert budgeted.metrics.keys() == one_shot.metrics.keys()
    # the loss and the gradient; token-level ratios (clipfrac, ppo_kl) are per-micro-batch
    # means weighted by the loss denominators, as with micro_batch_size and in verl
    for name in ("actor/pg_loss", "critic/vf_loss", "actor/dpo_loss", "actor/grad_norm",
                 "critic/grad_norm", "rewards/margins"):
        if name in one_shot.metrics:
            assert budgeted.metrics[name] == pytest.approx(one_shot.metrics[name], abs=1e-5)


class _BusierWorker(Workers):
    """Another worker whose rows needed `count` micro-batches."""

    def __init__(self, count: int) -> None:
        self.count = count

    def max(self, value: int) -> int:
        return max(value, self.count)


def test_every_worker_runs_as_many_micro_batches_as_the_busiest() -> None:
    """A sharded model's forward is a collective: the cut [3+5] [2+2 1+4] [3+0] becomes
    four micro-batches when another worker needs four (the largest halved), and the step
    is still the one-shot step."""
    lengths = torch.tensor([[3, 5], [2, 2], [1, 4], [3, 0]])
    cut = micro_batches(lengths, max_token_len=12, workers=_BusierWorker(4))
    assert [r.tolist() for r in cut] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="another worker runs 5 micro-batches"):
        micro_batches(lengths, max_token_len=12, workers=_BusierWorker(5))
    model, update, kwargs = _accumulation_case("actor", "token-mean")
    twin = copy.deepcopy(model)
    busy = _ctx(twin)
    busy.workers = _BusierWorker(4)
    _train(update, _ctx(model), **kwargs, mini_batch_size=4)
    _train(update, busy, **kwargs, mini_batch_size=4, max_token_len=12)
    assert (_params(model) - _params(twin)).abs().max() < 1e-6


def test_a_token_budget_and_a_micro_batch_size_are_refused_together() -> None:
    model = _actor()
    with pytest.raises(ValueError, match=r"micro_batch_size=2 and max_token_len=10: set one"):
        _train(ppo_actor_update, _ctx(model), **_ppo_batch(model), micro_batch_size=2,
               max_token_len=10)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("policy_loss", ["gspo", "cispo", "gpg"])
def test_every_loss_of_tokens_accumulates_to_the_one_shot_gradient(
        policy_loss: str, mode: str) -> None:
    """As above for the other policy losses whose per-token loss depends on its own row
    only (clip_cov and kl_cov rank tokens within the micro-batch, as verl's do)."""
    model, update, kwargs = _accumulation_case("actor", mode)
    kwargs = {**kwargs, "policy_loss": getattr(policy_losses, policy_loss),
              "clip_ratio_low": 0.1}
    twin = copy.deepcopy(model)
    _train(update, _ctx(model), **kwargs, mini_batch_size=4, micro_batch_size=4)
    _train(update, _ctx(twin), **kwargs, mini_batch_size=4, micro_batch_size=2)
    assert (_params(model) - _params(twin)).abs().max() < 1e-6


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo", "cispo", "gpg", "clip_cov",
                                         "kl_cov"])
def test_every_policy_loss_steps_the_actor(policy_loss: str) -> None:
    model = _actor()
    before = _params(model)
    ctx = _ctx(model)
    _train(ppo_actor_update, ctx, **_ppo_batch(model),
           policy_loss=getattr(policy_losses, policy_loss))
    assert math.isfinite(ctx.metrics["actor/pg_loss"])
    assert not torch.equal(before, _params(model))


def test_rollout_correction_weighs_by_the_rollout_s_own_probabilities() -> None:
    model = _actor()
    batch = _ppo_batch(model)
    mask = batch["response_mask"]
    # The rollout engine gave the first response's tokens e^1 times less probability:
    # its truncated weight is min(e, 2) = 2, the others' 1.
    rollout = batch["old_log_prob"] - mask * torch.tensor([1.0, 0, 0, 0])[:, None]
    ctx = _ctx(model)
    _train(ppo_actor_update, ctx, **batch, rollout_log_prob=rollout, rollout_is="token")
    valid = float(mask.sum())
    assert ctx.metrics["actor/rollout_is/mean"] == pytest.approx(
        (2 * float(mask[0].sum()) + float(mask[1:].sum())) / valid)
    assert ctx.metrics["actor/rollout_is/cut_frac"] == pytest.approx(float(mask[0].sum()) / valid)
    with pytest.raises(ValueError, match="wire generate's rollout_log_prob"):
        _train(ppo_actor_update, _ctx(model), **batch, rollout_is="token")


def test_a_plugin_policy_loss_is_written_into_the_plan_and_used() -> None:
    """The compiler writes the loss a graph names into the update's plan (a function of
    this session: the function itself, by value); the update calls it, no name looked up."""
    @policy_loss("test_update_plain_pg")
    def plain(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor,
              response_mask: Tensor, scale: float = 1.0) -> tuple[Tensor, dict[str, float]]:
        return -scale * advantages * log_prob, {"scale": scale}

    plan = compile_graph(GRAPHS / "grpo.yaml", overrides=[
        "nodes.update_actor.params.policy_loss=test_update_plain_pg"]).plan
    assert plan is not None
    params = plan.live_params("update_actor")
    assert params["policy_loss"] is plain
    assert plan.node("update_actor").param_values()["policy_loss"] == {
        "$python": f"{plain.__module__}:{plain.__qualname__}"}
    given = {p.name: p.value for p in plan.node("update_actor").given}
    assert given["policy_loss"] == '"test_update_plain_pg"'  # the graph's own words
    model = _actor()
    ctx = _ctx(model)
    _train(ppo_actor_update, ctx, **_ppo_batch(model), policy_loss=params["policy_loss"],
           policy_loss_params={"scale": 2.0})
    assert ctx.metrics["actor/scale"] == 2.0


def test_a_built_in_policy_loss_is_written_as_its_implementation() -> None:
    plan = compile_graph(GRAPHS / "grpo.yaml", overrides=[
        "nodes.update_actor.params.policy_loss=gspo"]).plan
    assert plan is not None
    assert plan.live_params("update_actor")["policy_loss"] == \
        "flowgraph.nodes.policy_losses:gspo"
    assert plan.live_params("update_actor", evaluation=True)["policy_loss"] == \
        "flowgraph.nodes.policy_losses:gspo"
    model = _actor()
    ctx = _ctx(model)
    _train(ppo_actor_update, ctx, **_ppo_batch(model),
           policy_loss="flowgraph.nodes.policy_losses:gspo")
    assert math.isfinite(ctx.metrics["actor/pg_loss"])
    with pytest.raises(FlowgraphError, match=r"implementation `flowgraph.nodes.policy_losses:"
                                             r"nope` cannot be imported"):
        _train(ppo_actor_update, _ctx(model), **_ppo_batch(model),
               policy_loss="flowgraph.nodes.policy_losses:nope")


def test_shuffling_is_seeded_by_seed_step_and_epoch_only() -> None:
    first = _actor()
    batch = _ppo_batch(first)
    second, other_step = copy.deepcopy(first), copy.deepcopy(first)
    rng = torch.get_rng_state()
    for model, step in [(first, 3), (second, 3), (other_step, 4)]:
        # Two mini-batches of 2: their order and composition change the result.
        _train(ppo_actor_update, _ctx(model, step=step), **batch, mini_batch_size=2, ppo_epochs=2)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is never drawn from
    assert torch.equal(_params(first), _params(second))
    assert not torch.allclose(_params(first), _params(other_step), atol=1e-5)


def test_non_finite_advantage_raises_before_the_optimizer_step() -> None:
    model = _actor()
    batch = _ppo_batch(model)
    batch["advantages"][0, 1] = math.nan
    before = _params(model)
    ctx = _ctx(model, sgd=False)
    with pytest.raises(NonFiniteError, match=r"non-finite loss in node `update` at step 0"):
        _train(ppo_actor_update, ctx, **batch, micro_batch_size=2)
    assert torch.equal(_params(model), before)
    assert all(p.grad is None for p in model.parameters())
    assert not ctx.optimizer.state  # Adam's moments were never touched either


def test_non_finite_gradient_norm_raises_before_the_optimizer_step() -> None:
    model = _actor()
    batch = _ppo_batch(model)
    before = _params(model)
    model.lm_head.weight.register_hook(lambda g: g * math.inf)
    ctx = _ctx(model, sgd=False, grad_clip=1.0)
    with pytest.raises(NonFiniteError, match="non-finite gradient norm") as info:
        _train(ppo_actor_update, ctx, **batch)
    assert (info.value.node, info.value.step) == ("update", 0)
    assert torch.equal(_params(model), before) and not ctx.optimizer.state


def test_grad_clip_bounds_the_update() -> None:
    # SGD with lr 1: Δθ = −g_clipped, so ‖Δθ‖ = min(‖g‖, clip); ‖g‖ is reported unclipped.
    free, clipped = _actor(), _actor()
    batch = _ppo_batch(free)
    before = _params(free)
    unclipped = _ctx(free, lr=1.0)
    _train(ppo_actor_update, unclipped, **batch)
    norm = unclipped.metrics["actor/grad_norm"]
    assert (_params(free) - before).norm().item() == pytest.approx(norm, rel=1e-4)
    ctx = _ctx(clipped, lr=1.0, grad_clip=norm / 10)
    _train(ppo_actor_update, ctx, **batch)
    assert ctx.metrics["actor/grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert (_params(clipped) - before).norm().item() == pytest.approx(norm / 10, rel=1e-4)


def test_every_mini_batch_steps_the_optimizer_and_the_call_steps_the_scheduler_once() -> None:
    model = _actor()
    batch = _ppo_batch(model)
    ctx = _ctx(model, lr=0.1, sgd=False)
    ctx.scheduler = torch.optim.lr_scheduler.LambdaLR(ctx.optimizer, lambda k: 0.5**k)
    with torch.no_grad():  # executors may run nodes without grad; an update still trains
        _train(ppo_actor_update, ctx, **batch, mini_batch_size=2, micro_batch_size=1, ppo_epochs=2)
    # 2 epochs × 2 mini-batches = 4 optimizer steps, one training step: verl's
    # lr_warmup_steps count training steps, so the scheduler steps once per call.
    assert ctx.optimizer.state[next(model.parameters())]["step"].item() == 4
    assert ctx.scheduler.last_epoch == 1
    # lr is the one the step used, constant within it.
    assert ctx.metrics["actor/lr"] == pytest.approx(0.1)


def test_entropy_is_reported_whether_or_not_it_is_in_the_loss() -> None:
    model = _actor()
    batch = _ppo_batch(model)
    with torch.no_grad():
        entropy = logprob(model, **_sequences(), with_entropy=True)["entropy"]
    want = (entropy.sum() / batch["response_mask"].sum()).item()  # token-mean
    for coeff in (0.0, 0.1):
        ctx = _ctx(model, lr=0.0)
        _train(ppo_actor_update, ctx, **batch, entropy_coeff=coeff)
        assert ctx.metrics["actor/entropy"] == pytest.approx(want, rel=1e-5)


def test_kl_loss_is_reported_when_ref_log_prob_is_wired() -> None:
    model = _actor()
    batch = _ppo_batch(model)
    ctx = _ctx(model, lr=0.0)
    _train(ppo_actor_update, ctx, **batch, ref_log_prob=batch["old_log_prob"], kl_loss_type="kl")
    # π = π_old = π_ref before the (lr 0) step: every estimator of KL is 0.
    assert ctx.metrics["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    _assert_metrics(ctx, (*(f"actor/{n}" for n in ACTOR_METRICS), "actor/kl_loss"))


@pytest.mark.parametrize(
    ("mini", "micro", "message"),
    [
        (3, None, r"mini_batch_size=3 does not divide the batch of 4 sequences"),
        (8, None, r"mini_batch_size=8 does not divide the batch of 4 sequences"),
        (4, 3, r"micro_batch_size=3 does not divide the 4 rows of a mini-batch"),
        (None, 3, r"micro_batch_size=3 does not divide the 4 rows of a mini-batch"),
    ],
)
def test_batch_sizes_that_do_not_divide_are_refused(
    mini: int | None, micro: int | None, message: str
) -> None:
    model = _actor()
    with pytest.raises(ValueError, match=message):
        _train(ppo_actor_update, _ctx(model), **_ppo_batch(model), mini_batch_size=mini,
               micro_batch_size=micro)


def test_one_step_without_old_log_prob_is_the_step_with_it() -> None:
    """Pass `on_policy`: with one optimizer step, the update's own detached log-probs are
    π_old's, so leaving `old_log_prob` out changes neither the step nor its metrics."""
    model = _actor()
    batch = _ppo_batch(model)
    with_old, without = _ctx(model), _ctx(copy.deepcopy(model))
    _train(ppo_actor_update, with_old, **batch)
    _train(ppo_actor_update, without, **{k: v for k, v in batch.items() if k != "old_log_prob"})
    assert torch.equal(_params(with_old.model), _params(without.model))
    assert with_old.metrics == pytest.approx(without.metrics, abs=1e-6)


@pytest.mark.parametrize("params", [{"mini_batch_size": 2}, {"ppo_epochs": 2}])
def test_more_than_one_step_without_old_log_prob_is_refused(params: dict[str, int]) -> None:
    model = _actor()
    batch = {k: v for k, v in _ppo_batch(model).items() if k != "old_log_prob"}
    with pytest.raises(ValueError, match=r"holds for one optimizer step only.*wire old_log_prob"):
        _train(ppo_actor_update, _ctx(model), **batch, **params)


def test_critic_update_lowers_the_value_loss() -> None:
    critic = _critic()
    seqs = _sequences()
    mask = seqs["response_mask"]
    with torch.no_grad():
        v = predict_values(critic, **seqs)["values"]
    batch = {**seqs, "values": v, "returns": (v + 1.0) * mask}
    ctx = _ctx(critic, lr=1e-2, sgd=False)
    _train(ppo_critic_update, ctx, **batch, cliprange_value=10.0)
    # v̂ = V = R − 1 on every valid token: ½·mean(1²) = 0.5, nothing clipped.
    assert ctx.metrics["critic/vf_loss"] == pytest.approx(0.5, abs=1e-5)
    assert ctx.metrics["critic/vf_clipfrac"] == 0.0
    assert ctx.metrics["critic/vpred_mean"] == pytest.approx(
        (v.sum() / mask.sum()).item(), abs=1e-5
    )
    _assert_metrics(
        ctx,
        tuple(f"critic/{n}" for n in ("vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm", "lr")),
    )
    for _ in range(4):
        ctx = NodeContext(
            "update", "ppo_critic_update", step=1, seed=7, model=critic, optimizer=ctx.optimizer
        )
        _train(ppo_critic_update, ctx, **batch, cliprange_value=10.0)
    assert ctx.metrics["critic/vf_loss"] < 0.25


def _pairs(model: nn.Module) -> dict[str, Tensor]:
    seqs, other = _sequences(0), _sequences(1)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 3:] = 0
    pairs = {
        "prompts": seqs["prompts"],
        "prompt_mask": seqs["prompt_mask"],
        "chosen": seqs["responses"],
        "chosen_mask": mask,
        "rejected": other["responses"],
        "rejected_mask": mask.flip(0),
    }
    with torch.no_grad():  # the reference is the policy's starting point
        for name in ("chosen", "rejected"):
            pairs[f"ref_{name}_logps"] = sequence_logprob(
                model, pairs["prompts"], pairs["prompt_mask"], pairs[name], pairs[f"{name}_mask"]
            )["log_prob"]
    return pairs


def test_dpo_update_widens_the_reward_margin() -> None:
    model = _actor()
    pairs = _pairs(model)
    margins = []
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(4):
        ctx = NodeContext("dpo", "dpo_update", step=step, seed=7, model=model, optimizer=optimizer)
        _train(dpo_update, ctx, **pairs, beta=0.1, micro_batch_size=2)
        margins.append(ctx.metrics["rewards/margins"])
        if step == 0:  # π = π_ref: h = 0, loss = −log σ(0) = log 2 and no margin yet
            assert ctx.metrics["actor/dpo_loss"] == pytest.approx(math.log(2), abs=1e-5)
            assert margins[0] == pytest.approx(0.0, abs=1e-5)
    _assert_metrics(
        ctx,
        (
            "actor/dpo_loss",
            "rewards/chosen",
            "rewards/rejected",
            "rewards/accuracies",
            "rewards/margins",
            "actor/grad_norm",
            "actor/lr",
        ),
    )
    assert margins == sorted(margins) and margins[-1] > 0.05
    assert ctx.metrics["rewards/accuracies"] == 1.0


def test_the_actor_rescores_at_the_rollout_temperature() -> None:
    """old_log_prob from a τ=0.5 rollout: on-policy (ppo_kl 0) only when the update
    scores at τ=0.5 too; at the default τ=1 the ratio is off from the first step."""
    model = _actor()
    seqs = _sequences()
    with torch.no_grad():
        old = logprob(model, **seqs, temperature=0.5)["log_prob"]
    batch = {**seqs, "old_log_prob": old, "advantages": seqs["response_mask"].float()}
    same = _ctx(model, lr=0.0)
    _train(ppo_actor_update, same, **batch, temperature=0.5)
    assert same.metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    other = _ctx(model, lr=0.0)
    _train(ppo_actor_update, other, **batch)
    assert abs(other.metrics["actor/ppo_kl"]) > 1e-3


# --------------------------------------------------------------------------- SFT


def _sft_batch() -> dict[str, Tensor]:
    seqs = _sequences()
    return {k: seqs[k] for k in ("prompts", "prompt_mask", "responses", "response_mask")}


def test_sft_loss_is_hugging_face_s_cross_entropy_on_response_tokens() -> None:
    """token-mean SFT loss = the loss HF computes with labels -100 on prompt and padding."""
    model, batch = _actor(), _sft_batch()
    ids = torch.cat([batch["prompts"], batch["responses"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
    labels = torch.cat([torch.full_like(batch["prompts"], -100),
                        batch["responses"].masked_fill(batch["response_mask"] == 0, -100)], 1)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, labels=labels,
                     position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).loss
    ctx = _ctx(model, lr=0.0)
    _train(sft_update, ctx, **batch, micro_batch_size=2)
    assert ctx.metrics["sft/loss"] == pytest.approx(float(want), abs=1e-5)
    assert {"actor/grad_norm", "actor/lr"} <= set(ctx.metrics)


def test_sft_steps_lower_the_loss_and_micro_batches_give_the_one_shot_step() -> None:
    model, batch = _actor(), _sft_batch()
    twin = copy.deepcopy(model)
    _train(sft_update, _ctx(model, lr=0.1), **batch)
    _train(sft_update, _ctx(twin, lr=0.1), **batch, max_token_len=12)
    assert (_params(model) - _params(twin)).abs().max() < 1e-6
    losses = []
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(5):
        ctx = NodeContext("sft", "sft_update", step=step, seed=7, model=model,
                          optimizer=optimizer)
        _train(sft_update, ctx, **batch)
        losses.append(ctx.metrics["sft/loss"])
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.1, losses


def test_sft_update_trains_the_loss_mask_tokens_only() -> None:
    """The loss is the token-mean cross-entropy over loss_mask; tokens outside it get no
    gradient (a response token the mask leaves out can be anything)."""
    from flowgraph.nodes.logprob import logprob
    from flowgraph.nodes.models import load_model
    from flowgraph.nodes.update import sft_update
    from flowgraph.runtime.context import NodeContext

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 500, (2, 4), generator=g)
    responses = torch.randint(3, 500, (2, 5), generator=g)
    ones, response_mask = torch.ones(2, 4, dtype=torch.long), torch.ones(2, 5, dtype=torch.long)
    loss_mask = torch.tensor([[1, 1, 0, 0, 1], [0, 1, 1, 1, 0]])
    results = []
    for changed in (False, True):
        model = load_model("builtin:tiny-lm", trainable=True)
        want = -(logprob(model, prompts, ones, responses, response_mask)["log_prob"]
                 * loss_mask).sum() / loss_mask.sum()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ctx = NodeContext("sft", "sft_update", step=0, seed=0, model=model, optimizer=opt,
                          grad_clip=0.0)
        seen = responses.clone()
        if changed:  # after each masked-out token: the loss's tokens see other contexts
            seen[loss_mask == 0] = 7
        _train(sft_update, ctx, prompts=prompts, prompt_mask=ones, responses=seen,
               response_mask=response_mask, loss_mask=loss_mask)
        if not changed:
            assert ctx.metrics["sft/loss"] == pytest.approx(want.item(), rel=1e-5)
        results.append(ctx.metrics["sft/loss"])
    assert results[0] != results[1]  # the masked tokens are context, not targets
    # a mark on padding trains nothing: the trained tokens are loss_mask ∧ response_mask
    model = load_model("builtin:tiny-lm", trainable=True)
    ctx = NodeContext("sft", "sft_update", step=0, seed=0, model=model,
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1), grad_clip=0.0)
    padded = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    _train(sft_update, ctx, prompts=prompts, prompt_mask=ones, responses=responses,
           response_mask=padded, loss_mask=response_mask)
    want = -(logprob(load_model("builtin:tiny-lm"), prompts, ones, responses, padded)
             ["log_prob"] * padded).sum() / padded.sum()
    assert ctx.metrics["sft/loss"] == pytest.approx(want.item(), rel=1e-5)
