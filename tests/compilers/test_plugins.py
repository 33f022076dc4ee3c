"""Plugins next to the graph: a `.py` file listed under `plugins:` is found in the graph
file's folder from any working directory, with no PYTHONPATH, by `check`, by `run` on
every target (fsdp ranks, Ray workers: the job's runtime environment ships it) and by
`run plan.json` from yet another folder, with the same numbers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowgraph.compilers import read_metrics
from flowgraph.testing.targets import assert_same_numbers

ROOT = Path(__file__).resolve().parents[2]
REWARD = '''
import torch
from jaxtyping import Float, Int
from torch import Tensor

from flowgraph import node_kind


@node_kind("brevity_next_to_graph", outputs=["scores"], category="reward")
def brevity(response_mask: Int[Tensor, "b T"], ground_truth: list[str], scale: float = 0.1
            ) -> Float[Tensor, " b"]:
    """Responses as long as the answer (a plain list port: one string per sequence)."""
    answer = torch.tensor([float(len(g)) for g in ground_truth])
    return -scale * (response_mask.sum(-1).float() - answer).abs()
'''
GRPO_REWARD = """  reward:
    kind: reward
    model: actor
    inputs:
      responses: gen.responses
      response_mask: gen.response_mask
      ground_truth: gen.ground_truth
    params: {fn: exact_match, format_score: 0.1}  # partial credit for any number
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A graph folder with its reward file, as a user keeps them: `g.yaml`, `brevity.py`."""
    folder = tmp_path_factory.mktemp("project")
    (folder / "brevity.py").write_text(REWARD)
    text = (ROOT / "graphs" / "grpo.yaml").read_text()
    assert GRPO_REWARD in text
    text = text.replace(GRPO_REWARD, "  reward:\n    kind: brevity_next_to_graph\n"
                                     "    inputs: {response_mask: gen.response_mask, "
                                     "ground_truth: gen.ground_truth}\n")
    (folder / "g.yaml").write_text("plugins: [brevity.py]\n" + text)
    return folder


def _flowgraph(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "flowgraph", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def _run(project: Path, cwd: Path, run_dir: Path, *args: str) -> list[dict[str, float]]:
    proc = _flowgraph(cwd, "run", str(project / "g.yaml"), f"trainer.run_dir={run_dir}",
                      "trainer.steps=2", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def local(project: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, float]]:
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    return _run(project, elsewhere, elsewhere / "local")


def test_check_and_a_plan_file_find_the_plugin_from_other_folders(
        project: Path, local: list[dict[str, float]], tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    check = _flowgraph(tmp_path / "a", "check", str(project / "g.yaml"))
    assert check.returncode == 0, check.stdout + check.stderr
    plan = tmp_path / "a" / "plan.json"
    compiled = _flowgraph(tmp_path / "a", "compile", str(project / "g.yaml"), "trainer.steps=2",
                          f"trainer.run_dir={tmp_path / 'run'}", "-o", str(plan))
    assert compiled.returncode == 0, compiled.stderr
    ran = _flowgraph(tmp_path / "b", "run", str(plan))
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert_same_numbers(read_metrics(tmp_path / "run"), local)
    assert local[0]["critic/score/mean"] < 0  # the plugin's reward: -0.1 per token off


@pytest.mark.parametrize("target", ["fsdp", "ray"])
def test_ranks_and_workers_import_the_plugin_without_pythonpath(
        project: Path, local: list[dict[str, float]], tmp_path: Path, target: str) -> None:
    rows = _run(project, tmp_path, tmp_path / target, "--target", target, "--nproc", "2")
    assert_same_numbers(rows, local)


def test_a_missing_plugin_file_names_the_graph_line(tmp_path: Path) -> None:
    (tmp_path / "g.yaml").write_text("plugins: [nowhere.py]\n"
                                     + (ROOT / "graphs" / "grpo.yaml").read_text())
    proc = _flowgraph(ROOT, "check", str(tmp_path / "g.yaml"))
    assert proc.returncode == 1
    assert f"{tmp_path / 'g.yaml'}:1:11: error[FG113]: plugin file `nowhere.py` not found; " \
           f"looked in {tmp_path.resolve()}" in proc.stdout + proc.stderr


VERL_FORMAT = ROOT / "graphs" / "verl_format" / "grpo.yaml"


@pytest.fixture(scope="module")
def verl_local(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, float]]:
    run_dir = tmp_path_factory.mktemp("verl_format") / "local"
    proc = _flowgraph(ROOT, "run", str(VERL_FORMAT), f"trainer.run_dir={run_dir}",
                      "trainer.steps=2", "--strict")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(run_dir)


def test_a_verl_compute_score_file_reads_columns_through_generate(
        verl_local: list[dict[str, float]]) -> None:
    """graphs/verl_format: data_source, extra_info (with the `ability` column) flow from
    the parquet through generate into rewards.py's compute_score, whose dict result adds
    critic/acc/mean and critic/answered/mean (strict mode checks the object ports)."""
    row = verl_local[0]
    assert {"critic/acc/mean", "critic/answered/mean", "critic/score/mean"} <= set(row)
    assert row["critic/score/mean"] == pytest.approx(
        row["critic/acc/mean"] + 0.1 * (row["critic/answered/mean"] - row["critic/acc/mean"]))


@pytest.mark.parametrize("target", ["fsdp", "ray"])
def test_the_verl_format_example_gives_equal_numbers_on_every_target(
        verl_local: list[dict[str, float]], tmp_path: Path, target: str) -> None:
    proc = _flowgraph(ROOT, "run", str(VERL_FORMAT), f"trainer.run_dir={tmp_path / 'run'}",
                      "trainer.steps=2", "--target", target, "--nproc", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_numbers(read_metrics(tmp_path / "run"), verl_local)
