"""The fsdp target against the local executor: equal numbers, a rank that dies, resume with
another world size, export of sharded checkpoints, vLLM rollouts from a sharded actor.

Every fsdp run starts 2 ranks through torch's launcher, ~15 s before their first step on
2 CPU cores, so each run serves several checks: PPO's run is also resumed by the local
target and exported; DPO's is killed and resumed, and its rows must still be the local
run's. The local references run in this process.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from flowgraph.api import load_plan
from flowgraph.compilers import RunOptions, read_metrics, run
from flowgraph.compilers.checkpoint.store import has_dcp, latest_checkpoint
from flowgraph.compilers.export import export_model
from flowgraph.compilers.targets import process_groups
from flowgraph.errors import RankFailed
from flowgraph.nodes.models import load_model
from flowgraph.passes import compile_graph
from flowgraph.plan import ExecutionPlan, plan_to_json
from flowgraph.testing.targets import assert_same_numbers

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = ROOT / "graphs"
PLUGINS = ROOT / "tests" / "plugins"
SHORT = ("trainer.steps=5", "trainer.checkpoint_every=2")



@pytest.fixture(autouse=True)
def _plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    # The ranks are spawned: they start with this process's sys.path.
    monkeypatch.syspath_prepend(str(PLUGINS))


def _compile(graph: Path, run_dir: Path, overrides: tuple[str, ...], target: str
             ) -> ExecutionPlan:
    """Compiled, written to a plan file and read back: what `flowgraph run plan.json` runs."""
    result = compile_graph(graph, target=target, nproc=2 if target == "fsdp" else None,
                           overrides=[f"trainer.run_dir={run_dir}", *overrides])
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]
    file = run_dir.parent / f"{run_dir.name}.plan.json"
    file.write_text(plan_to_json(result.plan))
    return load_plan(file)


def _fsdp(graph: Path, run_dir: Path, *overrides: str, resume: bool = False
          ) -> list[dict[str, Any]]:
    run(_compile(graph, run_dir, overrides, "fsdp"),
        RunOptions(resume=resume, overrides=(f"trainer.run_dir={run_dir}", *overrides)))
    return read_metrics(run_dir)


# DCP warns that it loads "in a single process" (the local resume, torch's converter).
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_ppo_equals_local_resumes_locally_and_exports(
        tmp_path: Path, local_reference: Any, local_run: Any,
        equal_overrides: dict[str, tuple[str, ...]]) -> None:
    """(a) equal numbers, with held-out evaluation at the last step; (c) the fsdp(2) run's
    step-3 checkpoint resumed by the local target gives the fsdp run's step 4; (d) the
    export of the sharded actor is exactly the checkpoint's weights."""
    graph, overrides = GRAPHS / "ppo.yaml", equal_overrides["ppo"]
    local = local_reference("ppo")
    fsdp = _fsdp(graph, tmp_path / "fsdp", *overrides)
    assert_same_numbers(fsdp, local)
    assert "val/score/mean" in fsdp[4]

    # (c) checkpoints after steps 1, 3 and 4 (every 2, and the last); the newest two stay.
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "fsdp", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_4")
    found = latest_checkpoint(resumed)
    assert found is not None and found[0] == 3 and has_dcp(found[1])
    assert_same_numbers(local_run(graph, resumed, *overrides, resume=True), fsdp)

    # (d) the actor's DCP shards, read back by torch's own converter, are what was exported
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    out = export_model(tmp_path / "fsdp", "actor", tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    dcp_to_torch_save(tmp_path / "fsdp" / "checkpoints" / "step_4" / "dcp" / "actor",
                      tmp_path / "actor.pt")
    saved = torch.load(tmp_path / "actor.pt")["model"]
    assert sorted(exported) == sorted(saved)
    for name, value in exported.items():
        assert torch.equal(value, saved[name]), name
    # trained (not the initial weights), and as the local run trained them
    initial = load_model("builtin:tiny-lm").state_dict()
    weights = local_reference.run_dir("ppo") / "checkpoints" / "step_4" / "model.actor.safetensors"
    trained = load_file(weights)
    for name, value in exported.items():
        # 5 Adam steps at lr 2e-3 move every weight by ~1e-2; the two runs differ by the
        # order of float32 sums only: 2e-5 at most, except a weight whose gradient is near
        # zero, where Adam's normalised update (m / (sqrt(v) + eps)) magnifies that order
        # (measured: 1 of 65536 embedding weights apart by 2e-4, a tenth of one step).
        assert float((value - initial[name]).abs().max()) > 1e-3, name
        torch.testing.assert_close(value, trained[name], rtol=0, atol=5e-4)
        apart = int(((value - trained[name]).abs() > 2e-5).sum())
        assert apart <= max(1, value.numel() // 10_000), (name, apart)


def _resumed_from(run_dir: Path, copy: Path, step: int) -> Path:
    """A copy of `run_dir` whose newest checkpoint is `step` (the later ones removed)."""
    shutil.copytree(run_dir, copy)
    for later in (copy / "checkpoints").glob("step_*"):
        if int(later.name.split("_")[1]) > step:
            shutil.rmtree(later)
    return copy


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("graph", ["ppo", pytest.param("grpo", marks=pytest.mark.slow),
                                   pytest.param("dpo", marks=pytest.mark.slow)])
def test_a_tied_model_equals_local_resumes_both_ways_and_exports(
        graph: str, tmp_path: Path, local_reference: Any, local_run: Any,
        equal_overrides: dict[str, tuple[str, ...]], tied_models: Any) -> None:
    """`builtin:tiny-tied` (the LM head is the input embedding, one parameter): equal
    numbers; the fsdp(2) run's step-3 checkpoint resumed by the local target, and the
    local run's resumed by fsdp(2), give the same step 4; the export holds the tied
    tensor once, loads back tied, and is the checkpoint's weights."""
    path, overrides = GRAPHS / f"{graph}.yaml", (*equal_overrides[graph], *tied_models(graph))
    local = local_reference(graph, tied=True)
    fsdp = _fsdp(path, tmp_path / "fsdp", *overrides)
    assert_same_numbers(fsdp, local)

    resumed = _resumed_from(tmp_path / "fsdp", tmp_path / "to-local", 3)
    assert_same_numbers(local_run(path, resumed, *overrides, resume=True), local)
    resumed = _resumed_from(local_reference.run_dir(graph, tied=True), tmp_path / "to-fsdp", 3)
    assert not has_dcp(resumed / "checkpoints" / "step_3")
    assert_same_numbers(_fsdp(path, resumed, *overrides, resume=True), local)

    from safetensors import safe_open
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    name = "policy" if graph == "dpo" else "actor"
    out = export_model(tmp_path / "fsdp", name, tmp_path / "hf")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys()), "the tied tensor is written once"
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    dcp_to_torch_save(tmp_path / "fsdp" / "checkpoints" / "step_4" / "dcp" / name,
                      tmp_path / "saved.pt")
    saved = torch.load(tmp_path / "saved.pt")["model"]
    for key, value in exported.state_dict().items():
        assert torch.equal(value, saved[key]), key


def test_parameters_shared_between_shard_units_are_left_replicated() -> None:
    """A tied head (outside every unit) and a weight two blocks share are found; a
    parameter used twice inside one unit, and an untied head, are not."""
    base = nn.Module()
    base.embed = nn.Embedding(8, 4)
    base.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
    base.layers[2].weight = base.layers[1].weight
    base.layers[0].twice = base.layers[0].bias
    model = nn.Module()
    model.base_model, model.lm_head, model.value_head = base, nn.Linear(4, 8), nn.Linear(4, 1)
    model.lm_head.weight = base.embed.weight
    shared = process_groups.shared_params(model, [*base.layers, base])
    assert {id(p) for p in shared} == {id(base.embed.weight), id(base.layers[1].weight)}


LAUNCHERS = {"flowgraph": ([], ["--nproc", "2"]),
             "torchrun": (["-m", "torch.distributed.run", "--nproc-per-node", "2"], [])}
"""(before, after `--target fsdp`): `flowgraph run` launches its ranks; torchrun started by
the user (the README's other way) starts them itself."""


@pytest.mark.parametrize("launch", sorted(LAUNCHERS))
def test_grpo_through_the_cli_equals_local(tmp_path: Path, local_reference: Any,
                                           equal_overrides: dict[str, tuple[str, ...]],
                                           launch: str) -> None:
    """(a) and (e): `python -m flowgraph run … --target fsdp --nproc 2`, end to end, and
    `python -m torch.distributed.run --nproc-per-node 2 -m flowgraph run … --target fsdp`."""
    graph = GRAPHS / "grpo.yaml"
    local = local_reference("grpo")
    run_dir = tmp_path / "fsdp"
    before, after = LAUNCHERS[launch]
    proc = subprocess.run(
        [sys.executable, *before, "-m", "flowgraph", "run", str(graph), "--target", "fsdp",
         *after, f"trainer.run_dir={run_dir}", *equal_overrides["grpo"]],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("run finished") == 1  # rank 0 says it
    assert f"run finished: {run_dir}/metrics.jsonl" in proc.stdout
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split("/")[0] for line in steps] == [f"step {s}" for s in range(5)], \
        "rank 0 prints"
    assert_same_numbers(read_metrics(run_dir), local)
    # every rank's stdout and stderr also in its log: rank 0's step lines, as shown
    logs = run_dir / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["rank-0.log", "rank-1.log"]
    assert [line for line in (logs / "rank-0.log").read_text().splitlines()
            if line.startswith("step ")] == steps
    assert (logs / "rank-1.log").read_text().startswith("flowgraph: rank 1 of 2 started")
    assert "step " not in (logs / "rank-1.log").read_text()  # rank 1 prints no step line


def _kill_rank(run_dir: Path, rank: int, at_step: int, done: threading.Event,
               killed: list[tuple[int, str]]) -> None:
    """SIGKILL `rank` once its status file (`.ranks/rank_R`: step, node, pid) shows
    `at_step` or later; record (step, node)."""
    status = process_groups.status_file(run_dir, rank)
    while not done.wait(0.01):
        try:  # a status file being rewritten reads empty
            m = re.match(r"step (\d+) node (\S+) pid (\d+)", status.read_text())
        except OSError:
            continue
        if m and int(m[1]) >= at_step:
            os.kill(int(m[3]), signal.SIGKILL)
            killed.append((int(m[1]), m[2]))
            return


def test_dpo_rank_killed_then_resumed_equals_local(tmp_path: Path,
                                                   capfd: pytest.CaptureFixture[str],
                                                   local_reference: Any) -> None:
    """(b) rank 1 is SIGKILLed mid-run: the launcher names rank, node, step and the last
    checkpoint, without the ranks' tracebacks; `--resume` finishes the run, every step is
    in metrics.jsonl once and the rows are the uninterrupted local run's (a)."""
    graph, run_dir = GRAPHS / "dpo.yaml", tmp_path / "fsdp"
    local = local_reference("dpo")
    capfd.readouterr()
    done, killed = threading.Event(), list[tuple[int, str]]()
    killer = threading.Thread(target=_kill_rank, args=(run_dir, 1, 3, done, killed))
    killer.start()
    try:
        with pytest.raises(RankFailed) as exc:
            _fsdp(graph, run_dir, *SHORT)
    finally:
        done.set()
        killer.join()
    (step, node), = killed
    found = latest_checkpoint(run_dir)
    assert found is not None and found[0] <= step
    message = str(exc.value)
    assert f"rank 1 was killed by SIGKILL at step {step} in node `{node}`" in message
    assert f"the last checkpoint is step {found[0]}; continue with: flowgraph run " \
           f"{graph} --target fsdp --nproc 2 --resume {' '.join(SHORT)} " \
           f"trainer.run_dir={run_dir}" in message  # the run's overrides repeated
    assert f"(the output of the failed rank: {run_dir / 'logs' / 'rank-1.log'})" in message
    assert "Traceback" not in capfd.readouterr().err

    fsdp = _fsdp(graph, run_dir, *SHORT, resume=True)
    assert [r["step"] for r in fsdp] == [0, 1, 2, 3, 4]
    assert_same_numbers(fsdp, local)


def test_a_failing_rank_names_node_and_step_without_tracebacks(
        tmp_path: Path, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN from a plugin node stops the ranks: one message naming node and step, the
    traceback kept in run_dir/.ranks, none of the launcher's per-rank logs, nothing
    left in the temp folder (torch's `pytorch-errorfile-*.pickle` of a failed rank).
    Each rank's stdout and stderr are in `run_dir/logs/rank-<R>.log` and, as before, on
    the console's stdout and stderr; its traceback in its log alone."""
    graph = tmp_path / "faults.yaml"
    graph.write_text((PLUGINS / "faults.yaml").read_text())
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # the launcher's, this process
    with pytest.raises(RankFailed) as exc:
        _fsdp(graph, tmp_path / "run", "trainer.steps=3", "nodes.score.params.nan_at=1",
              "nodes.score.params.say=said")
    message = str(exc.value)
    assert re.search(r"rank [01] failed: non-finite output `scores` in node `score` at "
                     r"step 1\n", message), message
    assert f"no checkpoint was written; start again from step 0 with: flowgraph run {graph} " \
           f"--target fsdp --nproc 2 --resume trainer.steps=3 nodes.score.params.nan_at=1 " \
           f"nodes.score.params.say=said trainer.run_dir={tmp_path / 'run'}" in message
    trace = re.search(r"the full traceback: (\S+)\)", message)
    assert trace and "NonFiniteError" in Path(trace[1]).read_text()
    logs = tmp_path / "run" / "logs"
    assert "the output of the failed rank" in message and str(logs / "rank-") in message
    out, err = capfd.readouterr()
    for rank in (0, 1):
        said = [f"said on stdout, rank {rank}, step {s}" for s in (0, 1)]
        written = [f"said on fd 2, rank {rank}, step {s}" for s in (0, 1)]
        log = (logs / f"rank-{rank}.log").read_text()
        assert log.startswith(f"flowgraph: rank {rank} of 2 started (host "), log
        assert all(f"\n{line}\n" in log for line in said + written), log
        assert re.search(r"Traceback(.|\n)*NonFiniteError: non-finite output `scores`", log)
        assert bool(re.search(r"^step 0/3 ", log, re.M)) == (rank == 0), log
        assert all(line in out.splitlines() for line in said), out
        assert all(line in err.splitlines() for line in written), err
    assert re.search(r"^step 0/3 ", out, re.M), out
    assert "said on fd 2" not in out and "said on stdout" not in err
    assert "Traceback" not in err and "Terminating process" not in err, err
    assert list(temp.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("model", ["untied", "tied", "lora"])
def test_grpo_vllm_rollouts_from_a_sharded_actor_equal_local(
        model: str, tmp_path: Path, local_run: Any, tied_models: Any) -> None:
    """Each rank's engine starts without weights and gets the actor's, one parameter made
    whole at a time, after every update; the rollouts are the local vLLM run's (a tied
    embedding goes once, and the engine ties its head to it; a LoRA actor's layers go
    merged, each sync checked against the trainer's log-probs).
    Slow: a vLLM engine takes 20-40 s to start, one per rank, ~3 min in all."""
    graph = GRAPHS / ("grpo_lora.yaml" if model == "lora" else "grpo.yaml")
    overrides = ("trainer.steps=3", "nodes.gen.params.backend=vllm",
                 *(tied_models("grpo") if model == "tied" else ()),
                 *(("trainer.verify_sync_every=1",) if model == "lora" else ()))
    try:
        local = local_run(graph, tmp_path / "local", *overrides)
    finally:
        from flowgraph.compilers.vllm import engine as _vllm

        _vllm.close_engines()
    assert_same_numbers(_fsdp(graph, tmp_path / "fsdp", *overrides), local)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_agent_rollouts_equal_local(tmp_path: Path, tied: bool, local_reference: Any,
                                    equal_overrides: dict[str, tuple[str, ...]],
                                    tied_models: Any, graph_path: Any) -> None:
    """The agent graph (tests/plugins/agent_turns.yaml: episodes of 1-3 turns calling a
    tool): each rank runs half of the episodes, and every turn's forward on both ranks:
    rank 1's episodes take one turn, so it samples placeholder rows while rank 0's go
    on, and its masked episodes (a tool that raised) may leave it micro-batches without
    a trained token, whose backward it still runs (else rank 0 waits in FSDP's
    all-gather forever). The numbers of the local run, `agent/*` included. Slow: ~1 min
    a model on 2 CPU cores."""
    overrides = (*equal_overrides["agent"], *(tied_models("agent") if tied else ()))
    fsdp = _fsdp(graph_path("agent"), tmp_path / "fsdp", *overrides)
    assert_same_numbers(fsdp, local_reference("agent", tied=tied))
    assert all(r["agent/tool_calls"] > 0 for r in fsdp)
    assert any(r["agent/status/error"] > 0 for r in fsdp), "masked episodes on rank 1"


ROUTED = ("dims.Bp=4", "dims.N=2", "nodes.update.params.mini_batch_size=8",
          "trainer.steps=3", "trainer.eval_every=3", "trainer.val_before_train=false")
"""graphs/agent_mixed.yaml (the calculator and guess the number in one dataset) small:
4 rows a step, 2 a rank, held-out evaluation after the last step."""


@pytest.mark.slow
def test_envs_routed_per_row_equal_local(tmp_path: Path, local_run: Any) -> None:
    """Each rank routes its half of the rows by their own `env_class`, so a rank whose
    rows name one env sums both envs' counts beside the other's: the local run's numbers,
    `agent/<env>/*`, `rewards/<env>/*` and the held-out `val/agent/<env>/*` included."""
    graph = GRAPHS / "agent_mixed.yaml"
    local = local_run(graph, tmp_path / "local", *ROUTED)
    fsdp = _fsdp(graph, tmp_path / "fsdp", *ROUTED)
    assert_same_numbers(fsdp, local)
    for env in ("calc", "guess"):
        assert any(f"rewards/{env}/mean" in r for r in fsdp), env
        assert f"val/agent/{env}/accuracy" in fsdp[-1], env


@pytest.mark.parametrize("packing", [False, True])
def test_token_budgets_on_sharded_models_equal_local(tmp_path: Path, local_run: Any,
                                                     packing: bool) -> None:
    """PPO with max_token_len on every forward and update: the two ranks cut their rows
    by the budget, run as many micro-batches as the busier one (each forward of a sharded
    model is a collective), and give the local run's numbers — also with every forward
    packed on the ranks (one row of valid tokens; the budget counts those) against the
    padded local run."""
    nodes = ("old_logprob", "ref_logprob", "values", "update_actor", "update_critic")
    overrides = ("trainer.steps=3", "trainer.eval_every=0", "trainer.checkpoint_every=0",
                 *(f"nodes.{n}.params.max_token_len=48" for n in nodes))
    packed = tuple(f"nodes.{n}.params.packing=true" for n in nodes if packing)
    graph = GRAPHS / "ppo.yaml"
    assert_same_numbers(_fsdp(graph, tmp_path / "fsdp", *overrides, *packed),
                        local_run(graph, tmp_path / "local", *overrides))


def test_async_rollouts_equal_a_local_producer_process_and_resume_locally(
        tmp_path: Path, local_run: Any, equal_overrides: dict[str, tuple[str, ...]]) -> None:
    """GRPO with `trainer.max_staleness: 1`: the ranks produce each step's rollout in their
    loop, one step ahead, and give the numbers of the local target's producer process
    (admission `block`: step k's batch from the policy of step k-1, whatever the timing);
    the fsdp checkpoint after step 3 (DCP shards and the buffer with step 4's rollout),
    resumed by the local target, gives the fsdp run's step 4."""
    graph = GRAPHS / "grpo.yaml"
    overrides = (*equal_overrides["grpo"], "trainer.max_staleness=1")
    fsdp = _fsdp(graph, tmp_path / "fsdp", *overrides)
    assert [r["async/staleness"] for r in fsdp] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert_same_numbers(fsdp, local_run(graph, tmp_path / "local", *overrides))
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "fsdp", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_4")
    assert (resumed / "checkpoints" / "step_3" / "rollouts.pt").exists()
    assert_same_numbers(local_run(graph, resumed, *overrides, resume=True)[4:], fsdp[4:])
