"""Suite-wide: each xdist worker (`-n 2` in pyproject's addopts) computes on one thread,
so that two workers share the cores without oversubscribing them (torch would give each
worker every core). Subprocesses (fsdp ranks, Ray workers) set their own."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
