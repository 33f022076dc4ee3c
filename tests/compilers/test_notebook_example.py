"""graphs/trl_format/notebook.py, the README's GRPO with a TRL reward function on a pandas
DataFrame from Python, run as its user runs it: a script from another folder, twice (a
notebook's cells run again), its check printed before training, its model exported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "graphs" / "trl_format" / "notebook.py"


def test_the_notebook_example_checks_trains_again_and_exports(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    assert "g.trainer(steps=100," in text
    script = tmp_path / "notebook.py"
    script.write_text(text.replace("g.trainer(steps=100,", "g.trainer(steps=2,"))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for _ in range(2):  # the second time: the same run dir, started afresh (overwrite=True)
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "graph `grpo_notebook`: ok, 0 error(s)" in out
    assert "gen.row -> reward.row" in out and "(Bp*N,) = (128,)" in out
    assert "rewards/correct/mean:" in out
    rows = [json.loads(line) for line in
            (tmp_path / "runs" / "grpo_notebook" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]  # the second run's rows only
    assert all("rewards/correct/std" in r for r in rows)
    card = (tmp_path / "runs" / "grpo_notebook-hf" / "README.md").read_text()
    assert "grpo_notebook" in card and "rewards/correct/mean" in card
    assert (tmp_path / "runs" / "grpo_notebook-hf" / "config.json").is_file()
