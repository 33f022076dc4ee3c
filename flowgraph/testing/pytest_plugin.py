"""pytest plugin: fixtures that check graph files and node kinds in a test.

    def test_my_graphs(flowgraph_check):
        flowgraph_check("graphs/my_grpo.yaml", dp=4)

    def test_my_reward(honours_contract):
        honours_contract("length_reward")   # or the @node_kind function itself
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from flowgraph.checker import CheckResult
from flowgraph.testing import assert_honours_contract, check_file


@pytest.fixture
def flowgraph_check() -> Callable[..., CheckResult]:
    return check_file


@pytest.fixture
def honours_contract() -> Callable[..., None]:
    """`flowgraph.testing.assert_honours_contract`: a kind (by name, spec or its
    `@node_kind` function) holds its contract on hypothesis-drawn inputs."""
    return assert_honours_contract
