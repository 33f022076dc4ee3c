"""The critic: one value per response token, read at the position that predicts it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaModel

from flowgraph.builtin_models import BUILTIN_MODELS
from flowgraph.nodes.values import ValueModel, values

B, P, T = 3, 4, 6


@pytest.fixture(scope="module")
def critic() -> ValueModel:
    config = {k: v for k, v in BUILTIN_MODELS["tiny-lm"].items() if k != "model_type"}
    torch.manual_seed(0)
    return ValueModel(LlamaModel(LlamaConfig(**config)), int(config["hidden_size"])).eval()


def _batch() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 500, (B, P), generator=g)
    prompt_mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]])
    responses = torch.randint(3, 500, (B, T), generator=g)
    response_mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [0] * 6])
    return prompts, prompt_mask, responses, response_mask


@pytest.mark.parametrize("packing", [False, True])
def test_values_shape_mask_and_position(critic: ValueModel, packing: bool) -> None:
    """Padded or packed into one row of valid tokens: V_t of the padded forward."""
    prompts, prompt_mask, responses, mask = _batch()
    with torch.no_grad():
        v = values(critic, prompts, prompt_mask, responses, mask, packing=packing)["values"]
        # Reference: the head on the full hidden states; V_t sits at position P-1+t.
        attention = torch.cat([prompt_mask, mask], 1)
        hidden = critic.backbone(
            input_ids=torch.cat([prompts, responses], 1),
            attention_mask=attention,
            position_ids=(attention.cumsum(-1) - 1).clamp_min(0),
        ).last_hidden_state
        want = critic.value_head(hidden[:, P - 1 : P + T - 1]).squeeze(-1) * mask
    assert v.shape == (B, T) and v.dtype == torch.float32
    torch.testing.assert_close(v, want)
    assert (v[mask == 0] == 0).all()


def test_micro_batches_give_the_same_values(critic: ValueModel) -> None:
    with torch.no_grad():
        whole = values(critic, *_batch())["values"]
        split = values(critic, *_batch(), micro_batch_size=2)["values"]
    torch.testing.assert_close(whole, split, atol=1e-6, rtol=0)


def test_a_two_label_head_is_refused_with_its_shape(critic: ValueModel) -> None:
    head = critic.value_head
    critic.value_head = nn.Linear(head.in_features, 2)
    try:
        with pytest.raises(ValueError, match=r"shape \(3, 6, 2\)"):
            values(critic, *_batch())
    finally:
        critic.value_head = head


def test_from_pretrained_builtin_trains_head_and_backbone(tmp_path: Path) -> None:
    critic = ValueModel.from_pretrained("builtin:tiny-lm", trainable=True, cache_dir=tmp_path)
    assert critic.training and all(p.requires_grad for p in critic.parameters())
    values(critic, *_batch())["values"].sum().backward()
    assert critic.value_head.weight.grad is not None
    assert critic.backbone.embed_tokens.weight.grad is not None
    again = ValueModel.from_pretrained("builtin:tiny-lm", cache_dir=tmp_path)
    torch.testing.assert_close(again.value_head.weight, critic.value_head.weight)  # seeded
    assert not any(p.requires_grad for p in again.parameters())
