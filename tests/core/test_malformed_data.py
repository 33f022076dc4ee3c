"""Malformed dataset rows: one message naming the file, the row and the column, in both
`flowgraph check --data` and `flowgraph run` (issue #25: no tracebacks)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowgraph.cli import main

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"prompt": [{"role": "user", "content": "1+1="}], "ground_truth": "2"}
"""A well-formed row; each case below adds one bad row at row 16 (Bp = 16 fit before)."""

CASES: dict[str, tuple[Any, str, str]] = {
    "no rows": (pa.table({"prompt": pa.array([], pa.string()),
                          "ground_truth": pa.array([], pa.string())}), "FG510",
                "has no rows"),
    "null prompt": ([{"prompt": "1+1=", "ground_truth": "2"}] * 16
                    + [{"prompt": None, "ground_truth": "2"}], "FG510",
                    "row 16 (0-based), column `prompt`: null"),
    "integer prompt": ([{"prompt": 5, "ground_truth": "2"}] * 17, "FG510",
                       "row 0 (0-based), column `prompt`: holds int64 values"),
    "empty message list": ([GOOD] * 16 + [{"prompt": [], "ground_truth": "2"}], "FG510",
                           "row 16 (0-based), column `prompt`: an empty message list"),
    "message without content": ([GOOD] * 16 + [{"prompt": [{"role": "user"}],
                                                "ground_truth": "2"}], "FG510",
                                "row 16 (0-based), column `prompt`: a message without "
                                "`content`"),
    "extra_info as a string": ([{**GOOD, "extra_info": json.dumps({"index": 0})}] * 17,
                               "FG510", "row 0 (0-based), column `extra_info`: holds "
                               "string values ('{\"index\": 0}')"),
    "null ground truth": ([GOOD] * 16 + [{**GOOD, "ground_truth": None}], "FG502",
                          "row 16 (0-based), column `ground_truth`: the ground truth is "
                          "missing (null); node `reward` reads it"),
    "NaN ground truth": ([{**GOOD, "ground_truth": 2.0}] * 16
                         + [{**GOOD, "ground_truth": math.nan}], "FG502",
                         "row 16 (0-based), column `ground_truth`: the ground truth is "
                         "missing (NaN)"),
}


def _case(tmp_path: Path, name: str) -> tuple[Path, Path, str, str]:
    """(graph, dataset, code, expected message) of a case: grpo.yaml on the file."""
    rows, code, needle = CASES[name]
    data = tmp_path / "bad.parquet"
    pq.write_table(rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows), data)
    text = (ROOT / "graphs" / "grpo.yaml").read_text()
    text = text.replace('path: "builtin:reverse"', f"path: {data}")
    text = text.replace("run_dir: runs/grpo", f"run_dir: {tmp_path / 'run'}")
    graph = tmp_path / "g.yaml"
    graph.write_text(text)
    return graph, data, code, f"dataset `{data}` {needle}"


@pytest.mark.faults
@pytest.mark.parametrize("name", list(CASES))
def test_check_data_names_file_row_and_column(
        name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph, _, code, message = _case(tmp_path, name)
    status = main(["check", str(graph), "--data", "--format", "json"])
    diags = json.loads(capsys.readouterr().out)
    errors = [d for d in diags if d["severity"] == "error"]
    assert status == 1
    assert [d["code"] for d in errors] == [code]
    assert message in errors[0]["message"]


@pytest.mark.faults
@pytest.mark.parametrize("name", list(CASES))
def test_run_stops_at_load_with_the_same_message(
        name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph, _, _, message = _case(tmp_path, name)
    status = main(["run", str(graph), "trainer.steps=1"])
    err = capsys.readouterr().err
    assert status != 0, err  # the code itself is issue #25 point 9's (runtime: 1)
    assert message in err
    assert "Traceback" not in err
