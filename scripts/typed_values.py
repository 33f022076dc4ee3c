"""The encoding of tests/fixtures/verl/reward_inputs.json, shared by the script that
records it (scripts/verl_reward_input_fixtures.py, run against verl) and the test that
holds flowgraph to it (tests/nodes/test_reward_inputs.py)."""

from __future__ import annotations

import math
from typing import Any


def encode(value: Any) -> Any:
    """A value with its Python type at every level; NaN as the string `nan`, a value
    JSON cannot hold as its repr."""
    if isinstance(value, dict):
        return {"type": "dict", "value": {k: encode(v) for k, v in value.items()}}
    if isinstance(value, list):
        return {"type": "list", "value": [encode(v) for v in value]}
    if isinstance(value, float) and math.isnan(value):
        return {"type": "float", "value": "nan"}
    return {"type": type(value).__name__, "value": value if value is None or isinstance(
        value, (str, int, float, bool)) else repr(value)}
