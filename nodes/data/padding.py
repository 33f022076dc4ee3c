"""Token ids cut to a length limit and padded into a batch's (ids, mask) tensors.

Prompts are left-padded (the generation prompt sits at the end), responses
right-padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["pad", "pad_id", "truncate"]


def truncate(seq: list[int], limit: int | None, keep_end: bool) -> list[int]:
    """`seq` cut to `limit` tokens: its last ones (`keep_end`) or its first."""
    if limit is None or len(seq) <= limit:
        return seq
    return seq[-limit:] if keep_end else seq[:limit]


def pad(
    seqs: Sequence[list[int]], length: int | None, pad_token: int, left: bool
) -> tuple[Tensor, Tensor]:
    """(ids, mask), each (len(seqs), L) int64; L = `length` or the longest sequence,
    which none is longer than (they were truncated or checked)."""
    L = length or max(len(s) for s in seqs)
    ids, mask = [], []
    for s in seqs:  # plain lists, one tensor each at the end: no per-row tensors
        fill = L - len(s)
        ids.append([pad_token] * fill + list(s) if left else list(s) + [pad_token] * fill)
        mask.append([0] * fill + [1] * len(s) if left else [1] * len(s) + [0] * fill)
    shape = (len(seqs), L)
    return (torch.tensor(ids, dtype=torch.int64).reshape(shape),
            torch.tensor(mask, dtype=torch.int64).reshape(shape))


def pad_id(tokenizer: Any) -> int:
    """The tokenizer's pad token id; its EOS when it has none (0 when neither)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad or 0)
