"""Prompt and preference datasets read with pyarrow, batched and exactly resumable.

Layouts:
* prompts (verl; TRL's standard and conversational formats): `prompt` is a string
  (raw text) or a chat-message list (rendered with the tokenizer's chat template and
  the generation prompt), the ground truth sits in
  `reward_model.ground_truth` (a struct column) or `ground_truth`, and `data_source`
  is optional.
* preferences (TRL): `prompt`, `chosen`, `rejected`; each a string or a message list;
  or TRL's implicit-prompt format, `chosen` and `rejected` only: the prompt is their
  shared first messages (`with_prompt`, TRL's `extract_prompt`). Responses end with
  EOS, as sampled responses do.
* sft (verl's SFT parquet): a `prompt` and a `response` column (strings; the keys are
  params, a struct field by its dotted name as `extra_info.question`), or a `messages`
  chat list whose last message is the assistant's answer: the messages before it are
  the prompt (chat template, generation prompt), its content the response + EOS.

Files are parquet (`.parquet`, `.pq`) or JSON lines (`.jsonl`, `.json`); `builtin:arith`
(and `builtin:arith:test`, its held-out fifth) is a generated toy task: single-digit
sums and differences such as `3+4=`, whose answers are one or two tokens, so even a
random tiny model samples a correct answer now and then and RL has a signal to
climb. `builtin:arith-pairs[:test]` pairs each problem's answer with a wrong one.
`builtin:reverse[:test]` (the main job's task) asks for a string of 3-4 digits
backwards (`reverse 381` -> `183`): 1,000 training and 100 held-out strings, disjoint.
Unlike single-digit sums, which a tiny model can only memorise, reversal is one skill
shared by every prompt, so what training teaches on one prompt carries to held-out
ones. Built-in tables also carry a `response` column (the answer), so `sft` reads them.
The agent tasks (`flowgraph.nodes.agent_tasks`): `builtin:mul` (`37*86=`, for a
calculator tool), `builtin:guess` (a number of 1-16) and their warm-up conversations
`builtin:mul-sft` and `builtin:guess-sft` (a `messages` column).

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

Prompts are rendered as TRL renders its formats: a message list through the chat
template, a string as raw text (so a base model without a chat template can be used)
unless `apply_chat_template: true` asks for the template (as one user message; the
`sft` kind's default, as verl's SFT datasets). A table may also be one given in Python
or a hub dataset (`flowgraph.tables`: its path is then a `memory:` key).

Notation: Bp prompts in a batch, P prompt length, T response length.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
import pyarrow.parquet as pq
import torch
from torch import Tensor

from flowgraph.agent.render import ChatRenderer
from flowgraph.builtin_models import BUILTIN_PREFIX, held_out_path
from flowgraph.errors import FlowgraphError
from flowgraph.nodes.agent_tasks import guess_games, guess_problems, mul_problems, mul_transcripts
from flowgraph.spelling import Word, command
from flowgraph.tables import held_table, is_memory

__all__ = [
    "Overlong",
    "PreferenceDataset",
    "PromptDataset",
    "SFTDataset",
    "Splits",
    "arith_problems",
    "check_rendering",
    "check_rows",
    "has_ground_truth",
    "missing_ground_truth",
    "missing_ground_truth_rows",
    "open_table",
    "overlong",
    "preference_source",
    "prompt_source",
    "render_prompts",
    "render_responses",
    "reverse_problems",
    "row_problems",
    "same_pairs",
    "sft_source",
    "shared_prompt",
    "with_prompt",
]

_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}


def arith_problems(split: str = "train") -> list[tuple[str, str]]:
    """(question, answer) pairs of `builtin:arith`: a+b and a−b (a ≥ b) over digits 0-9.

    155 problems; a fixed fifth (31) is held out as `test`.
    """
    problems = [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]
    problems += [(f"{a}-{b}=", str(a - b)) for a in range(10) for b in range(a + 1)]
    random.Random(0).shuffle(problems)
    n_test = len(problems) // 5
    return problems[:n_test] if split == "test" else problems[n_test:]


def reverse_problems(split: str = "train") -> list[tuple[str, str]]:
    """(question, answer) pairs of `builtin:reverse`: `reverse 381` -> `183`.

    1,100 distinct random strings of 3 or 4 digits (seeded); the last 100 are `test`.
    """
    rng, seen, digits = random.Random(0), set(), list[str]()
    while len(digits) < 1100:
        s = "".join(rng.choice("0123456789") for _ in range(rng.choice((3, 4))))
        if s not in seen:
            seen.add(s)
            digits.append(s)
    chosen = digits[1000:] if split == "test" else digits[:1000]
    return [(f"reverse {s}", s[::-1]) for s in chosen]


_TASKS = {"arith": arith_problems, "reverse": reverse_problems, "mul": mul_problems,
          "guess": guess_problems}
_CHATS = {"mul-sft": mul_transcripts, "guess-sft": guess_games}
"""Built-in chat tables (a `messages` column: the `sft` kind's multi-turn layout)."""


def _wrong_answer(question: str, answer: str) -> str:
    candidates = [str(x) for x in range(19) if str(x) != answer]
    return random.Random(question).choice(candidates)


def _builtin_table(name: str) -> pa.Table:
    task, _, split = name.partition(":")
    pairs = task == "arith-pairs"
    known = (*_TASKS, "arith-pairs", *_CHATS)
    if task not in known or split not in ("", "train", "test"):
        raise FlowgraphError(
            f"unknown built-in dataset `{BUILTIN_PREFIX}{name}`; known: "
            f"{', '.join(BUILTIN_PREFIX + k for k in known)} (suffix `:test` for held-out)"
        )
    if task in _CHATS:
        return pa.table({"messages": _CHATS[task](split or "train")})
    problems = _TASKS["arith" if pairs else task](split or "train")
    prompts = [[{"role": "user", "content": q}] for q, _ in problems]
    if pairs:
        return pa.table(
            {
                "prompt": prompts,
                "chosen": [a for _, a in problems],
                "rejected": [_wrong_answer(q, a) for q, a in problems],
            }
        )
    return pa.table(
        {
            "prompt": prompts,
            "response": [a for _, a in problems],
            "data_source": [task] * len(problems),
            "reward_model": [{"ground_truth": a} for _, a in problems],
        }
    )


def _read_table(path: str, fmt: str) -> pa.Table:
    if path.startswith(BUILTIN_PREFIX) and fmt in ("auto", "builtin"):
        return _builtin_table(path[len(BUILTIN_PREFIX) :])
    if is_memory(path):  # a DataFrame or Dataset given in Python (`flowgraph.tables`)
        table: pa.Table = held_table(path)
        return table
    file = Path(path).expanduser()
    fmt = _SUFFIXES.get(file.suffix, "") if fmt == "auto" else fmt
    if fmt not in ("parquet", "jsonl"):
        raise FlowgraphError(
            f"dataset `{path}`: cannot tell its format from the suffix; "
            f"set the param format to parquet or jsonl"
        )
    if not file.is_file():
        raise FlowgraphError(f"dataset file `{path}` does not exist")
    try:
        return pq.read_table(file) if fmt == "parquet" else pa_json.read_json(file)
    except (OSError, pa.ArrowException) as exc:
        raise FlowgraphError(f"cannot read dataset `{path}` as {fmt}: {exc}") from exc


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


def _apply_limits(
    ds: _TableDataset, found: Sequence[Overlong], truncation: str, filter_overlong: bool
) -> None:
    """Drop over-long rows (`filter_overlong_prompts`) or stop (`truncation: error`)."""
    if filter_overlong and found:
        drop = sorted({r for o in found for r in o.rows})
        keep = sorted(set(range(len(ds))) - set(drop))
        print(
            f"data/filtered_overlong={len(drop)}: dataset `{ds.path}`: dropped {len(drop)} of "
            f"{len(ds)} rows over "
            + ", ".join(f"{o.limit_name} {o.limit}" for o in found)
        )
        ds.table, ds.filtered_overlong = ds.table.take(keep), len(drop)
        return
    if found and truncation == "error":
        raise FlowgraphError(found[0].message(ds.path, len(ds)))


def _truncate(seq: list[int], limit: int | None, keep_end: bool) -> list[int]:
    if limit is None or len(seq) <= limit:
        return seq
    return seq[-limit:] if keep_end else seq[:limit]


def _pad(
    seqs: Sequence[list[int]], length: int | None, pad_id: int, left: bool
) -> tuple[Tensor, Tensor]:
    """(ids, mask), each (len(seqs), L) int64; L = `length` or the longest sequence,
    which none is longer than (they were truncated or checked)."""
    L = length or max(len(s) for s in seqs)
    ids, mask = [], []
    for s in seqs:  # plain lists, one tensor each at the end: no per-row tensors
        fill = L - len(s)
        ids.append([pad_id] * fill + list(s) if left else list(s) + [pad_id] * fill)
        mask.append([0] * fill + [1] * len(s) if left else [1] * len(s) + [0] * fill)
    shape = (len(seqs), L)
    return (torch.tensor(ids, dtype=torch.int64).reshape(shape),
            torch.tensor(mask, dtype=torch.int64).reshape(shape))


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad or 0)


def open_table(path: str, fmt: str, required: Sequence[str]) -> pa.Table:
    """The dataset's table; it must have the `required` columns."""
    table = _read_table(path, fmt)
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise FlowgraphError(
            f"dataset `{path}` has no column {', '.join(f'`{c}`' for c in missing)}; "
            f"its columns: {', '.join(table.column_names)}"
        )
    return table


def _rows_where(mask: pa.Array) -> list[int]:
    return [int(i) for i in np.flatnonzero(mask.to_numpy(zero_copy_only=False))]


def _cell_problem(path: str, column: str, rows: Sequence[int], n_rows: int, problem: str
                  ) -> str:
    """`dataset … row R (0-based), column C: problem (k of n rows)`."""
    many = f" ({len(rows)} of {n_rows} rows)" if len(rows) > 1 else ""
    return f"dataset `{path}` row {rows[0]} (0-based), column `{column}`: {problem}{many}"


_TEXT = "a string or a list of chat messages ({role, content} dicts)"


def _message_problems(values: pa.Array, prompt: bool) -> Iterator[tuple[list[int], str]]:
    """Rows of a chat-message list column that are null, hold a message without content
    or (a prompt) a role, or (a prompt) no message: (rows, problem) for each kind found.
    An empty response is counted at load instead (`same_pairs`)."""
    yield _rows_where(pc.is_null(values)), f"null; each row needs {_TEXT}"
    if prompt:
        yield (_rows_where(pc.equal(pc.fill_null(pc.list_value_length(values), 1), 0)),
               "an empty message list; a prompt needs at least one message")
    messages, parents = pc.list_flatten(values), pc.list_parent_indices(values)
    if not pa.types.is_struct(messages.type):
        yield [0], f"holds lists of {messages.type}, not chat messages ({{role, content}} dicts)"
        return
    for key in ("role", "content") if prompt else ("content",):
        if messages.type.get_field_index(key) < 0:
            yield [0] if len(messages) else [], f"its messages have no `{key}`"
            continue
        missing = pc.is_null(pc.struct_field(messages, key))
        rows = sorted({int(parents[i].as_py()) for i in _rows_where(missing)})
        yield rows, f"a message without `{key}`"


def _column_problems(values: pa.Array, prompt: bool) -> Iterator[tuple[list[int], str]]:
    """(rows, problem) of one text column: a string or a chat-message list per row."""
    kind = values.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        yield _rows_where(pc.is_null(values)), f"null; each row needs {_TEXT}"
    elif pa.types.is_list(kind) or pa.types.is_large_list(kind):
        yield from _message_problems(values, prompt)
    else:
        yield [0], f"holds {kind} values; each row needs {_TEXT}"


def row_problems(path: str, table: pa.Table, prompt: str, responses: Sequence[str] = ()
                 ) -> list[str]:
    """Every malformed row, one message per column and kind of problem, naming the file,
    the first such row and the column: no rows at all; a null, empty or mistyped
    `prompt` column cell, a null or mistyped response; a message without a role or
    content; an `extra_info` that is not a dict (struct) column. What `check --data`
    reports and a load refuses, before a tokenizer meets the row."""
    if table.num_rows == 0:
        return [f"dataset `{path}` has no rows"]
    out = []
    for column in (prompt, *responses):
        if column not in table.column_names:
            continue  # a missing column has its own message (`open_table`)
        values = table.column(column).combine_chunks()
        out += [_cell_problem(path, column, rows, table.num_rows, problem)
                for rows, problem in _column_problems(values, column == prompt) if rows]
    if "extra_info" in table.column_names:
        kind = table.schema.field("extra_info").type
        if not (pa.types.is_struct(kind) or pa.types.is_null(kind)):
            first = table.column("extra_info")[0].as_py()
            out.append(_cell_problem(
                path, "extra_info", [0], 1,
                f"holds {kind} values ({first!r}); verl's extra_info is a dict per row (a "
                f"struct column): write the dicts themselves, not their text"))
    return out


def check_rows(path: str, table: pa.Table, prompt: str, responses: Sequence[str] = ()
               ) -> None:
    """Refuse a table with a malformed row (`row_problems`): the first problem, and how
    many more `flowgraph check --data` lists."""
    problems = row_problems(path, table, prompt, responses)
    if problems:
        lister = command("check", Word("GRAPH"), [("data", True)])
        more = (f" (and {len(problems) - 1} more problems: {lister} lists them)"
                if len(problems) > 1 else "")
        raise FlowgraphError(problems[0] + more)


def missing_ground_truth_rows(path: str, table: pa.Table, needed_by: Sequence[str]
                              ) -> str | None:
    """The message for rows whose ground truth is null or NaN where nodes `needed_by`
    read it; None when every row has one. verl would score such a row against None."""
    column = _ground_truth_column(table)
    if column is None or not needed_by:
        return None
    whole = table.column(column.split(".")[0]).combine_chunks()
    values = pc.struct_field(whole, column.split(".")[1]) if "." in column else whole
    rows = _rows_where(pc.is_null(values, nan_is_null=True))
    if not rows:
        return None
    what = "null" if values[rows[0]].as_py() is None else "NaN"
    nodes = ", ".join(f"`{n}`" for n in needed_by)
    return _cell_problem(path, column, rows, table.num_rows,
                         f"the ground truth is missing ({what}); node {nodes} reads it") + (
        ". Fill it in, or drop such rows from the file")


def same_pairs(table: pa.Table, responses: Sequence[str]) -> tuple[list[int], list[int]]:
    """(rows whose responses are equal, rows with an empty response) of a preference
    table, by the text that is tokenized: DPO learns nothing from such a pair (its
    loss stays log 2)."""
    def text(v: Any) -> str:  # what `render_responses` tokenizes
        return v if isinstance(v, str) else "".join(m.get("content") or "" for m in v or [])

    texts = [[text(v) for v in r.values()] for r in table.select(list(responses)).to_pylist()]
    empty = [i for i, r in enumerate(texts) if any(not t for t in r)]
    same = [i for i, r in enumerate(texts) if len(set(r)) == 1 and r[0]]
    return same, empty


def shared_prompt(chosen: Any, rejected: Any) -> int:
    """How much of a pair is its prompt: TRL 1.16's `extract_prompt`, as it is — the
    first position where `chosen` and `rejected` (message lists, or strings) differ,
    one back over a space before it; the last shared position when one is a prefix of
    the other."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # remove space before the prompt
                idx -= 1
            break
    return idx


def with_prompt(path: str, table: pa.Table) -> pa.Table:
    """A preference table in TRL's explicit-prompt layout: `table` itself when it has a
    `prompt` column; else (TRL's implicit prompt) `chosen` and `rejected` cut where they
    first differ (`shared_prompt`): the shared messages are the prompt, the rest each
    response."""
    if "prompt" in table.column_names:
        return table
    check_rows(path, table, "chosen", ["rejected"])
    rows = table.select(["chosen", "rejected"]).to_pylist()
    cuts = [shared_prompt(r["chosen"], r["rejected"]) for r in rows]
    columns = {"prompt": [r["chosen"][:i] for r, i in zip(rows, cuts, strict=True)],
               "chosen": [r["chosen"][i:] for r, i in zip(rows, cuts, strict=True)],
               "rejected": [r["rejected"][i:] for r, i in zip(rows, cuts, strict=True)]}
    rest = [c for c in table.column_names if c not in columns]
    return pa.table({**columns, **{c: table.column(c) for c in rest}})


class _TableDataset:
    """A pyarrow table read once, and the cursor over its rows."""

    def __init__(
        self, path: str, fmt: str, required: Sequence[str], shuffle: bool, seed: int
    ) -> None:
        self.path = path
        self.table = self._prepare(open_table(path, fmt, required))
        self.shuffle, self.seed = shuffle, seed
        self.filtered_overlong = 0
        self.epoch, self.position = 0, 0
        self._order: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def _prepare(self, table: pa.Table) -> pa.Table:
        """The table as the subclass reads it (the `sft` kind brings its layouts to one)."""
        return table

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

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

    def batch(self, ids: list[int], rows: list[dict[str, Any]]) -> dict[str, Any]:
        raise NotImplementedError

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


class PromptDataset(_TableDataset):
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
        super().__init__(path, format, [prompt_key], shuffle, seed)
        check_rows(path, self.table, prompt_key)
        self.columns = tuple(columns)
        _check_columns(self.table, self.columns, path)
        self._ground_truth = _ground_truth_getter(self.table)
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
        _apply_limits(self, [found] if found else [], truncation, filter_overlong_prompts)

    def batch(self, ids: list[int], rows: list[dict[str, Any]]) -> dict[str, Any]:
        """input_ids, attention_mask (Bp, P) int64; uid (Bp,) int64; ground_truth and
        data_source (Bp) lists when the dataset has them; extra_info and row list[dict]
        (Bp).
        Values keep their parquet types (a string, a number, a dict, a list), as verl
        passes them to a reward function, never their str()."""
        prompts = render_prompts(self.tokenizer, [r[self.prompt_key] for r in rows], self.chat)
        prompts = [_truncate(p, self.max_prompt_length, self.keep_end) for p in prompts]
        input_ids, attention_mask = _pad(
            prompts, self.max_prompt_length, _pad_id(self.tokenizer), left=True
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


def _field(row: dict[str, Any], name: str) -> Any:
    """`reward_model.style` of a row: a struct column's field, by its dotted name."""
    value: Any = row
    for part in name.split("."):
        value = value[part]
    return value


def _extra_info(row: dict[str, Any], columns: Sequence[str]) -> dict[str, Any]:
    """verl's `extra_info` of a row (a dict; {} without the column) plus `columns`."""
    info = dict(row.get("extra_info") or {})
    info.update({name: _field(row, name) for name in columns})
    return info


def _check_columns(table: pa.Table, columns: Sequence[str], path: str) -> None:
    """Every column (or struct field) `columns` names is in the dataset."""
    for name in columns:
        kind: Any = table.schema
        for part in name.split("."):
            names = ([f.name for f in kind] if isinstance(kind, (pa.Schema, pa.StructType))
                     else [])
            if part not in names:
                raise FlowgraphError(
                    f"{path}: the param columns names `{name}`, which the dataset does not "
                    f"have; its columns: {', '.join(table.column_names)}")
            kind = kind.field(part).type


def has_ground_truth(table: pa.Table) -> bool:
    """Whether rows carry a ground truth (verl's `reward_model.ground_truth`, or flat)."""
    return _ground_truth_getter(table) is not None


def missing_ground_truth(path: str, columns: Sequence[str], needed_by: Sequence[str]) -> str:
    """The message for a dataset without ground truth that a node needs."""
    nodes = ", ".join(f"`{n}`" for n in needed_by)
    return (
        f"dataset `{path}` has no ground truth, which node {nodes} needs; its columns: "
        f"{', '.join(columns)}; add a `ground_truth` column (or verl's struct column "
        f"`reward_model` with a `ground_truth` field), or use a reward that needs none "
        f"(fn: format, or a reward_model node) and unwire ground_truth"
    )


def _ground_truth_column(table: pa.Table) -> str | None:
    """Where rows keep their ground truth: verl's nested field first, then a flat column."""
    names = table.column_names
    if "reward_model" in names:
        kind = table.schema.field("reward_model").type
        if pa.types.is_struct(kind) and kind.get_field_index("ground_truth") >= 0:
            return "reward_model.ground_truth"
    return "ground_truth" if "ground_truth" in names else None


def _ground_truth_getter(table: pa.Table) -> Callable[[dict[str, Any]], Any] | None:
    """How to read a row's ground truth (`_ground_truth_column`), as it is."""
    column = _ground_truth_column(table)
    if column == "reward_model.ground_truth":
        return lambda row: (row["reward_model"] or {}).get("ground_truth")
    return None if column is None else (lambda row: row["ground_truth"])


class PreferenceDataset(_TableDataset):
    """Preference pairs; `next_batch(Bp)` gives the outputs of the `preferences` kind."""

    RESPONSES: ClassVar[dict[str, tuple[str, str]]] = {
        "chosen": ("chosen", "chosen_mask"),
        "rejected": ("rejected", "rejected_mask"),
    }
    """Response column -> its output ports (ids, mask)."""

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
        super().__init__(path, format, self._required(), shuffle, seed)
        check_rows(path, self.table, "prompt", list(self.RESPONSES))
        check_rendering(tokenizer, apply_chat_template, self.table, "prompt", path)
        self.tokenizer, self.chat = tokenizer, apply_chat_template
        self.max_prompt_length, self.max_response_length = max_prompt_length, max_response_length
        self.keep_end = truncation != "right"
        _apply_limits(self, self._overlong(), truncation, filter_overlong_prompts)
        self.same_pairs, self.empty_pairs = self._count_pairs()

    def _required(self) -> list[str]:
        return list(self.RESPONSES)

    def _prepare(self, table: pa.Table) -> pa.Table:
        """TRL's implicit-prompt format (no `prompt` column): the prompt extracted from
        each pair (`with_prompt`)."""
        return with_prompt(self.path, table)

    def _count_pairs(self) -> tuple[int, int]:
        """Pairs DPO learns nothing from (equal or empty responses), counted and said
        once at load: `data/same_pairs`, `data/empty_pairs` in the first metrics row."""
        if len(self.RESPONSES) < 2:
            return 0, 0
        same, empty = same_pairs(self.table, list(self.RESPONSES))
        for name, rows, what in (("same_pairs", same, "identical responses"),
                                 ("empty_pairs", empty, "an empty response")):
            if rows:
                print(f"data/{name}={len(rows)}: dataset `{self.path}`: {len(rows)} of "
                      f"{len(self)} pairs have {what} (the first: row {rows[0]}); DPO learns "
                      f"nothing from them (their loss stays log 2)")
        return len(same), len(empty)

    def _overlong(self) -> list[Overlong]:
        """Prompts over P and responses over T, per column."""
        rows = self.table.to_pylist()
        limits = {"prompt": ("max_prompt_length", self.max_prompt_length)}
        limits |= {key: ("max_response_length", self.max_response_length)
                   for key in self.RESPONSES}
        found = [overlong(key, name, limit, self._render(rows, key))
                 for key, (name, limit) in limits.items() if limit is not None]
        return [o for o in found if o is not None]

    def _render(self, rows: Sequence[dict[str, Any]], key: str) -> list[list[int]]:
        column = [r[key] for r in rows]
        if key == "prompt":
            return render_prompts(self.tokenizer, column, self.chat, special_tokens=False)
        return render_responses(self.tokenizer, column)

    def batch(self, ids: list[int], rows: list[dict[str, Any]]) -> dict[str, Any]:
        """prompts, prompt_mask (Bp, P); each response column's ids and mask (Bp, T), one
        T for all; uid (Bp,); all int64."""
        pad, P, T = _pad_id(self.tokenizer), self.max_prompt_length, self.max_response_length
        prompts = [_truncate(s, P, self.keep_end) for s in self._render(rows, "prompt")]
        responses = {key: [_truncate(s, T, False) for s in self._render(rows, key)]
                     for key in self.RESPONSES}
        T = T or max(len(s) for seqs in responses.values() for s in seqs)
        prompt_ids, prompt_mask = _pad(prompts, P, pad, left=True)
        batch = {"prompts": prompt_ids, "prompt_mask": prompt_mask}
        for key, (ids_port, mask_port) in self.RESPONSES.items():
            batch[ids_port], batch[mask_port] = _pad(responses[key], T, pad, left=False)
        batch["uid"] = torch.tensor(ids, dtype=torch.int64)
        return batch


class SFTDataset(PreferenceDataset):
    """Prompt-response rows; `next_batch(Bp)` gives the outputs of the `sft` kind.

    verl's SFT layouts: `prompt_key` and `response_key` columns (dotted names reach
    into struct columns), or, when the table has no `prompt_key` column, a
    `messages_key` chat list ending with an assistant turn: the messages before the
    first assistant turn are the prompt, the rest the response, in which only the
    assistant turns are trained (`loss_mask`; verl's multi-turn SFT)."""

    RESPONSES: ClassVar[dict[str, tuple[str, str]]] = {
        "response": ("responses", "response_mask")}

    def _required(self) -> list[str]:
        return []

    def __init__(self, path: str, tokenizer: Any, prompt_key: str = "prompt",
                 response_key: str = "response", messages_key: str = "messages",
                 loss_mask_read: bool = True, **params: Any) -> None:
        self.keys = (prompt_key, response_key, messages_key)
        self.loss_mask_read = loss_mask_read
        params.setdefault("apply_chat_template", True)  # verl's SFT datasets: strings too
        super().__init__(path, tokenizer, **params)
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

    def _prepare(self, table: pa.Table) -> pa.Table:
        """One layout: a `prompt` (string or message list) and a `response` string; a
        conversation's later turns (after its first answer) in `turns`."""
        prompt_key, response_key, messages_key = self.keys
        if prompt_key.split(".")[0] not in table.column_names \
                and messages_key in table.column_names:
            return pa.table(_split_messages(self.path, messages_key,
                                            table.column(messages_key).to_pylist()))
        for key, param in ((prompt_key, "prompt_key"), (response_key, "response_key")):
            try:
                _check_columns(table, [key], self.path)
            except FlowgraphError:
                raise FlowgraphError(
                    f"{self.path}: the sft kind reads `{key}` (param {param}), which the "
                    f"dataset does not have; its columns: {', '.join(table.column_names)} "
                    f"(a chat dataset: a `{messages_key}` column, param messages_key)"
                ) from None
        rows = table.select([prompt_key.split(".")[0], response_key.split(".")[0]]).to_pylist()
        return pa.table({"prompt": [_field(r, prompt_key) for r in rows],
                         "response": [str(_field(r, response_key)) for r in rows]})

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

    def _render(self, rows: Sequence[dict[str, Any]], key: str) -> list[list[int]]:
        if key != "response" or not any(r.get("turns") for r in rows):
            return super()._render(rows, key)
        return [[t for ids, _ in self._spans(r) for t in ids] for r in rows]

    def batch(self, ids: list[int], rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The `sft` kind's outputs: PreferenceDataset's, and loss_mask (Bp, T): the
        trained response tokens (a conversation's assistant turns), cut and padded as
        the responses are."""
        out = super().batch(ids, rows)
        out["loss_mask"] = loss_mask = out["response_mask"].clone()  # one answer: all of it
        T = loss_mask.shape[1]
        for i, row in enumerate(rows):
            if row.get("turns"):
                trained = [int(keep) for span, keep in self._spans(row) for _ in span][:T]
                loss_mask[i, : len(trained)] = torch.tensor(trained, dtype=loss_mask.dtype)
        return out


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


@dataclass(frozen=True, slots=True)
class Splits:
    """The datasets of one data source."""

    train: Any
    """A PromptDataset or PreferenceDataset, shuffled."""
    eval: Any | None
    """Held-out rows in file order: `eval_path`, or a built-in's `:test` split."""


def _splits(dataset: Callable[..., Any], path: str, eval_path: str | None, *,
            shuffle: bool, seed: int) -> Splits:
    """The train set (shuffled) and the held-out set (file order) a source's datasets
    read."""
    held_out = held_out_path(path, eval_path)
    return Splits(dataset(path, shuffle=shuffle, seed=seed),
                  None if held_out is None else dataset(held_out, shuffle=False))


def prompt_source(
    path: str,
    *,
    tokenizer: Any,
    format: str = "auto",
    prompt_key: str = "prompt",
    max_prompt_length: int | None = None,
    shuffle: bool = True,
    eval_path: str | None = None,
    apply_chat_template: bool | None = None,
    truncation: str = "error",
    filter_overlong_prompts: bool = False,
    seed: int = 0,
    ground_truth_for: Sequence[str] = (),
    columns: Sequence[str] = (),
) -> Splits:
    """The `prompts` kind: train (and eval) PromptDatasets from its params;
    `ground_truth_for` names the nodes that read the ground truth (it must be there)."""
    dataset = partial(
        PromptDataset, tokenizer=tokenizer, prompt_key=prompt_key,
        max_prompt_length=max_prompt_length, apply_chat_template=apply_chat_template,
        format=format, truncation=truncation, filter_overlong_prompts=filter_overlong_prompts,
        ground_truth_for=ground_truth_for, columns=columns)
    return _splits(dataset, path, eval_path, shuffle=shuffle, seed=seed)


def preference_source(
    path: str,
    *,
    tokenizer: Any,
    format: str = "auto",
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
    shuffle: bool = True,
    eval_path: str | None = None,
    apply_chat_template: bool | None = None,
    truncation: str = "error",
    filter_overlong_prompts: bool = False,
    seed: int = 0,
) -> Splits:
    """The `preferences` kind: train (and eval) PreferenceDatasets from its params."""
    dataset = partial(
        PreferenceDataset, tokenizer=tokenizer, max_prompt_length=max_prompt_length,
        max_response_length=max_response_length, format=format,
        apply_chat_template=apply_chat_template, truncation=truncation,
        filter_overlong_prompts=filter_overlong_prompts)
    return _splits(dataset, path, eval_path, shuffle=shuffle, seed=seed)


def sft_source(
    path: str,
    *,
    tokenizer: Any,
    format: str = "auto",
    prompt_key: str = "prompt",
    response_key: str = "response",
    messages_key: str = "messages",
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
    shuffle: bool = True,
    eval_path: str | None = None,
    apply_chat_template: bool = True,
    truncation: str = "error",
    filter_overlong_prompts: bool = False,
    seed: int = 0,
    loss_mask_read: bool = True,
) -> Splits:
    """The `sft` kind: train (and eval) SFTDatasets from its params; `loss_mask_read`:
    whether a node reads the loss mask (multi-turn rows need one)."""
    dataset = partial(
        SFTDataset, tokenizer=tokenizer, prompt_key=prompt_key, response_key=response_key,
        messages_key=messages_key, max_prompt_length=max_prompt_length,
        max_response_length=max_response_length, format=format,
        apply_chat_template=apply_chat_template, truncation=truncation,
        filter_overlong_prompts=filter_overlong_prompts, loss_mask_read=loss_mask_read)
    return _splits(dataset, path, eval_path, shuffle=shuffle, seed=seed)
