"""TRL's names for what a graph sets: each `GRPOConfig` field a TRL user reaches for, its
default in TRL 1.16, and the flowgraph setting or param that does the same.

The one table of them: the YAML reader's unknown keys (FG003), the checker's unknown
params (FG112) and the Python builder's unknown keywords say which flowgraph name a TRL
name is (`trl_hint`), and the README's "From TRL" table is `markdown_table()` (held to it,
and each flowgraph name to a setting or param that exists, by tests/core/test_trl_names.py;
after a change, paste `python -c "from flowgraph.trl_names import markdown_table;
print(markdown_table())"` there).
A flowgraph name is `dims.<D>`, `trainer.<s>`, `resources.<s>`, `models.<m>.<s>` (also
`.optimizer.<s>`, `.lora`) or `<kind>.<param>`. A leaf module: it imports nothing of
flowgraph.

Defaults were read from trl/trainer/grpo_config.py, trl/trainer/base_config.py and
transformers' TrainingArguments as TRL 1.16 installs them (transformers 5), and recorded by
scripts/trl_names_fixture.py.
"""

from __future__ import annotations

from dataclasses import dataclass

ABSENT = "not in GRPOConfig"
"""A name TRL 1.16's GRPOConfig no longer has (older TRL, other TRL trainers)."""
TRAINER_ARG = "GRPOTrainer argument"
"""A name that is an argument of `GRPOTrainer`, not a GRPOConfig field."""


@dataclass(frozen=True, slots=True)
class TrlName:
    """One row: TRL names set together and what does the same in a graph."""

    trl: tuple[str, ...]
    """GRPOConfig fields."""
    defaults: tuple[str, ...]
    """Their defaults in TRL 1.16 (`str` of the value; `ABSENT`, `TRAINER_ARG`)."""

    def __post_init__(self) -> None:
        if len(self.defaults) != len(self.trl):
            raise ValueError(f"{self.trl}: one default per name")
    flowgraph: tuple[str, ...]
    """The flowgraph settings or params that do the same (the table's backticked names)."""
    meaning: str
    """What the flowgraph names mean, and where they differ from TRL's."""


TRL_NAMES = (
    TrlName(("num_generations",), ("8",), ("dims.N", "generate.n"),
            "samples per prompt; a step's batch is `dims.Bp` prompts x N (B = Bp*N "
            "sequences)"),
    TrlName(("per_device_train_batch_size", "gradient_accumulation_steps"), ("8", "1"),
            ("dims.Bp", "resources.nproc", "ppo_actor_update.micro_batch_size",
             "ppo_actor_update.mini_batch_size"),
            "TRL generates per_device_train_batch_size x gradient_accumulation_steps x world "
            "size completions at once (its generation batch, steps_per_generation at its "
            "default) and takes one optimizer step over them; here a step generates Bp*N "
            "sequences (Bp = that batch / num_generations), `resources.nproc` is the world "
            "size, `micro_batch_size` the sequences per forward/backward on one rank (TRL's "
            "per_device_train_batch_size) and `mini_batch_size` the sequences per optimizer "
            "step over all ranks (default null: the whole batch, one optimizer step, as TRL)"),
    TrlName(("beta",), ("0.0",), ("ppo_actor_update.kl_loss_coef", "kl_penalty.kl_coef"),
            "the KL coefficient: TRL's 0.0 loads no reference model; here a graph has a KL "
            "term only where it wires one: `ref_log_prob` into the update (a loss, weight "
            "`kl_loss_coef`, default 0.001, estimator `kl_loss_type: low_var_kl`, TRL's k3) "
            "or a `kl_penalty` node in the reward (`kl_coef`)"),
    TrlName(("epsilon", "epsilon_high"), ("0.2", "None"),
            ("ppo_actor_update.clip_ratio_low", "ppo_actor_update.clip_ratio_high"),
            "the clip range 1 - low <= ratio <= 1 + high; both default to 0.2"),
    TrlName(("loss_type",), ("dapo",), ("ppo_actor_update.loss_agg_mode",
                                     "ppo_actor_update.policy_loss"),
            "how token losses average: dapo -> `token-mean` (the default here), grpo -> "
            "`seq-mean-token-mean`, dr_grpo -> `seq-mean-token-sum-norm` (divided by T, "
            "TRL's max_completion_length); bnpo (per local batch) has none; cispo is "
            "`policy_loss: cispo`; sapo, luspo and vespo are not built in (a plugin's "
            "`@policy_loss`)"),
    TrlName(("scale_rewards",), ("group",), ("grpo.norm_by_std",),
            "group -> `norm_by_std: true` (the default), none -> false (Dr. GRPO); batch "
            "(the std over the whole batch) is not built in. TRL divides by std + 1e-4, "
            "flowgraph by std + `epsilon` (default 1e-6, verl's): `epsilon: 1.0e-4` gives "
            "TRL's advantages"),
    TrlName(("reward_funcs", "reward_weights"), (TRAINER_ARG, "None"),
            ("compute_score.fn", "compute_score.weights"),
            "a TRL reward function as it is (`completions`, `prompts`, `completion_ids`, "
            "the dataset's columns as keywords, `None` for a row it does not score), or a "
            "list of them; `weights` one number per function, their weighted sum skips "
            "`None` (TRL's nansum)"),
    TrlName(("num_iterations",), ("1",), ("ppo_actor_update.ppo_epochs",),
            "passes over each generated batch"),
    TrlName(("max_prompt_length", "max_completion_length"), (ABSENT, "512"),
            ("dims.P", "prompts.max_prompt_length", "prompts.truncation", "dims.T",
             "generate.max_new_tokens"),
            "prompt and response lengths: P is checked against the data before training "
            "(`truncation: error` refuses longer prompts; left or right cuts them), T binds "
            "the responses' length"),
    TrlName(("learning_rate", "warmup_steps", "max_grad_norm"), ("1e-06", "0", "1.0"),
            ("models.actor.optimizer.lr", "models.actor.optimizer.warmup_steps",
             "models.actor.optimizer.grad_clip"),
            "per trained model, the same defaults; warm-up counts training steps"),
    TrlName(("lr_scheduler_type",), ("linear",), ("models.actor.optimizer.schedule",),
            "`constant` (the default here: no decay), `linear` or `cosine` to 0 at "
            "`trainer.steps`, numerically transformers' schedules; they step once per training "
            "step, where TRL's step once per optimizer step"),
    TrlName(("max_steps", "num_train_epochs"), ("-1", "3.0"), ("trainer.steps",),
            "training steps (each generates, scores and updates once); data repeats as "
            "epochs as needed"),
    TrlName(("logging_steps",), ("10",), ("trainer.log_every",),
            "the console prints a line every this many steps (default 1; that step's "
            "numbers, where TRL averages over the interval); metrics.jsonl and the trackers "
            "get every step"),
    TrlName(("save_steps", "save_total_limit"), ("500", "None"),
            ("trainer.checkpoint_every", "trainer.max_checkpoints"),
            "checkpoint every this many steps (default 0: at the end only), keep the newest "
            "this many (default 2)"),
    TrlName(("report_to",), ("none",), ("trainer.loggers",),
            "where step rows go: default console, jsonl (always written) and tensorboard; "
            "wandb and mlflow on request"),
    TrlName(("peft_config",), (TRAINER_ARG,), ("models.actor.lora",),
            "LoRA on a trained model: a peft `LoraConfig` or a dict with its key names "
            "(`GraphBuilder.model(..., lora=...)`), in a graph file `{r, alpha, dropout, "
            "target_modules}`; peft fields flowgraph does not apply are refused"),
    TrlName(("seed",), ("42",), ("trainer.seed",), "the default here is 0"),
)
"""The "From TRL" table, row by row."""

def trl_name(name: str) -> TrlName | None:
    """The row of TRL's `name`, if it is one."""
    return next((row for row in TRL_NAMES if name in row.trl), None)


def trl_hint(name: str) -> str | None:
    """What a key or param called `name` is here, if it is one of TRL's names."""
    row = trl_name(name)
    if row is None:
        return None
    targets = ", ".join(f"`{t}`" for t in row.flowgraph)
    return f"`{name}` is TRL's name; here: {targets} — {row.meaning}"


def markdown_table() -> str:
    """The README's "From TRL" table."""
    lines = ["| TRL (GRPOConfig) | TRL 1.16 default | flowgraph | meaning here |",
             "|---|---|---|---|"]
    for row in TRL_NAMES:
        trl = ", ".join(f"`{t}`" for t in row.trl)
        ours = ", ".join(f"`{t}`" for t in row.flowgraph)
        lines.append(f"| {trl} | {', '.join(row.defaults)} | {ours} | {row.meaning} |")
    return "\n".join(lines) + "\n"
