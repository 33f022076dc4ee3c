"""Write tests/fixtures/verl/reward_inputs.json (and the parquet files it reads,
tests/fixtures/verl/reward_inputs/*.parquet): what verl 0.9.1 hands a `compute_score`
function for a dataset's ground truth, `data_source` and `extra_info` of each type.

Each parquet file is verl's prompt layout (`prompt`, `data_source`,
`reward_model.ground_truth`, `extra_info`) with the ground truth of one type: a string,
an integer, a float, a dict (`{"target": …, "numbers": […]}`, as countdown sets), a
list, a null and a NaN. verl's path is followed as its trainer takes it: `RLHFDataset`
(HF `datasets` reading the parquet), `collate_fn`, `DataProto.repeat(n=2,
interleave=True)` (rollout.n), then `NaiveRewardManager`, whose `compute_score` records
its keyword arguments, type by type (`{"type": "int", "value": 7}`). A second pass
records what the reward manager makes of a function that returns a bool.
tests/nodes/test_reward_inputs.py holds flowgraph's `prompts` -> `generate` ->
`compute_score` to these records.

Run (verl is not a dependency of flowgraph):

    pip install -c constraints/cpu.txt --no-deps verl==0.9.1
    pip install -c constraints/cpu.txt tensordict omegaconf codetiming pandas datasets
    python scripts/verl_reward_input_fixtures.py

Made with verl 0.9.1, datasets 4.x, pyarrow of the dev install.
"""

from __future__ import annotations

import copy
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from omegaconf import OmegaConf
from typed_values import encode  # scripts/, next to this file
from verl import DataProto
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
from verl.workers.reward_manager.naive import NaiveRewardManager

from flowgraph.nodes.models import load_tokenizer

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "verl"
OUT = FIXTURES / "reward_inputs.json"
N = 2
"""Samples per prompt (verl's rollout.n)."""
PROMPTS = [[{"role": "user", "content": "1+1="}], [{"role": "user", "content": "2+3="}]]
EXTRA_INFO = pa.array(
    [{"index": 0, "split": "train", "tags": ["easy"], "meta": {"level": 1}},
     {"index": 1, "split": "train", "tags": [], "meta": {"level": 2}}])
CASES: dict[str, tuple[pa.Array, pa.Array]] = {
    "str": (pa.array(["2", "5"]), pa.array(["openai/gsm8k", "openai/gsm8k"])),
    "int": (pa.array([2, 5], pa.int64()), pa.array([7, 8], pa.int64())),
    "float": (pa.array([2.0, 5.5]), pa.array(["a", "b"])),
    "dict": (pa.array([{"target": 2, "numbers": [1, 1]}, {"target": 5, "numbers": [2, 3]}]),
             pa.array(["countdown", "countdown"])),
    "list": (pa.array([["2", "two"], ["5"]]), pa.array(["a", "a"])),
    "null": (pa.array(["2", None], pa.string()), pa.array(["a", "a"])),
    "nan": (pa.array([2.0, math.nan]), pa.array(["a", "a"])),
}
"""Case -> (ground truth, data_source), two prompts each."""
ADDED_BY_VERL = ("num_turns", "rollout_reward_scores")
"""Keys verl's reward manager writes into `extra_info` (its agent loop's)."""


def write_case(path: Path, truth: pa.Array, source: pa.Array) -> None:
    reward_model = pa.StructArray.from_arrays([truth], ["ground_truth"])
    pq.write_table(pa.table({"prompt": PROMPTS, "data_source": source,
                             "reward_model": reward_model, "extra_info": EXTRA_INFO}), path)


def verl_batch(path: Path, tokenizer: Any, cache: str) -> DataProto:
    """The dataset's rows as verl's trainer has them at its reward manager: N samples a
    prompt, with a one-token prompt and response around them."""
    config = OmegaConf.create({"max_prompt_length": 64, "filter_overlong_prompts": False,
                               "cache_dir": cache})
    dataset = RLHFDataset(str(path), tokenizer, config)
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))]))
    batch = batch.repeat(N, interleave=True)
    rows = len(batch)
    batch = batch.union(DataProto.from_single_dict({
        "prompts": torch.full((rows, 1), 5), "responses": torch.full((rows, 1), 6),
        "attention_mask": torch.ones(rows, 2, dtype=torch.int64)}))
    return batch


def main() -> None:
    tokenizer = load_tokenizer("builtin:tiny-lm")
    cases, calls = {}, []

    def record(data_source: Any, solution_str: str, ground_truth: Any,
               extra_info: Any = None) -> float:
        info = {k: v for k, v in extra_info.items() if k not in ADDED_BY_VERL}
        calls.append({"data_source": encode(data_source), "ground_truth": encode(ground_truth),
                      "extra_info": encode(copy.deepcopy(info)), "id": id(extra_info)})
        return 0.5

    with tempfile.TemporaryDirectory() as tmp:
        for name, (truth, source) in CASES.items():
            path = FIXTURES / "reward_inputs" / f"{name}.parquet"
            write_case(path, truth, source)
            calls.clear()
            NaiveRewardManager(tokenizer, 0, record)(verl_batch(path, tokenizer, tmp))
            shared = [calls[i]["id"] == calls[i + 1]["id"] for i in range(0, len(calls), N)]
            cases[name] = {"calls": [{k: v for k, v in c.items() if k != "id"} for c in calls],
                           "samples_share_extra_info": all(shared)}
        rewards = NaiveRewardManager(tokenizer, 0, lambda **_: True)(
            verl_batch(FIXTURES / "reward_inputs" / "str.parquet", tokenizer, tmp))
    out = {"verl": "0.9.1", "n": N, "added_by_verl": list(ADDED_BY_VERL), "cases": cases,
           "bool_score_reward": rewards[:, -1].tolist()}
    lines = [f" {json.dumps(name)}: {json.dumps(case, separators=(',', ':'))}"
             for name, case in cases.items()]
    head = {k: v for k, v in out.items() if k != "cases"}
    OUT.write_text(json.dumps(head)[:-1] + ', "cases": {\n' + ",\n".join(lines) + "\n}}\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
