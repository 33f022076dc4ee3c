"""TRL's reward convention against TRL 1.16 itself: the same reward functions
(`tests/fixtures/trl/rewards.py`) on the same prompts, completions and dataset columns give
the same per-function rewards, weighted sum, GRPO advantages and `rewards/<fn>/mean|std`
as `GRPOTrainer._generate_and_score_completions` (`tests/fixtures/trl/grpo_rewards.json`,
made by `scripts/trl_reward_fixtures.py`).

Tolerance: the rewards are equal to the bit (float32, summed as TRL does); advantages and
metrics within 1e-6, as flowgraph's group statistics run in float64 where TRL's run in
float32."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from flowgraph.errors import RewardFnError
from flowgraph.nodes.advantage import grpo
from flowgraph.nodes.reward import compute_score
from flowgraph.runtime import NodeContext
from flowgraph.runtime.reward_call import TrainerState

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "trl"
FIXTURE = json.loads((FIXTURES / "grpo_rewards.json").read_text())
_spec = importlib.util.spec_from_file_location("trl_fixture_rewards", FIXTURES / "rewards.py")
assert _spec is not None and _spec.loader is not None
REWARDS = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(REWARDS)


def _batch(case: dict[str, Any]) -> tuple[Any, torch.Tensor, torch.Tensor, list[dict[str, Any]]]:
    """The fixture's completions as a rollout gives them: right-padded ids, the mask
    (EOS included, as TRL's completion mask), and each sample's dataset row."""
    tok = PreTrainedTokenizerFast.from_pretrained(FIXTURES / "tokenizer")
    ids = case["completion_ids"]
    width = max(map(len, ids))
    responses = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in ids])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in ids])
    columns = case["columns"]
    row = [{"prompt": p, **{k: v[i] for k, v in columns.items()}}
           for i, p in enumerate(case["prompts"])]
    return tok, responses, mask, row


def _spy(fn: Any, seen: list[dict[str, Any]]) -> Any:
    """fn, keeping the keywords it is called with; named as fn (the metrics' name)."""
    def spy(prompts: Any, completions: Any, completion_ids: Any, **kwargs: Any) -> Any:
        seen.append({"prompts": prompts, "completions": completions,
                     "completion_ids": completion_ids, **kwargs})
        return fn(prompts=prompts, completions=completions, completion_ids=completion_ids,
                  **kwargs)
    spy.__name__ = fn.__name__
    return spy


@pytest.mark.parametrize("name", ["standard", "conversational"])
def test_rewards_and_grpo_advantages_equal_trls(name: str) -> None:
    case = FIXTURE["cases"][name]
    tok, responses, mask, row = _batch(case)
    seen: list[dict[str, Any]] = []
    ctx = NodeContext("reward", "compute_score", step=0, seed=0)
    with pytest.warns(UserWarning, match=r"every reward function \(correct, brevity\) "
                      r"returned None for 1 of 12 rows \(the first: row 7"):
        out = compute_score(responses, mask, row=row, ctx=ctx, tokenizer=tok,
                            fn=[_spy(REWARDS.correct, seen), _spy(REWARDS.brevity, seen)],
                            weights=FIXTURE["reward_weights"])
    # called as TRL calls them: the same prompts, completions (message lists for the
    # conversational case), ids and columns, plus trainer_state, log_extra, log_metric
    for call in seen:
        assert call["prompts"] == case["prompts"]
        assert call["completions"] == case["completions"]
        assert call["completion_ids"] == case["completion_ids"]
        assert {k: call[k] for k in case["columns"]} == case["columns"]
        assert call["trainer_state"] == TrainerState(global_step=0)
        assert set(call) == {"prompts", "completions", "completion_ids", *case["columns"],
                             "trainer_state", "log_extra", "log_metric"}
    assert out["scores"].tolist() == case["rewards"]  # to the bit
    per_func = zip(*case["rewards_per_func"].values(), strict=True)
    assert out["score_mask"].tolist() == [int(any(v is not None for v in values))
                                          for values in per_func]
    for fn in case["rewards_per_func"]:
        for stat in ("mean", "std"):
            key = f"rewards/{fn}/{stat}"
            assert ctx.metrics[key] == pytest.approx(case["metrics"][key], abs=1e-6)
    # TRL's default scale_rewards="group" is grpo's norm_by_std; its 1e-4 is epsilon
    index = torch.arange(len(row)) // FIXTURE["num_generations"]
    advantages, _ = grpo(out["scores"], mask, index, score_mask=out["score_mask"],
                         epsilon=FIXTURE["epsilon"], norm_by_std=True)
    assert advantages[:, 0].tolist() == pytest.approx(case["advantages"], abs=1e-6)


def test_each_function_alone_gives_trls_rewards_per_function() -> None:
    """One function: its values where it applies, 0 and score_mask 0 where it returned
    None (TRL's NaN in rewards_per_func)."""
    case = FIXTURE["cases"]["standard"]
    tok, responses, mask, row = _batch(case)
    for fn in (REWARDS.correct, REWARDS.brevity):
        ctx = NodeContext("reward", "compute_score", step=0, seed=0)
        with pytest.warns(UserWarning, match="returned None"):
            out = compute_score(responses, mask, row=row, ctx=ctx, tokenizer=tok, fn=fn)
        expected = case["rewards_per_func"][fn.__name__]
        assert out["scores"].tolist() == [0.0 if v is None else v for v in expected]
        assert out["score_mask"].tolist() == [int(v is not None) for v in expected]


def _rollout(texts: list[str]) -> tuple[Any, torch.Tensor, torch.Tensor, list[dict[str, Any]]]:
    tok = PreTrainedTokenizerFast.from_pretrained(FIXTURES / "tokenizer")
    ids = [[*tok(t, add_special_tokens=False).input_ids, tok.eos_token_id] for t in texts]
    width = max(map(len, ids))
    responses = torch.tensor([[*s, *[tok.pad_token_id] * (width - len(s))] for s in ids])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in ids])
    row = [{"prompt": "name a number", "solution": "seven", "level": "hard"}] * len(texts)
    return tok, responses, mask, row


def short(completions: list[str], **kwargs: Any) -> list[float]:
    return [1.0]


def text(completions: list[str], **kwargs: Any) -> list[Any]:
    return ["good" for _ in completions]


def nan(completions: list[str], **kwargs: Any) -> list[float]:
    return [float("nan") for _ in completions]


def raises(completions: list[str], **kwargs: Any) -> list[float]:
    raise KeyError("solution")


@pytest.mark.faults
@pytest.mark.parametrize(("fn", "error", "message"), [
    (short, ValueError, "reward fn `short` at step 5 returned 1 values for 2 completions; it "
                        "returns exactly one float (or None) per completion"),
    (text, ValueError, "reward fn `text` at step 5 returned str 'good' for row 0; each value "
                       "is a float, or None where the function does not apply"),
    (nan, RewardFnError, "reward fn `nan` at step 5 returned nan for row 0; a score must be a "
                         "finite number (None: the function does not apply to the row)"),
    (raises, RewardFnError, "reward fn `raises` raised at step 5 on a batch of 2 completions "
                            "(rows 0..1): KeyError: 'solution'"),
])
def test_a_trl_function_that_fails_is_named_with_the_step(
        fn: Any, error: type[Exception], message: str) -> None:
    tok, responses, mask, row = _rollout(["seven", "four"])
    with pytest.raises(error) as exc:
        compute_score(responses, mask, row=row, tokenizer=tok, fn=fn,
                      ctx=NodeContext("reward", "compute_score", step=5, seed=0))
    assert str(exc.value) == message


def test_a_trl_function_without_the_row_says_what_to_wire() -> None:
    tok, responses, mask, _ = _rollout(["seven"])
    with pytest.raises(ValueError, match=r"reward fn `short` is called as TRL calls a reward "
                                         r"function .* wire `row: gen.row`"):
        compute_score(responses, mask, tokenizer=tok, fn=short,
                      ctx=NodeContext("reward", "compute_score", step=0, seed=0))


def test_log_metric_log_extra_and_keywords_a_function_names() -> None:
    """TRL's log_metric (averaged over the step's calls) and log_extra (a column of the
    validation table); a function without **kwargs gets the keywords it names."""
    def logs(completions: list[str], solution: list[str], log_metric: Any,
             log_extra: Any) -> list[float]:
        log_metric("hits", float(sum(s in c for c, s in zip(completions, solution, strict=True))))
        log_extra("judged", [c.upper() for c in completions])
        return [0.5 for _ in completions]

    tok, responses, mask, row = _rollout(["seven", "four"])
    ctx = NodeContext("reward", "compute_score", step=0, seed=0)
    out = compute_score(responses, mask, row=row, tokenizer=tok, fn=logs, ctx=ctx)
    assert ctx.metrics["hits"] == 1.0
    assert out["reward_extra_info"] == [{"judged": "SEVEN"}, {"judged": "FOUR"}]
    assert (ctx.metrics["rewards/logs/mean"], ctx.metrics["rewards/logs/std"]) == (0.5, 0.0)


def test_a_list_of_functions_needs_one_weight_each() -> None:
    tok, responses, mask, row = _rollout(["seven"])
    with pytest.raises(ValueError, match="1 weights for 2 functions in fn; give one weight "
                                         "per function"):
        compute_score(responses, mask, row=row, tokenizer=tok, fn=[short, short],
                      weights=[1.0], ctx=NodeContext("reward", "compute_score", step=0, seed=0))


# --- the checker: which call a function gets, before launch ---------------------------

EXAMPLE = Path(__file__).resolve().parents[2] / "graphs" / "trl_format" / "grpo.yaml"


def _line(text: str, start: str) -> int:
    """The 1-based line of `text` whose stripped text starts as `start` does."""
    return next(i for i, line in enumerate(text.splitlines(), 1)
                if line.strip().startswith(start.strip()))


def _checked(graph_text: str, folder: Path) -> list[Any]:
    from flowgraph.checker import check_graph
    from flowgraph.frontend import load_graph

    (folder / "rewards.py").write_text((EXAMPLE.parent / "rewards.py").read_text())
    (folder / "train.jsonl").write_text((EXAMPLE.parent / "train.jsonl").read_text())
    (folder / "g.yaml").write_text(graph_text)
    graph, diags = load_graph(folder / "g.yaml")
    assert graph is not None and not diags
    return list(check_graph(graph).diagnostics)


def test_the_trl_example_checks_and_a_missing_row_is_found(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    assert _checked(text, tmp_path) == []
    wired = "inputs: {responses: gen.responses, response_mask: gen.response_mask, row: gen.row}"
    assert wired in text
    (diag,) = _checked(text.replace(wired, wired.replace(", row: gen.row", "")), tmp_path)
    assert (diag.code, diag.node, diag.pos.line) == ("FG104", "reward", _line(text, "  reward:"))
    assert diag.message == (
        "`reward` calls `rewards.py:correct` and `rewards.py:brevity` as TRL calls reward "
        "functions (their signatures name completions, prompts or completion_ids), with the "
        "prompts and the dataset's columns of the input `row`, which it does not wire")
    assert diag.hint == "wire `inputs: {row: gen.row}` (generate passes on the data's " \
                        "`row`: `inputs: {row: train.row}`)"


def neither(text: str, answer: str) -> float:  # takes no keyword TRL or verl passes
    return 0.0


def test_a_python_callable_is_checked_at_its_own_line(tmp_path: Path) -> None:
    """A function given as the object itself (the builder delivers it) is held to the
    call its signature picks, the diagnostic on its `def` line."""
    from dataclasses import replace

    from flowgraph.checker import check_graph
    from flowgraph.frontend import load_graph
    from flowgraph.ir import Params

    _checked(EXAMPLE.read_text(), tmp_path)
    graph, _ = load_graph(tmp_path / "g.yaml")
    assert graph is not None
    for fn, expected in ((REWARDS.correct, []), ((REWARDS.correct, REWARDS.brevity), []),
                         (neither, ["FG112"])):
        nodes = tuple(replace(n, params=Params.of({"fn": fn}, n.pos))
                      if n.name == "reward" else n for n in graph.nodes)
        diags = list(check_graph(replace(graph, nodes=nodes)).diagnostics)
        assert [d.code for d in diags] == expected
    (diag,) = diags
    assert (diag.pos.file, diag.pos.line) == (__file__, neither.__code__.co_firstlineno)
    assert "`neither(text, answer)` takes neither of the parameters " \
           "that say how to call it" in diag.message


@pytest.mark.parametrize(("weights", "message"), [
    ("[1.0]", "parameter `weights` of `reward` has 1 entries for 2 in `fn`"),
    ("[1.0, high]", "parameter `weights` of `reward` holds 'high', not a number"),
])
def test_weights_are_one_number_per_function(weights: str, message: str,
                                             tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    assert "weights: [1.0, 0.5]" in text
    (diag,) = _checked(text.replace("weights: [1.0, 0.5]", f"weights: {weights}"), tmp_path)
    assert (diag.code, diag.pos.line, diag.message) == ("FG112", _line(text, "weights:"),
                                                        message)


def test_fns_routes_rows_to_a_trl_function_by_data_source() -> None:
    """A TRL function under `fns` is called once on the rows of its data source."""
    calls: list[list[str]] = []

    def mine(completions: list[str], **kwargs: Any) -> list[float]:
        calls.append(completions)
        return [2.0 for _ in completions]

    tok, responses, mask, row = _rollout(["seven", "four", "seven"])
    out = compute_score(responses, mask, row=row, data_source=["a", "b", "a"], tokenizer=tok,
                        fn=REWARDS.correct, fns={"a": mine},
                        ctx=NodeContext("reward", "compute_score", step=0, seed=0))
    assert calls == [["seven", "seven"]]
    assert out["scores"].tolist() == [2.0, 0.0, 2.0]  # row 1: correct, "four" != "seven"
