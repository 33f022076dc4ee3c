"""The prompt and preference datasets: a table read once, batched and exactly resumable.

A batch is drawn without replacement from a per-epoch order (shuffled by seed and
epoch); an epoch's last incomplete batch is dropped, as verl's sampler does. The
cursor (`state_dict()`: epoch and position) makes a resumed run see the same batches.
Prompts are left-padded, responses right-padded.

Over-long rows, checked when the dataset is opened (every row is tokenized once, as
an epoch would: 6.5 s for 20k chat prompts of 125 tokens with the builtin tokenizer on
2 busy cores; not at all when there is no limit), with verl's two options:
* `filter_overlong_prompts: true` drops rows whose prompt is longer than
  `max_prompt_length` (for preferences: or whose chosen or rejected response is longer
  than `max_response_length`); the count is printed once as `data/filtered_overlong`.
* `truncation` decides what happens to the rows still over a limit: `error` (the
  default) stops with the file, the row, its length and the limit; `left` keeps a
  prompt's last tokens (where the generation prompt sits), `right` its first ones.
  A response over T keeps its first T tokens under both, as TRL truncates completions.
With no limit (neither the param nor the dim is set) a batch pads to its longest row.

Notation: Bp prompts in a batch, P prompt length, T response length.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import pyarrow as pa
import torch

from flowgraph.data.readers import open_table, with_prompt
from flowgraph.data.rendering import (
    Overlong,
    check_rendering,
    overlong,
    render_prompts,
    render_responses,
)
from flowgraph.data.rows import (
    check_columns,
    check_rows,
    field_value,
    ground_truth_getter,
    missing_ground_truth,
    missing_ground_truth_rows,
    same_pairs,
)
from flowgraph.errors import FlowgraphError
from flowgraph.nodes.data.padding import pad, pad_id, truncate

__all__ = ["PreferenceDataset", "PromptDataset", "ResponseBatcher", "TableDataset"]


class TableDataset(ABC):
    """A pyarrow table read once, and the cursor over its rows; `batch` makes the rows
    a kind's outputs."""

    def __init__(self, path: str, table: pa.Table, shuffle: bool, seed: int) -> None:
        self.path, self.table = path, table
        self.shuffle, self.seed = shuffle, seed
        self.filtered_overlong = 0
        self.epoch, self.position = 0, 0
        self._order: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def apply_limits(self, found: Sequence[Overlong], truncation: str,
                     filter_overlong: bool) -> None:
        """Drop over-long rows (`filter_overlong_prompts`) or stop (`truncation: error`)."""
        if filter_overlong and found:
            drop = sorted({r for o in found for r in o.rows})
            keep = sorted(set(range(len(self))) - set(drop))
            print(
                f"data/filtered_overlong={len(drop)}: dataset `{self.path}`: dropped "
                f"{len(drop)} of {len(self)} rows over "
                + ", ".join(f"{o.limit_name} {o.limit}" for o in found)
            )
            self.table, self.filtered_overlong = self.table.take(keep), len(drop)
            return
        if found and truncation == "error":
            raise FlowgraphError(found[0].message(self.path, len(self)))

    def _epoch_order(self) -> list[int]:
        if self._order is None or self._order[0] != self.epoch:
            order = list(range(len(self)))
            if self.shuffle:
                random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
            self._order = (self.epoch, order)
        return self._order[1]

    def batches(self, batch_size: int) -> Iterator[dict[str, Any]]:
        """Every row once, in file order, in batches of `batch_size` (the last may be
        short); the cursor stays where it is. What the plan's prologue runs over."""
        for start in range(0, len(self), batch_size):
            ids = list(range(start, min(start + batch_size, len(self))))
            yield self.batch(ids, self.table.take(ids).to_pylist())

    def next_batch(self, batch_size: int) -> dict[str, Any]:
        """The next `batch_size` rows of the epoch's order; a new epoch when too few are
        left."""
        return self.batch(*self._next_rows(batch_size))

    @abstractmethod
    def batch(self, ids: list[int], rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The kind's outputs for `rows` (table rows `ids`)."""

    def _next_rows(self, batch_size: int) -> tuple[list[int], list[dict[str, Any]]]:
        if not 1 <= batch_size <= len(self):
            raise FlowgraphError(
                f"dataset `{self.path}` has {len(self)} rows; cannot draw batches of {batch_size}"
            )
        if self.position + batch_size > len(self):
            self.epoch, self.position = self.epoch + 1, 0
        ids = self._epoch_order()[self.position : self.position + batch_size]
        self.position += batch_size
        return ids, self.table.take(ids).to_pylist()


class PromptDataset(TableDataset):
    """Prompts for rollouts; `next_batch(Bp)` gives the outputs of the `prompts` kind."""

    def __init__(
        self,
        path: str,
        tokenizer: Any,
        prompt_key: str = "prompt",
        max_prompt_length: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        apply_chat_template: bool | None = None,
        format: str = "auto",
        truncation: str = "error",
        filter_overlong_prompts: bool = False,
        ground_truth_for: Sequence[str] = (),
        columns: Sequence[str] = (),
    ) -> None:
        super().__init__(path, open_table(path, format, [prompt_key]), shuffle, seed)
        check_rows(path, self.table, prompt_key)
        self.columns = tuple(columns)
        check_columns(self.table, self.columns, path)
        self._ground_truth = ground_truth_getter(self.table)
        if ground_truth_for and self._ground_truth is None:
            raise FlowgraphError(missing_ground_truth(path, self.table.column_names,
                                                      ground_truth_for))
        gap = missing_ground_truth_rows(path, self.table, ground_truth_for)
        if gap is not None:
            raise FlowgraphError(gap)
        check_rendering(tokenizer, apply_chat_template, self.table, prompt_key, path)
        self.tokenizer, self.prompt_key = tokenizer, prompt_key
        self.max_prompt_length, self.chat = max_prompt_length, apply_chat_template
        self.keep_end = truncation != "right"
        found = None if max_prompt_length is None else overlong(
            "prompt", "max_prompt_length", max_prompt_length,
            render_prompts(tokenizer, self.table.column(prompt_key).to_pylist(), self.chat),
        )
        self.apply_limits([found] if found else [], truncation, filter_overlong_prompts)

    def batch(self, ids: list[int], rows: list[dict[str, Any]]) -> dict[str, Any]:
        """input_ids, attention_mask (Bp, P) int64; uid (Bp,) int64; ground_truth and
        data_source (Bp) lists when the dataset has them; extra_info and row list[dict]
        (Bp).
        Values keep their parquet types (a string, a number, a dict, a list), as verl
        passes them to a reward function, never their str()."""
        prompts = render_prompts(self.tokenizer, [r[self.prompt_key] for r in rows], self.chat)
        prompts = [truncate(p, self.max_prompt_length, self.keep_end) for p in prompts]
        input_ids, attention_mask = pad(
            prompts, self.max_prompt_length, pad_id(self.tokenizer), left=True
        )
        batch: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "uid": torch.tensor(ids, dtype=torch.int64),
        }
        if self._ground_truth is not None:
            batch["ground_truth"] = [self._ground_truth(r) for r in rows]
        if "data_source" in self.table.column_names:
            batch["data_source"] = [r["data_source"] for r in rows]
        batch["extra_info"] = [_extra_info(r, self.columns) for r in rows]
        batch["row"] = [_row(r, self.prompt_key) for r in rows]
        return batch


def _row(row: dict[str, Any], prompt_key: str) -> dict[str, Any]:
    """A row as TRL hands it to a reward function: every column, the prompt (as the
    file holds it) under `prompt`."""
    return {"prompt": row[prompt_key], **{k: v for k, v in row.items() if k != prompt_key}}


def _extra_info(row: dict[str, Any], columns: Sequence[str]) -> dict[str, Any]:
    """verl's `extra_info` of a row (a dict; {} without the column) plus `columns`."""
    info = dict(row.get("extra_info") or {})
    info.update({name: field_value(row, name) for name in columns})
    return info


RenderResponse = Callable[[Sequence[dict[str, Any]], str], list[list[int]]]
"""Token ids of one response column of rows: (rows, column) -> ids per row."""


@dataclass(frozen=True, slots=True)
class ResponseBatcher:
    """A `prompt` column and response columns, as token ids and as a batch: what the
    `preferences` and `sft` kinds share. Prompts render as TRL's `tokenize_row` renders a
    pair's: a raw prompt without special tokens."""

    tokenizer: Any
    chat: bool | None
    """`apply_chat_template`."""
    max_prompt_length: int | None
    max_response_length: int | None
    keep_end: bool
    """A prompt over P keeps its last tokens (else its first: `truncation: right`)."""
    responses: Mapping[str, tuple[str, str]]
    """Response column -> its output ports (ids, mask)."""
    render_response: RenderResponse
    """How a response column becomes token ids (the `sft` kind: a conversation's turns)."""

    def render(self, rows: Sequence[dict[str, Any]], key: str) -> list[list[int]]:
        if key == "prompt":
            column = [r[key] for r in rows]
            return render_prompts(self.tokenizer, column, self.chat, special_tokens=False)
        return self.render_response(rows, key)

    def overlong(self, rows: Sequence[dict[str, Any]]) -> list[Overlong]:
        """Prompts over P and responses over T, per column."""
        limits = {"prompt": ("max_prompt_length", self.max_prompt_length)}
        limits |= {key: ("max_response_length", self.max_response_length)
                   for key in self.responses}
        found = [overlong(key, name, limit, self.render(rows, key))
                 for key, (name, limit) in limits.items() if limit is not None]
        return [o for o in found if o is not None]

    def batch(self, ids: list[int], rows: list[dict[str, Any]]) -> dict[str, Any]:
        """prompts, prompt_mask (Bp, P); each response column's ids and mask (Bp, T), one
        T for all; uid (Bp,); all int64."""
        fill, P, T = pad_id(self.tokenizer), self.max_prompt_length, self.max_response_length
        prompts = [truncate(s, P, self.keep_end) for s in self.render(rows, "prompt")]
        responses = {key: [truncate(s, T, False) for s in self.render(rows, key)]
                     for key in self.responses}
        T = T or max(len(s) for seqs in responses.values() for s in seqs)
        prompt_ids, prompt_mask = pad(prompts, P, fill, left=True)
        batch = {"prompts": prompt_ids, "prompt_mask": prompt_mask}
        for key, (ids_port, mask_port) in self.responses.items():
            batch[ids_port], batch[mask_port] = pad(responses[key], T, fill, left=False)
        batch["uid"] = torch.tensor(ids, dtype=torch.int64)
        return batch


def plain_responses(tokenizer: Any, rows: Sequence[dict[str, Any]], key: str
                    ) -> list[list[int]]:
    """A response column as raw text ending in EOS (`render_responses`)."""
    return render_responses(tokenizer, [r[key] for r in rows])


_PAIR = {"chosen": ("chosen", "chosen_mask"), "rejected": ("rejected", "rejected_mask")}
"""A preference pair's response columns -> their output ports (ids, mask)."""


class PreferenceDataset(TableDataset):
    """Preference pairs; `next_batch(Bp)` gives the outputs of the `preferences` kind."""

    def __init__(
        self,
        path: str,
        tokenizer: Any,
        max_prompt_length: int | None = None,
        max_response_length: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        apply_chat_template: bool | None = None,
        format: str = "auto",
        truncation: str = "error",
        filter_overlong_prompts: bool = False,
    ) -> None:
        # TRL's implicit-prompt format (no `prompt` column): the prompt extracted from
        # each pair
        table = with_prompt(path, open_table(path, format, list(_PAIR)))
        super().__init__(path, table, shuffle, seed)
        check_rows(path, self.table, "prompt", list(_PAIR))
        check_rendering(tokenizer, apply_chat_template, self.table, "prompt", path)
        self.rendering = ResponseBatcher(
            tokenizer, apply_chat_template, max_prompt_length, max_response_length,
            truncation != "right", _PAIR, partial(plain_responses, tokenizer))
        self.apply_limits(self.rendering.overlong(self.table.to_pylist()), truncation,
                          filter_overlong_prompts)
        self.same_pairs, self.empty_pairs = self._count_pairs()

    def _count_pairs(self) -> tuple[int, int]:
        """Pairs DPO learns nothing from (equal or empty responses), counted and said
        once at load: `data/same_pairs`, `data/empty_pairs` in the first metrics row."""
        same, empty = same_pairs(self.table, list(_PAIR))
        for name, rows, what in (("same_pairs", same, "identical responses"),
                                 ("empty_pairs", empty, "an empty response")):
            if rows:
                print(f"data/{name}={len(rows)}: dataset `{self.path}`: {len(rows)} of "
                      f"{len(self)} pairs have {what} (the first: row {rows[0]}); DPO learns "
                      f"nothing from them (their loss stays log 2)")
        return len(same), len(empty)

    def batch(self, ids: list[int], rows: list[dict[str, Any]]) -> dict[str, Any]:
        """prompts, prompt_mask (Bp, P); chosen, chosen_mask, rejected, rejected_mask
        (Bp, T); uid (Bp,); all int64."""
        return self.rendering.batch(ids, rows)
