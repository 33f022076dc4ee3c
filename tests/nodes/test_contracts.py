"""Every built-in kind's implementation honours its declared contract (hypothesis).

Model kinds run on a 1-layer random Llama (vocab 32); critics are `ValueModel`s on its
backbone. The data kinds (`prompts`, `preferences`, `sft`) are datasets rather than per-step
functions and are checked on one `next_batch` of the built-in arithmetic task.

Notation: b batch of the node, Bp prompts, P prompt length, T response length.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

from flowgraph.agent import Env, Step
from flowgraph.contracts import TensorSpec
from flowgraph.kinds import BUILTIN_KINDS
from flowgraph.nodes.values import ValueModel
from flowgraph.registry import KindSpec, PortSpec, node_kind
from flowgraph.runtime import NodeContext
from flowgraph.testing import assert_honours_contract
from flowgraph.testing.contracts import output_problem

V, H = 32, 32
DATA_KINDS = ("prompts", "preferences", "sft")
PURE_KINDS = ("token_reward", "kl_penalty", "grpo", "rloo", "remax", "dpo_loss",
              "overlong_penalty", "length_penalty", "weighted_sum", "repeat")
PARAMS = {"overlong_penalty": {"overlong_buffer_len": 1}}
"""Params a kind cannot do without (a buffer of 1 token fits every drawn T)."""
# Whitening once needed >= 2 valid tokens, which the contract did not say (b=1, T=1,
# response_mask [[1]] raised); a single valid token now whitens to 0.
WHITENING_KINDS = ("gae", "reinforce_pp", "reinforce_pp_baseline")
CAUSAL_KINDS = ("generate", "logprob", "sequence_logprob")
CRITIC_KINDS = ("values", "reward_model")
UPDATE_KINDS = ("ppo_actor_update", "ppo_critic_update", "dpo_update", "sft_update")
FILTER_KINDS = ("filter",)
AGENT_KINDS = ("agent_rollout",)
"""Their outputs' batch dim (`g*n`) is that of the rows joined over a step's tries;
one call returns the kept rows of one try (test_filter_kind_keeps_whole_groups)."""
EXAMPLES = {"generate": 6, "logprob": 8, "sequence_logprob": 8, "values": 8,
            "reward_model": 8, "reward": 10, "ppo_actor_update": 5,
            "ppo_critic_update": 5, "dpo_update": 5, "sft_update": 5}


@pytest.fixture(scope="module")
def lm() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def critic(lm: LlamaForCausalLM) -> ValueModel:
    return ValueModel(lm.base_model, H)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from flowgraph.nodes.models import load_tokenizer

    return load_tokenizer("builtin:tiny-lm")


def test_every_builtin_kind_is_covered() -> None:
    covered = (DATA_KINDS + PURE_KINDS + WHITENING_KINDS + CAUSAL_KINDS + CRITIC_KINDS
               + UPDATE_KINDS + FILTER_KINDS + AGENT_KINDS + ("reward", "compute_score", "judge"))
    assert sorted(covered) == sorted(BUILTIN_KINDS)


@pytest.mark.parametrize("name", PURE_KINDS)
def test_pure_kind_honours_contract(name: str) -> None:
    assert_honours_contract(name, max_examples=30, params=PARAMS.get(name))


@pytest.mark.parametrize("name", WHITENING_KINDS)
def test_whitening_kind_honours_contract(name: str) -> None:
    assert_honours_contract(name, max_examples=30)


@pytest.mark.parametrize("name", CAUSAL_KINDS)
def test_causal_model_kind_honours_contract(name: str, lm: LlamaForCausalLM,
                                            tokenizer: Any) -> None:
    # `generate` reads EOS/pad ids from the tokenizer (hf backend only here).
    tok = tokenizer if name == "generate" else None
    assert_honours_contract(name, model=lm, tokenizer=tok, max_examples=EXAMPLES[name])


class OneDigit(Env):
    """A one-token first prompt (P may be drawn 1) and one reply: two turns at most."""

    def reset(self, task: Any) -> str:
        self.replied = False
        return str(task["index"] % 10)

    def step(self, message: Any) -> Step:
        done, self.replied = self.replied, True
        return Step(["7"], reward=0.5, done=done)


def test_agent_rollout_honours_contract(tokenizer: Any) -> None:
    """On the 512-token tiny model (the rendered ids are the tokenizer's), with a chat
    template that writes contents only, so a first prompt fits any drawn P."""
    from flowgraph.nodes.models import load_model

    assert_honours_contract(
        "agent_rollout", model=load_model("builtin:tiny-lm"), tokenizer=tokenizer,
        max_examples=6, params={"env": OneDigit, "max_turns": 2, "chat_template":
                                "{% for m in messages %}{{ m['content'] }}{% endfor %}"})


@pytest.mark.parametrize("name", CRITIC_KINDS)
def test_critic_kind_honours_contract(name: str, critic: ValueModel) -> None:
    assert_honours_contract(name, model=critic, max_examples=EXAMPLES[name])


def test_reward_honours_contract(tokenizer: Any) -> None:
    # `format` does not need the optional ground_truth; the default fn does (below).
    assert_honours_contract("reward", tokenizer=tokenizer, max_examples=EXAMPLES["reward"],
                            params={"fn": "format"})


def test_compute_score_honours_contract(tokenizer: Any) -> None:
    assert_honours_contract("compute_score", tokenizer=tokenizer,
                            max_examples=EXAMPLES["reward"], params={"fn": "gsm8k"})


def test_judge_honours_contract(tokenizer: Any) -> None:
    # the judge model decodes greedily; its policy's tokenizer decodes the drawn ids
    from flowgraph.nodes.models import load_model

    ctx = NodeContext(node="judge", kind="judge", step=0, seed=0,
                      tokenizers={"actor": tokenizer})
    assert_honours_contract("judge", model=load_model("builtin:tiny-lm"), tokenizer=tokenizer,
                            ctx=ctx, max_examples=4,
                            params={"template": "{prompt} {response} Score:",
                                    "max_new_tokens": 2})
    assert set(ctx.metrics) == {"judge/invalid", "judge/mean"}


def test_reward_with_default_params_honours_contract(tokenizer: Any) -> None:
    assert_honours_contract("reward", tokenizer=tokenizer, max_examples=EXAMPLES["reward"])


@pytest.mark.parametrize("name", UPDATE_KINDS)
def test_update_kind_honours_contract(name: str, lm: LlamaForCausalLM,
                                      critic: ValueModel) -> None:
    model = critic if name == "ppo_critic_update" else lm
    ctx = NodeContext(node=name, kind=name, step=0, seed=0, model=model,
                      optimizer=torch.optim.SGD(model.parameters(), lr=1e-3))
    assert_honours_contract(name, model=model, ctx=ctx, max_examples=EXAMPLES[name])
    assert ctx.metrics, "an update reports its metrics"
    assert all(math.isfinite(v) for v in ctx.metrics.values()), ctx.metrics


@pytest.mark.parametrize("seed", range(20))
def test_filter_kind_keeps_whole_groups(seed: int) -> None:
    """One try: each output has the kept rows of its input (whole groups of n, at most
    the b given), the dtypes and trailing dims of the contract, the index renumbered
    0..groups-1 from the offset."""
    from flowgraph.nodes.filter import filter_groups

    gen = torch.Generator().manual_seed(seed)
    groups, n, p, t = (int(torch.randint(1, 6, (1,), generator=gen)) for _ in range(4))
    b = groups * n
    scores = torch.randint(0, 2, (b,), generator=gen).float()
    index = torch.arange(groups).repeat_interleave(n)
    out = filter_groups(scores, index, torch.ones(b, p, dtype=torch.long),
                        torch.ones(b, p, dtype=torch.long), torch.ones(b, t, dtype=torch.long),
                        torch.ones(b, t, dtype=torch.long),
                        rollout_log_prob=torch.zeros(b, t), ground_truth=["1"] * b, offset=3)
    rows = len(out["index"])
    assert rows <= b and rows % n == 0
    kept = rows // n
    assert out["index"].tolist() == [3 + g for g in range(kept) for _ in range(n)]
    for port in FILTER_SPEC.outputs:
        value = out[port.name]
        assert len(value) == rows, port.name
        if isinstance(value, torch.Tensor):
            assert value.dim() == len(port.spec.dims.split()), port.name
            assert value.dtype.is_floating_point == (port.spec.dtype == "float"), port.name


FILTER_SPEC = BUILTIN_KINDS["filter"]


def _data_sizes(kind: KindSpec, batch: dict[str, Any], bp: int) -> dict[str, int]:
    first = kind.outputs[0].name  # input_ids / prompts: binds P
    sizes = {"Bp": bp, "P": int(batch[first].shape[1])}
    for response in ("chosen", "responses"):
        if response in batch:
            sizes["T"] = int(batch[response].shape[1])
    return sizes


@pytest.mark.parametrize(("name", "path"), [("prompts", "builtin:arith"),
                                            ("preferences", "builtin:arith-pairs"),
                                            ("sft", "builtin:reverse")])
def test_data_kind_batches_honour_contract(name: str, path: str, tokenizer: Any) -> None:
    from flowgraph.nodes.data import preference_source, prompt_source, sft_source

    kind = BUILTIN_KINDS[name]
    source = {"prompts": prompt_source, "preferences": preference_source,
              "sft": sft_source}[name]
    splits = source(path, tokenizer=tokenizer)
    for bp in (1, 4):
        batch = splits.train.next_batch(bp)
        sizes = _data_sizes(kind, batch, bp)
        for port in kind.outputs:
            if port.name not in batch:
                assert port.optional, f"{name}: no output `{port.name}`"
                continue
            problem = output_problem(port.spec, batch[port.name], sizes)
            assert problem is None, f"kind `{name}`: output `{port.name}`: {problem}"
        if name == "preferences":
            # A chosen and a rejected response share T; masks are right-padded.
            assert batch["rejected"].shape == batch["chosen"].shape


def _wrong_token_reward(scores: torch.Tensor, response_mask: torch.Tensor
                        ) -> dict[str, torch.Tensor]:
    return {"scores": torch.zeros(response_mask.shape)}  # (b, T) where `scores` is (b,)


def test_a_wrong_shape_is_reported_with_its_port() -> None:
    kind = KindSpec("wrong_scores", "transform", "says (b,), returns (b, T)",
                    inputs=BUILTIN_KINDS["token_reward"].inputs,
                    outputs=BUILTIN_KINDS["reward"].outputs)
    with pytest.raises(AssertionError, match=r"kind `wrong_scores`.*output `scores`: shape is"):
        assert_honours_contract(kind, fn=_wrong_token_reward, max_examples=5)


@node_kind("test_contracts_brevity", outputs=["scores"], category="reward")
def _brevity(response_mask: Int[Tensor, "b T"], scale: float = 0.1) -> Float[Tensor, " b"]:
    return -scale * response_mask.sum(-1).float()


def test_a_kind_declared_in_this_process_is_found_by_name_and_by_function(
        honours_contract: Callable[..., None]) -> None:
    """As the README documents: a user's own kind, just declared with @node_kind, checked
    by name and by its function, through the pytest plugin's fixture as well."""
    assert_honours_contract("test_contracts_brevity", max_examples=5)
    assert_honours_contract(_brevity, max_examples=5)
    honours_contract("test_contracts_brevity", max_examples=5)


def test_a_broken_kind_is_caught_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from flowgraph import registry

    # declared for this test alone: `flowgraph kinds` in the same process lists no more
    monkeypatch.setattr(registry, "_DECLARED", dict(registry._DECLARED))

    @node_kind("test_contracts_broken", outputs=["scores"], category="reward")
    def broken(response_mask: Int[Tensor, "b T"]) -> Float[Tensor, " b"]:
        return response_mask.sum().float()  # a scalar, not one score per sequence

    with pytest.raises(AssertionError, match="test_contracts_broken"):
        assert_honours_contract("test_contracts_broken", max_examples=5)


def test_an_unknown_kind_name_says_where_kinds_come_from() -> None:
    with pytest.raises(ValueError, match="not declared with @node_kind in this process"):
        assert_honours_contract("no_such_kind_anywhere")


def test_the_readme_custom_node_and_its_property_test_run(tmp_path: Path) -> None:
    """The README's `brevity.py` and `test_brevity.py`, written out and run by pytest."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(r"<!-- readme-example: (\S+) -->\n```python\n(.*?)```", readme, re.S)
    assert [name for name, _ in blocks] == ["brevity.py", "test_brevity.py"]
    for name, code in blocks:
        (tmp_path / name).write_text(code)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_brevity.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout


def _seq_mean_unguarded(values: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    return {"scores": (values * response_mask).sum(-1) / response_mask.sum(-1)}  # 0/0


def _first_eight(values: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    return {"scores": (values * response_mask)[:, :8]}  # T hard-coded


def test_planted_mask_sum_and_fixed_length_bugs_are_caught() -> None:
    """An unguarded division by a row's mask sum meets an all-zero row (an agent rollout's
    failed episode); a hard-coded `[:, :8]` meets T > 8. Both passed when masks had a
    valid token in every row and T was at most 8."""
    values = PortSpec("values", TensorSpec("b T", "float", ("finite",)))
    per_row = KindSpec("seq_mean", "transform", "a mean per row",
                       inputs=(values, BUILTIN_KINDS["grpo"].input("response_mask")),
                       outputs=BUILTIN_KINDS["reward"].outputs)
    with pytest.raises(AssertionError, match=r"kind `seq_mean`.*output `scores`: .*not finite"
                                             r"|kind `seq_mean`.*output `scores`.*nan"):
        assert_honours_contract(per_row, fn=_seq_mean_unguarded)
    per_token = KindSpec("first_eight", "transform", "per token",
                         inputs=per_row.inputs,
                         outputs=(PortSpec("scores", TensorSpec("b T", "float")),))
    with pytest.raises(AssertionError, match=r"kind `first_eight`.*output `scores`: shape is "
                                             r"\(\d+, 8\), expected"):
        assert_honours_contract(per_token, fn=_first_eight)
