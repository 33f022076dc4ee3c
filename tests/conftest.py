"""Suite-wide: the slow house check (mypy --strict, ~2 min on 2 cores) starts as soon as
the tests are collected, in a process of its own, so that it runs beside the tests
(most of them use one core); `tests/test_tooling.py` waits for its verdict."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any(item.name == "test_mypy_strict_is_clean" for item in items):
        from tests.test_tooling import start_mypy

        config.mypy = start_mypy()  # type: ignore[attr-defined]
