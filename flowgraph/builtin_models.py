"""The embedded tiny models, as plain architecture data (no torch).

`builtin:<name>` in a graph's `models.*.path` names one of these; the runtime builds
it from this config with random weights (and a locally trained BPE tokenizer), so a
fresh machine needs no download. head_dim = hidden_size / num_attention_heads = 64,
the smallest vLLM's CPU attention accepts. The compiler reads these numbers for its
memory estimate.

`tiny-lm` has its own LM head; `tiny-tied` is the same architecture with the LM head
tied to the input embeddings (`tie_word_embeddings`, as Llama-3.2-1B/3B, Qwen2.5-0.5B-3B
and Gemma): one parameter used twice, which every target keeps one parameter.
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

BUILTIN_PREFIX = "builtin:"


def builtin_config(path: str) -> dict[str, int | str | float] | None:
    """The config of `builtin:<name>`, or None if `path` names no embedded model."""
    if not path.startswith(BUILTIN_PREFIX):
        return None
    return BUILTIN_MODELS.get(path[len(BUILTIN_PREFIX):])


def held_out_path(path: str, eval_path: str | None) -> str | None:
    """Where a data source's held-out rows are: its `eval_path`, else a built-in task's
    `:test` split (`builtin:arith` -> `builtin:arith:test`); None when it has none."""
    if eval_path is None and path.startswith(BUILTIN_PREFIX) and path.count(":") == 1:
        return f"{path}:test"
    return eval_path
