"""The closed sets of names a graph file, a plan or a command may use, each defined once.

The IR's settings (`flowgraph.ir`), the built-in kinds' params, the plan verifier, the
CLI and the nodes import them from here (a list written twice drifts). A leaf module:
it imports nothing, so `nodes/` and `compilers/` can import it without the core.
"""

from __future__ import annotations

TARGETS = ("local", "fsdp", "ray")
"""Executors a graph compiles for (`--target`)."""
DEVICES = ("cpu", "cuda")
"""Devices a plan runs on."""
RESOURCE_DEVICES = ("auto", *DEVICES)
"""A graph's `resources.device`: `auto` is cuda when available."""
MODEL_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""A model's parameter dtypes (`models.<m>.dtype`), each with its bytes per element (the
memory estimate)."""
ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "eager")
"""transformers' attention implementations a model may use."""
VARLEN_ATTENTION = ("flash_attention_2",)
"""Attention that runs packed sequences as sequences (varlen kernels, cu_seqlens from the
position ids) instead of one N x N masked block: pass `packing` turns packing on there."""
OPTIMIZERS = {"adamw": 8, "adam": 8, "sgd": 0}
"""Optimizers a trainable model may use, each with its bytes of state per parameter (the
memory estimate): Adam keeps two fp32 moments, plain SGD none."""
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
