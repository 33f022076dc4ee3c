"""Write tests/fixtures/verl/dapo_overlong.pt: verl 0.9.1's DAPO reward manager on
seeded responses, the reference for `overlong_penalty` (tests/nodes/test_shaping.py).

verl's `DAPORewardManager` adds DAPO's soft overlong punishment to each response's
score and writes the sum on the last valid token. Here its tokenizer is a stand-in that
only joins token ids (the score comes from a table, not from the text), so the fixture
holds verl's arithmetic alone: 16 responses of 1…T valid tokens, for several
(max_resp_len, overlong_buffer_len, penalty_factor).

Run (verl is not a dependency of flowgraph; see scripts/verl_fixtures.py):

    pip install -c constraints/cpu.txt --no-deps verl==0.9.1
    pip install -c constraints/cpu.txt tensordict omegaconf codetiming
    python scripts/verl_dapo_fixtures.py
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import verl
from verl import DataProto
from verl.workers.reward_manager.dapo import DAPORewardManager

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "verl" / "dapo_overlong.pt"
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


def main() -> None:
    g = torch.Generator().manual_seed(0)
    cases = [case(g, *s) for s in SETTINGS]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"verl": verl.__version__, "torch": torch.__version__, "cases": cases}, OUT)
    print(f"wrote {OUT} ({len(cases)} cases, verl {verl.__version__})")


if __name__ == "__main__":
    main()
