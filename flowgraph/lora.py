"""`models.<m>.lora` from Python: a peft `LoraConfig`, or a dict with peft's key names or
the graph file's, read into a `LoraSpec`.

A `LoraConfig` is read field by field: `r`, `lora_alpha`, `lora_dropout` and
`target_modules` become the spec's settings (with their peft values: peft's default
alpha is 8, the graph file's 16); `bias: none` and `task_type: CAUSAL_LM` (or unset) are
what flowgraph does anyway; any other field set away from peft's default (`use_dora`,
`use_rslora`, `modules_to_save`, ...) is refused, never dropped, as is
`target_modules=None` (peft then picks modules by architecture; flowgraph needs them
named). A dict takes `r`, `alpha` or `lora_alpha`, `dropout` or `lora_dropout`,
`target_modules` (a name or a list; `all-linear`), and `bias`/`task_type` as above;
any other key is the graph file's FG003.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from flowgraph.diagnostics import Diagnostic, error
from flowgraph.errors import GraphError
from flowgraph.frontend import unknown_key
from flowgraph.ir import LoraSpec
from flowgraph.settings import declared
from flowgraph.source import SourcePos

PEFT_KEYS = {"r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout",
             "target_modules": "target_modules"}
"""peft `LoraConfig` field -> `LoraSpec` setting."""
AS_FLOWGRAPH = {"bias": ("none",), "task_type": (None, "CAUSAL_LM")}
"""peft fields whose only values flowgraph accepts are what its adapters do anyway:
no bias is trained, and they go on a causal LM."""
_METADATA = frozenset({"peft_type", "peft_version", "base_model_name_or_path", "revision",
                       "auto_mapping"})
"""`LoraConfig` fields that record where a config came from, not what it trains."""


def lora_spec(lora: Any, where: str, pos: SourcePos) -> LoraSpec | None:
    """The `LoraSpec` of `GraphBuilder.model(..., lora=...)`; `GraphError` listing every
    key or field it cannot honour, at the user's line."""
    if lora is None or isinstance(lora, LoraSpec):
        return lora
    if isinstance(lora, Mapping):
        return _from_dict(lora, where, pos)
    if dataclasses.is_dataclass(lora) and hasattr(lora, "lora_alpha"):
        return _from_peft(lora, where, pos)
    raise GraphError((error(
        "FG004", f"`{where}` must be a mapping, a LoraSpec or a peft LoraConfig, got "
        f"{type(lora).__name__}", pos, hint="e.g. lora={'r': 8, 'lora_alpha': 16}"),))


def _from_dict(lora: Mapping[str, Any], where: str, pos: SourcePos) -> LoraSpec:
    own = [f.name for f, _ in declared(LoraSpec)]
    values: dict[str, Any] = {}
    problems: list[Diagnostic] = []
    for key, value in lora.items():
        if key in AS_FLOWGRAPH:
            problems += _as_flowgraph(key, value, where, pos)
        elif key in PEFT_KEYS or key in own:
            values[PEFT_KEYS.get(key, key)] = value
        else:
            known = [*own, *(k for k in PEFT_KEYS if k not in own)]
            problems.append(unknown_key(key, known, where, pos))
    if problems:
        raise GraphError(tuple(problems))
    targets = values.get("target_modules", ("all-linear",))
    values["target_modules"] = (targets,) if isinstance(targets, str) else tuple(targets)
    return LoraSpec(**values, pos=pos)


def _from_peft(config: Any, where: str, pos: SourcePos) -> LoraSpec:
    default = type(config)()
    problems: list[Diagnostic] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in AS_FLOWGRAPH:
            problems += _as_flowgraph(f.name, value, where, pos)
        elif f.name not in PEFT_KEYS and f.name not in _METADATA \
                and value != getattr(default, f.name):
            problems.append(error(
                "FG004", f"`{where}`: the LoraConfig sets `{f.name}={value!r}`, which "
                "flowgraph's LoRA does not apply", pos,
                hint=f"leave `{f.name}` at peft's default ({getattr(default, f.name)!r}); "
                     "flowgraph trains plain adapters (r, lora_alpha, lora_dropout, "
                     "target_modules)"))
    targets = _targets(config.target_modules, where, pos, problems)
    if problems:
        raise GraphError(tuple(problems))
    return LoraSpec(r=config.r, alpha=float(config.lora_alpha),
                    dropout=float(config.lora_dropout), target_modules=targets, pos=pos)


def _targets(targets: Any, where: str, pos: SourcePos, problems: list[Diagnostic]
             ) -> tuple[str, ...]:
    """A `LoraConfig`'s `target_modules` as names: peft keeps a list as a set, and reads a
    string other than `all-linear` as a regular expression."""
    if targets == "all-linear":
        return ("all-linear",)
    if isinstance(targets, (set, frozenset, list, tuple)) and targets:
        return tuple(sorted(targets))
    problems.append(error(
        "FG004", f"`{where}`: the LoraConfig's `target_modules={targets!r}` does not name "
        "modules (None: peft picks them by architecture; a string: a regular expression)",
        pos, hint="target_modules='all-linear' (every linear layer but the output head) or "
                  "a list such as ['q_proj', 'v_proj']"))
    return ("all-linear",)


def _as_flowgraph(key: str, value: Any, where: str, pos: SourcePos) -> list[Diagnostic]:
    allowed = AS_FLOWGRAPH[key]
    if str(value) in map(str, allowed) or value in allowed:
        return []
    shown = ", ".join(repr(a) for a in allowed)
    return [error("FG004", f"`{where}.{key}` is {value!r}; flowgraph's LoRA takes only "
                  f"{shown}", pos,
                  hint="flowgraph trains no biases, on a causal LM" if key == "bias"
                  else "flowgraph's LoRA goes on a causal LM (task_type='CAUSAL_LM')")]
