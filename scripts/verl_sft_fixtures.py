"""Write tests/fixtures/verl/multiturn_sft.json: verl 0.9.1's multi-turn SFT rows.

verl's `MultiTurnSFTDataset` renders each message of a conversation with the chat
template and trains the assistant messages (their generation prompt excluded). The
`sft` data kind of flowgraph renders the messages before the first answer as the
prompt and the rest, turn by turn, as the response with a `loss_mask`;
tests/nodes/test_data.py holds prompt + response and the mask to verl's `input_ids` and
`loss_mask` of the same conversations, tokenized by the embedded tiny tokenizer.

Run (verl is not a dependency of flowgraph):

    pip install -c constraints/cpu.txt --no-deps verl==0.9.1
    pip install -c constraints/cpu.txt tensordict omegaconf codetiming pandas datasets
    python scripts/verl_sft_fixtures.py

Made with verl 0.9.1, transformers 5.19, pandas and pyarrow of the dev install.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf
from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

from flowgraph.nodes.models import load_tokenizer

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "verl" / "multiturn_sft.json"
CONVERSATIONS = [
    [{"role": "user", "content": "reverse 12"}, {"role": "assistant", "content": "21"},
     {"role": "user", "content": "reverse 345"}, {"role": "assistant", "content": "543"}],
    [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "1+1="},
     {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+3="},
     {"role": "user", "content": "and 4+4="}, {"role": "assistant", "content": "5 8"}],
    [{"role": "user", "content": "reverse 987"}, {"role": "assistant", "content": "789"}],
]


def main() -> None:
    tokenizer = load_tokenizer("builtin:tiny-lm")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chat.parquet"
        pd.DataFrame({"messages": CONVERSATIONS}).to_parquet(path)
        dataset = MultiTurnSFTDataset(str(path), tokenizer, OmegaConf.create(
            {"max_length": 64, "truncation": "error", "pad_mode": "right"}))
        rows = []
        for i, messages in enumerate(CONVERSATIONS):
            item = dataset[i]
            valid = item["attention_mask"].bool()
            rows.append({"messages": messages,
                         "input_ids": item["input_ids"][valid].tolist(),
                         "loss_mask": item["loss_mask"][valid].tolist()})
    OUT.write_text('{"verl": "0.9.1", "rows": [\n'
                   + ",\n".join(json.dumps(r, separators=(",", ":")) for r in rows) + "\n]}\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
