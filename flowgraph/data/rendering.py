"""Prompts and responses as token ids, and the rows over a length limit.

Prompts are rendered as TRL renders its formats: a message list through the chat
template with the generation prompt, a string as raw text (so a base model without a
chat template can be used) unless the data source's `apply_chat_template: true` asks
for the template (as one user message). Responses are raw text ending in EOS, as
sampled responses do. The tokenizer is any Hugging Face tokenizer; nothing here
imports one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from flowgraph.errors import FlowgraphError

__all__ = ["Overlong", "check_rendering", "overlong", "render_prompts", "render_responses"]


def check_rendering(tokenizer: Any, chat: bool | None, table: pa.Table, key: str, path: str
                    ) -> None:
    """Fail at start-up, not at the batch that first meets an unrenderable prompt."""
    kind = table.schema.field(key).type
    conversational = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    if chat is False and conversational:
        raise FlowgraphError(
            f"dataset `{path}`: column `{key}` holds chat-message lists ({kind}); "
            f"set apply_chat_template: true (or leave it unset) to render them"
        )
    if (chat or conversational) and getattr(tokenizer, "chat_template", None) is None:
        raise FlowgraphError(
            f"dataset `{path}`: the tokenizer has no chat template (a base model?), and "
            + (f"column `{key}` holds chat messages: give string prompts, or a tokenizer "
               "with a chat template" if conversational else
               "apply_chat_template is true: unset it to tokenize string prompts as raw text")
        )


def render_prompts(
    tokenizer: Any,
    prompts: Sequence[str | list[dict[str, str]]],
    chat: bool | None,
    special_tokens: bool = True,
) -> list[list[int]]:
    """Token ids of prompts, as TRL's `maybe_apply_chat_template` renders them: message
    lists (and strings, when `chat` is true) through the chat template with the
    generation prompt; strings (`chat` null or false) as raw text, with the tokenizer's
    special tokens (a base model's BOS) unless `special_tokens` is false."""
    if not chat and all(isinstance(p, str) for p in prompts):
        return [
            list(ids)
            for ids in tokenizer(list(prompts), add_special_tokens=special_tokens).input_ids
        ]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}] if isinstance(p, str) else p,
            add_generation_prompt=True,
            tokenize=False,
        )
        for p in prompts
    ]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids]


def render_responses(
    tokenizer: Any, responses: Sequence[str | list[dict[str, str]]]
) -> list[list[int]]:
    """Token ids of responses as raw text (a message list: its contents), ending in EOS."""
    texts = [r if isinstance(r, str) else "".join(m["content"] for m in r) for r in responses]
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return [[*ids, *eos] for ids in tokenizer(texts, add_special_tokens=False).input_ids]


@dataclass(frozen=True, slots=True)
class Overlong:
    """The rows of one column over a length limit."""

    what: str
    """`prompt`, `chosen` or `rejected`."""
    limit_name: str
    """The param that sets the limit (`max_prompt_length`, `max_response_length`)."""
    limit: int
    rows: tuple[int, ...]
    lengths: tuple[int, ...]
    """Token lengths of those rows."""

    def message(self, path: str, n_rows: int) -> str:
        """The error `truncation: error` raises: file, first row, its length, the limit."""
        row, length = self.rows[0], self.lengths[0]
        keep = (
            f"truncation: left to keep each prompt's last {self.limit} tokens (right: its first)"
            if self.what == "prompt"
            else f"truncation: left or right to keep each response's first {self.limit} tokens"
        )
        return (
            f"dataset `{path}` row {row} (0-based): the {self.what} is {length} tokens, over "
            f"{self.limit_name} {self.limit} ({len(self.rows)} of {n_rows} rows are over, "
            f"the longest {max(self.lengths)} tokens); raise {self.limit_name} (or the dim "
            f"{'P' if self.what == 'prompt' else 'T'}), set filter_overlong_prompts: true "
            f"to drop such rows, or {keep}"
        )


def overlong(what: str, limit_name: str, limit: int, seqs: Sequence[list[int]]) -> (
    Overlong | None
):
    """The rows of `seqs` longer than `limit`; None when there are none."""
    over = [(i, len(s)) for i, s in enumerate(seqs) if len(s) > limit]
    if not over:
        return None
    rows, lengths = zip(*over, strict=True)
    return Overlong(what, limit_name, limit, rows, lengths)
