"""Pass `memory`: estimate the memory of each device of each pool, before anything starts.

Model sizes come from the model's config: the embedded `builtin:<name>` models, else
`<path>/config.json` when `path` is a local directory (read as JSON; no transformers
import), else `models.<name>.config`. Parameters are counted for a llama-style decoder
(`count_parameters`). Per device of a pool, with s = P+T tokens per sequence, h hidden
size, L layers, a attention heads, V vocabulary, m the micro-batch on one worker:

    weights      (params - head) x bytes / shards + head x bytes, bytes those of the
                 dtype the precision keeps them in (`flowgraph.choices.MODEL_DTYPES`):
                 a trained model's master dtype (fp32 for `bfloat16`), a frozen one's
                 compute dtype; a LoRA model's base in the compute dtype, its adapters
                 in the master dtype
    grads        as the trained weights, in the master dtype     (trainable models)
    optimizer    the trained weights x 2 x master bytes: AdamW's exp_avg and exp_avg_sq
                 (8 bytes a parameter in fp32, 4 in `pure_bf16`)
    compute      a mixed-precision model's bf16 copies while a node runs it: the weights
                 matmuls read (autocast's casts) on a whole model; FSDP2's gathered unit,
                 the prefetched one and the head's cast on a sharded one
    offload      `offload.params`: the shards, their grads and the optimizer state are in
                 host memory, not counted; `offload.optimizer`: the state counts while
                 the update runs only
    activations  training: L x s*m x (2h(4 + 2d) + (3q + 2kv + 4i) d) bytes with SDPA or
                 flash attention (transformers' default; d dtype bytes, q and kv = query
                 and KV heads x head dim, i the MLP width), plus a*s*(4 + d, or 4 in fp32) with
                 `attn_implementation: eager`, which keeps the softmaxed scores
                 (`layer_activation_bytes`: Korthikanti et al. 2022, eq. 1, counted for
                 a llama layer as it runs; under autocast an fp32 residual stream and a
                 cast of each norm's output per projection); with gradient
                 checkpointing each layer's input, s*m*h*d (d = 4 under autocast), plus
                 one layer's activations (sec. 4.1); inference:
                 one layer's activations. A packed node (`packing: true`) runs one row of
                 m*s tokens: the same per-token terms, and eager's scores over all m*s.
                 Nodes fused into one forward (pass `fusion`) count their rows together
                 (an upper bound where two of them read the same rows).
    logits       the fp32 logits of the tokens projected at once: 2 x min(1024, m x T)
                 x V x 4 in an update (a chunk and its gradient), min(chunk_size,
                 m x T) x V x 4 in a logprob node
    kv_cache     per-worker rollouts x s x L x 2 x kv_heads x head_dim x dtype bytes
    vllm         vLLM's KV cache for the rollout's sequences (`vllm_kv_cache_bytes`,
                 what the engine reserves) plus its own copy of the weights; with
                 `gpu_memory_utilization` set and `resources.memory_gib` declared,
                 that share of the device

An asynchronous plan on the local target adds its producer process, resident beside
the trainer: a copy of each model its nodes run (twice for a trained one: the
process's own and the shared-memory copy the trainer publishes into) and its largest
node's working memory.

`shards` is the pool's size for FSDP-sharded models, 1 otherwise; `head`, the V x h LM
head (tied or not) or the h scalar head, stays replicated on every worker as
compilers/targets/process_groups.py keeps it (`replicated_parameters`). Weights, grads and
optimizer state stay resident; the other items live while their node runs, and the
nodes of a pool run one at a time, so a device's peak is the resident memory plus
the largest node's. When `resources.memory_gib` is declared and a pool's peak exceeds
it, FG401 says by how much and what each fix would save, by estimating the changed
plan again.

One module past ~450 lines, on purpose: one pass, its memory model's formulas
(parameters, activations, KV cache) beside the pass that applies them; they are tested
through it and used nowhere else.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

from flowgraph.builtin_models import builtin_config
from flowgraph.checker import CheckResult
from flowgraph.checker.structure import Resolved, param_value
from flowgraph.choices import OPTIMIZERS, TENSOR_BYTES
from flowgraph.diagnostics import Diagnostic, error, warning
from flowgraph.frontend import with_params
from flowgraph.ir import Graph, LoraSpec, ModelSpec, NodeSpec, OptimizerSpec
from flowgraph.passes.program import (
    Placement,
    Program,
    graph_producer_side,
    producer_process,
    rollout_pool,
)
from flowgraph.plan import GIB, MemoryItem, ModelPlacement, PoolMemory, PoolPlan, gib
from flowgraph.registry import KindSpec
from flowgraph.spelling import Word, option

HEAD_CHUNK = 1024
"""Tokens an update projects onto the vocabulary at once (`head_logprob`'s chunk_size)."""
CONFIG_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "vocab_size")
CONFIG_MAX_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The architecture numbers the estimate needs (Hugging Face config names)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    tie_word_embeddings: bool = False

    @staticmethod
    def parse(fields: Mapping[str, object]) -> ModelConfig | str:
        """The config, or why it cannot be read."""
        bad = [k for k in CONFIG_FIELDS if not _positive_int(fields.get(k))]
        if bad:
            return f"the config lacks positive integer(s) {', '.join(bad)}"
        h, heads = int(str(fields["hidden_size"])), int(str(fields["num_attention_heads"]))
        kv = fields.get("num_key_value_heads", heads)
        head_dim = fields.get("head_dim") or h // heads
        if not _positive_int(kv) or not _positive_int(head_dim):
            return "num_key_value_heads and head_dim must be positive integers"
        return ModelConfig(h, int(str(fields["intermediate_size"])),
                           int(str(fields["num_hidden_layers"])), heads, int(str(kv)),
                           int(str(fields["vocab_size"])), int(str(head_dim)),
                           fields.get("tie_word_embeddings") is True)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def read_config(model: ModelSpec) -> ModelConfig | str:
    """The model's config from the first source that has one, or why none does."""
    builtin = builtin_config(model.path)
    if builtin is not None:
        return ModelConfig.parse(builtin)
    directory = Path(model.path)
    if directory.is_dir():
        return _config_json(directory / "config.json")
    if model.config.items:
        return ModelConfig.parse(model.config.to_python())
    return (f"`{model.path}` is neither a built-in model nor a local directory, and "
            f"`models.{model.name}.config` is empty")


def _config_json(file: Path) -> ModelConfig | str:
    try:
        if file.stat().st_size > CONFIG_MAX_BYTES:
            return f"{file} is larger than {CONFIG_MAX_BYTES} bytes"
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"cannot read {file}: {exc}"
    if not isinstance(data, dict):
        return f"{file} does not hold a JSON object"
    return ModelConfig.parse(data)


def count_parameters(cfg: ModelConfig, lm_head: bool = True) -> int:
    """Parameters of a llama-style decoder: embeddings, per layer q/k/v/o projections,
    gate/up/down MLP and two RMSNorms, the final norm, and the LM head (shared with the
    embeddings when tied) or a scalar h -> 1 head. No biases."""
    h = cfg.hidden_size
    q_dim = cfg.num_attention_heads * cfg.head_dim
    kv_dim = cfg.num_key_value_heads * cfg.head_dim
    attention = h * q_dim + 2 * h * kv_dim + q_dim * h
    mlp = 3 * h * cfg.intermediate_size
    layer = attention + mlp + 2 * h
    embeddings = cfg.vocab_size * h
    if not lm_head:
        head = h  # the scalar value / score head
    elif cfg.tie_word_embeddings:
        head = 0
    else:
        head = cfg.vocab_size * h
    return embeddings + cfg.num_hidden_layers * layer + h + head


def lora_parameters(cfg: ModelConfig, lora: LoraSpec) -> int:
    """Adapter parameters: r·(in + out) for every linear layer `lora.target_modules`
    names (by the last part of its name; `all-linear`: all seven of a llama layer)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q_dim = cfg.num_attention_heads * cfg.head_dim
    kv_dim = cfg.num_key_value_heads * cfg.head_dim
    shapes = {"q_proj": (h, q_dim), "k_proj": (h, kv_dim), "v_proj": (h, kv_dim),
              "o_proj": (q_dim, h), "gate_proj": (h, i), "up_proj": (h, i),
              "down_proj": (i, h)}
    every = "all-linear" in lora.target_modules
    per_layer = sum(lora.r * (a + b) for name, (a, b) in shapes.items()
                    if every or any(t.split(".")[-1] == name for t in lora.target_modules))
    return cfg.num_hidden_layers * per_layer


def layer_parameters(cfg: ModelConfig) -> int:
    """One decoder layer's parameters: attention and MLP projections, two RMSNorms."""
    h = cfg.hidden_size
    q_dim = cfg.num_attention_heads * cfg.head_dim
    kv_dim = cfg.num_key_value_heads * cfg.head_dim
    return 2 * h * q_dim + 2 * h * kv_dim + 3 * h * cfg.intermediate_size + 2 * h


def matmul_parameters(cfg: ModelConfig, lm_head: bool = True) -> int:
    """The weights matmuls read, which autocast casts: every layer's projections and the
    head (a tied head reads the embedding), not the embedding lookup or the norms."""
    norms = 2 * cfg.hidden_size
    head = cfg.vocab_size * cfg.hidden_size if lm_head else cfg.hidden_size
    return cfg.num_hidden_layers * (layer_parameters(cfg) - norms) + head


def replicated_parameters(cfg: ModelConfig, lm_head: bool = True) -> int:
    """Parameters FSDP leaves whole on every worker (compilers/targets/process_groups.py):
    the head, and a tied head's shared embedding, which costs the same V x h."""
    return cfg.vocab_size * cfg.hidden_size if lm_head else cfg.hidden_size


def layer_activation_bytes(cfg: ModelConfig, micro: int, seq: int, dtype_bytes: int,
                           attention: str = "sdpa", autocast: bool = False) -> int:
    """What one llama layer of transformers keeps for its backward pass, in bytes a token
    (d the dtype's bytes; measured by benchmarks/bench_memory.py):

        each RMSNorm  h(4 + 2d)   its input upcast to fp32, the normalised input cast back
                                  and the weighted output (all three in d when d = 4)
        attention     (3q + 2kv)d q, k, v after RoPE and the attention output (SDPA's
                                  saved tensors), o_proj's contiguous input (q = a x head
                                  dim, h in most models)
        MLP           4i d        gate, SiLU(gate), up, down's input

    Korthikanti et al. 2022 eq. 1 counts the same tensors for a GPT layer (LayerNorm,
    4h GELU MLP, dropout masks). `eager` attention also keeps the fp32 softmax of the
    scores, a*s a token, and its cast to d when d < 4: O(s²) in all; SDPA and flash
    attention recompute them in the backward pass from O(s) statistics (Dao et al.
    2022).

    Under `autocast` (a whole model in mixed precision: fp32 weights, bf16 matmuls) the
    residual stream stays fp32: each RMSNorm keeps its fp32 input and normalised input
    (8h), and every projection that reads a norm's output keeps its own cast of it in d
    (q, k, v and gate, up: 5hd); the rest is as above (measured by
    benchmarks/bench_memory.py, case bf16)."""
    h, d = cfg.hidden_size, dtype_bytes
    q, kv = (n * cfg.head_dim for n in (cfg.num_attention_heads, cfg.num_key_value_heads))
    norms = 2 * h * 8 + 5 * h * d if autocast else 2 * h * (4 + 2 * d)
    per_token = norms + (3 * q + 2 * kv + 4 * cfg.intermediate_size) * d
    if attention == "eager":
        per_token += cfg.num_attention_heads * seq * (4 + (d if d < 4 else 0))
    return seq * micro * per_token


def training_activation_bytes(cfg: ModelConfig, micro: int, seq: int, dtype_bytes: int,
                              checkpointing: bool, attention: str = "sdpa",
                              autocast: bool = False) -> int:
    layer = layer_activation_bytes(cfg, micro, seq, dtype_bytes, attention, autocast)
    if not checkpointing:
        return cfg.num_hidden_layers * layer
    # Full recompute keeps each layer's input (s*b*h elements; the fp32 residual stream
    # under autocast) and rebuilds one layer's activations at a time during the backward.
    residual = 4 if autocast else dtype_bytes
    inputs = cfg.num_hidden_layers * seq * micro * cfg.hidden_size * residual
    return inputs + layer


def kv_cache_bytes(cfg: ModelConfig, rows: int, seq: int, dtype_bytes: int) -> int:
    return (rows * seq * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim
            * dtype_bytes)


VLLM_KV_MARGIN = 1.25
"""Head-room over the exact need: vLLM allocates whole blocks and keeps a few spare."""
VLLM_BLOCK_TOKENS = 128
"""vLLM's KV block on CPU (its default there; 16 on most GPUs): a sequence takes whole
blocks, so its length is rounded up to a multiple of this."""


def vllm_kv_cache_bytes(cfg: ModelConfig, sequences: int, max_model_len: int,
                        dtype_bytes: int) -> int:
    """The KV cache a vLLM engine reserves (`kv_cache_memory_bytes`) to hold `sequences`
    sequences of `max_model_len` (P+T) tokens at once: `kv_cache_bytes` of whole blocks,
    times VLLM_KV_MARGIN."""
    tokens = -(-max_model_len // VLLM_BLOCK_TOKENS) * VLLM_BLOCK_TOKENS
    return math.ceil(kv_cache_bytes(cfg, sequences, tokens, dtype_bytes) * VLLM_KV_MARGIN)


# --- the pass ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Inputs:
    """What one estimate depends on; a what-if for a hint changes one of these."""

    graph: Graph
    placement: Placement
    kinds: dict[str, KindSpec]
    rows: dict[str, int]
    """Global rows (sequences) per node: its largest known batch axis."""
    configs: dict[str, ModelConfig]
    lm_head: dict[str, bool]
    seq: tuple[int, int] | None
    """(P, T), when both are bound."""
    producer: tuple[str, ...] = ()
    """The nodes of an asynchronous plan's producer process (target local), which run
    beside the trainer with models of their own; empty otherwise."""


@dataclass(frozen=True, slots=True)
class EstimateMemory:
    """Estimate memory per device and pool from model configs and dims; check it fits."""

    name: ClassVar[str] = "memory"
    requires: ClassVar[tuple[str, ...]] = ("infer_dims", "placement")

    def apply(self, program: Program) -> Program:
        assert program.placement is not None and program.check is not None
        placed = [m for p in program.placement.pools for m in p.models]
        diags: list[Diagnostic] = []
        configs: dict[str, ModelConfig] = {}
        for mp in placed:
            spec = program.graph.model(mp.name)
            assert spec is not None
            cfg = read_config(spec)
            if isinstance(cfg, str):
                diags.append(_no_config(spec, cfg))
            else:
                configs[mp.name] = cfg
        inp = _inputs(program, program.placement, program.check, configs)
        memory = tuple(_estimate_pool(inp, p) for p in program.placement.pools if p.models)
        memory += _rollout_pool_memory(inp, program)
        diags += [d for m in memory if (d := _unestimated_nodes(inp, m)) is not None]
        diags += [d for m in memory if (d := _over(inp, program, m)) is not None]
        return replace(program, memory=memory).add(*diags)


def _inputs(program: Program, placement: Placement, check: CheckResult,
            configs: dict[str, ModelConfig]) -> _Inputs:
    graph = program.graph
    dims = {d.name: d.value for d in program.dims}
    # A model run only with a scalar head (`KindSpec.head`: a critic, a reward model)
    # has no V x h projection.
    heads: dict[str, set[str]] = {}
    for n in graph.nodes:
        if n.model is not None:
            heads.setdefault(n.model, set()).add(program.kind(n.name).head)
    lm_head = {m: h != {"scalar"} for m, h in heads.items()}
    rows = {n.name: r for n in graph.nodes if (r := _rows(check, n.name)) is not None}
    for group in program.fused:  # one forward over the rows of the whole group
        total = sum(rows.get(n, 0) for n in group)
        rows |= {n: total for n in group if n in rows}
    seq = (dims["P"], dims["T"]) if "P" in dims and "T" in dims else None
    kinds = {n.name: program.kind(n.name) for n in graph.nodes}
    producer: tuple[str, ...] = ()
    if program.asynchronous and producer_process(program.target) \
            and program.schedule is not None:
        producer = graph_producer_side(graph, program.schedule.stages, kinds)
    return _Inputs(graph, placement, kinds, rows, configs, lm_head, seq, producer)


def _rows(check: CheckResult, name: str) -> int | None:
    """The node's largest known batch axis over its inputs and outputs (a generate's
    outputs hold n rows per prompt)."""
    env = check.shapes.env
    sizes = [check.shapes.batch.get(name)]
    sizes += [env.value(s.dims[0]) for (node, _), s in check.shapes.outputs.items()
              if node == name and s.dims]
    return max((s for s in sizes if s is not None), default=None)


def _estimate_pool(inp: _Inputs, pool: PoolPlan) -> PoolMemory:
    """The memory of one device of `pool`."""
    items: list[MemoryItem] = []
    missing = [m.name for m in pool.models if m.name not in inp.configs]
    for mp in pool.models:
        if mp.name in inp.configs:
            items += _state_items(inp, pool, mp)
    _add_nodes(inp, pool, [n for n in inp.graph.nodes if _runs_in(inp, n, pool)], items,
               missing)
    return PoolMemory.of(pool.name, items + _producer_items(inp, pool, items),
                         tuple(missing))


def _add_nodes(inp: _Inputs, pool: PoolPlan, nodes: list[NodeSpec], items: list[MemoryItem],
               missing: list[str]) -> None:
    """The working memory of `nodes` (those whose model is known) on `pool`, into
    `items`; a node whose memory cannot be told, into `missing`."""
    for node in nodes:
        if node.model not in inp.configs:
            continue
        node_items = _node_items(inp, pool, node)
        if node_items is None:
            missing.append(node.name)
        else:
            items += node_items


def _producer_items(inp: _Inputs, pool: PoolPlan, items: list[MemoryItem]
                    ) -> list[MemoryItem]:
    """An asynchronous plan's producer process, resident beside the trainer: its own
    copy of every model its nodes run (and of a trained one, the shared-memory copy the
    trainer publishes into), and its largest node's working memory, as it runs while
    the trainer's nodes do."""
    nodes = [n for n in inp.graph.nodes if n.name in inp.producer and _runs_in(inp, n, pool)]
    out: list[MemoryItem] = []
    for name in sorted({n.model for n in nodes if n.model in inp.configs}):
        weights = sum(i.bytes for i in items if i.what == "weights" and i.owner == name)
        model = inp.graph.model(name)
        copies = 2 if model is not None and model.trainable else 1
        out += [MemoryItem("weights", f"{name} (rollout process)", copies * weights, False)]
    working = {n.name: sum(i.bytes for i in items if i.transient and i.owner == n.name)
               for n in nodes}
    if working and max(working.values()) > 0:
        node = max(working, key=lambda n: working[n])
        out.append(MemoryItem("activations", f"{node} (rollout process)", working[node], False))
    return out


def _rollout_pool_memory(inp: _Inputs, program: Program) -> tuple[PoolMemory, ...]:
    """The rollout pool of an asynchronous plan on ray (`program.rollout_pool`): its
    whole copy of each model the producer runs (weights only: no optimizer), and the
    working memory of the producer's model nodes on the whole batch."""
    if not program.asynchronous or program.schedule is None or program.placement is None:
        return ()
    producer = graph_producer_side(inp.graph, program.schedule.stages, inp.kinds)
    nodes = [n for n in inp.graph.nodes if n.name in producer and n.model is not None
             and inp.kinds[n.name].model != "none" and inp.kinds[n.name].head != "tokenizer"]
    pool = rollout_pool(program.target, program.placement.pools, {n.model for n in nodes
                        if n.model is not None}, program.device,
                        inp.graph.resources.rollout_cpus)
    if pool is None:
        return ()
    items = [i for m in pool.models if m.name in inp.configs
             for i in _state_items(inp, pool, m) if i.what == "weights"]
    missing = [m.name for m in pool.models if m.name not in inp.configs]
    _add_nodes(inp, pool, nodes, items, missing)
    return (PoolMemory.of(pool.name, items, tuple(missing)),)


def _runs_in(inp: _Inputs, node: NodeSpec, pool: PoolPlan) -> bool:
    return (inp.kinds[node.name].model == "required"
            and inp.placement.of(node.name).pool == pool.name)


def _state_items(inp: _Inputs, pool: PoolPlan, placed: ModelPlacement) -> list[MemoryItem]:
    """Weights, and a trained model's gradients and optimizer state (a LoRA model's:
    its adapters'); a LoRA model's base (`base_of`) holds nothing of its own.

    Per `models.<m>.dtype` (`flowgraph.choices.MODEL_DTYPES`): what the optimizer trains
    (the whole model, or a LoRA model's adapters) is held in the master dtype, with
    gradients and each optimizer state tensor in it too; the rest (a frozen model, a LoRA
    base) in the compute dtype. `offload.params` keeps the shards, their gradients and
    the optimizer state in host memory: only what FSDP leaves whole (the head) stays
    here; `offload.optimizer` alone brings the state here for the update's steps only
    (an item of each update node that trains the model)."""
    name = placed.name
    model = inp.graph.model(name)
    assert model is not None
    if placed.base_of is not None:
        return []
    cfg, lm_head, shards = inp.configs[name], inp.lm_head.get(name, True), pool.shards(name)
    precision, offload = model.precision, model.offload
    on_host = offload is not None and offload.params and shards > 1
    head = replicated_parameters(cfg, lm_head)
    adapters = lora_parameters(cfg, model.lora) / shards if model.lora else 0
    shard = (count_parameters(cfg, lm_head) - head) / shards
    own = (0 if on_host else shard) + head  # the model's own weights on this device
    master = TENSOR_BYTES[precision.master]
    weights = own * TENSOR_BYTES[precision.params(model.trainable and not model.lora)]
    items = [MemoryItem("weights", name, math.ceil(weights + (0 if on_host else adapters)
                                                   * master), False)]
    if not model.trainable:
        return items
    trained = (0 if on_host else adapters) if model.lora else own
    state = trained * OPTIMIZERS[(model.optimizer or OptimizerSpec()).name] * master
    items.append(MemoryItem("grads", name, math.ceil(trained * master), False))
    if offload is None or not offload.optimizer or offload.params:
        return [*items, MemoryItem("optimizer", name, math.ceil(state), False)]
    return items + [MemoryItem("optimizer", n.name, math.ceil(state), True)
                    for n in inp.graph.nodes if n.model == name and inp.kinds[n.name].trains]


def _compute_items(inp: _Inputs, pool: PoolPlan, node: NodeSpec) -> list[MemoryItem]:
    """The compute-dtype copies of a mixed-precision model's fp32 masters while a node runs
    it (`dtype: bfloat16`, trained): autocast's cast of every weight a matmul reads (the
    layers' projections and the head), kept while the node runs, on a whole model; on a
    sharded one, FSDP2's all-gathered bf16 unit and the one prefetched beside it (two
    layers), and the head's cast. A LoRA model casts only its fp32 adapters."""
    assert node.model is not None
    model, cfg = inp.graph.model(node.model), inp.configs[node.model]
    assert model is not None
    if not model.trainable or not model.precision.mixed:
        return []
    lm_head = inp.lm_head.get(node.model, True)
    shards = pool.shards(node.model)
    if model.lora is not None:
        cast = lora_parameters(cfg, model.lora) / shards
    elif shards > 1:
        cast = 2 * layer_parameters(cfg) + replicated_parameters(cfg, lm_head)
    else:
        cast = matmul_parameters(cfg, lm_head)
    return [MemoryItem("compute", node.name,
                       math.ceil(cast * TENSOR_BYTES[model.precision.compute]), True)]


def _node_items(inp: _Inputs, pool: PoolPlan, node: NodeSpec) -> list[MemoryItem] | None:
    """Transient memory of one model node; None when its dims are not bound."""
    per_worker = _per_worker(inp, pool, node)
    if per_worker is None or inp.seq is None:
        return None
    kind = inp.kinds[node.name]
    if kind.category == "rollout":
        return _rollout_items(inp, node, kind, per_worker) + _compute_items(inp, pool, node)
    micro = _micro(node, kind, per_worker, inp.rows.get(node.name))[0]
    budget = _int_param(node, kind, "max_token_len")
    if budget is not None:  # rows x the padded length <= budget: full-length rows at most
        micro = min(micro, max(budget // (sum(inp.seq) * kind.sequences_per_row), 1))
    compute = _compute_items(inp, pool, node)
    if kind.trains:
        return _training_items(inp, pool, node, kind, micro) + compute
    return _forward_items(inp, pool, node, kind, micro) + compute


def _per_worker(inp: _Inputs, pool: PoolPlan, node: NodeSpec) -> int | None:
    rows = inp.rows.get(node.name)
    if rows is None:
        return None
    dp = pool.size if inp.placement.of(node.name).data_parallel else 1
    return -(-rows // dp)


def _int_param(node: NodeSpec, kind: KindSpec, name: str) -> int | None:
    value = param_value(Resolved(node, kind), name)
    return value if isinstance(value, int) and _positive_int(value) else None


def _micro(node: NodeSpec, kind: KindSpec, per_worker: int, rows: int | None
           ) -> tuple[int, int]:
    """(micro-batch, what it must divide): the sequences one worker runs per forward (and
    backward) pass. An update's micro-batch defaults to the worker's share of its
    (global) mini-batch, which defaults to the whole batch; a forward node's to the
    worker's batch."""
    mini = _int_param(node, kind, "mini_batch_size") if kind.trains else None
    workers = rows // per_worker if rows and per_worker and rows >= per_worker else 1
    limit = max(mini // workers, 1) if mini else per_worker
    return _int_param(node, kind, "micro_batch_size") or limit, limit


def _training_items(inp: _Inputs, pool: PoolPlan, node: NodeSpec, kind: KindSpec, micro: int
                    ) -> list[MemoryItem]:
    assert inp.seq is not None and node.model is not None
    model, cfg = inp.graph.model(node.model), inp.configs[node.model]
    assert model is not None
    p, t = inp.seq
    m = micro * kind.sequences_per_row  # DPO: chosen and rejected in one forward
    rows, seq = _forward_shape(node, kind, m, p + t)
    act = training_activation_bytes(cfg, rows, seq, TENSOR_BYTES[model.precision.compute],
                                    model.gradient_checkpointing, model.attn_implementation,
                                    _autocast(inp, pool, node.model))
    items = [MemoryItem("activations", node.name, act, True)]
    if inp.lm_head.get(node.model, True):
        # The update projects its tokens HEAD_CHUNK at a time (`head_logprob`), each chunk
        # but the last (kept) recomputed in the backward pass: one chunk's fp32 logits and
        # their gradient live at once.
        chunk = min(HEAD_CHUNK, m * t)
        items.append(MemoryItem("logits", node.name, 2 * chunk * cfg.vocab_size * 4, True))
    return items


def _forward_items(inp: _Inputs, pool: PoolPlan, node: NodeSpec, kind: KindSpec, micro: int
                   ) -> list[MemoryItem]:
    assert inp.seq is not None and node.model is not None
    model, cfg = inp.graph.model(node.model), inp.configs[node.model]
    assert model is not None
    p, t = inp.seq
    act = layer_activation_bytes(cfg, *_forward_shape(node, kind, micro, p + t),
                                 TENSOR_BYTES[model.precision.compute],
                                 model.attn_implementation, _autocast(inp, pool, node.model))
    items = [MemoryItem("activations", node.name, act, True)]
    if inp.lm_head.get(node.model, True):
        tokens = micro * t
        chunk = min(_int_param(node, kind, "chunk_size") or tokens, tokens)
        items.append(MemoryItem("logits", node.name, chunk * cfg.vocab_size * 4, True))
    return items


def _autocast(inp: _Inputs, pool: PoolPlan, model_name: str) -> bool:
    """The model's nodes run under autocast over fp32 weights (a trained mixed-precision
    model held whole; sharded, FSDP2 hands its layers bf16 weights: plain bf16)."""
    model = inp.graph.model(model_name)
    assert model is not None
    return (model.trainable and model.precision.mixed and model.lora is None
            and pool.shards(model_name) == 1)


def _forward_shape(node: NodeSpec, kind: KindSpec, rows: int, seq: int) -> tuple[int, int]:
    """(rows, tokens a row) of a forward of `rows` sequences of `seq` tokens at most: one
    row of them all when the node packs its sequences."""
    packed = param_value(Resolved(node, kind), "packing") is True
    return (1, rows * seq) if packed else (rows, seq)


def _rollout_items(inp: _Inputs, node: NodeSpec, kind: KindSpec, per_worker: int
                   ) -> list[MemoryItem]:
    assert inp.seq is not None and node.model is not None
    model, cfg = inp.graph.model(node.model), inp.configs[node.model]
    assert model is not None
    dtype = TENSOR_BYTES[model.precision.compute]
    if param_value(Resolved(node, kind), "backend") != "vllm":
        return [MemoryItem("kv_cache", node.name, kv_cache_bytes(cfg, per_worker, sum(inp.seq),
                                                                 dtype), True)]
    declared, util = inp.graph.resources.memory_gib, _utilization(node, kind)
    if declared is not None and util is not None:
        return [MemoryItem("vllm", node.name, int(util * declared * GIB), False)]
    # vLLM's KV cache sized for the rollout (the default), plus its own copy of the weights.
    kv = vllm_kv_cache_bytes(cfg, per_worker, sum(inp.seq), dtype)
    copy = count_parameters(cfg) * dtype
    return [MemoryItem("kv_cache", node.name, kv, False),
            MemoryItem("vllm", node.name, copy, False)]


def _utilization(node: NodeSpec, kind: KindSpec) -> float | None:
    value = param_value(Resolved(node, kind), "gpu_memory_utilization")
    return float(value) if isinstance(value, (int, float)) else None


# --- diagnostics ---------------------------------------------------------------------------


def _no_config(model: ModelSpec, why: str) -> Diagnostic:
    fields = ", ".join((*CONFIG_FIELDS, "num_key_value_heads"))
    return warning("FG402", f"cannot estimate memory for model `{model.name}`: {why}",
                   model.pos, hint=f"point `path` at a local directory with a config.json, or "
                   f"give `models.{model.name}.config: {{{fields}}}`; the estimate leaves "
                   "this model out")


def _unestimated_nodes(inp: _Inputs, mem: PoolMemory) -> Diagnostic | None:
    nodes = [n for n in mem.missing if inp.graph.node(n) is not None]
    if not nodes:
        return None
    bound = {d.name for d in inp.graph.dims if d.value is not None}
    unbound = [d for d in ("Bp", "N", "P", "T") if d not in bound]
    return warning("FG402", f"cannot estimate the activation memory of {', '.join(nodes)} in "
                   f"pool `{mem.pool}`: the dims of their batch or sequence ({', '.join(unbound)}"
                   ") are not all bound", inp.graph.dims[0].pos if inp.graph.dims else None,
                   hint="bind them under `dims:` (max_new_tokens binds T, max_prompt_length P)")


def _over(inp: _Inputs, program: Program, mem: PoolMemory) -> Diagnostic | None:
    declared = inp.graph.resources.memory_gib
    if declared is None or mem.total_bytes <= declared * GIB:
        return None
    if mem.pool not in {p.name for p in inp.placement.pools}:  # the rollout pool
        return error(
            "FG401", f"plan needs {gib(mem.total_bytes)} on the device of the rollout pool "
            f"`{mem.pool}`, declared {gib(declared * GIB)}", inp.graph.resources.pos,
            expected=f"<= {gib(declared * GIB)} per device", actual=gib(mem.total_bytes),
            hint="run fewer rows per rollout (dims.Bp, dims.N), or declare "
                 f"resources.memory_gib >= {math.ceil(mem.total_bytes / GIB * 1000) / 1000:g}")
    pool = inp.placement.pool(mem.pool)
    counted = [i for i in mem.items if not i.transient or i.owner == mem.peak_node]
    largest = sorted(counted, key=lambda i: -i.bytes)[:4]
    need_gib = math.ceil(mem.total_bytes / GIB * 1000) / 1000
    return error(
        "FG401", f"plan needs {gib(mem.total_bytes)} on each device of pool `{pool.name}`, "
        f"declared {gib(declared * GIB)}: over by {gib(mem.total_bytes - declared * GIB)}",
        inp.graph.resources.pos, expected=f"<= {gib(declared * GIB)} per device",
        actual=gib(mem.total_bytes),
        notes=tuple(f"{i.what} of {i.owner}: {gib(i.bytes)}" for i in largest),
        hint="; ".join([*_fixes(inp, program, pool, mem),
                        f"or declare resources.memory_gib >= {need_gib:g}"]))


Option = tuple[_Inputs, PoolPlan, str]
"""The changed estimate inputs, the changed pool, and the change in words ('' if none)."""


def _fixes(inp: _Inputs, program: Program, pool: PoolPlan, mem: PoolMemory) -> list[str]:
    """Each applicable change with what it saves per device of this pool, largest first.
    Savings come from estimating the changed plan again, so a change that only moves the
    peak to another node claims no more than it really saves."""
    options = [_smaller_micro_batches(inp, pool), _checkpointing(inp, pool),
               _less_vllm(inp, pool), _more_workers(inp, program, pool)]
    found = [(mem.total_bytes - _estimate_pool(changed, p).total_bytes, text)
             for changed, p, text in options if text]
    return [f"{text} (saves {gib(saved)})" for saved, text in sorted(found, reverse=True)
            if saved > 0]


def _smaller_micro_batches(inp: _Inputs, pool: PoolPlan) -> Option:
    """Every node of the pool with a micro-batch takes the next smaller valid one."""
    graph, changes = inp.graph, []
    for node in inp.graph.nodes:
        kind = inp.kinds[node.name]
        per_worker = _per_worker(inp, pool, node)
        if per_worker is None or kind.param("micro_batch_size") is None \
                or not _runs_in(inp, node, pool):
            continue
        micro, limit = _micro(node, kind, per_worker, inp.rows.get(node.name))
        # The largest smaller micro-batch that still divides the mini-batch (FG303).
        smaller = max((d for d in range(1, micro) if limit % d == 0), default=None)
        if smaller is not None:
            graph = _with_node(graph, with_params(node, micro_batch_size=smaller))
            changes.append(f"{node.name} {micro}→{smaller}")
    text = f"set params.micro_batch_size of {', '.join(changes)}" if changes else ""
    return replace(inp, graph=graph), pool, text


def _checkpointing(inp: _Inputs, pool: PoolPlan) -> Option:
    names = {m.name for m in pool.models}
    off = [m.name for m in inp.graph.models
           if m.name in names and m.trainable and not m.gradient_checkpointing]
    models = tuple(replace(m, gradient_checkpointing=True) if m.name in off else m
                   for m in inp.graph.models)
    text = ", ".join(f"models.{m}.gradient_checkpointing: true" for m in off)
    return replace(inp, graph=replace(inp.graph, models=models)), pool, text and f"set {text}"


def _less_vllm(inp: _Inputs, pool: PoolPlan) -> Option:
    graph, changes = inp.graph, []
    for node in inp.graph.nodes:
        kind = inp.kinds[node.name]
        if not _runs_in(inp, node, pool) or param_value(Resolved(node, kind), "backend") != "vllm":
            continue
        util = _utilization(node, kind)
        if util is None:  # a KV cache sized for the rollout: nothing to give back
            continue
        graph = _with_node(graph, with_params(node, gpu_memory_utilization=util / 2))
        changes.append(f"{node.name} {util:g}→{util / 2:g}")
    text = f"set params.gpu_memory_utilization of {', '.join(changes)}" if changes else ""
    return replace(inp, graph=graph), pool, text


def _more_workers(inp: _Inputs, program: Program, pool: PoolPlan) -> Option:
    """Twice the workers: sharded state and per-worker batches halve."""
    local = program.target == "local"
    size = 2 if local else pool.size * 2
    models = tuple(replace(m, sharding="full_shard") for m in pool.models) if local \
        else pool.models
    bigger = replace(pool, size=size, models=models, bundles=pool.bundles[:1] * size)
    nodes = tuple(replace(n, data_parallel=True) if n.pool == pool.name else n
                  for n in inp.placement.nodes)
    placement = Placement(tuple(bigger if p is pool else p for p in inp.placement.pools), nodes)
    if not _splits_evenly(inp, pool, size):
        text = ""
    elif local:
        text = f"compile with {option('target', 'fsdp')} {option('nproc', 2)}"
    elif any(p.name == pool.name for p in inp.graph.resources.pools):
        text = f"set resources.pools.{pool.name}.size {pool.size}→{size}"
    else:
        text = f"use {option('nproc', Word(f'{pool.size}→{size}'))}"
    return replace(inp, placement=placement), bigger, text


def _splits_evenly(inp: _Inputs, pool: PoolPlan, size: int) -> bool:
    """The batch arithmetic `validate` checks (FG301) still holds with `size` workers."""
    for node in inp.graph.nodes:
        kind, rows = inp.kinds[node.name], inp.rows.get(node.name)
        if not kind.trains or rows is None or not _runs_in(inp, node, pool):
            continue
        mini = _int_param(node, kind, "mini_batch_size") or rows
        if rows % size or rows % mini or mini % size:
            return False
    return True


def _with_node(graph: Graph, node: NodeSpec) -> Graph:
    return replace(graph, nodes=tuple(node if n.name == node.name else n for n in graph.nodes))
