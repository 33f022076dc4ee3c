"""`flowgraph compile`: exit codes, the plan file, pass listing and dumps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from flowgraph.cli import main
from flowgraph.plan import PLAN_VERSION, plan_from_json

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"
PPO = str(GRAPHS / "ppo.yaml")


def test_compile_prints_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", PPO, "--target", "ray", "--nproc", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"plan for `ppo` ({PPO}): target ray, nproc 2, device cpu\n")
    assert "  critic             2 worker(s) on cpu, each {CPU: 1}, placed PACK\n" in out
    assert "  step.6     update_actor, update_critic\n" in out
    assert "memory per device (estimate):\n  actor_rollout_ref: " in out


def test_output_file_holds_the_plan_as_json(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["compile", str(GRAPHS / "grpo.yaml"), "--target", "fsdp", "--nproc", "2",
                 "-o", str(out)]) == 0
    assert capsys.readouterr().out.endswith(f"plan written to {out}\n")
    data = json.loads(out.read_text())
    assert (data["target"], data["nproc"], data["version"]) == ("fsdp", 2, PLAN_VERSION)
    plan = plan_from_json(out.read_text())
    # one optimizer step per rollout: no old log-prob forward; the update reads the groups
    assert plan.edge("gen.responses", "ref_logprob.responses").group_aligned


@pytest.mark.parametrize(("args", "code", "stderr"), [
    # errors in the graph: batch arithmetic for 2 ranks, memory over the declared size
    ([str(GRAPHS / "dpo.yaml"), "--nproc", "3"], 1, "error[FG301]"),
    ([PPO, "resources.memory_gib=0.0001"], 1, "error[FG401]: plan needs"),
    ([PPO, "nodes.gen.model=critc"], 1, "error[FG109]"),
    # input that cannot be read
    (["no/such/graph.yaml"], 2, "error[FG001]: cannot read `no/such/graph.yaml`"),
    ([str(GRAPHS)], 2, "is a directory, not a graph file"),
    # wrong calls
    ([PPO, "--disable-pass", "nope"], 2, "flowgraph: error: unknown pass `nope`; the passes are: "
                                         "validate, infer_dims, asynchronous, on_policy, "
                                         "token_budget, packing, dce, hoist, fusion, "
                                         "placement, schedule, memory"),
    ([PPO, "--dump-after", "hoist", "--disable-pass", "hoist"], 2, "that pass is disabled"),
    ([], 2, "compile needs a graph FILE (or --print-passes)"),
])
def test_exit_codes(args: list[str], code: int, stderr: str,
                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", *args]) == code
    captured = capsys.readouterr()
    assert stderr in captured.err
    assert captured.out == ""


def test_print_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", "--print-passes", "--disable-pass", "dce"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line[:15] for line in lines] == [
        " 1. validate   ", " 2. infer_dims ", " 3. asynchronou", " 4. on_policy  ",
        " 5. token_budge", " 6. packing    ", " 7. dce        ", " 8. hoist      ",
        " 9. fusion     ", "10. placement  ", "11. schedule   ", "12. memory     "]
    assert lines[6].endswith("[disabled]") and not lines[7].endswith("[disabled]")


def test_dump_after_dce_prints_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", PPO, "--dump-after", "dce"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("# --- after pass `dce` ---\nversion: 1\nname: ppo\n")
    dumped = yaml.safe_load(err)
    assert list(dumped["nodes"]) == ["gen", "old_logprob", "ref_logprob", "values", "reward",
                                     "token_reward", "kl", "adv", "update_actor", "update_critic"]


def test_disable_pass_hoist_changes_the_plan(tmp_path: Path) -> None:
    hoisted, plain = tmp_path / "a.json", tmp_path / "b.json"
    dpo = str(GRAPHS / "dpo.yaml")
    assert main(["compile", dpo, "-o", str(hoisted)]) == 0
    assert main(["compile", dpo, "--disable-pass", "hoist", "-o", str(plain)]) == 0
    stages = [[s["name"] for s in json.loads(f.read_text())["stages"]] for f in (hoisted, plain)]
    assert stages == [["prologue", "step.0", "step.1"], ["step.0", "step.1", "step.2"]]
