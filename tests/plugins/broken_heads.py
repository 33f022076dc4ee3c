"""Plugin kinds for graphs/broken/: custom heads with the shape bugs users ship.

Not a package of the project: tests/core/test_graphs_dir.py puts tests/plugins/ on
`sys.path` (and PYTHONPATH for subprocesses), so graphs under graphs/broken/ can list
`plugins: [broken_heads]`. Run by hand:

    PYTHONPATH=tests/plugins flowgraph check graphs/broken/off_by_one_logprob.yaml

Notation: b batch of the node, P prompt length, T response length.
"""

from __future__ import annotations

from flowgraph.contracts import TensorSpec
from flowgraph.registry import KindSpec, PortSpec, register_kind


def _p(name: str, dims: str, dtype: str = "float", *constraints: str) -> PortSpec:
    return PortSpec(name, TensorSpec(dims, dtype, tuple(constraints)))


_SEQUENCE = (
    _p("prompts", "b P", "int"),
    _p("prompt_mask", "b P", "mask", "binary"),
    _p("responses", "b T", "int"),
    _p("response_mask", "b T", "mask", "binary"),
)

SHIFTED_LOGPROB = register_kind(KindSpec(
    "shifted_logprob", "model",
    "Log-probs gathered from logits[:, :-1] against responses[:, 1:]: one token short.",
    inputs=_SEQUENCE,
    outputs=(_p("log_prob", "b T-1", "float", "nonpositive"),),
    model="required",
    impl="broken_heads:shifted_logprob",
    source=__name__,
))
"""The classic causal-LM shift done twice: `(b, T-1)` where every consumer wants `(b, T)`."""

TWO_LABEL_VALUES = register_kind(KindSpec(
    "two_label_values", "model",
    "A critic built from AutoModelForTokenClassification with num_labels=2.",
    inputs=_SEQUENCE,
    outputs=(_p("values", "b T 2", "float", "finite"),),
    model="required",
    impl="broken_heads:two_label_values",
    source=__name__,
))
"""A value head with two labels: `(b, T, 2)` where GAE wants one value per token."""
