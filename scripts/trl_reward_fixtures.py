"""Record what TRL 1.16's GRPOTrainer computes from two reward functions: per-function
rewards, their weighted sum, GRPO advantages and the logged `rewards/<fn>/mean|std`.

Run with the TRL venv (TRL is never a flowgraph dependency):

    /work/benchvenv/bin/python scripts/trl_reward_fixtures.py

It builds a word-level tokenizer and a tiny random Llama locally (no downloads), a
3-prompt dataset with the extra columns `solution` and `level`, in TRL's standard
(string prompts) and conversational (message lists) formats, and runs TRL's own
`GRPOTrainer._generate_and_score_completions` on it with generation replaced by fixed
completions (`_generate_single_turn`), so the numbers are deterministic; everything
after generation (decoding, `_calculate_rewards`, the None handling, `reward_weights`,
the group normalisation with TRL's default `scale_rewards="group"`, the metrics) is
TRL's code. The reward functions are `tests/fixtures/trl/rewards.py`, which
`tests/nodes/test_trl_rewards.py` gives flowgraph's `compute_score` and `grpo` nodes.
Writes `tests/fixtures/trl/grpo_rewards.json` and the tokenizer `tests/fixtures/trl/
tokenizer/`; rerunning it writes the same bytes.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import trl
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "trl"
sys.path.insert(0, str(OUT))
from rewards import brevity, correct  # noqa: E402  (the fixture's own functions)

N = 4
"""num_generations: completions per prompt."""
WEIGHTS = [1.0, 0.5]
"""reward_weights of (correct, brevity)."""
ROWS = [  # prompt, solution, level, the N completions
    ("what is two plus two", "four", "hard", ["four", "it is four", "five", ""]),
    ("say the color of the sky", "blue", "easy", ["blue", "the sky is blue", "green", ""]),
    ("name a number", "seven", "hard", ["seven", "seven", "seven", "seven"]),
]
# Row 0's empty completion: `correct` None, `brevity` -0.1 (its EOS token).
# Row 1 is `easy`: `brevity` None everywhere; its empty completion is None for both
# functions, unscorable (TRL: left out of the group's mean and std, advantage 0).
# Row 2: every completion equal, std 0, advantages 0.
SPECIALS = ["[PAD]", "[EOS]", "[UNK]"]
CHAT = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}")


def tokenizer() -> PreTrainedTokenizerFast:
    """Word-level: every word of ROWS one token, joined back with spaces."""
    words = sorted({w for p, s, lv, cs in ROWS for text in (p, s, lv, *cs)
                    for w in text.split()} | {"user", "assistant", ":"})
    vocab = {w: i for i, w in enumerate([*SPECIALS, *words])}
    word = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    word.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=word, pad_token="[PAD]",
                                  eos_token="[EOS]", unk_token="[UNK]")
    tok.chat_template = CHAT
    return tok


def record(tok: PreTrainedTokenizerFast, conversational: bool) -> dict[str, Any]:
    """TRL's numbers for ROWS, the prompts as strings or as one user message."""
    def prompt(text: str) -> Any:
        return [{"role": "user", "content": text}] if conversational else text

    data = Dataset.from_dict({"prompt": [prompt(p) for p, *_ in ROWS],
                              "solution": [s for _, s, _, _ in ROWS],
                              "level": [lv for _, _, lv, _ in ROWS]})
    ids = [[*tok(c, add_special_tokens=False).input_ids, tok.eos_token_id]
           for *_, cs in ROWS for c in cs]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id))
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(output_dir=tmp, per_device_train_batch_size=len(ids),
                          num_generations=N, reward_weights=WEIGHTS, beta=0.0,
                          max_completion_length=8, report_to="none", use_cpu=True,
                          logging_steps=1, save_strategy="no", bf16=False)
        trainer = GRPOTrainer(model=model, reward_funcs=[correct, brevity], args=args,
                              train_dataset=data, processing_class=tok)
        # Generation replaced by the fixed completions; everything after is TRL's.
        trainer._generate_single_turn = lambda *_, **__: (ids, None)  # type: ignore[method-assign]
        trainer.model.train()
        inputs = [dict(row) for row in data for _ in range(N)]  # RepeatSampler's order
        out = trainer._generate_and_score_completions(inputs)
    logs, metrics = trainer._logs, trainer._metrics["train"]
    per_func = torch.tensor([logs["rewards"][name] for name in trainer.reward_func_names]).T
    # The weighted sum as `_generate_and_score_completions` forms it (a local there).
    rewards = (per_func * trainer.reward_weights.unsqueeze(0)).nansum(dim=1)
    return {
        "prompts": [prompt(p) for p, *_ in ROWS for _ in range(N)],
        "columns": {"solution": [s for _, s, _, _ in ROWS for _ in range(N)],
                    "level": [lv for _, _, lv, _ in ROWS for _ in range(N)]},
        "completions": list(logs["completion"]),
        "completion_ids": ids,
        "rewards_per_func": {name: [None if math.isnan(v) else v for v in logs["rewards"][name]]
                             for name in trainer.reward_func_names},
        "rewards": rewards.tolist(),
        "advantages": out["advantages"].tolist(),
        "metrics": {k: v[-1] for k, v in sorted(metrics.items())
                    if k.startswith("reward") or k == "frac_reward_zero_std"},
    }


def main() -> None:
    tok = tokenizer()
    fixture = {
        "source": f"trl {trl.__version__} GRPOTrainer._generate_and_score_completions "
                  f"(scripts/trl_reward_fixtures.py)",
        "num_generations": N,
        "reward_weights": WEIGHTS,
        "scale_rewards": "group",
        "epsilon": 1e-4,
        "cases": {"standard": record(tok, False), "conversational": record(tok, True)},
    }
    tok.save_pretrained(OUT / "tokenizer")
    (OUT / "grpo_rewards.json").write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {OUT / 'grpo_rewards.json'}")


if __name__ == "__main__":
    main()
