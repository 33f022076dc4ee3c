"""The closed sets of names a graph file, a plan or a command may use, each defined once.

The IR's settings (`flowgraph.ir`), the built-in kinds' params, the plan verifier, the
CLI and the nodes import them from here (a list written twice drifts). A leaf module:
it imports nothing of flowgraph, so `nodes/` and `compilers/` can import it without the
core.
"""

from __future__ import annotations

from dataclasses import dataclass

TARGETS = ("local", "fsdp", "ray")
"""Executors a graph compiles for (`--target`)."""
DEVICES = ("cpu", "cuda")
"""Devices a plan runs on."""
RESOURCE_DEVICES = ("auto", *DEVICES)
"""A graph's `resources.device`: `auto` is cuda when available."""
PLACEMENT_STRATEGIES = ("pack", "spread", "strict_pack", "strict_spread")
"""How a pool's workers spread over the cluster's nodes (`resources.pools.<p>.strategy`):
Ray's placement-group strategies PACK, SPREAD, STRICT_PACK, STRICT_SPREAD."""
TENSOR_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the torch dtypes a model's tensors are held in (vLLM's names too)."""


@dataclass(frozen=True, slots=True)
class Precision:
    """What a `models.<m>.dtype` means: the dtype of what the optimizer trains (its master
    weights, their gradients and the optimizer's state) and the dtype the forward and
    backward passes compute in, which is also the dtype of a frozen model's weights and of
    the weights a rollout engine receives."""

    master: str
    """The trained parameters' dtype (a key of `TENSOR_BYTES`)."""
    compute: str
    """The compute dtype; where it differs from `master`, the executors cast on the fly
    (`flowgraph.compilers.build` says how on each target)."""
    doc: str

    @property
    def mixed(self) -> bool:
        """A trained model keeps masters in one dtype and computes in another."""
        return self.master != self.compute

    def params(self, trained: bool) -> str:
        """The dtype a model's parameters are loaded in: trained ones as masters, frozen
        ones (a reference, a LoRA model's base) in the compute dtype."""
        return self.master if trained else self.compute


MODEL_DTYPES = {
    "float32": Precision("float32", "float32", "fp32 everywhere"),
    "bfloat16": Precision(
        "float32", "bfloat16",
        "bf16 compute with fp32 master weights, fp32 gradients and fp32 optimizer state "
        "(FSDP2's MixedPrecisionPolicy on a sharded model, torch.autocast on a whole one; "
        "verl's and TRL's bf16); a frozen model is plain bf16"),
    "pure_bf16": Precision(
        "bfloat16", "bfloat16",
        "bf16 parameters, gradients and optimizer moments, no fp32 copy: half the memory of "
        "the state, and updates smaller than bf16's resolution are lost"),
    "float16": Precision("float16", "float16", "fp16 parameters and optimizer moments (no "
                                               "loss scaling)"),
}
"""A model's dtypes (`models.<m>.dtype`): what each keeps and computes in; the memory
estimate, the model loader, the sharding and the weight sync read them from here."""
ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "eager")
"""transformers' attention implementations a model may use."""
VARLEN_ATTENTION = ("flash_attention_2",)
"""Attention that runs packed sequences as sequences (varlen kernels, cu_seqlens from the
position ids) instead of one N x N masked block: pass `packing` turns packing on there."""
OPTIMIZERS = {"adamw": 2, "adam": 2, "sgd": 0}
"""Optimizers a trainable model may use, each with its state tensors per parameter, each
in the parameter's (master) dtype (the memory estimate): Adam keeps two moments, plain
SGD none."""
SCHEDULES = ("constant", "linear", "cosine")
"""Learning-rate decay after warm-up."""
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
"""What `trainer.loggers` may list: the per-step console line, `run_dir/metrics.jsonl`
(always written: resume and `flowgraph.run(...).rows` read it), and the experiment
trackers of `flowgraph.runtime.trackers`."""
ON_NONFINITE = ("stop", "skip")
"""`trainer.on_nonfinite`: what a batch with NaN/inf does."""
ADMISSIONS = ("block", "drop")
"""`trainer.admission` of asynchronous rollouts."""
OLD_LOG_PROBS = ("recompute", "rollout")
"""`trainer.old_log_prob` of asynchronous rollouts."""

KL_ESTIMATORS = ("kl", "abs", "mse", "low_var_kl")
"""Estimators of KL(pi || pi_ref) per token: k1, |k1|, k2 and k3 (Schulman's names)."""
KL_ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}
"""Other names the KL nodes accept for `KL_ESTIMATORS`."""
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")
"""DPO's loss variants, by TRL's names."""
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")
"""How token losses are averaged into one number (verl's `loss_agg_mode`)."""

ROUTE_COLUMN = "env_class"
"""The dataset column an `agent_rollout` with several `envs` reads each row's env from by
default (its `route_by`): SkyRL's name."""
ROUTE_ALIAS = "agent_name"
"""verl's name for that column (`AgentLoopManager` routes a row to the agent loop its
`agent_name` names): read where a row has no `ROUTE_COLUMN` and `route_by` is left at it."""

SHOW_TOOLS = ("template", "system", "none")
"""How an episode's tools reach its prompt (the `agent_rollout` kind's `show_tools`):
the chat template lists them (`apply_chat_template(tools=...)`; a template that does
not is refused), a system message flowgraph writes lists them
(`flowgraph.agent.render.tools_system_message`), or no prompt does (the model learned
its tools in training, or the env's own prompt describes them)."""
