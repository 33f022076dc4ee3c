"""pytest plugin: the `flowgraph_check` fixture checks graph files in a test.

    def test_my_graphs(flowgraph_check):
        flowgraph_check("graphs/my_grpo.yaml", dp=4)
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from flowgraph.check import CheckResult
from flowgraph.testing import check_file


@pytest.fixture
def flowgraph_check() -> Callable[..., CheckResult]:
    return check_file
