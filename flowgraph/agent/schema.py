"""A tool's JSON schema: built from a function's type hints and Google-style docstring,
and the check of a call's arguments against it.

`function_schema(fn)` gives the dict `transformers.utils.get_json_schema(fn)` gives (the
format chat templates render in their tools list, TRL's `tools=` builds with it), without
importing transformers: `flowgraph check` builds every tool's schema, and stays light.
`tests/agent/test_tools.py` proves the equality against transformers itself. Where
transformers raises (a parameter without a hint, no docstring, an argument the `Args:`
block does not describe), this raises `ToolSchemaError` naming the function, its
file:line and what to add.

The docstring format (transformers'): a description, then an `Args:` block with one
`name: description` per argument, continued on indented lines; a description may end in
`(choices: ["a", "b"])` (a JSON list: the argument's `enum`); `Returns:` and `Raises:`
end the block. An unannotated first parameter named `self` or `cls` is the receiver.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from flowgraph.errors import ToolSchemaError
from flowgraph.objects import defined_at

__all__ = ["argument_problem", "function_schema", "json_type"]

# The docstring's parts, as transformers reads them (chat_template_utils.py): the same
# patterns, so that the same docstring gives the same descriptions.
_DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS = re.compile(r"\n\s*Args:\n\s*(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
_ARG = re.compile(r"(?:^|\n)\s*(\w+):\s*(.*?)\s*(?=\n\s*\w+:|\Z)", re.DOTALL)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)

_BASIC: dict[Any, dict[str, Any]] = {
    int: {"type": "integer"}, float: {"type": "number"}, str: {"type": "string"},
    bool: {"type": "boolean"}, type(None): {"type": "null"}, list: {"type": "array"},
    tuple: {"type": "array"}, dict: {"type": "object"}, Any: {},
}
_LITERALS = (int, float, str, bool, type(None))


def function_schema(fn: Callable[..., Any], description: str | None = None) -> dict[str, Any]:
    """`{"type": "function", "function": {"name", "description", "parameters"[, "return"]}}`
    for `fn`, as `transformers.utils.get_json_schema(fn)`. `description` replaces the
    docstring's (a function with no argument then needs no docstring)."""
    name = getattr(fn, "__name__", "operation")
    doc = (inspect.getdoc(fn) or "").strip()
    if not doc and description is None:
        raise _error(fn, "has no docstring; add a Google-style one: a line saying what the "
                         "tool does, then `Args:` with one `name: what it is` per argument")
    summary, arg_docs, return_doc = _docstring(doc)
    parameters = _parameters(fn)
    returns = parameters["properties"].pop("return", None)
    if returns is not None and return_doc is not None:
        returns["description"] = return_doc
    for arg, schema in parameters["properties"].items():
        if arg not in arg_docs:
            raise _error(fn, f"its docstring does not describe the argument `{arg}`; add "
                             f"`{arg}: <what it is>` under `Args:`")
        schema.update(_described(fn, arg, arg_docs[arg]))
    out = {"name": name, "description": summary if description is None else description,
           "parameters": parameters}
    if returns is not None:
        out["return"] = returns
    return {"type": "function", "function": out}


def _docstring(doc: str) -> tuple[str, dict[str, str], str | None]:
    """The description, each argument's description, the `Returns:` text."""
    summary = _DESCRIPTION.search(doc)
    args = _ARGS.search(doc)
    returns = _RETURNS.search(doc)
    arg_docs: dict[str, str] = {}
    if args is not None:
        block = "\n".join(line for line in args.group(1).strip().split("\n") if line.strip())
        arg_docs = {m[0]: re.sub(r"\s*\n+\s*", " ", m[1].strip()) for m in _ARG.findall(block)}
    return (summary.group(1).strip() if summary else "", arg_docs,
            returns.group(1).strip() if returns else None)


def _described(fn: Callable[..., Any], arg: str, text: str) -> dict[str, Any]:
    """An argument's `description`, and its `enum` from a trailing `(choices: [...])`."""
    choices = _CHOICES.search(text)
    if choices is None:
        return {"description": text}
    try:
        values = json.loads(choices.group(1))
    except json.JSONDecodeError as e:
        raise _error(fn, f"the `(choices: ...)` of argument `{arg}` is not a JSON list ({e}); "
                         'write it as `(choices: ["a", "b"])`') from None
    return {"enum": [v.strip() if isinstance(v, str) else v for v in values],
            "description": text[:choices.start()].strip()}


def _parameters(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema object of fn's parameters (and its `return`, when annotated)."""
    try:
        hints = get_type_hints(fn)
    except Exception as e:  # a forward reference that does not resolve, a bad annotation
        raise _error(fn, f"its type hints do not resolve ({type(e).__name__}: {e}); import "
                         "the types it names where the function is defined") from None
    params = inspect.signature(fn).parameters
    first = next(iter(params), None)
    receiver = first if first in ("self", "cls") and \
        params[first].annotation is inspect.Parameter.empty else None
    required = []
    for name, param in params.items():
        if name == receiver:
            continue
        if param.annotation is inspect.Parameter.empty:
            raise _error(fn, f"its argument `{name}` has no type hint; add one "
                             f"(`{name}: str`): the tool's JSON schema is built from them")
        if param.default is inspect.Parameter.empty:
            required.append(name)
    properties = {name: _hint_schema(fn, name, hint) for name, hint in hints.items()
                  if name != receiver}
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def _hint_schema(fn: Callable[..., Any], arg: str, hint: Any) -> dict[str, Any]:
    """The JSON schema of one type hint (transformers' mapping, case by case)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is None:
        return _plain(hint)
    if origin is Union or origin is types.UnionType:
        return _union(fn, arg, args)
    if origin is Literal and args:
        return _literal(fn, arg, args)
    if origin is list:
        return {"type": "array", "items": _hint_schema(fn, arg, args[0])} if args \
            else {"type": "array"}
    if origin is tuple:
        return _tuple(fn, arg, hint, args)
    if origin is dict:
        out: dict[str, Any] = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = _hint_schema(fn, arg, args[1])
        return out
    raise _error(fn, f"the type hint `{_show_hint(hint)}` of `{arg}` has no JSON schema; use "
                     "str, int, float, bool, list[...], dict[str, ...], Literal[...] or a "
                     "union of them")


def _plain(hint: Any) -> dict[str, Any]:
    """A class: a basic type, an image or audio (as transformers maps PIL images and
    torch tensors, looked up only where the caller already imported them), else an object."""
    if hint in _BASIC:
        return dict(_BASIC[hint])
    image = sys.modules.get("PIL.Image")
    if image is not None and hint is getattr(image, "Image", None):
        return {"type": "image"}
    torch = sys.modules.get("torch")
    if torch is not None and hint is getattr(torch, "Tensor", None):
        return {"type": "audio"}
    return {"type": "object"}


def _union(fn: Callable[..., Any], arg: str, args: tuple[Any, ...]) -> dict[str, Any]:
    subtypes = [_hint_schema(fn, arg, t) for t in args if t is not type(None)]
    if len(subtypes) == 1:
        out = subtypes[0]
    elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subtypes):
        # Basic types only: a list of type names (sorted, without repeats, as transformers).
        names = sorted({s["type"] for s in subtypes})
        out = {"type": names[0] if len(names) == 1 else names}
    else:
        out = {"anyOf": subtypes}
    if type(None) in args:
        out["nullable"] = True
    return out


def _literal(fn: Callable[..., Any], arg: str, args: tuple[Any, ...]) -> dict[str, Any]:
    names: list[str] = []
    for value in args:
        if type(value) not in _LITERALS:
            raise _error(fn, f"the Literal of `{arg}` holds {value!r}; a Literal may hold "
                             "str, int, float, bool or None values only")
        name = _BASIC[type(value)]["type"]
        if name not in names:
            names.append(name)
    return {"type": names[0] if len(names) == 1 else names, "enum": list(args)}


def _tuple(fn: Callable[..., Any], arg: str, hint: Any, args: tuple[Any, ...]) -> dict[str, Any]:
    if not args:
        return {"type": "array"}
    if len(args) == 1 or ... in args:
        raise _error(fn, f"the type hint `{_show_hint(hint)}` of `{arg}` has no JSON schema; "
                         "use list[...] for a list of any length, or the element itself")
    return {"type": "array", "prefixItems": [_hint_schema(fn, arg, t) for t in args]}


def _show_hint(hint: Any) -> str:
    return str(hint).replace("typing.", "")


def _error(fn: Callable[..., Any], what: str) -> ToolSchemaError:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
    where = defined_at(fn)
    return ToolSchemaError(f"tool `{name}`{f' ({where})' if where else ''}: {what}")


# --- the arguments of a call ----------------------------------------------------------

_IS: dict[str, Callable[[Any], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list | tuple),
    "object": lambda v: isinstance(v, Mapping),
}


def json_type(value: Any) -> str:
    """The JSON type of a value a call holds, with the value: `string "3"`, `null`."""
    name = next((t for t in ("null", "boolean", "integer", "number", "string", "array",
                             "object") if _IS[t](value)), type(value).__name__)
    if name in ("null", "array", "object"):
        return {"null": "null", "array": "an array", "object": "an object"}[name]
    shown = json.dumps(value, ensure_ascii=False, default=repr)
    return f"{name} {shown if len(shown) <= 40 else shown[:37] + '...'}"


def argument_problem(schema: Mapping[str, Any], value: Any) -> str | None:
    """What is wrong with `value` for the JSON schema `schema` (`must be a number, got
    string "3"`), or None. Types this module does not know (image, audio) are not judged."""
    if value is None and schema.get("nullable"):
        return None
    if "anyOf" in schema:
        if any(argument_problem(s, value) is None for s in schema["anyOf"]):
            return None
        return f"must be {' or '.join(_expected(s) for s in schema['anyOf'])}, " \
               f"got {json_type(value)}"
    names = _type_names(schema)
    if names and not any(_IS.get(n, lambda v: True)(value) for n in names):
        return f"must be {_expected(schema)}, got {json_type(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"must be one of {json.dumps(schema['enum'])}, got {json_type(value)}"
    return _inner_problem(schema, value)


def _inner_problem(schema: Mapping[str, Any], value: Any) -> str | None:
    """The first item of an array, or value of an object, that breaks its schema."""
    if isinstance(value, list | tuple):
        fixed = schema.get("prefixItems")
        if isinstance(fixed, list) and len(fixed) != len(value):
            return f"must hold {len(fixed)} items, got {len(value)}"
        for i, item in enumerate(value):
            item_schema = fixed[i] if isinstance(fixed, list) else schema.get("items")
            problem = argument_problem(item_schema, item) if item_schema else None
            if problem:
                return f"item {i} {problem}"
    extra = schema.get("additionalProperties")
    if isinstance(value, Mapping) and isinstance(extra, Mapping):
        for key, item in value.items():
            problem = argument_problem(extra, item)
            if problem:
                return f"key {json.dumps(key)} {problem}"
    return None


def _type_names(schema: Mapping[str, Any]) -> list[str]:
    names = schema.get("type")
    return [names] if isinstance(names, str) else list(names or ())


def _expected(schema: Mapping[str, Any]) -> str:
    """`a number`, `a string or null`, `an array of integers`."""
    words = {"integer": "an integer", "number": "a number", "string": "a string",
             "boolean": "a boolean", "null": "null", "array": "an array", "object": "an object"}
    names = [words.get(n, n) for n in _type_names(schema)] or ["anything"]
    if schema.get("nullable"):
        names.append("null")
    return " or ".join(names)
