"""Write tests/fixtures/trl/env_episodes.json: what TRL 1.16's GRPOTrainer does with an
`environment_factory` (tests/fixtures/trl/envs.py's `Guess`), the reference for
flowgraph's TRL adapter (`flowgraph.agent.adapters.TRLEnv`, tests/agent/test_adapters.py).

TRL's own `GRPOTrainer._generate_and_score_completions` runs on 2 rows x 2 generations with
generation replaced by scripted turns: `_generate_single_turn` returns one marker token per
turn and `parse_response` (TRL's tool-call parser) maps it to the scripted assistant
message, so the tool calls are known. Everything else is TRL's: the env pool, which
methods become tools, `reset(**row)` and how its string joins the prompt, the tool loop
(sync and async methods, a raising tool, an unknown tool, two calls in one turn), and
`get_reward` as a reward function over `environments`. Recorded: the tools' names and
schemas (transformers' `get_json_schema`, as the chat template gets them), each sample's
`reset` keywords and prompt after reset, its conversation, and its reward.

Run with the TRL venv (TRL is never a flowgraph dependency):

    /work/benchvenv/bin/python scripts/trl_env_fixtures.py

A word-level tokenizer and a tiny random Llama are built locally (no downloads); the chat
template renders tool calls and tool messages, as TRL requires of a tool-calling one.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import trl
import trl.trainer.grpo_trainer as grpo
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import get_json_schema
from trl import GRPOConfig, GRPOTrainer

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "trl"
sys.path.insert(0, str(FIXTURES))
from envs import Guess  # noqa: E402  (the fixture's environment)

N = 2
"""num_generations."""
ROWS = [{"prompt": [{"role": "user", "content": "Guess my number."}], "answer": 7,
         "quiet": False},
        {"prompt": [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Guess again."}], "answer": 5, "quiet": True}]
"""`quiet`: `reset` returns None, the prompt stays as it is."""


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


TURNS = [  # per sample (row 0 twice, row 1 twice), its assistant turns in order
    [[call("guess", n=3)], [call("guess", n=7)], "done"],
    [[call("guess", n=11)], [call("guess", m=1)], "give up"],   # out of range; bad keyword
    [[call("hint"), call("rules", verbose=True)], [call("guess", n=5)], "ok"],  # two calls
    [[call("peek")], "no"],                                      # no such tool
]
SPECIALS = ["[PAD]", "[EOS]", "[UNK]"]
MARKS = [f"t{s}{k}" for s, turns in enumerate(TURNS) for k in range(len(turns))]
CHAT = ("{% for m in messages %}{{ m['role'] }} : "
        "{% if m['content'] is string %}{{ m['content'] }}{% endif %}"
        "{% for c in m.get('tool_calls') or [] %} call {{ c['function']['name'] }} "
        "{{ c['function']['arguments'] | tojson }}{% endfor %} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}")


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate([*SPECIALS, *MARKS, "user", "assistant", "tool",
                                         "system", ":", "call"])}
    word = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    word.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=word, pad_token="[PAD]",
                                  eos_token="[EOS]", unk_token="[UNK]")
    tok.chat_template = CHAT
    tok.response_template = "scripted"  # parsing is `parse_response`, replaced below
    return tok


def message(turn: Any) -> dict[str, Any]:
    if isinstance(turn, str):
        return {"role": "assistant", "content": turn}
    return {"role": "assistant", "content": "", "tool_calls": turn}


class Script:
    """Scripted generation: each call answers the samples still calling tools, in order
    (TRL's `idxs_with_tool`), with their next turn's marker token."""

    def __init__(self, tok: PreTrainedTokenizerFast) -> None:
        self.tok = tok
        self.next = [0] * len(TURNS)
        self.active = list(range(len(TURNS)))
        self.by_id: dict[int, dict[str, Any]] = {}

    def generate(self, prompt_ids: list[list[int]], *_: Any, **__: Any) -> Any:
        assert len(prompt_ids) == len(self.active), (len(prompt_ids), self.active)
        ids = []
        for s in self.active:
            k = self.next[s]
            mark = self.tok.convert_tokens_to_ids(f"t{s}{k}")
            self.by_id[mark] = message(TURNS[s][k])
            self.next[s] += 1
            ids.append([mark, self.tok.eos_token_id])
        self.active = [s for s in self.active if not isinstance(TURNS[s][self.next[s] - 1], str)]
        return ids, None

    def parse(self, tok: Any, ids: list[int], prefix: Any = None, tools: Any = None) -> Any:
        return copy.deepcopy(self.by_id[ids[0]])


def main() -> None:
    tok = tokenizer()
    script = Script(tok)
    grpo.parse_response = script.parse  # TRL's parser of the model's tool calls
    data = Dataset.from_list(ROWS)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id))
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(output_dir=tmp, per_device_train_batch_size=len(ROWS) * N,
                          num_generations=N, beta=0.0, max_completion_length=512,
                          report_to="none", use_cpu=True, logging_steps=1,
                          save_strategy="no", bf16=False)
        trainer = GRPOTrainer(model=model, args=args, train_dataset=data,
                              processing_class=tok, environment_factory=Guess)
        trainer._generate_single_turn = script.generate  # type: ignore[method-assign]
        seen: dict[str, Any] = {}
        generate, tool_loop = trainer._generate, trainer._tool_call_loop

        def spy_generate(prompts: list[Any]) -> Any:
            seen["prompts"] = copy.deepcopy(prompts)
            return generate(prompts)

        def spy_tool_loop(*args: Any) -> Any:
            out = tool_loop(*args)
            seen["completions"] = copy.deepcopy(out[1])
            return out

        trainer._generate = spy_generate  # type: ignore[method-assign]
        trainer._tool_call_loop = spy_tool_loop  # type: ignore[method-assign]
        trainer.model.train()
        inputs = [dict(row) for row in data for _ in range(N)]  # RepeatSampler's order
        trainer._generate_and_score_completions(inputs)
    methods = trainer._env_tools[None]
    fixture = {
        "source": f"trl {trl.__version__} GRPOTrainer._generate_and_score_completions "
                  "(scripts/trl_env_fixtures.py)",
        "rows": [dict(r) for r in inputs],
        "tools": [get_json_schema(m) for m in methods],
        "reset_kwargs": [env.rows[-1] for env in trainer.environments],
        "prompts": seen["prompts"],
        "completions": seen["completions"],
        "rewards": list(trainer._logs["rewards"]["Guess"]),
        "environments_made": Guess.made,
    }
    out = FIXTURES / "env_episodes.json"
    out.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
