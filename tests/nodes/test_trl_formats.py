"""TRL's dataset formats read with TRL's semantics, against TRL 1.16 itself
(tests/fixtures/trl/dataset_formats.json, recorded by scripts/trl_dataset_fixtures.py
with the same tiny tokenizer): standard prompts are raw text, conversational prompts go
through the chat template with the generation prompt, and an implicit-prompt pair's
prompt is its shared first messages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch

from flowgraph.data.held import hold
from flowgraph.data.readers import shared_prompt, with_prompt
from flowgraph.errors import FlowgraphError
from flowgraph.nodes.data import PreferenceDataset, PromptDataset
from flowgraph.nodes.models import build_tiny_tokenizer

TOK = build_tiny_tokenizer()
FIXTURE = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "trl"
                      / "dataset_formats.json").read_text())


def _held(rows: list[dict[str, Any]]) -> str:
    return hold(pa.Table.from_pylist(rows), "test rows")[0]


def _unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]


@pytest.mark.parametrize("fmt", ["standard", "conversational"])
def test_prompt_ids_equal_trls(fmt: str) -> None:
    """GRPOTrainer's prompt ids: a string as raw text (the tokenizer's call), a message
    list through the template with the generation prompt; nothing to ask for either."""
    records = FIXTURE[fmt]
    assert {r["conversational"] for r in records} == {fmt == "conversational"}
    ds = PromptDataset(_held([r["row"] for r in records]), TOK, shuffle=False)
    batch = ds.next_batch(len(records))
    got = _unpadded(batch["input_ids"], batch["attention_mask"])
    assert got == [r["prompt_ids"] for r in records]
    assert [TOK.decode(ids) for ids in got] == [r["prompt_text"] for r in records]


def test_a_string_prompt_through_the_template_when_asked() -> None:
    """apply_chat_template: true renders `1+1=` as the one-message conversation TRL
    renders for [{"role": "user", "content": "1+1="}]."""
    ds = PromptDataset(_held([{"prompt": "1+1="}]), TOK, apply_chat_template=True)
    batch = ds.next_batch(1)
    assert _unpadded(batch["input_ids"], batch["attention_mask"]) == [
        FIXTURE["conversational"][0]["prompt_ids"]]


def test_implicit_prompt_pairs_equal_trls_extract_prompt_and_tokens() -> None:
    """Only `chosen` / `rejected` conversations: the prompt is their shared messages
    (TRL's `extract_prompt`), rendered with the generation prompt; each response is the
    text the template adds after the prompt (its content and EOS), as DPOTrainer's."""
    records = FIXTURE["implicit_preference"]
    table = pa.Table.from_pylist([r["row"] for r in records])
    extracted = with_prompt("pairs", table).to_pylist()
    assert [{k: e[k] for k in ("prompt", "chosen", "rejected")} for e in extracted] == [
        r["extracted"] for r in records]
    ds = PreferenceDataset(_held([r["row"] for r in records]), TOK, shuffle=False)
    batch = ds.next_batch(len(records))
    assert _unpadded(batch["prompts"], batch["prompt_mask"]) == [r["prompt_ids"] for r in records]
    for key in ("chosen", "rejected"):
        assert _unpadded(batch[key], batch[f"{key}_mask"]) == [r[f"{key}_ids"] for r in records]


def test_implicit_prompt_of_strings_is_trls_shared_text() -> None:
    """Standard implicit pairs: the prompt is the shared text, less a space before where
    they differ (TRL's rule), raw text."""
    record = FIXTURE["implicit_standard_preference"][0]
    row = record["row"]
    cut = shared_prompt(row["chosen"], row["rejected"])
    assert (row["chosen"][:cut], row["chosen"][cut:], row["rejected"][cut:]) == (
        record["extracted"]["prompt"], record["extracted"]["chosen"],
        record["extracted"]["rejected"])
    batch = PreferenceDataset(_held([row]), TOK).next_batch(1)
    assert _unpadded(batch["prompts"], batch["prompt_mask"]) == [record["prompt_ids"]]


def test_an_implicit_pair_with_no_shared_message_is_refused() -> None:
    rows = [{"chosen": [{"role": "user", "content": "a"}],
             "rejected": [{"role": "user", "content": "b"}]}]
    with pytest.raises(FlowgraphError, match="column `prompt`: an empty message list"):
        PreferenceDataset(_held(rows), TOK)
