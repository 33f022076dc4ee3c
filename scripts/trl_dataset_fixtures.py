"""Write tests/fixtures/trl/dataset_formats.json: TRL 1.16's prompts of its dataset formats.

TRL's trainers read a dataset in one of its formats: *standard* (`prompt` a string:
raw text, tokenized by the tokenizer's call, as GRPOTrainer does) or *conversational*
(`prompt` a list of messages: the chat template with the generation prompt,
`apply_chat_template(..., add_generation_prompt=True, tokenize=True)`); preference
pairs with an explicit `prompt`, or the *implicit-prompt* format (only `chosen` and
`rejected`, the prompt their shared prefix: `extract_prompt`), tokenized as
DPOTrainer's `tokenize_fn` does (prompt ids; each response the ids the template adds
after the prompt). For each row this records TRL's extracted prompt, its text
(`maybe_apply_chat_template`) and token ids; tests/nodes/test_trl_formats.py holds the
`prompts` and `preferences` data kinds to them, with the same tiny tokenizer (the
embedded `builtin:tiny-lm` BPE and its chat template; nothing is downloaded).

Run (TRL is not a dependency of flowgraph; its venv has torch and transformers):

    PYTHONPATH=. /work/benchvenv/bin/python scripts/trl_dataset_fixtures.py

Made with TRL 1.16.0, transformers of that venv.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trl
from trl.data_utils import extract_prompt, is_conversational, maybe_apply_chat_template

from flowgraph.nodes.models import build_tiny_tokenizer

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "trl" / "dataset_formats.json"


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


STANDARD = [{"prompt": "1+1="}, {"prompt": "reverse 381"}, {"prompt": "The sky is"}]
CONVERSATIONAL = [
    {"prompt": [_msg("user", "1+1=")]},
    {"prompt": [_msg("system", "answer briefly"), _msg("user", "reverse 381")]},
]
IMPLICIT = [
    {"chosen": [_msg("user", "What color is the sky?"), _msg("assistant", "It is blue.")],
     "rejected": [_msg("user", "What color is the sky?"), _msg("assistant", "It is green.")]},
    {"chosen": [_msg("user", "reverse 12"), _msg("assistant", "21"),
                _msg("user", "reverse 345"), _msg("assistant", "543")],
     "rejected": [_msg("user", "reverse 12"), _msg("assistant", "21"),
                  _msg("user", "reverse 345"), _msg("assistant", "345")]},
]
IMPLICIT_STANDARD = [{"chosen": "The sky is blue.", "rejected": "The sky is green."}]


def _prompt_ids(tok: Any, prompt: str | list[dict[str, str]]) -> list[int]:
    """GRPOTrainer's prompt ids (DPOTrainer's `_tokenize` reads them the same way)."""
    if isinstance(prompt, str):
        return list(tok(text=prompt)["input_ids"])
    out = tok.apply_chat_template(conversation=[prompt], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)
    return list(out["input_ids"][0])


def _prompts(tok: Any, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"row": row, "conversational": is_conversational(row),
             "prompt_text": maybe_apply_chat_template(row, tok)["prompt"],
             "prompt_ids": _prompt_ids(tok, row["prompt"])} for row in rows]


def _pairs(tok: Any, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """DPOTrainer's rows: the extracted prompt, its ids, and (conversational) each
    response's ids after the prompt: the template's text of prompt + response, less the
    prompt's."""
    out = []
    for row in rows:
        pair = extract_prompt(row)
        record = {"row": row, "extracted": pair,
                  "prompt_text": maybe_apply_chat_template(pair, tok)["prompt"],
                  "prompt_ids": _prompt_ids(tok, pair["prompt"])}
        if is_conversational(row):
            n = len(record["prompt_ids"])
            for key in ("chosen", "rejected"):
                full = tok.apply_chat_template(pair["prompt"] + pair[key], tokenize=True,
                                               return_dict=True)["input_ids"]
                record[f"{key}_ids"] = list(full[n:])
        out.append(record)
    return out


def main() -> None:
    tok = build_tiny_tokenizer()
    fixture = {
        "trl_version": trl.__version__,
        "standard": _prompts(tok, STANDARD),
        "conversational": _prompts(tok, CONVERSATIONAL),
        "implicit_preference": _pairs(tok, IMPLICIT),
        "implicit_standard_preference": _pairs(tok, IMPLICIT_STANDARD),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
