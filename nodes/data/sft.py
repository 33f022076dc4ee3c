"""The SFT dataset: prompt-response rows, and conversations trained on their assistant
turns.

verl's SFT parquet: a `prompt` and a `response` column (strings; the keys are params, a
struct field by its dotted name as `extra_info.question`), or a `messages` chat list
whose last message is the assistant's answer: the messages before the first answer are
the prompt (chat template, generation prompt), its content the response + EOS, and the
messages after it (a multi-turn conversation) more response, in which only the
assistant turns are trained (`loss_mask`; verl's multi-turn SFT).

Notation: Bp prompts in a batch, T response length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import torch

from flowgraph.agent.render import ChatRenderer
from flowgraph.data.readers import open_table
from flowgraph.data.rendering import check_rendering, render_responses
from flowgraph.data.rows import check_columns, check_rows, field_value
from flowgraph.errors import FlowgraphError
from flowgraph.nodes.data.datasets import ResponseBatcher, TableDataset

__all__ = ["SFTDataset", "conversation_spans"]

_RESPONSE = {"response": ("responses", "response_mask")}
"""The response column -> its output ports (ids, mask)."""


class SFTDataset(TableDataset):
    """Prompt-response rows; `next_batch(Bp)` gives the outputs of the `sft` kind.

    verl's SFT layouts: `prompt_key` and `response_key` columns (dotted names reach
    into struct columns), or, when the table has no `prompt_key` column, a
    `messages_key` chat list ending with an assistant turn: the messages before the
    first assistant turn are the prompt, the rest the response, in which only the
    assistant turns are trained (`loss_mask`; verl's multi-turn SFT). Rendered, cut and
    padded as the preference pairs are (`ResponseBatcher`), with one response."""

    def __init__(
        self,
        path: str,
        tokenizer: Any,
        prompt_key: str = "prompt",
        response_key: str = "response",
        messages_key: str = "messages",
        loss_mask_read: bool = True,
        *,
        max_prompt_length: int | None = None,
        max_response_length: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        apply_chat_template: bool | None = True,  # verl's SFT datasets: strings too
        format: str = "auto",
        truncation: str = "error",
        filter_overlong_prompts: bool = False,
    ) -> None:
        table = _one_layout(path, open_table(path, format, []),
                            (prompt_key, response_key, messages_key))
        super().__init__(path, table, shuffle, seed)
        check_rows(path, self.table, "prompt", list(_RESPONSE))
        check_rendering(tokenizer, apply_chat_template, self.table, "prompt", path)
        self.tokenizer, self.chat = tokenizer, apply_chat_template
        self.loss_mask_read = loss_mask_read
        self.rendering = ResponseBatcher(
            tokenizer, apply_chat_template, max_prompt_length, max_response_length,
            truncation != "right", _RESPONSE, self._render_response)
        self.apply_limits(self.rendering.overlong(self.table.to_pylist()), truncation,
                          filter_overlong_prompts)
        if "turns" in self.table.column_names:
            self._check_turns()

    def _check_turns(self) -> None:
        """Multi-turn rows need the chat template, and an update that reads loss_mask
        (else the user turns inside the response would be trained on, silently)."""
        turns = self.table.column("turns").to_pylist()
        multi = [i for i, t in enumerate(turns) if t]
        if not multi:
            return
        if not self.chat:
            raise FlowgraphError(f"{self.path}: row {multi[0]} is a conversation with several "
                                 "assistant turns; rendering it needs the chat template "
                                 "(apply_chat_template: true)")
        if not self.loss_mask_read:
            raise FlowgraphError(
                f"{self.path}: {len(multi)} rows (the first: row {multi[0]}) are conversations "
                "with several assistant turns, and no node reads this source's loss_mask: the "
                "user turns between them would be trained on. Wire `<source>.loss_mask` into "
                "the sft_update's loss_mask input")

    def _spans(self, row: dict[str, Any]) -> list[tuple[list[int], bool]]:
        """A row's response as (token ids, trained) spans: one trained span (the answer
        and EOS), or a conversation's turns (`conversation_spans`)."""
        if not row.get("turns"):
            return [(render_responses(self.tokenizer, [row["response"]])[0], True)]
        if not self.chat:
            raise FlowgraphError(f"{self.path}: a conversation with several assistant turns "
                                 "needs the chat template (apply_chat_template: true)")
        prompt = row["prompt"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        answer = {"role": "assistant", "content": row["response"]}
        return conversation_spans(self.tokenizer, [*prompt, answer, *row["turns"]],
                                  len(prompt))

    def _render_response(self, rows: Sequence[dict[str, Any]], key: str) -> list[list[int]]:
        """The response column as token ids: a conversation's turns, all of them."""
        if not any(r.get("turns") for r in rows):
            return render_responses(self.tokenizer, [r[key] for r in rows])
        return [[t for ids, _ in self._spans(r) for t in ids] for r in rows]

    def batch(self, ids: list[int], rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The `sft` kind's outputs: prompts, prompt_mask (Bp, P); responses,
        response_mask (Bp, T); uid (Bp,); and loss_mask (Bp, T): the trained response
        tokens (a conversation's assistant turns), cut and padded as the responses are."""
        out = self.rendering.batch(ids, rows)
        out["loss_mask"] = loss_mask = out["response_mask"].clone()  # one answer: all of it
        T = loss_mask.shape[1]
        for i, row in enumerate(rows):
            if row.get("turns"):
                trained = [int(keep) for span, keep in self._spans(row) for _ in span][:T]
                loss_mask[i, : len(trained)] = torch.tensor(trained, dtype=loss_mask.dtype)
        return out


def _one_layout(path: str, table: pa.Table, keys: tuple[str, str, str]) -> pa.Table:
    """One layout: a `prompt` (string or message list) and a `response` string; a
    conversation's later turns (after its first answer) in `turns`."""
    prompt_key, response_key, messages_key = keys
    if prompt_key.split(".")[0] not in table.column_names \
            and messages_key in table.column_names:
        return pa.table(_split_messages(path, messages_key,
                                        table.column(messages_key).to_pylist()))
    for key, param in ((prompt_key, "prompt_key"), (response_key, "response_key")):
        try:
            check_columns(table, [key], path)
        except FlowgraphError:
            raise FlowgraphError(
                f"{path}: the sft kind reads `{key}` (param {param}), which the "
                f"dataset does not have; its columns: {', '.join(table.column_names)} "
                f"(a chat dataset: a `{messages_key}` column, param messages_key)"
            ) from None
    rows = table.select([prompt_key.split(".")[0], response_key.split(".")[0]]).to_pylist()
    return pa.table({"prompt": [field_value(r, prompt_key) for r in rows],
                     "response": [str(field_value(r, response_key)) for r in rows]})


def _split_messages(path: str, key: str, conversations: list[Any]) -> dict[str, list[Any]]:
    """Chat rows -> prompt (the messages before the first answer), response (its
    content) and turns (every message after it: empty for a one-answer row)."""
    prompts, responses, turns = [], [], []
    for i, messages in enumerate(conversations):
        roles = [m.get("role") for m in messages or []]
        if not roles or roles[-1] != "assistant":
            raise FlowgraphError(
                f"{path}: row {i}: the last message of `{key}` must be the assistant's "
                f"answer (the response trained on); the roles are {roles}")
        first = roles.index("assistant")
        plain = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
        prompts.append(plain[:first])
        responses.append(plain[first]["content"])
        turns.append(plain[first + 1:])
    return {"prompt": prompts, "response": responses, "turns": turns}


def conversation_spans(tokenizer: Any, messages: list[dict[str, str]], first: int
                       ) -> list[tuple[list[int], bool]]:
    """The response of a conversation whose first answer is `messages[first]`, as
    (token ids, trained) spans, rendered by the agent rollouts' renderer
    (`flowgraph.agent.render.ChatRenderer.spans`): each assistant turn as the chat
    template renders it (trained), each run of other messages with the next generation
    prompt (not trained)."""
    return ChatRenderer(tokenizer, probe=False).spans(messages, first)
