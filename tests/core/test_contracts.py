"""Tensor specs, dtype families and jaxtyping annotations."""

import pytest
import torch
from jaxtyping import Bool, Float, Int, Shaped

from flowgraph.contracts import TensorSpec, spec_from_annotation
from flowgraph.errors import RegistryError


def test_dtype_families_accept_members() -> None:
    assert TensorSpec("b T", "float").accepts_dtype(TensorSpec("b T", "float32"))
    assert not TensorSpec("b T", "float32").accepts_dtype(TensorSpec("b T", "float"))
    assert not TensorSpec("b T", "float").accepts_dtype(TensorSpec("b T", "int"))
    assert TensorSpec("b T", "mask").accepts_dtype(TensorSpec("b T", "bool"))
    assert TensorSpec("b T", "any").accepts_dtype(TensorSpec("b T", "str"))


def test_unknown_dtype_and_constraint_are_rejected() -> None:
    with pytest.raises(RegistryError, match="unknown dtype `float31`"):
        TensorSpec("b", "float31")
    with pytest.raises(RegistryError, match="unknown constraint"):
        TensorSpec("b", "float", ("positive-ish",))


@pytest.mark.parametrize(
    ("annotation", "dims", "dtype"),
    [
        (Float[torch.Tensor, "b T"], "b T", "float"),
        (Int[torch.Tensor, "b"], "b", "int"),
        (Bool[torch.Tensor, "b T-1"], "b T-1", "bool"),
        (Shaped[torch.Tensor, "Bp*N P+T"], "Bp*N P+T", "any"),
    ],
)
def test_jaxtyping_annotations_are_read(annotation: object, dims: str, dtype: str) -> None:
    spec = spec_from_annotation(annotation)
    assert spec is not None
    assert (spec.dims, spec.dtype) == (dims, dtype)


def test_non_jaxtyping_annotation_gives_none() -> None:
    assert spec_from_annotation(float) is None
    assert spec_from_annotation(torch.Tensor) is None
