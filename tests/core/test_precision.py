"""`models.<m>.dtype` and `models.<m>.offload` at compile time: the memory estimate of
each precision on local and fsdp(2), and where offload is refused (FG405).

Numbers by hand for builtin:tiny-lm (h 128, MLP 256, 2 layers, 2 heads of 64, V 512):
P = 459,392 parameters, of them the V x h = 65,536 LM head; one layer 164,096
(2*128*128 + 2*128*128 + 3*128*256 + 2*128); the weights matmuls read (autocast casts
them) 2 * (164,096 - 256) + 65,536 = 393,216.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flowgraph.choices import MODEL_DTYPES
from flowgraph.frontend import graph_from_yaml
from flowgraph.passes import compile_graph
from flowgraph.plan import ExecutionPlan

DPO = Path(__file__).resolve().parents[2] / "graphs" / "dpo.yaml"
P, HEAD = 459_392, 65_536
SHARD = (P - HEAD) // 2 + HEAD  # per worker of fsdp(2): 262,464


def _plan(*overrides: str, nproc: int | None = None) -> ExecutionPlan:
    result = compile_graph(DPO, target="fsdp" if nproc else "local", nproc=nproc,
                           overrides=list(overrides))
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]
    return result.plan


def _items(plan: ExecutionPlan) -> dict[tuple[str, str], int]:
    (pool,) = plan.memory
    return {(i.what, i.owner): i.bytes for i in pool.items}


# (what, owner) -> bytes; the reference is fp32 beside the fp32 policy, bf16 otherwise.
LOCAL = {
    "float32": {("weights", "policy"): 4 * P, ("grads", "policy"): 4 * P,
                ("optimizer", "policy"): 8 * P, ("weights", "ref"): 4 * P},
    # fp32 masters, grads and Adam moments; the update's bf16 casts of 393,216 weights
    "bfloat16": {("weights", "policy"): 4 * P, ("grads", "policy"): 4 * P,
                 ("optimizer", "policy"): 8 * P, ("weights", "ref"): 2 * P,
                 ("compute", "update"): 2 * 393_216},
    # bf16 parameters, gradients and both moments
    "pure_bf16": {("weights", "policy"): 2 * P, ("grads", "policy"): 2 * P,
                  ("optimizer", "policy"): 4 * P, ("weights", "ref"): 2 * P},
}
FSDP = {
    "float32": {("weights", "policy"): 4 * SHARD, ("grads", "policy"): 4 * SHARD,
                ("optimizer", "policy"): 8 * SHARD, ("weights", "ref"): 4 * SHARD},
    # FSDP2's bf16 unit and the one prefetched (2 layers) and the head's cast
    "bfloat16": {("weights", "policy"): 4 * SHARD, ("grads", "policy"): 4 * SHARD,
                 ("optimizer", "policy"): 8 * SHARD, ("weights", "ref"): 2 * SHARD,
                 ("compute", "update"): 2 * (2 * 164_096 + HEAD)},
    "pure_bf16": {("weights", "policy"): 2 * SHARD, ("grads", "policy"): 2 * SHARD,
                  ("optimizer", "policy"): 4 * SHARD, ("weights", "ref"): 2 * SHARD},
}


@pytest.mark.parametrize("nproc", [None, 2], ids=["local", "fsdp2"])
@pytest.mark.parametrize("dtype", [d for d in MODEL_DTYPES if d != "float16"])
def test_the_estimate_counts_what_each_precision_keeps(dtype: str, nproc: int | None) -> None:
    ref = "float32" if dtype == "float32" else "bfloat16"
    items = _items(_plan(f"models.policy.dtype={dtype}", f"models.ref.dtype={ref}",
                         nproc=nproc))
    expected = (FSDP if nproc else LOCAL)[dtype]
    assert {k: items.get(k) for k in expected} == expected
    assert any(what == "compute" for what, _ in items) == (dtype == "bfloat16")


def test_the_update_activations_of_each_precision() -> None:
    """dpo.yaml: 16 sequences of 24 tokens in one micro-batch, 2 layers: 768 layer-tokens.
    Per token and layer (`layer_activation_bytes`): fp32 2*128*12 + (3*128 + 2*128 +
    4*256)*4 = 9,728; pure bf16 2*128*8 + 1,664*2 = 5,376; bf16 under autocast (fp32
    residual stream and norms, one bf16 cast of a norm's output per projection reading
    it) 2*128*8 + 5*128*2 + 1,664*2 = 6,656."""
    per_token = {"float32": 9_728, "bfloat16": 6_656, "pure_bf16": 5_376}
    for dtype, bytes_ in per_token.items():
        items = _items(_plan(f"models.policy.dtype={dtype}"))
        assert items[("activations", "update")] == 768 * bytes_, dtype


def test_offloaded_state_leaves_the_device() -> None:
    """offload.params: only what FSDP keeps whole (the head) stays, with its gradient and
    moments; offload.optimizer alone: the moments are here while the update steps."""
    params = _items(_plan("models.policy.dtype=bfloat16", "models.policy.offload.params=true",
                          nproc=2))
    assert (params[("weights", "policy")], params[("grads", "policy")],
            params[("optimizer", "policy")]) == (4 * HEAD, 4 * HEAD, 8 * HEAD)
    optimizer = _items(_plan("models.policy.offload.optimizer=true", nproc=2))
    assert ("optimizer", "policy") not in optimizer
    assert optimizer[("optimizer", "update")] == 8 * SHARD


@pytest.mark.parametrize(("overrides", "nproc", "message"), [
    (("models.policy.offload.params=true",), None,
     "models.policy.offload: CPU offload moves the shards of an FSDP2-sharded model to host "
     "memory, and the local target runs whole models in one process"),
    (("models.policy.offload.optimizer=true",), 1,
     "models.policy.offload: CPU offload moves the shards of an FSDP2-sharded model to host "
     "memory, and model `policy` is not sharded over two or more workers"),
    (("models.ref.offload.optimizer=true",), 2,
     "models.ref.offload.optimizer: model `ref` is frozen and has no optimizer state"),
])
def test_offload_where_it_cannot_work_is_refused(overrides: tuple[str, ...],
                                                 nproc: int | None, message: str) -> None:
    result = compile_graph(DPO, target="fsdp" if nproc else "local", nproc=nproc,
                           overrides=list(overrides))
    errors = [d for d in result.diagnostics if d.is_error]
    assert result.plan is None and [d.code for d in errors] == ["FG405"]
    assert errors[0].message == message
    assert errors[0].pos is not None  # the override that set it


def test_offload_is_read_from_the_graph_file_and_written_back(tmp_path: Path) -> None:
    from flowgraph.frontend import graph_to_yaml

    text = DPO.read_text().replace(
        '    optimizer: {lr: 2.0e-3, grad_clip: 1.0}',
        '    optimizer: {lr: 2.0e-3, grad_clip: 1.0}\n    offload: {params: true}')
    graph = graph_from_yaml(text)
    policy = graph.model("policy")
    assert policy is not None and policy.offload is not None
    assert (policy.offload.params, policy.offload.optimizer) == (True, False)
    assert graph_from_yaml(graph_to_yaml(graph)) == graph
