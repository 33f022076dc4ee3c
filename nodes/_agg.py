"""Masked reductions and loss aggregation shared by every node.

Every advantage estimator and every loss in ``flowgraph.nodes`` reduces over the
valid (mask == 1) response tokens only. The helpers here are the single place
where that happens, so that "token-mean" means the same thing everywhere.

Masks may be ``bool``, integer or floating tensors holding 0/1; a floating mask
with other values acts as a per-token weight. As in verl, masking multiplies
(``values * mask``), so masked-out entries must be finite (0·inf is nan).

Degenerate inputs differ from verl in one deliberate way: a mean over zero
valid tokens is 0 (still connected to the autograd graph) instead of ``nan``.

Notation:
    B  number of sequences in the batch
    T  response length (tokens per sequence, right- or left-padded)
"""

from __future__ import annotations

import torch
from torch import Tensor

from flowgraph.choices import LOSS_AGG_MODES

__all__ = [
    "agg_loss",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]



def _check_mask_shape(fn: str, values: Tensor, mask: Tensor) -> None:
    if values.shape != mask.shape:
        raise ValueError(
            f"{fn}: mask must have the same shape as the values it masks; "
            f"got values {tuple(values.shape)} and mask {tuple(mask.shape)}. "
            "Pass a response mask aligned token-for-token with the values."
        )


def _weights(mask: Tensor, values: Tensor) -> Tensor:
    """The mask as a multiplicative weight in the dtype of ``values``."""
    return mask if mask.dtype == values.dtype else mask.to(values.dtype)


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ values·mask over ``dim`` (all elements when ``dim`` is None)."""
    _check_mask_shape("masked_sum", values, mask)
    masked = values * _weights(mask, values)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ values·mask / Σ mask over ``dim``; 0 where the mask sums to 0.

    verl: ``verl.utils.torch_functional.masked_mean`` (which returns nan there).
    """
    _check_mask_shape("masked_mean", values, mask)
    weight = _weights(mask, values)
    masked = values * weight
    total = masked.sum() if dim is None else masked.sum(dim=dim)
    count = weight.sum() if dim is None else weight.sum(dim=dim)
    return total / torch.where(count != 0, count, torch.ones_like(count))


def _centred_moments(
    fn: str, values: Tensor, mask: Tensor, unbiased: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(mean, values − mean, var) over the valid entries; the var is unbiased on request."""
    _check_mask_shape(fn, values, mask)
    count = float(mask.sum(dtype=torch.float64).item())
    needed = 2.0 if unbiased else 1.0
    if count < needed:
        raise ValueError(
            f"{fn}: the mask must select at least {int(needed)} token(s) "
            f"(unbiased={unbiased}); it selects {count:g}. Whiten over a larger "
            "batch/minibatch or pass unbiased=False."
        )
    weight = _weights(mask, values)
    mean = (values * weight).sum() / count
    centred = values - mean
    var = (centred.square() * weight).sum() / (count - 1.0 if unbiased else count)
    return mean, centred, var


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the valid entries: Σ m·(x − mean)² / (n − 1), or / n if not ``unbiased``.

    verl: ``masked_var`` (n = Σ mask, Bessel factor n/(n−1)). Raises when the
    mask holds no token (or a single one with ``unbiased``), as verl does.
    """
    return _centred_moments("masked_var", values, mask, unbiased)[2]


def masked_whiten(
    values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """(x − mean)/sqrt(var + eps) with masked mean and unbiased masked var.

    verl: ``masked_whiten``. With ``shift_mean=False`` the mean is added back.
    Entries where mask == 0 are transformed too (callers multiply by the mask).
    A single valid entry whitens to 0 (it is its own mean; verl raises there, which
    would stop a run on a batch with one response token); none is a ValueError.
    """
    single = float(mask.sum(dtype=torch.float64).item()) == 1.0
    mean, centred, var = _centred_moments("masked_whiten", values, mask, unbiased=not single)
    whitened = centred * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str,
             loss_scale_factor: float | None = None) -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar (verl ``core_algos.agg_loss``).

    token-mean:          Σ_{b,t} m·ℓ / Σ_{b,t} m
    seq-mean-token-sum:  mean over sequences with ≥1 valid token of Σ_t m·ℓ
    seq-mean-token-mean: mean over sequences with ≥1 valid token of Σ_t m·ℓ / (Σ_t m + 1e-8)
    seq-mean-token-sum-norm: seq-mean-token-sum / loss_scale_factor (default T, the padded
                         length), a constant: Dr. GRPO's length-unbiased loss (Liu et al. 2025)
    As verl 0.9.1 (tests/nodes/test_verl_reference.py), except that no valid row at all
    gives 0, not nan.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"agg_loss: unknown mode {mode!r}; valid modes are {', '.join(LOSS_AGG_MODES)}."
        )
    _check_mask_shape("agg_loss", loss_mat, mask)
    if loss_mat.dim() != 2:
        raise ValueError(
            f"agg_loss: loss_mat must be 2-D (B, T); got shape {tuple(loss_mat.shape)}. "
            "Flatten extra dims into the batch dim first."
        )
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    has_tokens = (mask != 0).any(dim=-1)
    seq_losses = masked_sum(loss_mat, mask, dim=-1)
    if mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (_weights(mask, loss_mat).sum(dim=-1) + 1e-8)
    loss = masked_mean(seq_losses, has_tokens)
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_scale_factor or loss_mat.shape[-1])
    return loss
