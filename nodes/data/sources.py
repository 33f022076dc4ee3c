"""The data kinds' implementations (`prompts`, `preferences`, `sft`): a data source's
train and held-out datasets, from its params."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from flowgraph.builtin_models import held_out_path
from flowgraph.nodes.data.datasets import PreferenceDataset, PromptDataset
from flowgraph.nodes.data.sft import SFTDataset

__all__ = ["Splits", "preference_source", "prompt_source", "sft_source"]


@dataclass(frozen=True, slots=True)
class Splits:
    """The datasets of one data source."""

    train: Any
    """A PromptDataset, PreferenceDataset or SFTDataset, shuffled."""
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
