"""Python objects where users hold them (#26 point 1): a reward function, a class and a
`@node_kind` defined in a script's `__main__` run on local as they are and on fsdp and ray
shipped by value, give the same numbers everywhere, and a plan file holding them refuses to
run outside the session that defines them. A notebook (nbclient) does the same, with a
plugin file next to it found from the working directory.

The scripts run as real `__main__` modules (a subprocess), as a user's do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = '''
import json
import sys

import torch
from jaxtyping import Float, Int
from torch import Tensor

import flowgraph
from flowgraph import GraphBuilder, node_kind
from flowgraph.plan import plan_summary, plan_to_json


def even_share(rows):
    """A user's reward: the share of even token ids in each response."""
    return [sum(t % 2 == 0 for t in row) / len(row) for row in rows]


class Halve:
    factor = 0.5


@node_kind("main_reward", outputs=["scores"], category="reward")
def main_reward(responses: Int[Tensor, "b T"], fn=None, shaping=None) -> Float[Tensor, " b"]:
    """Calls the function it is given (the object itself, not a name) on the responses."""
    return torch.tensor(fn(responses.tolist()), dtype=torch.float32) \\
        * shaping["scale"][0]().factor


def graph(staleness=0):
    g = GraphBuilder("pyobjects")
    g.trainer(max_staleness=staleness)  # 1: the rollout producer in a process of its own
    g.dims(Bp=2, N=2, P=16, T=8)
    g.model("actor", "builtin:tiny-lm", trainable=True, optimizer={"lr": 1e-3})
    data = g.data("train", "prompts", "builtin:arith")
    gen = g.node("gen", "generate", model="actor", prompts=data.input_ids,
                 prompt_mask=data.attention_mask)
    seq = dict(prompts=gen.prompts, prompt_mask=gen.prompt_mask, responses=gen.responses,
               response_mask=gen.response_mask)
    old = g.node("old", "logprob", model="actor", **seq)
    reward = g.node("reward", "main_reward", responses=gen.responses,
                    params={"fn": even_share, "shaping": {"scale": [Halve]}})
    adv = g.node("adv", "grpo", scores=reward.scores, index=gen.index,
                 response_mask=gen.response_mask)
    g.node("update", "ppo_actor_update", model="actor", old_log_prob=old.log_prob,
           advantages=adv.advantages, **seq)
    return g.build()


def main(target, out):
    checked = flowgraph.check_graph(graph())
    staleness, target = (1, "local") if target == "async" else (0, target)
    plan = flowgraph.compile(graph(staleness), target=target,
                             nproc=2 if target != "local" else None)
    result = flowgraph.run(plan, overrides=["trainer.steps=2", f"trainer.run_dir={out}/run"])
    report = {"errors": [d.one_line() for d in checked.errors], "summary": plan_summary(plan),
              "scores": [r["critic/score/mean"] for r in result.rows]}
    if target == "local" and not staleness:  # a plan file, run again in the defining session
        with open(f"{out}/plan.json", "w") as f:
            f.write(plan_to_json(plan))
        again = flowgraph.run(f"{out}/plan.json", overrides=[
            "trainer.steps=1", f"trainer.run_dir={out}/again"])
        report["again"] = [r["critic/score/mean"] for r in again.rows]
    with open(f"{out}/report.json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":  # the fsdp ranks import this file: Python's rule for processes
    main(sys.argv[1], sys.argv[2])
'''

LINE = SCRIPT.splitlines().index("def even_share(rows):") + 1
"""The line of the reward function's definition in the script."""


def _python(cwd: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=dict(os.environ), input=stdin,
                          capture_output=True, text=True, timeout=600)


def _script_run(tmp: Path, target: str) -> dict[str, Any]:
    (tmp / "train.py").write_text(SCRIPT)
    proc = _python(tmp, "train.py", target, str(tmp))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: dict[str, Any] = json.loads((tmp / "report.json").read_text())
    return report


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("local")
    return tmp, _script_run(tmp, "local")


def test_main_objects_run_on_local_and_the_plan_says_so(
        local: tuple[Path, dict[str, Any]]) -> None:
    tmp, report = local
    assert report["errors"] == []  # check_graph knows the `__main__` kind (no FG102)
    summary = report["summary"]
    assert "python objects:" in summary
    assert f"__main__:even_share  function, defined at {tmp / 'train.py'}:{LINE}: node " \
           "`reward` param `fn`; shipped by value" in summary
    assert "__main__:Halve  class" in summary and "node `reward` param `shaping`" in summary
    assert "__main__:main_reward  function" in summary and \
           "node `reward` (kind `main_reward`)" in summary
    # scores are the share of even ids, halved: within [0, 0.5], and not all zero
    assert all(0 <= s <= 0.5 for s in report["scores"]) and any(report["scores"])
    assert report["again"] == report["scores"][:1]  # the plan file, in the same session


def test_a_plan_file_of_main_objects_refuses_elsewhere(
        local: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    tmp, _ = local
    plan = json.loads((tmp / "plan.json").read_text())
    assert [o["ref"] for o in plan["objects"]] == ["__main__:even_share", "__main__:Halve",
                                                    "__main__:main_reward"]
    assert all(o["shipped"] == "by value" for o in plan["objects"])
    reward = next(n for n in plan["nodes"] if n["name"] == "reward")
    assert {"name": "fn", "value": '{"$python": "__main__:even_share"}'} in reward["params"]
    for file in (tmp / "plan.json", tmp / "run" / "plan.json"):
        proc = _python(tmp_path, "-m", "flowgraph", "run", str(file),
                       f"trainer.run_dir={tmp_path / 'x'}")
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "cannot rebuild the Python function `__main__:even_share` (node `reward` " \
               f"param `fn`, defined at {tmp / 'train.py'}:{LINE}): defined in the Python " \
               "session that compiled the plan" in proc.stderr
        assert "Run the plan from the Python session that defines it" in proc.stderr
        assert "module the graph lists under `plugins:`" in proc.stderr
        assert "Traceback" not in proc.stderr
        assert not (tmp_path / "x").exists()


@pytest.mark.multiprocess
@pytest.mark.parametrize("target", ["fsdp", "ray", pytest.param("async", marks=pytest.mark.slow)])
def test_main_objects_are_shipped_by_value_with_the_numbers_of_local(
        target: str, local: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """fsdp ranks, Ray actors, and the rollout producer's own process (`async`: the
    reward reads only the rollout, so it runs there) get the objects by value."""
    report = _script_run(tmp_path, target)
    assert report["errors"] == []
    if target == "async":  # step 1 trains on a rollout one version old: step 0 is equal
        assert report["scores"][0] == pytest.approx(local[1]["scores"][0], abs=1e-6)
        assert "python objects:" in report["summary"]
        assert "async      producer train, gen, reward, adv runs" in report["summary"]
        return
    assert report["scores"] == pytest.approx(local[1]["scores"], abs=1e-6)
    if target == "fsdp":  # the ranks' channel holds the objects; the run's plan.json not
        assert (tmp_path / "run" / ".ranks" / "plan.json.objects").is_file()
        assert "$python" in (tmp_path / "run" / "plan.json").read_text()


PLUGIN = '''
import torch
from jaxtyping import Float, Int
from torch import Tensor
from flowgraph import node_kind


@node_kind("nb_length", outputs=["scores"], category="reward")
def nb_length(response_mask: Int[Tensor, "b T"]) -> Float[Tensor, " b"]:
    return response_mask.sum(-1).float() / 100
'''
CELLS = ['''
import torch
from jaxtyping import Float, Int
from torch import Tensor
import flowgraph
from flowgraph import GraphBuilder, node_kind

def even_share(rows):
    return [sum(t % 2 == 0 for t in row) / len(row) for row in rows]

@node_kind("cell_reward", outputs=["scores"], category="reward")
def cell_reward(responses: Int[Tensor, "b T"], fn=None) -> Float[Tensor, " b"]:
    return torch.tensor(fn(responses.tolist()), dtype=torch.float32)
''', '''
g = GraphBuilder("notebook")
g.plugin("nb_rewards.py")   # next to the notebook: the working directory
g.dims(Bp=2, N=2, P=16, T=8)
g.model("actor", "builtin:tiny-lm", trainable=True)
data = g.data("train", "prompts", "builtin:arith")
gen = g.node("gen", "generate", model="actor", prompts=data.input_ids,
             prompt_mask=data.attention_mask)
seq = dict(prompts=gen.prompts, prompt_mask=gen.prompt_mask, responses=gen.responses,
           response_mask=gen.response_mask)
old = g.node("old", "logprob", model="actor", **seq)
mine = g.node("mine", "cell_reward", responses=gen.responses, params={"fn": even_share})
length = g.node("length", "nb_length", response_mask=gen.response_mask)
total = g.node("total", "weighted_sum", a=mine.scores, b=length.scores)
adv = g.node("adv", "grpo", scores=total.scores, index=gen.index,
             response_mask=gen.response_mask)
g.node("update", "ppo_actor_update", model="actor", old_log_prob=old.log_prob,
       advantages=adv.advantages, **seq)
g.trainer(steps=1, run_dir="run")
result = flowgraph.run(g.build())
print("SCORE", result.rows[-1]["critic/score/mean"])
''']


@pytest.mark.slow
def test_a_notebook_defines_a_reward_and_a_kind_and_finds_its_plugin(tmp_path: Path) -> None:
    import nbclient  # the dev extra installs them, with ipykernel: never skipped
    import nbformat

    (tmp_path / "nb_rewards.py").write_text(PLUGIN)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    score = float(printed.split("SCORE ")[1].split()[0])
    assert score > 0
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_stdin_finds_a_plugin_file_in_the_working_directory_and_names_it_when_missing(
        tmp_path: Path) -> None:
    """`python -` (and `-c`, a notebook cell): relative plugin files are relative to the
    working directory, and FG113 names the folder it looked in."""
    (tmp_path / "nb_rewards.py").write_text(PLUGIN)
    code = CELLS[0] + CELLS[1]
    proc = _python(tmp_path, "-", stdin=code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SCORE" in proc.stdout
    (tmp_path / "nb_rewards.py").unlink()
    proc = _python(tmp_path, "-", stdin=code)
    assert proc.returncode == 1
    assert f"plugin file `nb_rewards.py` not found; looked in {tmp_path}: a plugin file is " \
           "relative to the folder of the graph file that lists it, or to the working " \
           "directory for a graph built in a notebook, stdin or `python -c`" in proc.stderr


UNGUARDED = {
    "flowgraph.run": "import flowgraph\nflowgraph.run('{graph}', overrides={overrides})\n",
    "flowgraph.cli.main": "import sys\nimport flowgraph.cli\n"
                          "sys.exit(flowgraph.cli.main(['run', '{graph}', *{overrides}]))\n",
}


@pytest.mark.parametrize("call", sorted(UNGUARDED))
def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path: Path, call: str) -> None:
    """The rollout producer (a process of its own) imports the script again as it starts:
    the call made there is refused with the fix, and the trainer says the producer never
    started and where its error is, not "killed, or out of memory?"."""
    graph = Path(__file__).parents[2] / "graphs" / "grpo.yaml"
    overrides = ["trainer.max_staleness=1", "trainer.steps=1", f"trainer.run_dir={tmp_path}/r"]
    (tmp_path / "train.py").write_text(UNGUARDED[call].format(graph=graph, overrides=overrides))
    proc = _python(tmp_path, "train.py")
    assert proc.returncode != 0
    assert f"{call} was called again as a worker process of the run imported your script: " \
           "start the run under `if __name__ == \"__main__\":`" in proc.stderr
    assert "the rollout producer process exited (code 1) before it started, its error " \
           "printed above" in proc.stderr
    assert "out of memory" not in proc.stderr
