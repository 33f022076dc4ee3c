"""PLACEHOLDER until the `envs` branch merges (its version replaces this file)."""

from __future__ import annotations

from functools import partial
from typing import Any

from flowgraph.agent.env import Env


def load_env(obj: Any, *, params: dict[str, Any] | None = None, where: str = "") -> Any:
    if isinstance(obj, type) and issubclass(obj, Env):
        return partial(obj, **(params or {}))
    raise TypeError(f"not an env: {obj!r}")
