"""Rule rewards, the reward model, token placement, and a user-declared reward kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformers import LlamaConfig, LlamaForSequenceClassification, LlamaModel

from flowgraph.builder import GraphBuilder
from flowgraph.builtin_models import BUILTIN_MODELS
from flowgraph.checker import check_graph
from flowgraph.errors import RewardFnError
from flowgraph.nodes.logprob import forward_hidden
from flowgraph.nodes.models import build_tiny_tokenizer
from flowgraph.nodes.reward import compute_score, reward_model, rule_reward, token_reward
from flowgraph.nodes.scores import BUILTIN_SCORES
from flowgraph.nodes.values import ValueModel
from flowgraph.registry import node_kind
from flowgraph.runtime import NodeContext

CONFIG = {k: v for k, v in BUILTIN_MODELS["tiny-lm"].items() if k != "model_type"}


def _encode(texts: list[str]) -> tuple[object, Tensor, Tensor]:
    """Right-padded token ids of `texts` and their mask, with the tiny tokenizer."""
    tok = build_tiny_tokenizer()
    ids = [[*tok(t, add_special_tokens=False).input_ids, tok.eos_token_id] for t in texts]
    L = max(map(len, ids))
    responses = torch.tensor([s + [tok.pad_token_id] * (L - len(s)) for s in ids])
    mask = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in ids])
    return tok, responses, mask


TEXTS = ["7", "so #### 1,234", "3 then 12.", "no number", "#### 5"]


def test_exact_match_scores() -> None:
    tok, responses, mask = _encode(TEXTS)
    scores = rule_reward(
        responses,
        mask,
        ["7", "1234", " 12 ", "1", "6"],
        tokenizer=tok,
        correct_score=1.0,
        format_score=0.1,
    )["scores"]
    # right, right (commas), right (whitespace in the truth), no answer, wrong answer
    assert scores.tolist() == pytest.approx([1.0, 1.0, 1.0, 0.0, 0.1])
    assert scores.dtype == torch.float32


def test_format_and_length_penalty_scores() -> None:
    tok, responses, mask = _encode(TEXTS)
    fmt = rule_reward(responses, mask, tokenizer=tok, fn="format", correct_score=2.0)["scores"]
    assert fmt.tolist() == [0.0, 2.0, 0.0, 0.0, 2.0]
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    pen = rule_reward(
        torch.zeros_like(mask), mask, fn="length_penalty", target_length=2, length_coef=0.5
    )["scores"]
    assert pen.tolist() == [-0.5, -0.5, -1.0]  # -0.5·|3-2|, -0.5·|1-2|, -0.5·|0-2|


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fn": "exact_match"}, "needs one ground_truth per response"),
        ({"fn": "exact_match", "ground_truth": ["1"]}, r"\(5\); got 1 values"),
        ({"fn": "length_penalty"}, "needs the param target_length"),
        ({"fn": "bleu"}, "unknown reward fn `bleu`"),
    ],
)
def test_rule_reward_errors(kwargs: dict[str, object], message: str) -> None:
    tok, responses, mask = _encode(TEXTS)
    with pytest.raises(ValueError, match=message):
        rule_reward(responses, mask, tokenizer=tok, **kwargs)  # type: ignore[arg-type]


def test_text_rules_need_a_tokenizer() -> None:
    _, responses, mask = _encode(TEXTS)
    with pytest.raises(ValueError, match="bind a model"):
        rule_reward(responses, mask, ["7"] * 5)


def test_token_reward_on_hand_examples() -> None:
    scores = torch.tensor([1.0, -2.0, 3.0, 4.0])
    mask = torch.tensor(
        [
            [1, 1, 1, 1],  # full row: the last token
            [1, 1, 0, 0],  # right-padded: token 1
            [0, 0, 0, 0],  # empty: nothing anywhere
            [1, 0, 1, 0],  # a hole: the last valid token is 2
        ]
    )
    want = torch.tensor(
        [
            [0.0, 0.0, 0.0, 1.0],
            [0.0, -2.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 4.0, 0.0],
        ]
    )
    assert torch.equal(token_reward(scores, mask)["token_level_scores"], want)
    with pytest.raises(ValueError, match=r"scores must be \(B,\) = \(4,\)"):
        token_reward(scores[:3], mask)


def _sequences() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 500, (3, 4), generator=g)
    responses = torch.randint(3, 500, (3, 5), generator=g)
    response_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    return prompts, torch.ones_like(prompts), responses * response_mask, response_mask


@pytest.mark.parametrize("packing", [False, True])
def test_reward_model_matches_hf_sequence_classifier(packing: bool) -> None:
    """Padded or packed into one row of valid tokens: HF's score."""
    torch.manual_seed(0)
    clf = LlamaForSequenceClassification(LlamaConfig(**CONFIG, num_labels=1, pad_token_id=0)).eval()
    prompts, prompt_mask, responses, mask = _sequences()
    with torch.no_grad():
        scores = reward_model(clf, prompts, prompt_mask, responses, mask,
                              packing=packing)["scores"]
        # HF pools at the last non-pad token; rows 0 and 1 have no left padding.
        want = clf(input_ids=torch.cat([prompts, responses], 1)).logits.squeeze(-1)
    assert scores.shape == (3,)
    torch.testing.assert_close(scores[:2], want[:2], atol=1e-5, rtol=0)
    assert scores[2] == 0  # no valid response token


def test_reward_model_accepts_a_value_model() -> None:
    torch.manual_seed(0)
    critic = ValueModel(LlamaModel(LlamaConfig(**CONFIG)), int(CONFIG["hidden_size"])).eval()
    prompts, prompt_mask, responses, mask = _sequences()
    with torch.no_grad():
        scores = reward_model(critic, prompts, prompt_mask, responses, mask, micro_batch_size=2)[
            "scores"
        ]
        hidden = forward_hidden(
            critic.backbone, prompts, prompt_mask, responses, mask, on_tokens=True
        )
        on_tokens = critic.value_head(hidden).squeeze(-1)
    torch.testing.assert_close(scores[:2], torch.stack([on_tokens[0, 4], on_tokens[1, 1]]))


# A user's reward, declared with its contract (the example of nodes/reward.py). pyflakes
# reads jaxtyping's dim strings as forward references, hence the suppressions.
@node_kind("brevity_test", outputs=["scores"], category="reward")
def brevity(
    responses: Int[Tensor, "b T"],
    response_mask: Int[Tensor, "b T"],
    scale: float = 0.1,
) -> Float[Tensor, "b"]:  # noqa: F821, UP037
    return -scale * response_mask.sum(-1).float()


def test_user_reward_kind_reads_its_contract() -> None:
    kind = brevity.__flowgraph_kind__
    assert [(p.name, p.spec.dims, p.spec.dtype) for p in kind.inputs] == [
        ("responses", "b T", "int"),
        ("response_mask", "b T", "int"),
    ]
    assert [(p.name, p.spec.dims) for p in kind.outputs] == [("scores", "b")]
    assert kind.param("scale").default == 0.1
    assert brevity(
        torch.zeros(2, 3, dtype=torch.int64), torch.tensor([[1, 1, 0], [1, 0, 0]])
    ).tolist() == pytest.approx([-0.2, -0.1])


@pytest.mark.parametrize(
    ("advantage", "port", "ok"),
    [
        ("grpo", "scores", True),  # (b,) scores meet a (b,) port
        ("reinforce_pp", "token_level_rewards", False),  # (b,) scores meet a (b, T) port
    ],
)
def test_user_reward_kind_is_checked_in_a_graph(advantage: str, port: str, ok: bool) -> None:
    g = GraphBuilder("brevity")
    g.plugin(brevity.__module__)  # as `plugins: [my_pkg.rewards]` in a graph file
    g.dims(Bp=2, N=2, P=8, T=4)
    g.model("actor", "builtin:tiny-lm", trainable=True)
    data = g.data("train", "prompts", "builtin:arith")
    gen = g.node(
        "gen", "generate", model="actor", prompts=data.input_ids, prompt_mask=data.attention_mask
    )
    seq = {
        "prompts": gen.prompts,
        "prompt_mask": gen.prompt_mask,
        "responses": gen.responses,
        "response_mask": gen.response_mask,
    }
    old = g.node("old", "logprob", model="actor", **seq)
    reward = g.node(
        "reward", "brevity_test", responses=gen.responses, response_mask=gen.response_mask
    )
    group = {"index": gen.index} if advantage == "grpo" else {}
    adv = g.node(
        "adv", advantage, response_mask=gen.response_mask, **group, **{port: reward.scores}
    )
    g.node(
        "update",
        "ppo_actor_update",
        model="actor",
        old_log_prob=old.log_prob,
        advantages=adv.advantages,
        **seq,
    )
    result = check_graph(g.build())
    messages = [d.one_line() for d in result.errors]
    assert result.ok == ok, messages
    assert ok or any("reward.scores" in m for m in messages)


# --- compute_score: verl-style reward functions ----------------------------------------

VERL_SCORES = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "verl"
                          / "reward_scores.json").read_text())["cases"]


@pytest.mark.parametrize("name", ["gsm8k", "math"])
def test_builtin_scores_equal_verls(name: str) -> None:
    """verl 0.9.1's gsm8k / math_reward on the fixture's strings
    (scripts/verl_reward_fixtures.py)."""
    fn = BUILTIN_SCORES[name]
    ours = [fn(None, c["solution"], c["ground_truth"]) for c in VERL_SCORES[name]]
    assert ours == [c["score"] for c in VERL_SCORES[name]]


def _ctx() -> NodeContext:
    return NodeContext("reward", "compute_score", step=3, seed=0)


def by_source(data_source: str, solution_str: str, ground_truth: str,
              extra_info: dict[str, object] | None = None) -> dict[str, float]:
    """A user's function: a dict with `score` and extra numbers."""
    length = float(len(solution_str))
    return {"score": 1.0 if solution_str == ground_truth else 0.0, "length": length,
            "split_is_train": float((extra_info or {}).get("split") == "train")}


def raises_on_twelve(data_source: str, solution_str: str, ground_truth: str,
                     extra_info: object = None) -> float:
    if "12" in solution_str:
        raise KeyError("twelve")
    return 0.5


def test_compute_score_routes_by_data_source_and_logs_extra_numbers() -> None:
    tok, responses, mask = _encode(["7", "#### 5", "8"])
    ctx = _ctx()
    out = compute_score(
        responses, mask, ground_truth=["7", "5", "9"], data_source=["mine", "openai/gsm8k",
                                                                     "mine"],
        extra_info=[{"split": "train"}, {}, {"split": "test"}], ctx=ctx, tokenizer=tok,
        fn=f"{__name__}:by_source", fns={"openai/gsm8k": "gsm8k"})
    # row 0: by_source, "7" == "7"; row 1: gsm8k, #### 5; row 2: by_source, "8" != "9"
    assert out["scores"].tolist() == [1.0, 1.0, 0.0]
    assert out["scores"].dtype == torch.float32
    # extra numbers are averaged over the rows whose function gave them (rows 0 and 2);
    # each function's scores over its rows as TRL logs them (gsm8k's one row: no std)
    assert ctx.metrics == pytest.approx({
        "critic/length/mean": 1.0, "critic/split_is_train/mean": 0.5,
        "rewards/by_source/mean": 0.5, "rewards/by_source/std": 0.5 ** 0.5,
        "rewards/gsm8k/mean": 1.0, "rewards/gsm8k/std": float("nan")}, nan_ok=True)


def test_a_raising_function_names_the_row_and_its_data_source() -> None:
    tok, responses, mask = _encode(["7", "3 then 12."])
    with pytest.raises(RewardFnError) as exc:
        compute_score(responses, mask, data_source=["a", "b"], ctx=_ctx(), tokenizer=tok,
                      fn=f"{__name__}:raises_on_twelve")
    assert str(exc.value) == (f"reward fn `{__name__}:raises_on_twelve` raised on row 1 "
                              "(data_source `b`): KeyError: 'twelve'")
    assert isinstance(exc.value.__cause__, KeyError)  # the user's frame is the cause's


@pytest.mark.parametrize(("returned", "message"), [
    ({"acc": 1.0}, "returned a dict without `score`: keys \\['acc'\\]"),
    ("1.0", "returned str '1.0'; a score is a number"),
    (None, "returned NoneType None"),
])
def test_a_result_that_is_not_a_score_is_named(returned: object, message: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    tok, responses, mask = _encode(["7"])
    name = f"gives_{type(returned).__name__}"  # one name per case: functions are cached
    monkeypatch.setitem(globals(), name, lambda **_: returned)
    with pytest.raises(ValueError, match=f"reward fn `{__name__}:{name}` on row 0 "
                                         f"\\(data_source `None`\\) {message}"):
        compute_score(responses, mask, ctx=_ctx(), tokenizer=tok, fn=f"{__name__}:{name}")


@pytest.mark.faults
@pytest.mark.parametrize(("returned", "shown"), [
    (float("nan"), "nan"), (float("inf"), "inf"), ({"score": float("-inf")}, "-inf")])
def test_a_non_finite_score_names_the_function_and_row(
        returned: object, shown: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tok, responses, mask = _encode(["7", "8"])
    name = f"gives_{shown.replace('-', 'minus_')}"
    monkeypatch.setitem(globals(), name, lambda **kw: returned if kw["solution_str"] == "8"
                        else 0.0)
    ctx = _ctx()
    ctx.row_offset = 4  # this worker's rows start at 4 of the batch
    with pytest.raises(RewardFnError) as exc:
        compute_score(responses, mask, data_source=["a", "b"],
                      extra_info=[{"index": 10}, {"index": 11}], ctx=ctx, tokenizer=tok,
                      fn=f"{__name__}:{name}")
    assert str(exc.value).startswith(
        f"reward fn `{__name__}:{name}` on row 5 (data_source `b`, extra_info index 11) "
        f"returned {shown}; a score must be a finite number")


def with_text(data_source: str, solution_str: str, ground_truth: str,
              extra_info: object = None) -> dict[str, object]:
    return {"score": 1.0, "pred": solution_str, "acc": True}


def test_text_entries_are_kept_per_row_and_reported_once() -> None:
    tok, responses, mask = _encode(["7", "8"])
    ctx = _ctx()
    with pytest.warns(UserWarning, match="`pred` = '7' \\(str\\): not a number") as seen:
        out = compute_score(responses, mask, ctx=ctx, tokenizer=tok,
                            fn=f"{__name__}:with_text")
        compute_score(responses, mask, ctx=_ctx(), tokenizer=tok, fn=f"{__name__}:with_text")
    assert len(seen) == 1  # once, not once a row or a step
    assert out["reward_extra_info"] == [{"pred": "7", "acc": True}, {"pred": "8", "acc": True}]
    # a bool counts as 1, as the score
    assert ctx.metrics == {"critic/acc/mean": 1.0, "rewards/with_text/mean": 1.0,
                           "rewards/with_text/std": 0.0}


WRONG_SIGNATURES = {
    "positional": "def compute_score(solution, truth):\n    return 0.0\n",
    "no extra_info": ("def compute_score(data_source, solution_str, ground_truth):\n"
                      "    return 0.0\n"),
}

EXPECTED = {
    "positional": "`compute_score(solution, truth)` takes neither of the parameters that say "
                  "how to call it: `completions` or `prompts` or `completion_ids` (TRL: "
                  "`def f(prompts, completions, completion_ids, **kwargs) -> "
                  "list[float | None]`, called once per batch); "
                  "`solution_str` (verl: `def f(data_source, solution_str, ground_truth, "
                  "extra_info=None) -> float | dict`, called once per row)",
    "no extra_info": "cannot be called with the keywords data_source, solution_str, "
                     "ground_truth, extra_info",
}

GRAPH = """
version: 1
name: sig
dims: {Bp: 2, N: 2, P: 8, T: 4}
plugins: [rewards.py]
models:
  actor: {path: "builtin:tiny-lm"}
data:
  train: {kind: prompts, path: "builtin:arith"}
nodes:
  gen:
    kind: generate
    model: actor
    inputs: {prompts: train.input_ids, prompt_mask: train.attention_mask,
             ground_truth: train.ground_truth}
  reward:
    kind: compute_score
    model: actor
    inputs: {responses: gen.responses, response_mask: gen.response_mask,
             ground_truth: gen.ground_truth}
    params: {fn: "rewards.py:compute_score"}
"""


@pytest.mark.faults
@pytest.mark.parametrize("name", list(WRONG_SIGNATURES))
def test_check_refuses_a_function_verl_could_not_call(
        name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from flowgraph.cli import main

    (tmp_path / "rewards.py").write_text("# a user's reward\n\n" + WRONG_SIGNATURES[name])
    (tmp_path / "g.yaml").write_text(GRAPH)
    assert main(["check", str(tmp_path / "g.yaml"), "--format", "json"]) == 1
    diags = [d for d in json.loads(capsys.readouterr().out) if d["code"] == "FG112"]
    assert len(diags) == 1
    assert (diags[0]["file"], diags[0]["line"]) == (str(tmp_path / "rewards.py"), 3)
    assert ("`rewards.py:compute_score` (parameter `fn` of `reward`, "
            f"{tmp_path / 'g.yaml'}:") in diags[0]["message"]
    assert EXPECTED[name] in diags[0]["message"]


def test_a_number_data_source_routes_by_its_value_or_its_text() -> None:
    """data_source 7 reaches the function as 7; `fns: {7: …}` in YAML may be read with
    the key `"7"`: both route it."""
    tok, responses, mask = _encode(["#### 5", "#### 5", "#### 5"])
    out = compute_score(responses, mask, ground_truth=["5", "5", "5"],
                        data_source=[7, 8, {"a": 1}], ctx=_ctx(), tokenizer=tok,
                        fn=f"{__name__}:raises_on_twelve", fns={"7": "gsm8k", 8: "gsm8k"})
    assert out["scores"].tolist() == [1.0, 1.0, 0.5]  # gsm8k, gsm8k, fn
