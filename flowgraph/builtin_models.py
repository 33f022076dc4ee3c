"""The embedded tiny models, as plain architecture data (no torch).

`builtin:<name>` in a graph's `models.*.path` names one of these; the runtime builds
it from this config with random weights (and a locally trained BPE tokenizer), so a
fresh machine needs no download. head_dim = hidden_size / num_attention_heads = 64,
the smallest vLLM's CPU attention accepts. The compiler reads these numbers for its
memory estimate.

`tiny-lm` has its own LM head; `tiny-tied` is the same architecture with the LM head
tied to the input embeddings (`tie_word_embeddings`, as Llama-3.2-1B/3B, Qwen2.5-0.5B-3B
and Gemma): one parameter used twice, which every target keeps one parameter.

`tiny-lm-sft` is what real RL starts from: `tiny-lm` after supervised fine-tuning by the
project's own SFT graph (`SFT_RECIPE`, the same graph as graphs/sft.yaml), trained on
first use by the executors (`flowgraph.compilers.builtin_training`) and cached under a name
that carries the recipe's hash, so a changed recipe trains a new model. The recipe is
short on purpose: the model learns the answer format and reverses ~15% of the held-out
strings, which leaves the RL graphs something to improve.

`tiny-lm-calc` and `tiny-lm-guess` start the agent examples (graphs/agent_calculator.yaml,
graphs/agent_guess.yaml): `tiny-lm` after SFT on warm-up conversations
(`builtin:mul-sft`, `builtin:guess-sft`; `CALC_RECIPE`, `GUESS_RECIPE`);
`tiny-lm-calc-guess` starts graphs/agent_mixed.yaml, whose one dataset holds both tasks
(`builtin:calc-guess-sft`, `CALC_GUESS_RECIPE`).
"""

from __future__ import annotations

BUILTIN_MODELS: dict[str, dict[str, int | str | float]] = {
    "tiny-lm": {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
    "tiny-tied": {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
}
"""Name -> Hugging Face config fields."""

SFT_RECIPE = """\
# Supervised fine-tuning: cross-entropy on the response tokens (the prompt's carry no
# loss), the usual first stage before RL. This graph is the recipe of the embedded
# `builtin:tiny-lm-sft` (the RL graphs' start), short on purpose: after 60 steps the
# model answers in the task's format and reverses ~15% of the held-out strings.
#   flowgraph run graphs/sft.yaml
#   flowgraph export runs/sft --model policy -o sft-model   # then: models.actor.path=sft-model
version: 1
name: sft
dims: {Bp: 32, P: 16, T: 8}

models:
  policy:
    path: "builtin:tiny-lm"
    trainable: true
    optimizer: {lr: 1.0e-3, grad_clip: 1.0}

data:
  train: {kind: sft, path: "builtin:reverse"}

nodes:
  update:
    kind: sft_update
    model: policy
    inputs:
      prompts: train.prompts
      prompt_mask: train.prompt_mask
      responses: train.responses
      response_mask: train.response_mask
      loss_mask: train.loss_mask
    params: {mini_batch_size: 32, loss_agg_mode: token-mean}

trainer: {steps: 60, seed: 0, run_dir: runs/sft, checkpoint_every: 60, eval_every: 20}
"""
"""The SFT graph that trains `builtin:tiny-lm-sft`; graphs/sft.yaml is this text."""

def _agent_recipe(name: str, data: str, dims: str, steps: int, what: str) -> str:
    """The SFT graph that warms `tiny-lm` up for an agent example: the multi-turn `sft`
    rows of a built-in chat task, only the assistant turns trained (`loss_mask`)."""
    return f"""\
# {what}
version: 1
name: {name}
dims: {{{dims}}}

models:
  policy:
    path: "builtin:tiny-lm"
    trainable: true
    optimizer: {{lr: 3.0e-3, grad_clip: 1.0, warmup_steps: 40, schedule: cosine}}

data:
  train: {{kind: sft, path: "builtin:{data}"}}

nodes:
  update:
    kind: sft_update
    model: policy
    inputs:
      prompts: train.prompts
      prompt_mask: train.prompt_mask
      responses: train.responses
      response_mask: train.response_mask
      loss_mask: train.loss_mask
    params: {{mini_batch_size: 32, loss_agg_mode: token-mean}}

trainer: {{steps: {steps}, seed: 0, run_dir: runs/{name}, checkpoint_every: {steps}}}
"""


CALC_RECIPE = _agent_recipe(
    "sft-calc", "mul-sft", "Bp: 32, P: 8, T: 88", 800,
    "The warm-up of `builtin:tiny-lm-calc` (graphs/agent_calculator.yaml's start): half\n"
    "# the transcripts call the calculator with a Hermes tool call and answer with its\n"
    "# result, half answer at once. Measured (scripts/agent_sft_probe.py, temperature 1,\n"
    "# held-out problems): 50% of first turns call the tool, 99% of calls well formed,\n"
    "# 98% with the question's numbers, 99% of answers copy the result; direct answers\n"
    "# are never right.")
"""The SFT graph that trains `builtin:tiny-lm-calc`."""

GUESS_RECIPE = _agent_recipe(
    "sft-guess", "guess-sft", "Bp: 32, P: 12, T: 72", 400,
    "The warm-up of `builtin:tiny-lm-guess` (graphs/agent_guess.yaml's start): games of\n"
    "# guess the number (1-16), half by binary search, half one up or down at a time.\n"
    "# Measured (scripts/agent_sft_probe.py, temperature 1): 99% of games won within 9\n"
    "# guesses, 4.6 guesses on average (binary search alone: 3.4).")
"""The SFT graph that trains `builtin:tiny-lm-guess`."""

CALC_GUESS_RECIPE = _agent_recipe(
    "sft-calc-guess", "calc-guess-sft", "Bp: 32, P: 12, T: 88", 800,
    "The warm-up of `builtin:tiny-lm-calc-guess` (graphs/agent_mixed.yaml's start): the\n"
    "# calculator's transcripts and the guessing games in one table (1,000 and 512), so\n"
    "# one model plays both envs of one dataset.")
"""The SFT graph that trains `builtin:tiny-lm-calc-guess`."""

TRAINED_BUILTINS: dict[str, tuple[str, str]] = {
    "tiny-lm-sft": ("tiny-lm", SFT_RECIPE),
    "tiny-lm-calc": ("tiny-lm", CALC_RECIPE),
    "tiny-lm-guess": ("tiny-lm", GUESS_RECIPE),
    "tiny-lm-calc-guess": ("tiny-lm", CALC_GUESS_RECIPE),
}
"""Name -> (the built-in it starts from, the recipe graph that trains it; its model
`policy` is the result)."""

TRAINING_REVISION = 2
"""Hashed with a recipe into its cache folder's name: raised when flowgraph trains the
same recipe to other weights (2: Adam's fused kernel), so a model cached by an earlier
version is not taken for this version's."""

BUILTIN_PREFIX = "builtin:"


def builtin_config(path: str) -> dict[str, int | str | float] | None:
    """The config of `builtin:<name>`, or None if `path` names no embedded model."""
    if not path.startswith(BUILTIN_PREFIX):
        return None
    name = path[len(BUILTIN_PREFIX):]
    name = TRAINED_BUILTINS[name][0] if name in TRAINED_BUILTINS else name
    return BUILTIN_MODELS.get(name)


def recipe_hash(name: str) -> str:
    """Eight hex digits of a trained built-in's recipe and `TRAINING_REVISION`: part of
    its cache folder's name."""
    import hashlib

    keyed = f"{TRAINING_REVISION}\n{TRAINED_BUILTINS[name][1]}"
    return hashlib.sha256(keyed.encode()).hexdigest()[:8]


def held_out_path(path: str, eval_path: str | None) -> str | None:
    """Where a data source's held-out rows are: its `eval_path`, else a built-in task's
    `:test` split (`builtin:arith` -> `builtin:arith:test`); None when it has none."""
    if eval_path is None and path.startswith(BUILTIN_PREFIX) and path.count(":") == 1:
        return f"{path}:test"
    return eval_path
