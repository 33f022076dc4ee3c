"""What a reward function receives: a dataset's ground truth, `data_source` and
`extra_info` with their parquet types, as verl 0.9.1 passes them
(tests/fixtures/verl/reward_inputs.json, scripts/verl_reward_input_fixtures.py)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from flowgraph.errors import FlowgraphError
from flowgraph.nodes.data import PromptDataset
from flowgraph.nodes.generate import generate
from flowgraph.nodes.models import load_model, load_tokenizer
from flowgraph.nodes.reward import compute_score
from flowgraph.runtime.context import NodeContext

_spec = importlib.util.spec_from_file_location(  # the recording script's encoding
    "typed_values", Path(__file__).resolve().parents[2] / "scripts" / "typed_values.py")
assert _spec is not None and _spec.loader is not None
_typed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_typed)
encode = _typed.encode

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "verl"
VERL = json.loads((FIXTURES / "reward_inputs.json").read_text())
CALLS: list[dict[str, Any]] = []


def record(data_source: Any, solution_str: str, ground_truth: Any,
           extra_info: Any = None) -> float:
    """A user's function that notes what it was given, then writes into extra_info (as
    verl's own reward manager does) to show the write stays in this sample."""
    CALLS.append({"data_source": encode(data_source), "ground_truth": encode(ground_truth),
                  "extra_info": encode(copy.deepcopy(extra_info))})
    extra_info["seen"] = True
    extra_info["tags"].append("scored")
    return 0.5


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("builtin:tiny-lm")


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return load_model("builtin:tiny-lm")


def _scored(case: str, tokenizer: Any, model: nn.Module) -> list[dict[str, Any]]:
    """The case's two prompts through `prompts` -> `generate` (n = 2) -> `compute_score`."""
    n = VERL["n"]
    data = PromptDataset(str(FIXTURES / "reward_inputs" / f"{case}.parquet"), tokenizer,
                         shuffle=False).next_batch(2)
    ctx = NodeContext("gen", "generate", step=0, seed=0, dims={"N": n, "T": 2})
    gen = generate(ctx, model, tokenizer, prompts=data["input_ids"],
                   prompt_mask=data["attention_mask"], ground_truth=data["ground_truth"],
                   data_source=data["data_source"], extra_info=data["extra_info"])
    CALLS.clear()
    compute_score(gen["responses"], gen["response_mask"], ground_truth=gen["ground_truth"],
                  data_source=gen["data_source"], extra_info=gen["extra_info"],
                  ctx=NodeContext("reward", "compute_score", step=0, seed=0),
                  tokenizer=tokenizer, fn=f"{__name__}:record")
    return list(CALLS)


@pytest.mark.parametrize("case", ["str", "int", "float", "dict", "list"])
def test_reward_inputs_keep_their_types_as_verl_passes_them(
        case: str, tokenizer: Any, model: nn.Module) -> None:
    # verl's reward manager adds its agent loop's `num_turns` and `rollout_reward_scores`
    # to extra_info; the fixture leaves them out, flowgraph has no such loop.
    assert _scored(case, tokenizer, model) == VERL["cases"][case]["calls"]


def test_each_sample_gets_its_own_extra_info(tokenizer: Any, model: nn.Module) -> None:
    """`record` writes into each sample's extra_info; verl's samples of a prompt share one
    dict (`samples_share_extra_info`), so there the second sample would see the first's
    writes. Here each sees the row as the dataset holds it."""
    assert VERL["cases"]["dict"]["samples_share_extra_info"]
    calls = _scored("dict", tokenizer, model)
    assert [c["extra_info"] for c in calls] == [
        c["extra_info"] for c in VERL["cases"]["dict"]["calls"]]


@pytest.mark.faults
@pytest.mark.parametrize(("case", "what"), [("null", "null"), ("nan", "NaN")])
def test_a_missing_ground_truth_stops_the_load(case: str, what: str, tokenizer: Any) -> None:
    """verl scores the missing label (None, nan: the fixture's row 1); flowgraph refuses
    it when a node reads the ground truth, naming the file, row and column."""
    assert VERL["cases"][case]["calls"][2]["ground_truth"]["value"] in (None, "nan")
    path = FIXTURES / "reward_inputs" / f"{case}.parquet"
    with pytest.raises(FlowgraphError) as exc:
        PromptDataset(str(path), tokenizer, ground_truth_for=["reward"])
    assert str(exc.value).startswith(
        f"dataset `{path}` row 1 (0-based), column `reward_model.ground_truth`: the ground "
        f"truth is missing ({what}); node `reward` reads it")
    # Without a reader the row loads, its value as it is.
    assert PromptDataset(str(path), tokenizer, shuffle=False).next_batch(2)["ground_truth"][0] \
        in ("2", 2.0)


def test_a_bool_score_counts_as_one_or_zero(tokenizer: Any) -> None:
    """verl writes a function's True into the reward tensor as 1.0."""
    assert VERL["bool_score_reward"] == [1.0] * 4
    ids = torch.tensor(tokenizer(["7", "8"], add_special_tokens=False).input_ids)
    out = compute_score(ids, torch.ones_like(ids), ground_truth=["7", "7"],
                        ctx=NodeContext("reward", "compute_score", step=0, seed=0),
                        tokenizer=tokenizer, fn=f"{__name__}:is_seven")
    assert out["scores"].tolist() == [1.0, 0.0]


def is_seven(data_source: Any, solution_str: str, ground_truth: Any,
             extra_info: Any = None) -> bool:
    return solution_str == ground_truth
