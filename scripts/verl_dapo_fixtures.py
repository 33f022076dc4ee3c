"""Write verl 0.9.1's answers for DAPO's two pieces, the references of the tests:

- tests/fixtures/verl/dapo_overlong.pt: verl's `DAPORewardManager` on seeded responses,
  for `overlong_penalty` (tests/nodes/test_shaping.py). The manager adds DAPO's soft
  overlong punishment to each response's score and writes the sum on the last valid
  token. Its tokenizer here is a stand-in that only joins token ids (the score comes
  from a table, not from the text), so the fixture holds verl's arithmetic alone: 16
  responses of 1…T valid tokens, for several (max_resp_len, overlong_buffer_len,
  penalty_factor).
- tests/fixtures/verl/dapo_filter.json: which groups verl's DAPO filter drops, for the
  `filter` kind (tests/nodes/test_filter.py). verl's rule lives in
  `verl.trainer.ppo.v1.replay_buffer.ReplayBuffer._dapo_filtered_keys`
  (`algorithm.filter_groups`, metric `reward`: a group's summed token scores); it is run
  on seeded groups, with the transfer queue it reads replaced by a dict (the queue is a
  service; the rule is what is tested).

The tests never import verl. Run (verl is not a dependency of flowgraph; see
scripts/verl_fixtures.py for the venv):

    pip install -c constraints/cpu.txt --no-deps verl==0.9.1
    pip install -c constraints/cpu.txt tensordict omegaconf codetiming
    python scripts/verl_dapo_fixtures.py
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import verl
from verl import DataProto
from verl.workers.reward_manager.dapo import DAPORewardManager

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "verl"

B, P, T = 16, 4, 20
SETTINGS = [(20, 4, 1.0), (20, 8, 0.5), (16, 16, 1.0), (12, 2, 2.0)]
"""(max_resp_len, overlong_buffer_len, penalty_factor); max_resp_len ≤ T."""


class Joiner:
    """Decodes ids as their numbers: verl's manager needs a tokenizer, the scores don't."""

    eos_token = "</s>"

    def decode(self, ids: torch.Tensor, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


def case(g: torch.Generator, max_len: int, buffer: int, factor: float) -> dict[str, Any]:
    lengths = torch.randint(1, max_len + 1, (B,), generator=g)
    lengths[:3] = torch.tensor([1, max(max_len - buffer, 1), max_len])  # the kinks of the ramp
    response_mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    scores = torch.rand(B, generator=g, dtype=torch.float64).float().round(decimals=3)
    table = scores.tolist()
    data = DataProto.from_dict(
        tensors={
            "prompts": torch.ones(B, P, dtype=torch.long),
            "responses": torch.randint(3, 100, (B, T), generator=g) * response_mask,
            "attention_mask": torch.cat([torch.ones(B, P, dtype=torch.long), response_mask], 1),
        },
        non_tensors={
            "data_source": np.array(["table"] * B, dtype=object),
            "reward_model": np.array([{"ground_truth": ""}] * B, dtype=object),
            "extra_info": np.array([{"index": i} for i in range(B)], dtype=object),
        },
    )
    cfg = SimpleNamespace(enable=True, len=buffer, penalty_factor=factor, log=True)
    manager = DAPORewardManager(
        tokenizer=Joiner(), num_examine=0,
        compute_score=lambda data_source, solution_str, ground_truth, extra_info: table[
            extra_info["index"]],
        max_resp_len=max_len, overlong_buffer_cfg=cfg)
    out = manager(data, return_dict=True)
    reward = out["reward_tensor"].gather(1, (lengths - 1)[:, None]).squeeze(1)
    return {
        "scores": scores, "response_mask": response_mask,
        "params": {"max_response_length": max_len, "overlong_buffer_len": buffer,
                   "penalty_factor": factor},
        "shaped": reward,
        "penalty": torch.tensor(out["reward_extra_info"]["overlong_reward"],
                                dtype=torch.float32),
    }


def _fake_queue(store: dict[str, torch.Tensor]) -> types.ModuleType:
    tq = types.ModuleType("transfer_queue")

    def kv_batch_get(keys: list[str], partition_id: str, select_fields: list[str]) -> Any:
        return {"rm_scores": [store[k] for k in keys]}

    tq.kv_batch_get = kv_batch_get  # type: ignore[attr-defined]
    tq.KVBatchMeta = object  # type: ignore[attr-defined]
    return tq


def _replay_buffer_module() -> Any:
    """verl's replay_buffer.py loaded by path: the `verl.trainer.ppo.v1` package would
    import the whole trainer (hydra, ray, the agent loop) first."""
    path = Path(verl.__file__).parent / "trainer" / "ppo" / "v1" / "replay_buffer.py"
    spec = importlib.util.spec_from_file_location("verl_replay_buffer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dropped_groups(groups: list[list[float]]) -> list[int]:
    """verl's answer: the positions of the groups its DAPO filter evicts."""
    store: dict[str, torch.Tensor] = {}
    for g, scores in enumerate(groups):
        for j, s in enumerate(scores):
            store[f"{g}_{j}"] = torch.tensor([s, 0.0])  # token scores: the outcome, then 0
    sys.modules["transfer_queue"] = _fake_queue(store)
    rb = _replay_buffer_module()
    buffer = types.SimpleNamespace(
        filter_groups_metric=rb.FILTER_GROUPS_REWARD_METRIC,
        finished_keys={"train": {str(g) for g in range(len(groups))}},
        _dapo_classification_cache=defaultdict(dict),
        partitions={"train": list(store)})
    uids, _ = rb.ReplayBuffer._dapo_filtered_keys(buffer, "train")  # type: ignore[arg-type]
    return sorted(int(u) for u in uids)


def overlong() -> None:
    g = torch.Generator().manual_seed(0)
    cases = [case(g, *s) for s in SETTINGS]
    out = FIXTURES / "dapo_overlong.pt"
    torch.save({"verl": verl.__version__, "torch": torch.__version__, "cases": cases}, out)
    print(f"wrote {out} ({len(cases)} cases, verl {verl.__version__})")


def filter_groups() -> None:
    rng = np.random.default_rng(0)
    groups: list[list[float]] = [
        [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1],  # all equal
        [0.0, 1.0, 0.0, 0.0], [0.1, 0.0, 0.1, 0.1], [0.5], [2.0],  # spread; singletons
        [0.0, 0.0], [0.0, 1.0], [-1.0, -1.0, -1.0], [0.1, 0.1, 0.1], [0.7] * 7,
    ]
    choices = [0.0, 0.1, 1.0]
    groups += [[float(rng.choice(choices)) for _ in range(int(rng.integers(1, 6)))]
               for _ in range(40)]
    out = FIXTURES / "dapo_filter.json"
    out.write_text(json.dumps({"verl": verl.__version__, "groups": groups,
                               "dropped": dropped_groups(groups)}, indent=1) + "\n")
    print(f"wrote {out}")


def main() -> None:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    overlong()
    filter_groups()


if __name__ == "__main__":
    main()
