"""The local executor: runs, checkpoints, faults, export (the loop's steps, resume and
non-finite batches: test_loop.py; strict mode: test_interpreter.py)."""

import functools
import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from flowgraph.compilers import RunOptions, read_metrics, run
from flowgraph.compilers.checkpoint.store import latest_checkpoint, load_checkpoint, remove_partial
from flowgraph.compilers.export import export_model
from flowgraph.errors import FlowgraphError
from flowgraph.passes import compile_graph
from flowgraph.testing.targets import assert_same_numbers, numbers

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "tests" / "plugins"

FAULTS = (PLUGINS / "faults.yaml").read_text()  # one node of the fault plugin


def _run(graph: str | Path, tmp_path: Path, *overrides: str, text: str | None = None,
         resume: bool = False) -> list[dict[str, float]]:
    file = tmp_path / "g.yaml"
    if text is not None:
        file.write_text(text)
    result = compile_graph(file if text is not None else graph,
                           overrides=[f"trainer.run_dir={tmp_path / 'run'}", *overrides])
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]
    with open(os.devnull, "w") as out:
        return run(result.plan, RunOptions(resume=resume, tensorboard=False, out=out)).rows


def _numbers(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    return [numbers(r) for r in rows]


@pytest.fixture(autouse=True)
def _plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))


def test_dpo_trains_hoists_and_checkpoints(tmp_path: Path) -> None:
    rows = _run(ROOT / "graphs" / "dpo.yaml", tmp_path, "trainer.steps=3",
                "trainer.checkpoint_every=2", "trainer.eval_every=3")
    assert sorted(k for k in rows[0] if k.startswith("rewards/")) == [
        "rewards/accuracies", "rewards/chosen", "rewards/margins", "rewards/rejected"]
    assert all("timing_s/update" in r and "actor/dpo_loss" in r for r in rows)
    # held-out pairs scored by dpo_update's eval hook, on the last step only
    assert [("val/rewards/accuracies" in r) for r in rows] == [False, False, True]
    assert 0.0 <= rows[2]["val/rewards/accuracies"] <= 1.0
    written = read_metrics(tmp_path / "run")
    assert [r["step"] for r in written] == [0, 1, 2]
    # checkpoint after step 2 (every 2) and at the end (step 2): the newest is step_2
    found = latest_checkpoint(tmp_path / "run")
    assert found is not None and found[0] == 2
    assert (found[1] / "model.policy.safetensors").exists()
    assert (found[1] / "optim.policy.pt").exists()
    # the frozen reference is rebuilt from its source on resume, never saved again
    assert sorted(p.name for p in found[1].glob("model.*")) == ["model.policy.safetensors"]


@pytest.mark.parametrize(("keep", "kept"), [(3, [1, 2, 3]), (0, [0, 1, 2, 3])])
def test_max_checkpoints_is_how_many_are_kept(tmp_path: Path, keep: int,
                                              kept: list[int]) -> None:
    _run(ROOT / "graphs" / "dpo.yaml", tmp_path, "trainer.steps=4", "trainer.checkpoint_every=1",
         f"trainer.max_checkpoints={keep}")
    steps = sorted(int(p.name.removeprefix("step_"))
                   for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert steps == kept


def test_on_policy_elision_keeps_the_numbers(tmp_path: Path) -> None:
    """GRPO with one optimizer step per rollout, with and without pass `on_policy`: the
    old-log-prob forward repeated the update's own, so every metric is the same."""
    from flowgraph.passes import PassPipeline

    runs = []
    for disabled in ((), ("on_policy",)):
        result = compile_graph(ROOT / "graphs" / "grpo.yaml", pipeline=PassPipeline.default(
            disabled=disabled), overrides=[f"trainer.run_dir={tmp_path / str(len(disabled))}",
                                           "trainer.steps=3", "trainer.eval_every=3",
                                           "nodes.update_actor.params.mini_batch_size=null"])
        assert result.plan is not None
        assert ("old_logprob" in result.plan.dropped) == (not disabled)
        with open(os.devnull, "w") as out:
            runs.append(run(result.plan, RunOptions(tensorboard=False, out=out)).rows)
    elided, full = runs
    assert "timing_s/old_logprob" in full[0] and "timing_s/old_logprob" not in elided[0]
    assert _numbers(elided) == _numbers(full)
    # Held out, the update scores the actor itself (`ActorLoss.held_out`).
    assert "val/log_ratio_to_ref" in elided[-1]


def test_token_budgets_keep_the_numbers_of_the_padded_run(tmp_path: Path) -> None:
    """PPO with micro_batch_size 2 on every forward and update: pass `token_budget`
    turns each into max_token_len 48 (two full-length rows, more of shorter ones, each
    micro-batch trimmed to its longest prompt and response). Its numbers are those of
    the row-count micro-batches (the pass disabled), of one whole padded batch, and of
    the budgets with every forward packed (`packing: true`: no pad token computed)."""
    from flowgraph.passes import PassPipeline

    nodes = ("old_logprob", "ref_logprob", "values", "update_actor", "update_critic")
    runs = {}
    for name, micro, disabled in (("budget", 2, ()), ("rows", 2, ("token_budget",)),
                                  ("whole", "null", ()), ("packed", 2, ())):
        packing = [f"nodes.{n}.params.packing=true" for n in nodes if name == "packed"]
        result = compile_graph(ROOT / "graphs" / "ppo.yaml", pipeline=PassPipeline.default(
            disabled=disabled), overrides=[
                f"trainer.run_dir={tmp_path / name}", "trainer.steps=3", "trainer.eval_every=3",
                *(f"nodes.{n}.params.micro_batch_size={micro}" for n in nodes), *packing])
        assert result.plan is not None
        rewritten = [r for r in result.plan.rewrites if r.startswith("token_budget")]
        assert len(rewritten) == (0 if name in ("rows", "whole") else 5), result.plan.rewrites
        if name == "budget":
            assert "`update_actor` micro_batch_size 2 -> max_token_len 48 " in rewritten[3]
        with open(os.devnull, "w") as out:
            runs[name] = run(result.plan, RunOptions(tensorboard=False, out=out)).rows
    assert min(r["response_length/mean"] for r in runs["budget"]) < 8  # rows of several lengths
    assert_same_numbers(runs["budget"], runs["rows"])
    assert_same_numbers(runs["budget"], runs["whole"])
    # one row of valid tokens per forward, the budget counting valid tokens only
    assert_same_numbers(runs["packed"], runs["whole"])


@pytest.mark.parametrize(("graph", "nodes"), [
    ("dpo.yaml", ("ref_chosen", "ref_rejected", "update")), ("sft.yaml", ("update",))])
def test_packed_forwards_keep_the_numbers_of_the_padded_run(tmp_path: Path, graph: str,
                                                            nodes: tuple[str, ...]) -> None:
    """DPO (the frozen reference's forwards, the update's chosen + rejected in one) and
    SFT (a loss mask inside the responses) with `packing: true`: every forward one row of
    valid tokens, the padded run's numbers, held-out metrics included."""
    runs = [_run(ROOT / "graphs" / graph, tmp_path / packing, "trainer.steps=3",
                 "trainer.eval_every=3", *(f"nodes.{n}.params.packing={packing}" for n in nodes))
            for packing in ("false", "true")]
    assert any(k.startswith("val/") for k in runs[1][-1])
    for rows in runs:  # step 0: policy = reference, whether chosen > rejected is rounding
        rows[0].pop("rewards/accuracies", None)
    assert_same_numbers(runs[1], runs[0])


@pytest.mark.parametrize("same", [False, True])
def test_fused_forwards_keep_the_numbers_of_separate_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, same: bool) -> None:
    """DPO's reference scores of the chosen and the rejected responses: pass `fusion`
    runs them as one forward over the 2 x Bp rows (one call a batch instead of two),
    with the numbers of the two forwards (`ref_rejected` lists its inputs in another
    order than `ref_chosen`). With `same`, both nodes score the chosen responses: one
    forward over the Bp rows, both nodes get its outputs."""
    import flowgraph.nodes.logprob as logprob_module
    from flowgraph.passes import PassPipeline

    calls: list[tuple[str, int]] = []  # (node, rows) of each call the executor makes
    real = logprob_module.sequence_logprob

    @functools.wraps(real)
    def counted(*args: Any, **kwargs: Any) -> Any:
        given = inspect.signature(real).bind(*args, **kwargs).arguments
        if given.get("ctx") is not None:  # the executor's, not the update's own
            calls.append((given["ctx"].node, len(given["prompts"])))
        return real(*args, **kwargs)

    monkeypatch.setattr(logprob_module, "sequence_logprob", counted)
    rewire = ("nodes.ref_rejected.inputs.responses=pairs.chosen",
              "nodes.ref_rejected.inputs.response_mask=pairs.chosen_mask") if same else ()
    text = (ROOT / "graphs" / "dpo.yaml").read_text()
    ports = ("      prompts: pairs.prompts\n      prompt_mask: pairs.prompt_mask\n"
             "      responses: pairs.rejected\n      response_mask: pairs.rejected_mask\n")
    assert ports in text
    graph = tmp_path / "dpo.yaml"
    graph.write_text(text.replace(ports, "".join(reversed(ports.splitlines(True)))))
    runs, counts = [], []
    for disabled in ((), ("fusion",)):
        calls.clear()
        result = compile_graph(graph, pipeline=PassPipeline.default(
            disabled=disabled), overrides=[f"trainer.run_dir={tmp_path / str(len(disabled))}",
                                           "trainer.steps=3", "trainer.eval_every=3", *rewire])
        assert result.plan is not None
        assert result.plan.node("ref_chosen").fused == (() if disabled else ("ref_rejected",))
        with open(os.devnull, "w") as out:
            runs.append(run(result.plan, RunOptions(tensorboard=False, out=out)).rows)
        counts.append(list(calls))
    fused, apart = counts  # the prologue's batches of Bp = 8 rows, train and held-out
    assert {node for node, _ in apart} == {"ref_chosen", "ref_rejected"}
    assert [rows for node, rows in apart if node == "ref_chosen"] == \
        [rows for node, rows in apart if node == "ref_rejected"]
    assert [node for node, _ in fused] == ["ref_chosen"] * (len(apart) // 2)
    assert [rows for _, rows in fused] == [rows * (1 if same else 2) for node, rows in apart
                                            if node == "ref_chosen"]
    for rows in runs:  # step 0: policy = reference, whether chosen > rejected is rounding
        rows[0].pop("rewards/accuracies", None)
    assert_same_numbers(runs[0], runs[1])


def test_an_existing_run_is_never_overwritten(tmp_path: Path) -> None:
    _run(tmp_path, tmp_path, "trainer.steps=1", text=FAULTS)
    with pytest.raises(FlowgraphError, match="already holds a run; continue it with --resume"):
        _run(tmp_path, tmp_path, "trainer.steps=1", text=FAULTS)


def test_missing_model_path_fails_before_anything_loads(tmp_path: Path) -> None:
    text = FAULTS.replace('"builtin:tiny-lm"', str(tmp_path / "no-such-model"))
    with pytest.raises(FlowgraphError, match="no-such-model` does not exist"):
        _run(tmp_path, tmp_path, "trainer.steps=1", text=text)


@pytest.mark.faults
def test_a_missing_dataset_file_names_the_graph_line(tmp_path: Path) -> None:
    """Compiled where the file was, run where it is not: the run's error names the data
    source's line in the graph file, as `check` does (FG123)."""
    missing = tmp_path / "gone.parquet"
    text = FAULTS.replace('"builtin:arith"', str(missing))
    with pytest.raises(FlowgraphError) as exc:
        _run(tmp_path, tmp_path, "trainer.steps=1", text=text)
    assert str(exc.value) == (f"dataset file `{missing}` does not exist (data source `train` "
                              f"at {tmp_path / 'g.yaml'}:7:3)")


def test_missing_dataset_column_names_file_and_column(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1+1="}) + "\n")
    text = FAULTS.replace('"builtin:arith"', str(data))
    with pytest.raises(FlowgraphError, match=r"d.jsonl` has no column `prompt`; its columns: "
                                             r"question"):
        _run(tmp_path, tmp_path, "trainer.steps=1", text=text)


def test_dataset_problems_stop_before_any_model_loads(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import flowgraph.nodes.models as models

    def no_loading(*args: object, **kw: object) -> None:
        raise AssertionError("a model was loaded before the dataset was checked")

    monkeypatch.setattr(models, "load_model", no_loading)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1+1="}) + "\n")
    with pytest.raises(FlowgraphError, match="has no column `prompt`"):
        _run(ROOT / "graphs" / "ppo.yaml", tmp_path, "trainer.steps=1",
             f"data.train.path={data}")


KILLER = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from flowgraph.compilers.checkpoint.store import save_checkpoint

    class Slow:
        def state_dict(self):
            print("writing", flush=True)
            time.sleep(60)
            return {}

    run = Path(sys.argv[1])
    save_checkpoint(run, 0, modules={"a": torch.nn.Linear(2, 2)}, state={"step": 0})
    save_checkpoint(run, 1, modules={"a": torch.nn.Linear(2, 2), "b": Slow()},
                    state={"step": 1})
""")


def test_sigkill_during_a_checkpoint_keeps_the_previous_one(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", KILLER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert any(".tmp-" in p.name for p in (tmp_path / "checkpoints").iterdir())
    found = latest_checkpoint(tmp_path)
    assert found is not None and found[0] == 0
    linear = torch.nn.Linear(2, 2)
    assert load_checkpoint(found[1], modules={"a": linear}) == {"step": 0}
    remove_partial(tmp_path)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_0"]


def test_export_gives_a_loadable_hugging_face_model(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    _run(ROOT / "graphs" / "dpo.yaml", tmp_path, "trainer.steps=1")
    out = export_model(tmp_path / "run", "policy", tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    saved = load_file(tmp_path / "run" / "checkpoints" / "step_0" / "model.policy.safetensors")
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, saved[name]), name
    with pytest.raises(FlowgraphError, match="no model `critic`"):
        export_model(tmp_path / "run", "critic", tmp_path / "x")
    with pytest.raises(FlowgraphError, match=r"`ref` is frozen .* those of `builtin:tiny-lm`"):
        export_model(tmp_path / "run", "ref", tmp_path / "x")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FlowgraphError, match=r"is not empty; .* --force"):
        export_model(tmp_path / "run", "policy", out)
    export_model(tmp_path / "run", "policy", out, force=True)
    assert (out / "notes.txt").read_text() == "mine"


VERL = torch.load(ROOT / "tests" / "fixtures" / "verl" / "core_algos.pt", weights_only=False)


@pytest.mark.parametrize("case", sorted(VERL["schedules"]))
def test_lr_schedule_is_verls(case: str) -> None:
    """LR factors of training steps 0..total-1, from verl 0.9.1's schedulers
    (scripts/verl_fixtures.py): warm-up from 0 (i/w), then constant or half cosine."""
    from flowgraph.compilers.build import lr_lambda

    name, warmup, total = case.split("/")
    factor = lr_lambda(int(warmup), int(total), name)
    ours = [factor(i) for i in range(int(total))]
    assert ours == pytest.approx(VERL["schedules"][case], abs=1e-12)


def test_warmup_counts_training_steps_not_optimizer_steps(tmp_path: Path) -> None:
    # PPO's update takes 2 mini-batches (16 sequences, mini_batch_size 8): 2 optimizer
    # steps a training step at one LR. Warm-up over 4 training steps: lr·0, ·¼, ·½, ·¾.
    rows = _run(ROOT / "graphs" / "ppo.yaml", tmp_path, "trainer.steps=4",
                "models.actor.optimizer.warmup_steps=4", "models.actor.optimizer.lr=0.001")
    assert [r["actor/lr"] for r in rows] == pytest.approx([0.0, 0.00025, 0.0005, 0.00075])


def test_evaluation_answers_each_held_out_prompt_once(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy decoding gives N copies of one response: evaluation asks for one."""
    from flowgraph.nodes import generate as generate_module

    calls: list[tuple[bool, int]] = []  # (sampled, responses)
    real = generate_module.decode  # what the hf backend calls, with the repeated prompts

    def spy(model: object, prompts: torch.Tensor, *args: object, **kwargs: object) -> object:
        out = real(model, prompts, *args, **kwargs)  # type: ignore[arg-type]
        calls.append((not args[2].greedy, len(out["responses"])))  # type: ignore[attr-defined]
        return out

    monkeypatch.setattr(generate_module, "decode", spy)
    _run(ROOT / "graphs" / "grpo.yaml", tmp_path, "trainer.steps=1", "trainer.eval_every=1")
    assert [r for sampled, r in calls if sampled] == [128]  # Bp = 16 prompts × N = 8
    # builtin:reverse:test has 100 prompts: 7 batches of Bp = 16 (the last one the last
    # 16 rows, 4 of them new), one response each
    assert [r for sampled, r in calls if not sampled] == [16] * 7


def test_a_run_dir_that_cannot_be_created_is_one_error(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    with pytest.raises(FlowgraphError, match=r"cannot write the run dir `.*afile/run` "
                                             r"\(trainer.run_dir\): Not a directory"):
        _run(ROOT / "graphs" / "grpo.yaml", tmp_path, f"trainer.run_dir={tmp_path}/afile/run")


@pytest.mark.parametrize("debug", [False, True])
def test_an_error_in_a_plugin_names_node_step_and_the_users_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, debug: bool) -> None:
    from flowgraph.errors import DEBUG_ENV

    if debug:
        monkeypatch.setenv(DEBUG_ENV, "1")
    text = FAULTS.replace("kind: prompt_score", "kind: brittle_score\n    params: {fail_at: 1}")
    with pytest.raises(FlowgraphError) as exc:
        _run(tmp_path, tmp_path, "trainer.steps=3", text=text)
    plugin = PLUGINS / "fg_runtime_faults.py"
    lines = plugin.read_text().splitlines()
    line = next(i for i, t in enumerate(lines, 1) if "the user's bug" in t)
    head = str(exc.value).splitlines()[:2]
    assert head[0].startswith("while executing node `score` (kind brittle_score, ")
    assert head[0].endswith(" at step 1: KeyError: 0"), head
    assert head[1] == (f"  at {plugin}:{line} in brittle_score: return input_ids.float()"
                       ".mean(-1) * weights[0]  # the user's bug: KeyError at fail_at")
    saved = (tmp_path / "run" / "traceback.txt").read_text()
    assert saved.startswith("Traceback (most recent call last)") and str(plugin) in saved
    assert ("Traceback (most recent call last)" in str(exc.value)) == debug


def test_adam_runs_fused_and_a_resumed_state_keeps_this_targets_kernel() -> None:
    """TRL's default (`adamw_torch_fused`) on plain parameters; a state saved by the
    other kernel (an fsdp run's DTensors take the per-op one) loads without switching."""
    from flowgraph.compilers.build import make_optimizer
    from flowgraph.ir import ModelSpec, OptimizerSpec

    spec = ModelSpec(name="actor", path="builtin:tiny-lm", optimizer=OptimizerSpec(lr=1e-3))
    model = torch.nn.Linear(4, 3)
    opt, _ = make_optimizer(spec, model, total_steps=2)
    assert opt.param_groups[0]["fused"] is True
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    saved["param_groups"][0].update(fused=None, foreach=True)  # as the other kernel saves it
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["foreach"] is None
    opt.step()  # the fused kernel on the loaded state


def test_a_nodes_tensors_are_moved_to_the_workers_device() -> None:
    """A data source's tensors come from the CPU; a node on another device gets them
    there (found on a GPU: an SFT update on cuda read its batch from the CPU). `meta`
    stands in for cuda on a machine without one; other values pass as they are."""
    import torch

    from flowgraph.compilers.worker import on_device

    ids, rows = torch.ones(2, 3, dtype=torch.int64), [{"a": 1}, {"a": 2}]
    moved = on_device({"prompts": ids, "row": rows}, "meta")
    assert moved["prompts"].device.type == "meta" and moved["row"] is rows
    same = on_device({"prompts": ids}, "cpu")
    assert same["prompts"] is ids
