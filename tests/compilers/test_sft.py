"""graphs/sft.yaml: supervised fine-tuning with the `sft_update` kind on the `sft` rows
of the embedded reversal task. It learns, evaluates its held-out loss, resumes exactly,
gives the same numbers on local, fsdp(2) and ray(2), and is the recipe that trains the
embedded `builtin:tiny-lm-sft`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flowgraph.testing.targets import assert_same_numbers

ROOT = Path(__file__).resolve().parents[2]
SFT = ROOT / "graphs" / "sft.yaml"
SHORT = ("trainer.steps=4", "trainer.checkpoint_every=2", "trainer.eval_every=4")


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory, local_run: Any) -> list[dict[str, Any]]:
    return local_run(SFT, tmp_path_factory.mktemp("sft") / "local", *SHORT)


def test_the_shipped_run_learns_and_is_the_embedded_sft_model(tmp_path: Path,
                                                              local_run: Any) -> None:
    """60 steps, ~3 s: the train loss falls from ~6.3 (a random model over 512 tokens)
    to ~1.0 (measured), the held-out loss at every evaluation falls (2.46, 1.42, 0.86);
    its export is, weight for weight, `builtin:tiny-lm-sft` (trained by the same graph
    on first use)."""
    import torch

    from flowgraph.builtin_models import SFT_RECIPE
    from flowgraph.compilers.builtin_training import ensure_builtin
    from flowgraph.compilers.export import export_model
    from flowgraph.nodes.models import load_model

    assert SFT.read_text() == SFT_RECIPE
    rows = local_run(SFT, tmp_path / "run")
    loss = [r["sft/loss"] for r in rows]
    assert loss[0] > 5.0 and sum(loss[-10:]) / 10 < 1.3, (loss[0], loss[-10:])
    val = [r["val/sft/loss"] for r in rows if "val/sft/loss" in r]
    assert len(val) == 3 and val == sorted(val, reverse=True) and val[-1] < 1.2, val
    ours = load_model(str(export_model(tmp_path / "run", "policy", tmp_path / "export")))
    embedded = load_model(str(ensure_builtin("tiny-lm-sft")))
    for (name, a), (_, b) in zip(ours.state_dict().items(), embedded.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name

    # SFT then RL as two graphs: GRPO pointed at the export runs as from the embedded model
    grpo = ROOT / "graphs" / "grpo.yaml"
    small = ("dims.Bp=4", "dims.N=4", "nodes.update_actor.params.mini_batch_size=8",
             "trainer.val_before_train=false", "trainer.steps=2")
    export = tmp_path / "export"
    two_graphs = local_run(grpo, tmp_path / "grpo-export", *small,
                           f"models.actor.path={export}", f"models.ref.path={export}")
    assert_same_numbers(two_graphs, local_run(grpo, tmp_path / "grpo-builtin", *small),
                        rel=0, abs_floor=0)


def test_a_resumed_run_gives_the_uninterrupted_numbers(
        local: list[dict[str, Any]], tmp_path: Path, local_run: Any) -> None:
    local_run(SFT, tmp_path / "run", "trainer.steps=2", "trainer.checkpoint_every=2")
    rows = local_run(SFT, tmp_path / "run", *SHORT, resume=True)
    assert_same_numbers(rows, local, rel=0, abs_floor=0)


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_fsdp_gives_the_numbers_of_the_local_run(
        local: list[dict[str, Any]], tmp_path: Path, local_run: Any) -> None:
    assert_same_numbers(local_run(SFT, tmp_path / "fsdp", *SHORT, target="fsdp"), local)


@pytest.mark.multiprocess
def test_ray_gives_the_numbers_of_the_local_run(
        local: list[dict[str, Any]], tmp_path: Path, local_run: Any) -> None:
    assert_same_numbers(local_run(SFT, tmp_path / "ray", *SHORT, target="ray"), local)


def test_a_trained_built_in_s_recipe_is_compiled_once_and_its_plan_kept() -> None:
    """`builtin:tiny-lm-sft` trains from its recipe's plan, compiled on first need and held
    for the process; each training sets only its own run dir."""
    from flowgraph.builtin_models import SFT_RECIPE
    from flowgraph.compilers.builtin_training import recipe_plan
    from flowgraph.frontend import graph_from_yaml

    plan = recipe_plan("tiny-lm-sft")
    assert recipe_plan("tiny-lm-sft") is plan
    assert plan.trainer == graph_from_yaml(SFT_RECIPE).trainer and plan.target == "local"



TRAIN_WHEN_TOLD = """
import sys, time
from pathlib import Path
from flowgraph.compilers import export
from flowgraph.compilers.targets import local

def run_plan(plan, opts):  # the recipe's run, 1 s long: what matters is who runs it
    time.sleep(1.0)
    Path(plan.trainer.run_dir).mkdir(parents=True)
    (Path(plan.trainer.run_dir) / "metrics.jsonl").write_text("")

def export_model(run_dir, name, dest):
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    return dest

local.run_plan, export.export_model = run_plan, export_model
from flowgraph.compilers.builtin_training import ensure_builtin
ready, go = Path(sys.argv[1]), Path(sys.argv[2])
ready.touch()
while not go.exists():
    time.sleep(0.05)
print("folder", ensure_builtin("tiny-lm-sft"), flush=True)
"""
"""A process that needs `builtin:tiny-lm-sft` once `argv[2]` exists (`argv[1]`: it is
imported and waits); its recipe's training is a stand-in of 1 s (the real one is ~60 s
of CPU)."""


@pytest.mark.multiprocess
def test_processes_that_need_a_trained_built_in_at_once_train_it_once(tmp_path: Path
                                                                      ) -> None:
    """Three processes (three runs started together) in an empty cache: one trains
    `builtin:tiny-lm-sft`, the others say they wait, then all load the same folder."""
    import os
    import subprocess
    import sys
    import time

    env = {**os.environ, "FLOWGRAPH_CACHE": str(tmp_path / "cache")}
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", TRAIN_WHEN_TOLD,
                               str(tmp_path / f"ready-{i}"), str(go)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(3)]
    try:
        while not all((tmp_path / f"ready-{i}").exists() for i in range(3)):
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.1)
        go.touch()
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    text = "".join(outs)
    assert text.count("builtin:tiny-lm-sft: training it once") == 1, text
    assert text.count("builtin:tiny-lm-sft: another process is training it") == 2, text
    assert len({line for line in text.splitlines() if line.startswith("folder ")}) == 1, text
