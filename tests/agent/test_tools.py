"""Tools: the JSON schema of a typed, documented function (equal to what
`transformers.utils.get_json_schema` gives, proved against it), method tools bound per
episode, an env's tool set, the check of a call's arguments, and the errors a user
reads when a tool cannot be built."""

# The hints below spell Optional and Union the old ways on purpose: users write them.
# ruff: noqa: UP007, UP045

from __future__ import annotations

import ast
import asyncio
import inspect
import math
import pickle
import re
import subprocess
import sys
import typing
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, Optional, Union

import cloudpickle
import pytest

import flowgraph
from flowgraph.agent import Env, Tool, ToolSchemaError, as_tool, tool, tools_of
from flowgraph.agent.schema import function_schema
from flowgraph.ir import from_python
from flowgraph.objects import PyObject, rebuilt

ROOT = Path(__file__).resolve().parents[2]
TYPING = {"Callable": Callable, "Sequence": Sequence, **{
    name: getattr(typing, name) for name in ("Dict", "List", "Tuple")}}


# --- a dozen varied functions, each compared with transformers' schema ------------------

def basic(a: int, b: float, c: str, d: bool = False):
    """Basic JSON types, one with a default.

    Args:
        a: an integer
        b: a number
        c: a string
        d: a flag
    """


def optionals(x: Optional[int] = None, y: int | None = None, z: Union[str, None] = "s"):
    """Optional in its three spellings.

    Args:
        x: typing.Optional
        y: a PEP 604 union with None
        z: typing.Union with None
    """


def unions(a: Union[int, str], b: int | list[int], c: Union[list, tuple], d: float | int):
    """Unions of basic types (a type list) and of richer ones (anyOf).

    Args:
        a: int or str
        b: an int or a list of ints
        c: two hints that are both arrays
        d: sorted type names
    """


def containers(a: list[str], b: list, c: list[list[int]], d: dict[str, int], e: dict,
               f: dict[str, list[float]], g: tuple[int, str], h: tuple):
    """Lists, dicts and tuples.

    Args:
        a: strings
        b: anything, as a list
        c: a matrix
        d: counts by name
        e: any object
        f: lists of numbers by name
        g: a pair
        h: a bare tuple
    """


def literals(mode: Literal["fast", "slow"], level: Literal[1, "x", None] = None,
             maybe: Optional[Literal["a", "b"]] = None):
    """Literal values become an enum.

    Args:
        mode: how fast
        level: mixed literal types
        maybe: an optional literal
    """


def choices(drink: str, size: int = 1):
    """Choices written in the docstring.

    Args:
        drink: what to drink (choices: ["tea", " coffee "])
        size: how big (choices: [1, 2, 3])
    """


def multiline(query: str, limit: int = 10) -> list[str]:
    """Search the index for a query.

    Longer description on a second paragraph.

    Args:
        query: what to look for, which may be
            long and span lines

        limit: how many results
            at most

    Returns:
        the matching documents, best first

    Raises:
        ValueError: never
    """
    return []


def returns_without_doc(n: int) -> int:
    """A return hint without a Returns block.

    Args:
        n: a number
    """
    return n


def no_arguments() -> str:
    """Tell the time."""
    return "noon"


def anything(x: Any, obj: object, nested: list[Optional[int]]):
    """Any, an unknown class and a nested optional.

    Args:
        x: any value
        obj: a Python object
        nested: a list that may hold nulls
    """


async def fetch(url: str, timeout: float = 1.0) -> str:
    """Fetch a URL (async).

    Args:
        url: the address
        timeout: seconds to wait
    """
    return url


class Calculator:
    def add(self, a: int, b: int) -> int:
        """Add two integers (a method: `self` is the receiver).

        Args:
            a: first
            b: second
        """
        return a + b

    def scale(cls, k: float):
        """A receiver named cls.

        Args:
            k: the factor
        """


FUNCTIONS = [basic, optionals, unions, containers, literals, choices, multiline,
             returns_without_doc, no_arguments, anything, fetch, Calculator.add,
             Calculator().add, Calculator.scale]


@pytest.fixture(scope="module")
def get_json_schema() -> Any:
    from transformers.utils import get_json_schema

    return get_json_schema


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__qualname__)
def test_schema_equals_transformers(fn: Any, get_json_schema: Any) -> None:
    expected = get_json_schema(fn)
    assert function_schema(fn) == expected
    # The order of keys too: the chat template renders the schema as written.
    assert repr(function_schema(fn)) == repr(expected)
    assert as_tool(fn).schema() == expected


HINTS = ["int", "None", "object", "bytes", "set", "Any", "list[Any]", "List[int]",
         "Dict[str, int]", "Tuple[int, str]", "dict[int, str]", "tuple[()]",
         "list[dict[str, int]]", "dict[str, list[int] | None]", "Union[int, Literal['a']]",
         "Optional[Any]", "Literal[True, 1]", "Literal['a'] | None", "int | str | None",
         "list[int] | tuple[int, int]", "list | dict", "frozenset[int]", "Callable[[int], int]",
         "Sequence[int]", "tuple[int]", "Literal[1.5, None]"]
DOCS = ["x: the value", 'x: the value (choices: [1, "b"])', "x: the value (CHOICES: ['a'])",
        "x: first line\n            second line", "y: not x"]


@pytest.mark.parametrize("doc", DOCS)
@pytest.mark.parametrize("hint", HINTS)
def test_every_hint_and_docstring_as_transformers(hint: str, doc: str,
                                                  get_json_schema: Any) -> None:
    """A grid of hints and argument docs: the same schema as transformers, or both refuse."""
    source = f'def f(x: {hint}) -> None:\n    """Doc.\n\n    Args:\n        {doc}\n    """\n'
    namespace: dict[str, Any] = {}
    exec(source, {**globals(), **TYPING}, namespace)
    try:
        expected = get_json_schema(namespace["f"])
    except Exception:
        with pytest.raises(ToolSchemaError, match=r"^tool `f` \("):
            function_schema(namespace["f"])
        return
    assert function_schema(namespace["f"]) == expected


def test_a_decorated_tool_gives_the_same_schema(get_json_schema: Any) -> None:
    assert tool(multiline).schema() == get_json_schema(multiline)
    assert tool(fetch).is_async and not tool(multiline).is_async


# --- where a schema cannot be built -----------------------------------------------------

def no_hint(a, b: int):  # type: ignore[no-untyped-def]
    """No hint on a.

    Args:
        a: first
        b: second
    """


def no_docstring(a: int):
    pass


def undescribed(a: int, b: int):
    """B is not described.

    Args:
        a: first
    """


def one_tuple(a: tuple[int]):
    """A one-element tuple.

    Args:
        a: a pair
    """


def ellipsis_tuple(a: tuple[int, ...]):
    """A variable-length tuple.

    Args:
        a: numbers
    """


def a_set(a: set[int]):
    """A set.

    Args:
        a: numbers
    """


def bad_choices(a: str):
    """Choices that are not JSON.

    Args:
        a: a letter (choices: [a, b])
    """


def bad_literal(a: Literal[b"x"]):
    """A bytes literal.

    Args:
        a: bytes
    """


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (no_hint, "its argument `a` has no type hint; add one (`a: str`)"),
        (no_docstring, "has no docstring; add a Google-style one"),
        (undescribed, "its docstring does not describe the argument `b`; add `b: <what it "
                      "is>` under `Args:`"),
        (one_tuple, "the type hint `tuple[int]` of `a` has no JSON schema; use list[...]"),
        (ellipsis_tuple, "the type hint `tuple[int, ...]` of `a` has no JSON schema"),
        (a_set, "the type hint `set[int]` of `a` has no JSON schema"),
        (bad_choices, "the `(choices: ...)` of argument `a` is not a JSON list"),
        (bad_literal, "the Literal of `a` holds b'x'; a Literal may hold str, int, float, "
                      "bool or None values only"),
    ],
)
def test_a_schema_that_cannot_be_built_names_the_function(
    fn: Any, expected: str, get_json_schema: Any
) -> None:
    with pytest.raises(Exception):  # noqa: B017 - transformers refuses it too
        get_json_schema(fn)
    line = inspect.getsourcelines(fn)[1]
    with pytest.raises(ToolSchemaError) as e:
        tool(fn)
    assert str(e.value).startswith(f"tool `{fn.__name__}` ({__file__}:{line}): ")
    assert expected in str(e.value)


def test_hints_that_do_not_resolve() -> None:
    def f(a: NotDefinedAnywhere) -> None:  # type: ignore[name-defined]  # noqa: F821
        """Bad hint.

        Args:
            a: something
        """

    with pytest.raises(ToolSchemaError, match=r"its type hints do not resolve \(NameError"):
        tool(f)


def test_a_description_given_replaces_the_docstring() -> None:
    t = tool(name="now", description="The time.")(no_arguments)
    assert (t.name, t.description) == ("now", "The time.")

    def bare() -> str:
        return "x"

    assert tool(description="No docstring needed.")(bare).schema()["function"] == {
        "name": "bare", "description": "No docstring needed.",
        "parameters": {"type": "object", "properties": {}}, "return": {"type": "string"}}


# --- the Tool record --------------------------------------------------------------------

@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


@tool(name="power", timeout_s=2.5)
async def slow_power(base: float, exponent: int = 2) -> float:
    """Raise a number to a power.

    Args:
        base: the number
        exponent: the power
    """
    return base**exponent


def test_decorated_functions_still_run() -> None:
    assert isinstance(multiply, Tool) and multiply(a=6, b=7) == 42 and multiply(2, 3) == 6
    assert (slow_power.name, slow_power.timeout_s, slow_power.is_async) == ("power", 2.5, True)
    assert asyncio.run(slow_power(base=3.0)) == 9.0
    assert multiply.timeout_s is None


def test_schema_is_a_copy() -> None:
    multiply.schema()["function"]["parameters"]["properties"].clear()
    assert "a" in multiply.schema()["function"]["parameters"]["properties"]


def test_a_module_tool_pickles_by_reference() -> None:
    assert pickle.loads(pickle.dumps(multiply)) is multiply
    assert pickle.loads(cloudpickle.dumps(multiply)) is multiply


def test_a_local_tool_travels_by_value() -> None:
    @tool(timeout_s=3.0)
    def local(x: int) -> int:
        """Double x.

        Args:
            x: a number
        """
        return 2 * x

    copy = pickle.loads(cloudpickle.dumps(local))
    assert copy is not local and copy == replace(local, fn=copy.fn) and copy(x=4) == 8


def test_a_graph_holds_a_tool_as_it_holds_a_function() -> None:
    # `params={"tools": [multiply]}`: the decorated function, by its module:qualname.
    held = from_python([multiply, basic])
    line = inspect.getsourcelines(multiply)[1]
    assert held == (PyObject(f"{__name__}:multiply"), PyObject(f"{__name__}:basic"))
    assert held[0].obj is multiply and held[0].where == f"{__file__}:{line}"
    assert rebuilt(held[0].ref).obj is multiply
    assert (multiply.__name__, multiply.__doc__) == ("multiply", multiply.fn.__doc__)


@pytest.mark.parametrize("timeout", [0, -1.0, math.inf, math.nan, True, "5"])
def test_a_timeout_must_be_positive_and_finite(timeout: Any) -> None:
    with pytest.raises(ToolSchemaError) as e:
        tool(timeout_s=timeout)(no_arguments)
    line = inspect.getsourcelines(no_arguments)[1]
    assert str(e.value) == (
        f"tool `no_arguments` ({__file__}:{line}): timeout_s={timeout!r} is not a positive, "
        "finite number of seconds; give one (timeout_s=10) or leave it None for the "
        "node's tool_timeout_s")


@pytest.mark.parametrize("name", ["", "two words", "x" * 65, 'q"uote'])
def test_a_name_must_be_callable_by_the_model(name: str) -> None:
    with pytest.raises(ToolSchemaError, match="a tool's name is 1 to 64 letters, digits"):
        tool(name=name)(no_arguments)


@pytest.mark.parametrize(
    ("obj", "expected"),
    [(42, "42 is not a function"), (Calculator, "is not a function: a tool is a function")],
)
def test_as_tool_refuses_what_is_not_a_function(obj: object, expected: str) -> None:
    with pytest.raises(ToolSchemaError, match=expected):
        as_tool(obj)


def test_as_tool_takes_tools_functions_and_bound_methods() -> None:
    assert as_tool(multiply) is multiply
    assert as_tool(basic).name == "basic"
    bound = as_tool(Calculator().add)
    assert not bound.receiver and bound(a=1, b=2) == 3


# --- the arguments of a call ------------------------------------------------------------

@tool
def search(query: str, limit: int = 5, tags: list[str] | None = None,
           mode: Literal["fast", "exact"] = "fast", weight: float = 1.0,
           ids: Union[int, list[int]] = 0) -> list[str]:
    """Search documents.

    Args:
        query: what to look for
        limit: at most this many
        tags: only these tags
        mode: how to match
        weight: a score weight
        ids: one id or several
    """
    return []


SIGNATURE = ("search(query: string, limit?: integer, tags?: array, mode?: fast|exact, "
             "weight?: number, ids?: integer|array)")


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"query": "x"}, None),
        ({"query": "x", "limit": 3, "tags": None, "mode": "exact", "weight": 2,
          "ids": [1, 2]}, None),
        ({}, f"`search` is missing the argument `query`; call it as {SIGNATURE}"),
        ({"query": "x", "lmit": 3}, f"`search` has no argument `lmit`; call it as {SIGNATURE}"),
        ({"query": 3}, 'the argument `query` of `search` must be a string, got integer 3'),
        ({"query": "x", "limit": "3"},
         'the argument `limit` of `search` must be an integer, got string "3"'),
        ({"query": "x", "limit": True},
         "the argument `limit` of `search` must be an integer, got boolean true"),
        ({"query": "x", "limit": 2.5},
         "the argument `limit` of `search` must be an integer, got number 2.5"),
        ({"query": "x", "weight": "heavy"},
         'the argument `weight` of `search` must be a number, got string "heavy"'),
        ({"query": "x", "mode": "slow"},
         'the argument `mode` of `search` must be one of ["fast", "exact"], got string "slow"'),
        ({"query": "x", "tags": ["a", 2]},
         "the argument `tags` of `search` item 1 must be a string, got integer 2"),
        ({"query": "x", "tags": "a"},
         'the argument `tags` of `search` must be an array or null, got string "a"'),
        ({"query": "x", "ids": "7"},
         'the argument `ids` of `search` must be an integer or an array, got string "7"'),
        (["x"], f"the arguments of `search` must be a JSON object, got an array; call it as "
                f"{SIGNATURE}"),
    ],
)
def test_check_arguments(arguments: Any, expected: str | None) -> None:
    assert search.check_arguments(arguments) == expected


def test_a_hand_written_schema_allows_extra_keys_when_it_says_so() -> None:
    loose = Tool("loose", "Any keys.", {"type": "object", "properties": {},
                                        "additionalProperties": True}, lambda **kw: kw)
    assert loose.check_arguments({"anything": 1}) is None
    typed = Tool("typed", "Values are numbers.", {
        "type": "object", "properties": {"m": {"type": "object",
                                               "additionalProperties": {"type": "number"}}}},
                 lambda **kw: kw)
    assert typed.check_arguments({"m": {"a": "b"}}) == (
        'the argument `m` of `typed` key "a" must be a number, got string "b"')


# --- method tools and an env's tool set ---------------------------------------------------

class Guess(Env):
    tools = (multiply,)

    def __init__(self, secret: int = 7) -> None:
        self.secret = secret
        self.guesses = 0

    @tool(timeout_s=1.0)
    def guess(self, n: int) -> str:
        """Guess the secret number.

        Args:
            n: the guess
        """
        self.guesses += 1
        return "right" if n == self.secret else ("higher" if n < self.secret else "lower")

    @tool
    async def hint(self) -> str:
        """Whether the secret is even."""
        return "even" if self.secret % 2 == 0 else "odd"


def test_a_method_tool_is_bound_per_episode() -> None:
    a, b = Guess(3), Guess(9)
    assert Guess.guess.receiver and "self" not in Guess.guess.parameters["properties"]
    assert a.guess(n=3) == "right" and b.guess(n=3) == "higher"
    assert (a.guesses, b.guesses) == (1, 1)
    tools = {t.name: t for t in tools_of(a)}
    assert list(tools) == ["multiply", "guess", "hint"]
    assert tools["guess"].fn(n=1) == "higher" and a.guesses == 2 and b.guesses == 1
    assert tools["guess"].timeout_s == 1.0 and tools["hint"].is_async
    assert asyncio.run(tools["hint"]()) == "odd"
    with pytest.raises(TypeError, match=r"tool `guess` .* is a method: call it on an instance"):
        Guess.guess(n=1)


def test_tools_of_a_class_are_unbound_schemas() -> None:
    tools = tools_of(Guess)
    assert [t.name for t in tools] == ["multiply", "guess", "hint"]
    assert tools[1].receiver and tools[1].schema()["function"]["parameters"] == {
        "type": "object", "properties": {"n": {"type": "integer", "description": "the guess"}},
        "required": ["n"]}


def test_a_subclass_redefinition_hides_a_base_tool() -> None:
    class NoHint(Guess):
        def hint(self) -> str:  # type: ignore[override]
            return "no"

    class MoreTools(Guess):
        tools = (multiply, basic)

    assert [t.name for t in tools_of(NoHint())] == ["multiply", "guess"]
    assert [t.name for t in tools_of(MoreTools())] == ["multiply", "basic", "guess", "hint"]


def test_two_tools_with_one_name_are_refused() -> None:
    class Twice(Env):
        tools = (multiply,)

        @tool
        def multiply(self, a: int) -> int:
            """A second multiply.

            Args:
                a: a number
            """
            return a

    with pytest.raises(ToolSchemaError) as e:
        tools_of(Twice())
    message = str(e.value)
    assert message.startswith(f"{Twice.__qualname__} ({__file__}:")
    assert "two tools are named `multiply`: " in message
    assert "Twice.tools[0] (" in message and "the method " in message
    assert message.endswith("rename one (@tool(name=...)) or list it once")


def test_tools_must_be_a_list() -> None:
    class Wrong(Env):
        tools = "multiply"  # type: ignore[assignment]

    with pytest.raises(ToolSchemaError, match="`tools` is 'multiply'; list the functions"):
        tools_of(Wrong())


def test_a_broken_tool_in_the_list_names_itself() -> None:
    class Broken(Env):
        tools = (no_hint,)

    with pytest.raises(ToolSchemaError, match=r"tool `no_hint` .*has no type hint"):
        tools_of(Broken)


# --- the package's face --------------------------------------------------------------------

def test_flowgraph_tool_and_env_at_the_top() -> None:
    assert flowgraph.tool is tool and flowgraph.Env is Env
    assert {"tool", "Env"} <= set(flowgraph.__all__)


def test_importing_the_agent_layer_imports_neither_torch_nor_transformers() -> None:
    code = ("import sys, flowgraph; flowgraph.tool; flowgraph.Env; import flowgraph.agent; "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert out.split() == ["False", "False"]


def test_the_readme_example() -> None:
    """The README's `### Tools` blocks: the tool, the schema it shows, the env's tools."""
    text = (ROOT / "README.md").read_text().split("### Tools\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    namespace: dict[str, Any] = {}
    exec(blocks[0], namespace)  # the tool
    assert namespace["multiply"].schema() == ast.literal_eval(blocks[1])
    exec(blocks[2], namespace)  # the env
    env = namespace["GuessEnv"]()
    assert env.reset({"secret": 40}) == "Guess my number between 1 and 100."
    tools = {t.name: t for t in tools_of(env)}
    assert list(tools) == ["multiply", "guess"] and tools["guess"].timeout_s == 1.0
    assert [tools["guess"].fn(n=n) for n in (3, 90, 40)] == ["higher", "lower", "right"]
    assert env.guesses == 3
