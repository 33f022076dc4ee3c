"""Write train.parquet and test.parquet here: the embedded arithmetic task in verl's
prompt layout (what `examples/data_preprocess/gsm8k.py` writes for GSM8K):

    data_source   "arith"
    prompt        [{"role": "user", "content": "What is 3 + 4? ..."}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "7"}
    extra_info    {"split": "train", "index": 0, "question": "What is 3 + 4? ..."}

Run from anywhere: `python graphs/verl_format/make_data.py` (deterministic; the files
are committed, this shows how they were made).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from flowgraph.data.tasks import arith_problems

HERE = Path(__file__).resolve().parent


def table(split: str) -> pa.Table:
    problems = arith_problems(split)
    return pa.table({
        "data_source": ["arith"] * len(problems),
        "prompt": [[{"role": "user", "content": q}] for q, _ in problems],
        "ability": ["math"] * len(problems),
        "reward_model": [{"style": "rule", "ground_truth": a} for _, a in problems],
        "extra_info": [{"split": split, "index": i, "question": q}
                       for i, (q, _) in enumerate(problems)],
    })


if __name__ == "__main__":
    for split in ("train", "test"):
        pq.write_table(table(split), HERE / f"{split}.parquet")
        print(f"wrote {HERE / f'{split}.parquet'}")
