"""Write tests/fixtures/verl/dapo_filter.json: which groups verl 0.9.1's DAPO filter drops.

verl's rule lives in `verl.trainer.ppo.v1.replay_buffer.ReplayBuffer._dapo_filtered_keys`
(`algorithm.filter_groups`, metric `reward`: a group's summed token scores); it is run
here on seeded groups, with the transfer queue it reads replaced by a dict (the queue
is a service; the rule is what is tested). tests/nodes/test_filter.py holds
`flowgraph.nodes.filter.keep_mask` to these answers; the tests never import verl.

Run with the verl venv (see scripts/verl_fixtures.py for how it is made):

    python scripts/verl_dapo_fixtures.py
"""

from __future__ import annotations

import json
import sys
import types
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "verl" / "dapo_filter.json"


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
    import importlib.util

    import verl

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


def main() -> None:
    rng = np.random.default_rng(0)
    groups: list[list[float]] = [
        [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1],  # all equal
        [0.0, 1.0, 0.0, 0.0], [0.1, 0.0, 0.1, 0.1], [0.5], [2.0],  # spread; singletons
        [0.0, 0.0], [0.0, 1.0], [-1.0, -1.0, -1.0], [0.1, 0.1, 0.1], [0.7] * 7,
    ]
    choices = [0.0, 0.1, 1.0]
    groups += [[float(rng.choice(choices)) for _ in range(int(rng.integers(1, 6)))]
               for _ in range(40)]
    import verl

    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"verl": verl.__version__, "groups": groups,
                               "dropped": dropped_groups(groups)}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
