"""The critic: a causal-LM backbone with a scalar value head, one value per token.

As in verl, the value of response token t is read at the position that predicts it
(P-1+t), i.e. V(s_t) with s_t the prompt and the first t response tokens:

    V_t = w·h_{P-1+t} + b,    t = 0 .. T-1

Notation: B sequences, P prompt length, T response length, H hidden size.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from flowgraph.nodes.logprob import forward_hidden, micro_batched
from flowgraph.nodes.models import load_model
from flowgraph.runtime import NodeContext

__all__ = ["ValueModel", "values"]


class ValueModel(nn.Module):
    """`backbone` (a Hugging Face base model, e.g. LlamaModel) + `value_head` (H -> 1)."""

    def __init__(self, backbone: nn.Module, hidden_size: int, seed: int = 0) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        # OpenRLHF's init, std 1/(H+1): small values at the start, seeded for equal runs.
        gen = torch.Generator().manual_seed(seed)
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden_size + 1), generator=gen)
        nn.init.zeros_(self.value_head.bias)
        self.value_head.to(next(backbone.parameters()).dtype)

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        dtype: torch.dtype | None = None,
        trainable: bool = False,
        cache_dir: str | Path | None = None,
        attn_implementation: str = "sdpa",
    ) -> ValueModel:
        """The backbone of the causal LM at `path` (see `load_model`) with a fresh head."""
        lm = load_model(path, dtype=dtype, trainable=trainable, cache_dir=cache_dir,
                        attn_implementation=attn_implementation)
        critic = cls(lm.base_model, lm.config.hidden_size)
        critic.train(trainable)
        critic.requires_grad_(trainable)
        return critic

    def forward(
        self,
        prompts: Tensor,
        prompt_mask: Tensor,
        responses: Tensor,
        response_mask: Tensor,
        *,
        on_tokens: bool = False,
        packing: bool = False,
    ) -> Tensor:
        """Raw head output (B, T, out_features) at the positions predicting the responses
        (`forward_hidden`; with `packing`, 0 at masked positions)."""
        hidden = forward_hidden(self.backbone, prompts, prompt_mask, responses, response_mask,
                                on_tokens=on_tokens, packing=packing)
        v: Tensor = self.value_head(hidden)
        return v


def values(
    critic: ValueModel,
    prompts: Tensor,
    prompt_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    micro_batch_size: int | None = None,
    max_token_len: int | None = None,
    packing: bool = False,
    ctx: NodeContext | None = None,
) -> dict[str, Tensor]:
    """values (B, T) float32: V_t for each response token, 0 where masked."""

    def forward(rows: Tensor) -> dict[str, Tensor]:
        v = critic(prompts[rows], prompt_mask[rows], responses[rows], response_mask[rows],
                   packing=packing)
        if v.shape[-1] != 1:
            raise ValueError(
                f"the value head returned shape {tuple(v.shape)}; a critic needs one value per "
                f"token, (B, T, 1). Give the head out_features=1 (num_labels=1)."
            )
        return {"values": torch.where(response_mask[rows].bool(), v.squeeze(-1).float(), 0.0)}

    return micro_batched(forward, prompt_mask, response_mask, micro_batch_size,
                         max_token_len, packing, ctx)
