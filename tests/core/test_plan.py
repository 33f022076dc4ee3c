"""ExecutionPlan: JSON round trip, self-validation, the summary."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flowgraph.errors import PlanError
from flowgraph.frontend import load_graph
from flowgraph.passes import compile_graph
from flowgraph.plan import (
    PLAN_VERSION,
    Bundle,
    EdgePlan,
    ExecutionPlan,
    MemoryItem,
    PoolMemory,
    PoolPlan,
    plan_document,
    plan_from_json,
    plan_summary,
    plan_to_json,
)

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "plans"
GOOD_GRAPHS = sorted(p for p in GRAPHS.rglob("*.yaml") if "broken" not in p.parts)


def plan_of(file: Path, **kw: Any) -> ExecutionPlan:
    result = compile_graph(file, **kw)
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]
    return result.plan


def test_every_example_graph_is_covered() -> None:
    assert {p.stem for p in GOOD_GRAPHS} >= {"ppo", "grpo", "dpo", "rloo", "reinforce_pp",
                                              "remax"}


@pytest.mark.parametrize("target", ["local", "fsdp", "ray"])
@pytest.mark.parametrize("file", GOOD_GRAPHS, ids=lambda p: p.stem)
def test_json_round_trip(file: Path, target: str) -> None:
    plan = plan_of(file, target=target)
    text = plan_to_json(plan)
    again = plan_from_json(text)
    assert again == plan
    assert plan_to_json(again) == text
    assert again.source == str(file)
    assert "graph" not in json.loads(text)  # each node once: its record


def test_json_round_trip_on_gpus_with_two_workers() -> None:
    plan = plan_of(GRAPHS / "grpo.yaml", target="ray", nproc=2, device="cuda")
    assert plan_from_json(plan_to_json(plan)) == plan


def test_the_plan_holds_the_compiled_ir() -> None:
    """The node records and the run's settings survive JSON: hoisting marks, models and
    the trainer's settings are the graph's."""
    plan = plan_from_json(plan_to_json(plan_of(GRAPHS / "dpo.yaml")))
    original, _ = load_graph(GRAPHS / "dpo.yaml")
    assert original is not None
    sources = plan.data_sources()
    nodes = [n for n in plan.nodes if n.name not in sources]
    assert [n.name for n in nodes] == [n.name for n in original.nodes]
    assert [n.hoisted for n in nodes] == [True, True, False]
    assert plan.models == original.models and plan.trainer == original.trainer


def test_a_plan_of_the_format_before_is_converted_with_a_note(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A version 6 plan (which held the graph beside its node records; written by
    `flowgraph compile graphs/grpo.yaml` of that version) reads as the plan compiled now."""
    old = plan_from_json((FIXTURES / "grpo_v6.json").read_text())
    assert capsys.readouterr().err == (
        f"flowgraph: note: the plan is format version 6, read as version {PLAN_VERSION} "
        "(compile the graph again to write it so)\n")
    monkeypatch.chdir(GRAPHS.parent)  # where the fixture was compiled: its `where`s say so
    now = plan_of(Path("graphs/grpo.yaml"))
    assert old == now and plan_document(old) == plan_document(now)


def test_json_layout() -> None:
    data = json.loads(plan_to_json(plan_of(GRAPHS / "dpo.yaml")))
    assert list(data) == ["run", "target", "nproc", "device", "dims", "nodes", "pools",
                          "stages", "edges", "memory", "dropped", "rewrites",
                          "plugin_paths", "source", "version", "resample", "asynchronous",
                          "objects"]
    assert data["version"] == PLAN_VERSION
    assert data["run"] == {"name": "dpo", "models": data["run"]["models"],
                           "data": data["run"]["data"], "trainer": data["run"]["trainer"]}
    assert data["nodes"][1]["hoisted"] is True
    assert data["pools"] == [{
        "name": "main", "size": 1, "device": "cpu",
        "models": [{"name": "policy", "trainable": True, "sharding": "none", "head": "lm",
                    "base_of": None},
                   {"name": "ref", "trainable": False, "sharding": "none", "head": "lm",
                    "base_of": None}],
        "bundles": [{"cpu": 1, "gpu": 0, "custom": []}], "strategy": "pack",
        "label_selector": []}]
    assert data["nodes"][1]["inputs"][2] == {
        "port": "responses", "src": "pairs.chosen", "shape": "(Bp, T) = (8, 8)", "dims": "Bp T",
        "spec": {"dims": "b T", "dtype": "int", "constraints": []},
        "where": str(GRAPHS / "dpo.yaml") + ":25:18"}  # where the graph wires it
    assert data["nodes"][1]["where"].endswith("dpo.yaml:19:3")
    assert data["nodes"][1]["outputs"] == [{
        "port": "log_prob", "dims": "Bp", "batched": True, "optional": False,
        "spec": {"dims": "b", "dtype": "float", "constraints": ["nonpositive", "finite"]}}]
    node = data["nodes"][1]  # the kind's facts and its params, resolved: what runs
    assert (node["loads_model"], node["trains"], node["category"], node["head"]) == (
        True, False, "model", "lm")
    assert {p["name"]: json.loads(p["value"]) for p in node["params"]} == {
        "chunk_size": 1024, "micro_batch_size": None, "max_token_len": None, "packing": False,
        "timeout_s": 0.0}
    assert node["eval_params"] == node["params"]
    assert data["dims"] == [{"name": "Bp", "value": 8}, {"name": "P", "value": 16},
                            {"name": "T", "value": 8}]


Edit = Callable[[dict[str, Any]], None]


def _set(path: str, value: object) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        *head, last = path.split("/")
        target: Any = data
        for key in head:
            target = target[int(key)] if key.isdigit() else target[key]
        target[last if not last.isdigit() else int(last)] = value
    return edit


def _repeat_edges(times: int) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        data["edges"] = data["edges"] * times
    return edit


def _all(*edits: Edit) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        for e in edits:
            e(data)
    return edit


@pytest.mark.parametrize(("edit", "message"), [
    (_set("version", 1), f"the plan is format version 1; this flowgraph reads version "
                         f"{PLAN_VERSION}: compile the graph again"),
    # the verifier: pools host the models their nodes run, stages keep every dependency,
    # dispatch follows placement and never splits a tensor without a batch axis
    (_set("nodes/1/pool", "elsewhere"), "invalid execution plan: node `ref_chosen` runs on "
                                        "unknown pool `elsewhere`"),
    (_set("pools/0/models", [{"name": "policy", "trainable": True, "sharding": "none"}]),
     "invalid execution plan: node `ref_chosen` runs model `ref` on pool `main`, which does "
     "not host it (hosted by: no pool)"),
    (_all(_set("stages/0/nodes", ["ref_rejected"]), _set("stages/2/nodes", ["ref_chosen",
                                                                              "update"]),
          _set("nodes/1/stage", "step.1"), _set("nodes/1/hoisted", False)),
     "invalid execution plan: node `update` (stage `step.1`) reads `ref_chosen.log_prob`, "
     "which stage `step.1` only computes at the same time or later"),
    (_set("edges/0/dispatch", "split"), "invalid execution plan: edge `pairs.prompts -> "
     "ref_chosen.prompts` is dispatched `split`; from `pairs` (whole batch on pool `main`) to "
     "`ref_chosen` (whole batch on pool `main`) it is `local`"),
    (_set("target", "slurm"),
     "invalid execution plan: target `slurm` is not one of ('local', 'fsdp', 'ray')"),
    (_set("nproc", True), "`plan.nproc` must be int, got bool True"),
    (_set("nodes/0/pool", "gpus"), "invalid execution plan: node `pairs` runs on unknown pool "
                                   "`gpus`"),
    (_set("nodes/0/stage", "step.9"), "invalid execution plan: node `pairs` says stage `step.9`, "
                                      "the stages say `step.0`"),
    (_set("edges/0/dispatch", "teleport"), "invalid edge `pairs.prompts -> ref_chosen.prompts`: "
     "dispatch must be one of ('local', 'split', 'gather', 'broadcast', 'reshard')"),
    (_set("pools/0/size", 0), "invalid pool `main`: size must be >= 1, got 0; 1 bundles for 0 "
                              "workers"),
    # 459,392 * 16 + 459,392 * 4 resident + the update's 7,471,104 + 524,288 = 17,183,232.
    (_set("memory/0/total_bytes", 1), "invalid memory of pool `main`: total 1 != 17183232"),
    (_set("stages/0/colour", "red"), "`plan.stages[0]` has unknown field(s) ['colour']"),
    (_set("run/trainer", 5), "`plan.run` is not valid: "),
    (_set("nodes/3/inputs/0/src", "gone.x"), "invalid execution plan: node `update` reads "
     "`gone.x`, which is not a node of the plan"),
    (_set("run/data", {}), "invalid execution plan: `pairs` is no data source of the run "
     "but its plan's category is `data`"),
    # one message however often they repeat (the 50 MB plan: 22,000 times)
    (_repeat_edges(200), "invalid execution plan: 16 edge(s) are listed more than once, each "
     "must be listed once: `pairs.prompts -> ref_chosen.prompts` (200 times), "
     "`pairs.prompt_mask -> ref_chosen.prompt_mask` (200 times), "),
    (_set("nodes/0/outputs/0/batched", False), "invalid execution plan: edge `pairs.prompts -> "
     "ref_chosen.prompts` is flagged batched: true, but output `pairs.prompts` is declared "
     "with batched: false; the two must agree (edit both alike)"),
])
def test_from_json_rejects_a_broken_plan(edit: Edit, message: str) -> None:
    data = json.loads(plan_to_json(plan_of(GRAPHS / "dpo.yaml")))
    edit(data)
    with pytest.raises(PlanError) as exc:
        plan_from_json(json.dumps(data))
    assert str(exc.value).startswith(message)


def _output(data: dict[str, Any], ref: str) -> dict[str, Any]:
    node, port = ref.split(".")
    record = next(n for n in data["nodes"] if n["name"] == node)
    return next(o for o in record["outputs"] if o["port"] == port)


@pytest.mark.parametrize(("edit", "messages"), [
    # an output's dims edited from "Bp P" to "P", `batched: true` left (it ran)
    (lambda d: _output(d, "train.input_ids").update(dims="P"), [
        "node `train` output `input_ids`: `dims` is `P` (1 axis), but its kind's contract "
        "`spec.dims` is `Bp P` (2 axes): edit both alike, or compile the graph again",
        "node `train` output `input_ids`: `batched` is true, but its `dims` `P` has no batch "
        "axis (Bp prompts or Bp*N samples first)",
        "node `gen` input `prompts`: `dims` is `Bp P`, but the output it reads, "
        "`train.input_ids`, has `dims` `P`"]),
    # `dims.B` set to 7 (it ran)
    (lambda d: next(x for x in d["dims"] if x["name"] == "B").update(value=7), [
        "`dims.B` is 7, but B is Bp*N = 16*8 = 128: set Bp or N instead"]),
    # `dims.Bp` set to 7: the shapes compiled at 16 say otherwise
    (lambda d: next(x for x in d["dims"] if x["name"] == "Bp").update(value=7), [
        "node `gen` input `prompts`: `shape` is `(Bp, P) = (16, 16)`, but Bp is 7 at the "
        "plan's `dims`"]),
], ids=["output-dims", "dims-B", "dims-Bp"])
def test_a_plan_file_that_contradicts_itself_is_refused_by_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Edit,
        messages: list[str]) -> None:
    from flowgraph.cli import main

    data = json.loads(plan_to_json(plan_of(GRAPHS / "grpo.yaml")))
    edit(data)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(data))
    assert main(["run", str(plan)]) == 1  # before any model loads
    err = capsys.readouterr().err
    assert err.startswith("flowgraph: error: invalid execution plan: ") \
        and "Traceback" not in err, err
    assert all(m in err for m in messages), err


def test_invalid_run_settings_name_the_problem() -> None:
    data = json.loads(plan_to_json(plan_of(GRAPHS / "dpo.yaml")))
    data["run"]["trainer"]["steps"] = -1
    with pytest.raises(PlanError) as exc:
        plan_from_json(json.dumps(data))
    assert "trainer.steps" in str(exc.value), exc.value


@pytest.mark.faults
@pytest.mark.parametrize(("content", "message"), [
    (b'{"version": "\xff"}', "is not UTF-8 text (byte 13: b'\\xff')"),
    (b"[" * 100_000 + b"]" * 100_000, "the plan is nested more than 80 levels deep"),
    (b'{"version": ' + b"[" * 81 + b"]" * 81 + b"}", "the plan is nested more than 80 levels deep"),
    (None, "is larger than 64 MiB"),
    (b"{nope", "the plan is not valid JSON"),
], ids=["not-utf8", "nested-100000", "nested-82", "too-large", "not-json"])
def test_an_unreadable_plan_file_is_one_message_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None,
        message: str) -> None:
    from flowgraph.cli import main

    plan = tmp_path / "plan.json"
    if content is None:
        with plan.open("wb") as f:  # sparse: 65 MiB of size, no MiB written
            f.truncate(65 << 20)
    else:
        plan.write_bytes(content)
    assert main(["run", str(plan)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowgraph: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_from_json_rejects_text_that_is_not_json() -> None:
    with pytest.raises(PlanError, match="the plan is not valid JSON"):
        plan_from_json("{nope")


def test_from_json_rejects_a_missing_field() -> None:
    data = json.loads(plan_to_json(plan_of(GRAPHS / "dpo.yaml")))
    del data["stages"]
    with pytest.raises(PlanError, match="missing 1 required positional argument: 'stages'"):
        plan_from_json(json.dumps(data))


@pytest.mark.parametrize(("build", "message"), [
    (lambda: PoolPlan("p", 2, "cpu", (), (Bundle(),)), "invalid pool `p`: 1 bundles for 2 workers"),
    (lambda: PoolPlan("p", 1, "tpu", (), (Bundle(),)),
     "invalid pool `p`: device `tpu` is not one of ('cpu', 'cuda')"),
    (lambda: EdgePlan("a.x", "b.y", "scatter"), "invalid edge `a.x -> b.y`: dispatch must be"),
    (lambda: MemoryItem("weights", "m", -1, False), "invalid memory item of `m`: bytes must be"),
    (lambda: PoolMemory("p", (MemoryItem("weights", "m", 3, False),), 3, "m"),
     "invalid memory of pool `p`: peak node m != None"),
    (lambda: Bundle(cpu=-1), "invalid bundle: cpu and gpu must be >= 0"),
])
def test_records_check_themselves(build: Callable[[], object], message: str) -> None:
    with pytest.raises(PlanError) as exc:
        build()
    assert str(exc.value).startswith(message)


def test_pool_memory_counts_only_the_largest_nodes_transient_memory() -> None:
    items = (MemoryItem("weights", "actor", 100, False),
             MemoryItem("activations", "update", 30, True), MemoryItem("logits", "update", 5, True),
             MemoryItem("kv_cache", "gen", 20, True))
    mem = PoolMemory.of("p", items)
    assert (mem.total_bytes, mem.peak_node) == (135, "update")


def test_summary() -> None:
    # Memory, fp32: policy 459,392 params * (4 + 4 + 8) bytes, ref 459,392 * 4; the update
    # runs 8 pairs = 16 sequences of P+T = 24 tokens: 2 layers of 24*16*9,728 (SDPA, a
    # token: tests/passes/test_memory.py::test_activation_formulas) = 7,471,104 bytes of
    # activations, and its 128 response tokens' logits in one chunk, with their gradient:
    # 2*128*512*4 = 524,288.
    assert plan_summary(plan_of(GRAPHS / "dpo.yaml")) == f"""\
plan for `dpo` ({GRAPHS / "dpo.yaml"}): target local, nproc 1, device cpu
dims: Bp=8 P=16 T=8

pools:
  main  1 worker(s) on cpu, each {{CPU: 1}}
          model policy (trainable, unsharded)
          model ref (frozen, unsharded)
          nodes: pairs, ref_chosen, ref_rejected, update

stages:
  prologue   ref_chosen, ref_rejected  (once per row, before the loop)
  step.0     pairs
  step.1     update
  fused      ref_chosen + ref_rejected: one forward, rows stacked

score: none reported (no advantage node reads scores)
edges: 16 local
rewritten: fusion: `ref_chosen`, `ref_rejected` run as one forward of model `ref` (kind \
sequence_logprob), their rows stacked

memory per device (estimate):
  main: 0.016 GiB, peak in node update
    weights      policy           0.00171 GiB
    grads        policy           0.00171 GiB
    optimizer    policy           0.00342 GiB
    weights      ref              0.00171 GiB
    activations  update           0.00696 GiB
    logits       update           0.000488 GiB"""


def test_summary_on_ray_names_pools_workers_and_dispatch() -> None:
    # at 4 prompts x 4 samples and mini-batches of 8 (two optimizer steps: the old log-prob
    # forward runs; the shipped one-step graph elides it)
    text = plan_summary(plan_of(GRAPHS / "grpo.yaml", target="ray", nproc=2, device="cuda",
                                overrides=["dims.Bp=4", "dims.N=4",
                                           "nodes.update_actor.params.mini_batch_size=8"]))
    assert "  driver             1 process (the single controller)\n" in text
    assert ("  actor_rollout_ref  2 worker(s) on cuda, each {CPU: 1, GPU: 1}, placed PACK\n"
            in text)
    assert "model ref (frozen, FSDP-sharded 2 ways)" in text
    # the update takes the whole batch on every worker (`broadcast` from the driver,
    # `gather` from the pool's data-parallel nodes); between data-parallel nodes every
    # tensor is gathered and split again (`reshard`), the N samples of a prompt together
    assert "edges: 1 local, 3 split, 11 gather, 1 broadcast, 8 reshard (8 group-aligned)" in text
