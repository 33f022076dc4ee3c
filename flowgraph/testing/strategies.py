"""Hypothesis strategies: random well-formed graphs, and single contract-breaking mutations.

    from hypothesis import given, strategies as st
    from flowgraph.testing.strategies import graphs, graph_texts, mutate

    @given(graphs())
    def test_my_pass_keeps_graphs_clean(graph): ...

    @given(graph_texts().flatmap(mutate))
    def test_the_checker_reports_it(m):      # m.text, m.codes, m.line, m.edge
        ...

`graphs()` builds PPO / GRPO / RLOO / REINFORCE++ / ReMax / DPO pipelines from the
built-in registry: random node and model names, random file order and input order,
random extra nodes (actor or reference log-probs, a chain of KL penalties, a second
critic pass, a learned reward model), random Bp/N/P/T, a random data-parallel size
with the batch arithmetic made consistent (mini- and micro-batches divide the
per-rank batch, groups never split) and random values for every other parameter,
within its `ParamSpec` type, minimum and choices. Every such graph checks clean
(warnings allowed: extra nodes may go unused).

`mutate(text)` applies one contract-breaking edit to the text of a clean graph file
and says what `flowgraph check` must report: `Mutation(text, codes, line, edge,
what)`. Every code in `codes` must be reported as an error on `line` (1-based) of
the new text, about `edge` (`producer.port -> consumer.port`) when it is not None.

Only this module of flowgraph imports hypothesis.

Notation: B = Bp*N sequences, Bp prompts, N samples per prompt, P prompt length,
T response length; dp is the data-parallel size (`resources.nproc`).

One module past ~450 lines, on purpose: the graph generators and the mutations
that break them share the drafts (`_Draft`) and sizes they are built from.
"""

from __future__ import annotations

import functools
import math
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hypothesis import strategies as st

from flowgraph.checker import CheckResult, check_graph
from flowgraph.document import YMap, YScalar, read_document
from flowgraph.frontend import graph_to_yaml, load_graph
from flowgraph.ir import (
    NAME_RE,
    DataSpec,
    DimBinding,
    Graph,
    ModelSpec,
    NodeSpec,
    OptimizerSpec,
    Param,
    Params,
    ParamValue,
    PortRef,
    ResourceSpec,
    TrainerSpec,
)
from flowgraph.kinds import BUILTIN_KINDS
from flowgraph.registry import KindSpec, ParamSpec, loss_names
from flowgraph.source import SourcePos

__all__ = ["ALGORITHMS", "Mutation", "graph_texts", "graphs", "mutate", "names", "yaml_strings"]

ALGORITHMS = ("ppo", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "dpo")
"""Pipeline skeletons `graphs()` draws from."""
GROUPED = frozenset({"grpo", "rloo", "reinforce_pp_baseline"})
"""Skeletons whose advantage needs whole groups of N samples (N >= 2)."""
_BATCH_PARAMS = frozenset({"mini_batch_size", "micro_batch_size", "max_token_len", "packing"})
"""Not drawn: the batch sizes follow the pipeline's arithmetic; packing on the random
graphs' SDPA models is warned about (FG305)."""
_PATH = "builtin:tiny-lm"
_TEXT = string.ascii_letters + string.digits + "_-./:+ "
"""Characters of random string params: enough to spell paths and numbers."""
_YAML_TRAPS = ("yes", "no", "on", "off", "null", "~", "true", "1_000", "0x1F", "0o17", "1:30",
               "2001-12-14", ".inf", ".nan", "-", "", " ", "#", "a: b", "[x]", "{x}", "*x", "&x")
"""Strings that YAML reads as other types or syntax unless a writer quotes them."""


def yaml_strings() -> st.SearchStrategy[str]:
    """Random strings, weighted towards ones a YAML writer must quote to read back."""
    return st.one_of(
        st.text(_TEXT, max_size=12),
        st.sampled_from(_YAML_TRAPS),
        st.from_regex(r"[-+]?[0-9]{1,3}(\.[0-9]{0,2})?[eE][-+]?[0-9]{1,2}", fullmatch=True),
    )


# --- names ---------------------------------------------------------------------------


def names(min_size: int = 1, max_size: int = 40) -> st.SearchStrategy[list[str]]:
    """Distinct node/model/data names, including ones YAML would read as other types
    (`yes`, `null`, `on`) and ones that look like numbers' prefixes (`e5`, `_1`)."""
    head = st.sampled_from(string.ascii_letters + "_")
    name = st.tuples(head, st.text(string.ascii_letters + string.digits + "_", max_size=11))
    traps = st.sampled_from(("yes", "No", "on", "OFF", "null", "true", "y", "n", "e5", "_1",
                             "NaN", "inf", "E2"))
    return st.lists(st.one_of(name.map("".join), traps), min_size=min_size,
                    max_size=max_size, unique=True)


# --- random well-formed graphs ---------------------------------------------------------


@dataclass(frozen=True)
class _Sizes:
    """Dims and batch arithmetic of one pipeline, consistent by construction."""

    bp: int
    n: int | None
    """Samples per prompt; None for DPO (no sampling)."""
    p: int
    t: int
    dp: int
    temperature: float | None = None
    """One sampling temperature for every node that samples or scores (FG116); None:
    every such node keeps the default."""

    @property
    def batch(self) -> int:
        """Sequences an update node gets: Bp*N (Bp for DPO)."""
        return self.bp * (self.n or 1)

    def dims(self) -> tuple[DimBinding, ...]:
        values = {"Bp": self.bp, "N": self.n, "P": self.p, "T": self.t}
        return tuple(DimBinding(k, v) for k, v in values.items() if v is not None)


@st.composite
def _sizes(draw: st.DrawFn, algo: str) -> _Sizes:
    dp = draw(st.sampled_from((1, 2, 4)))
    if algo == "dpo":
        n = None
    elif algo == "remax":
        n = 1  # the greedy baseline is one sample per prompt: B must equal Bp
    elif algo in GROUPED:
        n = draw(st.sampled_from((2, 3, 4, 8)))
    else:
        n = draw(st.sampled_from((1, 2, 4)))
    if algo in GROUPED:
        bp = dp * draw(st.integers(1, 6))  # whole groups on every rank: Bp % dp == 0
    else:
        step = dp // math.gcd(dp, n or 1)  # Bp*N % dp == 0
        bp = step * draw(st.integers(1, 12))
    temperature = draw(st.sampled_from((None, 0.0, 0.7, 1.0)))
    return _Sizes(bp, n, draw(st.integers(1, 64)), draw(st.integers(1, 64)), dp, temperature)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.cache
def _scalar(spec: ParamSpec) -> st.SearchStrategy[ParamValue]:
    """A value `param_problem` accepts: the type, the minimum and the choices."""
    options: list[st.SearchStrategy[Any]] = []
    if "null" in spec.types:
        options.append(st.none())
    if spec.choices:
        return st.one_of(st.sampled_from(spec.choices), *options)
    if spec.functions:  # a function: one of the built-ins (plugins are not drawn)
        return st.one_of(st.sampled_from(spec.functions), *options)
    if spec.names == "policy_loss":
        return st.one_of(st.sampled_from(loss_names()), *options)
    low = spec.minimum
    for t in spec.types:
        if t == "float":
            options.append(st.floats(low if low is not None else -1e3, 1e3,
                                     allow_nan=False, allow_infinity=False))
        elif t == "int":
            options.append(st.integers(math.ceil(low) if low is not None else -1000, 1000))
        elif t == "bool":
            options.append(st.booleans())
        elif t in ("str", "any"):
            options.append(yaml_strings())
    return st.one_of(*options)


@st.composite
def _params(draw: st.DrawFn, kind: KindSpec, sizes: _Sizes,
            fixed: dict[str, ParamValue] | None = None) -> Params:
    """Random values for a random subset of the kind's params.

    Params that bind a dim (`max_new_tokens` -> T) are left out or set to the dim's
    value; `n` and the batch sizes come through `fixed`, the caller's arithmetic.
    """
    fixed = fixed or {}
    dims = {"T": sizes.t, "P": sizes.p}
    out: list[Param] = []
    for spec in kind.params:
        if spec.name in fixed:
            if fixed[spec.name] is not None:
                out.append(Param(spec.name, fixed[spec.name]))
            continue
        if spec.name == "temperature":  # one for the whole graph: scored as sampled
            if sizes.temperature is not None:
                out.append(Param(spec.name, sizes.temperature))
            continue
        if spec.name in _BATCH_PARAMS or spec.dim == "n" or spec.executor \
                or not draw(st.booleans()):
            continue
        if _adds_an_input(kind, spec):  # an optional input the pipeline may not wire
            continue
        value = dims[spec.dim] if spec.dim in dims else draw(_scalar(spec))
        out.append(Param(spec.name, value))
    drawn = {p.name: p.value for p in out}
    val_n = drawn.get("val_n")
    if isinstance(val_n, int) and val_n > 1 and not _positive(drawn.get("val_temperature")):
        # n held-out responses a prompt are sampled (FG118): greedy ones would be copies
        out = [p for p in out if p.name != "val_temperature"]
        out.append(Param("val_temperature", 1.0))
    return Params(tuple(draw(st.permutations(out))))


def _positive(value: ParamValue | None) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _adds_an_input(kind: KindSpec, spec: ParamSpec) -> bool:
    """Whether some value of the param makes an optional input required that its default
    does not (`rollout_is` needs `rollout_log_prob`)."""
    return any(param == spec.name and value != spec.default
               for _, param, value in kind.required_when)


@st.composite
def _batch_params(draw: st.DrawFn, sizes: _Sizes) -> dict[str, ParamValue]:
    """mini_batch_size (global) divides the batch and splits evenly over the dp ranks;
    micro_batch_size divides a rank's share of the mini-batch."""
    per_rank = sizes.batch // sizes.dp
    share = draw(st.one_of(st.none(), st.sampled_from(_divisors(per_rank))))
    mini = share * sizes.dp if share is not None else None
    micro = draw(st.one_of(st.none(), st.sampled_from(_divisors(share or per_rank))))
    return {"mini_batch_size": mini, "micro_batch_size": micro}


Wire = dict[str, tuple[str, str]]
"""input port -> (producer, output port)."""


@dataclass
class _Draft:
    """A pipeline under construction: draws names, params and input order as it goes."""

    draw: st.DrawFn
    sizes: _Sizes
    fresh: Iterator[str]
    nodes: list[NodeSpec] = field(default_factory=list)
    models: dict[str, ModelSpec] = field(default_factory=dict)

    def model(self, role: str, trainable: bool = False) -> str:
        if role not in self.models:
            opt = OptimizerSpec(lr=self.draw(st.floats(1e-7, 1e-2))) if trainable else None
            self.models[role] = ModelSpec(next(self.fresh), _PATH, trainable, optimizer=opt)
        return self.models[role].name

    def node(self, kind: str, wire: Wire, model: str | None = None,
             fixed: dict[str, ParamValue] | None = None) -> str:
        name = next(self.fresh)
        spec = BUILTIN_KINDS[kind]
        inputs = tuple((port, PortRef(src, out)) for port, (src, out) in wire.items())
        params = self.draw(_params(spec, self.sizes, fixed))
        self.nodes.append(NodeSpec(name, kind, tuple(self.draw(st.permutations(inputs))),
                                   model, params))
        return name

    def update(self, kind: str, model: str, wire: Wire) -> str:
        return self.node(kind, wire, model, self.draw(_batch_params(self.sizes)))


def _sequences(gen: str) -> Wire:
    return {p: (gen, p) for p in ("prompts", "prompt_mask", "responses", "response_mask")}


def _generate(d: _Draft, train: str, fixed: dict[str, ParamValue] | None = None) -> str:
    wire = {"prompts": (train, "input_ids"), "prompt_mask": (train, "attention_mask")}
    if d.draw(st.booleans()):
        wire["ground_truth"] = (train, "ground_truth")
    n = fixed or {"n": d.draw(st.sampled_from((None, d.sizes.n)))}
    return d.node("generate", wire, d.model("actor", trainable=True), n)


def _reward(d: _Draft, gen: str) -> str:
    """A rule reward (maybe lending the actor's tokenizer) or a learned reward model."""
    if d.draw(st.booleans()):
        return d.node("reward_model", _sequences(gen), d.model("reward_model"))
    wire = {"responses": (gen, "responses"), "response_mask": (gen, "response_mask")}
    fixed: dict[str, ParamValue] = {}
    if d.draw(st.booleans()):
        wire["ground_truth"] = (gen, "ground_truth")
    else:
        fixed["fn"] = "format"  # exact_match (the default) needs the ground truth
    return d.node("reward", wire, d.draw(st.sampled_from((None, d.model("actor")))), fixed)


def _logprobs(d: _Draft, gen: str) -> tuple[str, str]:
    """(old log-prob node, reference log-prob node), plus 0-2 extra passes."""
    seq = _sequences(gen)
    old = d.node("logprob", seq, d.model("actor"))
    ref = d.node("logprob", seq, d.model("ref"))
    roles = d.draw(st.lists(st.sampled_from(("actor", "ref")), max_size=2))
    extra = [(role, d.node("logprob", seq, d.model(role))) for role in roles]
    # An extra actor pass may be the one the update reads; the others stay unused.
    return d.draw(st.sampled_from([old, *(n for role, n in extra if role == "actor")])), ref


def _kl_chain(d: _Draft, scores: str, gen: str, old: str, ref: str) -> str:
    """token_reward, then 1-3 KL penalties in a chain; returns the last one."""
    tok = d.node("token_reward", {"scores": (scores, "scores"),
                                  "response_mask": (gen, "response_mask")})
    last, port = tok, "token_level_scores"
    for _ in range(d.draw(st.integers(1, 3))):
        last = d.node("kl_penalty", {
            "token_level_scores": (last, port), "log_prob": (old, "log_prob"),
            "ref_log_prob": (ref, "log_prob"), "response_mask": (gen, "response_mask")})
        port = "token_level_rewards"
    return last


def _actor_update(d: _Draft, gen: str, old: str, adv: str, ref: str | None) -> None:
    wire = {**_sequences(gen), "old_log_prob": (old, "log_prob"),
            "advantages": (adv, "advantages")}
    if ref is not None:
        wire["ref_log_prob"] = (ref, "log_prob")  # KL as a loss term (GRPO style)
    d.update("ppo_actor_update", d.model("actor", trainable=True), wire)


def _ppo(d: _Draft, train: str) -> None:
    gen = _generate(d, train)
    old, ref = _logprobs(d, gen)
    critic = d.model("critic", trainable=True)
    passes = [d.node("values", _sequences(gen), critic)
              for _ in range(d.draw(st.integers(1, 2)))]
    kl = _kl_chain(d, _reward(d, gen), gen, old, ref)
    adv = d.node("gae", {"token_level_rewards": (kl, "token_level_rewards"),
                         "values": (passes[0], "values"),
                         "response_mask": (gen, "response_mask")})
    _actor_update(d, gen, old, adv, None)
    d.update("ppo_critic_update", critic, {**_sequences(gen), "values": (passes[-1], "values"),
                                           "returns": (adv, "returns")})


def _grouped(d: _Draft, train: str, kind: str) -> None:
    gen = _generate(d, train)
    old, ref = _logprobs(d, gen)
    adv = d.node(kind, {"scores": (_reward(d, gen), "scores"),
                        "response_mask": (gen, "response_mask"), "index": (gen, "index")})
    _actor_update(d, gen, old, adv, d.draw(st.sampled_from((None, ref))))


def _reinforce_pp(d: _Draft, train: str) -> None:
    gen = _generate(d, train)
    old, ref = _logprobs(d, gen)
    kl = _kl_chain(d, _reward(d, gen), gen, old, ref)
    adv = d.node("reinforce_pp", {"token_level_rewards": (kl, "token_level_rewards"),
                                  "response_mask": (gen, "response_mask")})
    _actor_update(d, gen, old, adv, None)


def _remax(d: _Draft, train: str) -> None:
    gen = _generate(d, train)
    greedy = _generate(d, train, {"n": 1, "do_sample": False})
    old, ref = _logprobs(d, gen)
    kl = _kl_chain(d, _reward(d, gen), gen, old, ref)
    adv = d.node("remax", {"token_level_rewards": (kl, "token_level_rewards"),
                           "reward_baselines": (_reward(d, greedy), "scores"),
                           "response_mask": (gen, "response_mask")})
    _actor_update(d, gen, old, adv, None)


def _dpo(d: _Draft, pairs: str) -> None:
    ref = d.model("ref")
    logps = {}
    for side in ("chosen", "rejected"):
        wire = {"prompts": (pairs, "prompts"), "prompt_mask": (pairs, "prompt_mask"),
                "responses": (pairs, side), "response_mask": (pairs, f"{side}_mask")}
        logps[f"ref_{side}_logps"] = (d.node("sequence_logprob", wire, ref), "log_prob")
    wire = {p: (pairs, p) for p in ("prompts", "prompt_mask", "chosen", "chosen_mask",
                                    "rejected", "rejected_mask")}
    d.update("dpo_update", d.model("actor", trainable=True), {**wire, **logps})


_BUILD: dict[str, Callable[[_Draft, str], None]] = {
    "ppo": _ppo,
    "grpo": lambda d, train: _grouped(d, train, "grpo"),
    "rloo": lambda d, train: _grouped(d, train, "rloo"),
    "reinforce_pp_baseline": lambda d, train: _grouped(d, train, "reinforce_pp_baseline"),
    "reinforce_pp": _reinforce_pp,
    "remax": _remax,
    "dpo": _dpo,
}


@st.composite
def graphs(draw: st.DrawFn, algorithms: tuple[str, ...] = ALGORITHMS) -> Graph:
    """A random well-formed pipeline (see the module docstring); checks clean."""
    algo = draw(st.sampled_from(algorithms))
    sizes = draw(_sizes(algo))
    fresh = iter(draw(names(min_size=40, max_size=40)))
    d = _Draft(draw, sizes, fresh)
    data_kind = "preferences" if algo == "dpo" else "prompts"
    train = next(fresh)
    path = "builtin:arith-pairs" if algo == "dpo" else "builtin:arith"
    no_file: dict[str, ParamValue] = {"eval_path": None}  # a held-out file must exist (FG123)
    data = DataSpec(train, data_kind, path,
                    draw(_params(BUILTIN_KINDS[data_kind], sizes, no_file)))
    _BUILD[algo](d, train)
    return Graph(
        name=draw(yaml_strings()),
        nodes=tuple(draw(st.permutations(d.nodes))),  # the checker orders them itself
        models=tuple(draw(st.permutations(list(d.models.values())))),
        data=(data,),
        dims=sizes.dims(),
        trainer=TrainerSpec(steps=draw(st.integers(0, 1000)), seed=draw(st.integers(0, 2**31))),
        resources=ResourceSpec(nproc=sizes.dp),
    )


def graph_texts(algorithms: tuple[str, ...] = ALGORITHMS) -> st.SearchStrategy[str]:
    """`graphs()` written out by `graph_to_yaml`: what a user's graph file looks like."""
    return graphs(algorithms).map(graph_to_yaml)


# --- mutations -------------------------------------------------------------------------


class Mutation(NamedTuple):
    """One contract-breaking edit and what `flowgraph check` must say about it."""

    text: str
    """The mutated graph file."""
    codes: frozenset[str]
    """Every one of these is reported as an error on `line`."""
    line: int
    """1-based line of the mutated text."""
    edge: str | None
    """`producer.port -> consumer.port` the diagnostics name, or None (not about an edge)."""
    what: str
    """The edit, for failure messages."""


@dataclass(frozen=True)
class _Context:
    """A clean graph file: its text, located document, IR and check result."""

    lines: list[str]
    doc: YMap
    graph: Graph
    result: CheckResult

    @staticmethod
    def of(text: str) -> _Context | None:
        doc, _ = read_document(text, "<mutate>")
        graph, diags = load_graph("<mutate>", text=text)
        if not isinstance(doc, YMap) or graph is None or any(d.is_error for d in diags):
            return None
        result = check_graph(graph)
        return _Context(text.splitlines(keepends=True), doc, graph, result) \
            if result.ok else None

    def node_map(self, name: str) -> YMap:
        nodes = self.doc.get("nodes")
        assert isinstance(nodes, YMap)
        node = nodes.get(name)
        assert isinstance(node, YMap)
        return node

    def inputs(self, name: str) -> list[tuple[YScalar, YScalar]]:
        """A node's `port: node.port` entries, located (merged `<<` entries included)."""
        found = self.node_map(name).get("inputs")
        if not isinstance(found, YMap):
            return []
        return [(k, v) for k, v in found.items if isinstance(v, YScalar)
                and isinstance(v.value, str) and k.pos.line == v.pos.line]

    def kind(self, name: str) -> KindSpec | None:
        r = self.result.table.get(name)
        return r.kind if r is not None else None

    def descendants(self, roots: set[str]) -> set[str]:
        """The roots and every node downstream of them."""
        out = set(roots)
        changed = True
        while changed:
            changed = False
            for ref, node, _ in self.graph.edges():
                if ref.node in out and node.name not in out:
                    out.add(node.name)
                    changed = True
        return out

    def sharing(self, value: YScalar) -> set[str]:
        """Nodes whose inputs include this very scalar (one YAML anchor, several users)."""
        return {n.name for n in self.graph.nodes
                if any(v.pos == value.pos for _, v in self.inputs(n.name))}

    def replace(self, pos: SourcePos, old: str, new: str) -> str | None:
        """The text with `old` at `pos` replaced, or None when `old` is not there."""
        lines = list(self.lines)
        line, i = lines[pos.line - 1], pos.col - 1
        if line[i:i + len(old)] != old:
            return None
        lines[pos.line - 1] = line[:i] + new + line[i + len(old):]
        return "".join(lines)


def _misspellings(word: str) -> st.SearchStrategy[str]:
    """Typos: a letter dropped, doubled, swapped with the next, or replaced."""
    i = st.integers(0, len(word) - 1)
    letter = st.sampled_from(string.ascii_lowercase)
    return st.one_of(
        i.map(lambda k: word[:k] + word[k + 1:]),
        i.map(lambda k: word[:k] + word[k] + word[k:]),
        i.map(lambda k: word[:k] + word[k + 1:k + 2] + word[k] + word[k + 2:]),
        st.tuples(i, letter).map(lambda a: word[:a[0]] + a[1] + word[a[0] + 1:]),
    ).filter(lambda w: w != word and NAME_RE.match(w) is not None)


MutationFn = Callable[[st.DrawFn, _Context], Mutation | None]


def _misspell_kind(draw: st.DrawFn, ctx: _Context) -> Mutation | None:
    node = draw(st.sampled_from(ctx.graph.nodes))
    value = ctx.node_map(node.name).get("kind")
    assert isinstance(value, YScalar)
    typo = draw(_misspellings(node.kind).filter(lambda w: w not in BUILTIN_KINDS))
    text = ctx.replace(value.pos, node.kind, typo)
    if text is None:
        return None
    return Mutation(text, frozenset({"FG102"}), node.pos.line, None,
                    f"kind of `{node.name}`: {node.kind} -> {typo}")


def _pick_input(draw: st.DrawFn, ctx: _Context) -> tuple[NodeSpec, YScalar, YScalar] | None:
    node = draw(st.sampled_from(ctx.graph.nodes))
    entries = ctx.inputs(node.name)
    if not entries:
        return None
    key, value = draw(st.sampled_from(entries))
    return node, key, value


def _misspell_input_port(draw: st.DrawFn, ctx: _Context) -> Mutation | None:
    picked = _pick_input(draw, ctx)
    kind = ctx.kind(picked[0].name) if picked else None
    if picked is None or kind is None:
        return None
    node, key, value = picked
    port = str(key.value)
    if kind.terms is not None:  # any name is a term of such a kind, not a typo
        return None
    taken = {p.name for p in kind.inputs} | {str(k.value) for k, _ in ctx.inputs(node.name)}
    typo = draw(_misspellings(port).filter(lambda w: w not in taken))
    text = ctx.replace(key.pos, port, typo)
    if text is None:
        return None
    return Mutation(text, frozenset({"FG103"}), value.pos.line,
                    f"{value.value} -> {node.name}.{typo}",
                    f"input port `{node.name}.{port}` -> `{typo}`")


def _misspell_output_port(draw: st.DrawFn, ctx: _Context) -> Mutation | None:
    picked = _pick_input(draw, ctx)
    if picked is None:
        return None
    node, key, value = picked
    src, _, port = str(value.value).partition(".")
    src_kind = ctx.kind(src)
    if src_kind is None:
        return None
    outs = {p.name for p in src_kind.outputs}
    typo = draw(_misspellings(port).filter(lambda w: w not in outs))
    text = ctx.replace(value.pos, str(value.value), f"{src}.{typo}")
    if text is None:
        return None
    return Mutation(text, frozenset({"FG106"}), value.pos.line,
                    f"{src}.{typo} -> {node.name}.{key.value}",
                    f"output port `{value.value}` -> `{src}.{typo}`")


def _drop_span(line: str, key: YScalar, value: YScalar) -> tuple[int, int] | None:
    """Columns [start, end) that remove `port: ref` from its line, flow or block style."""
    start, end = key.pos.col - 1, value.pos.col - 1 + len(str(value.value))
    if line[:start].strip() == "" and line[end:].strip() == "":
        return 0, len(line)  # block style: the whole line
    if line[end:end + 1] == ",":
        return start, end + 1 + (line[end + 1:end + 2] == " ")
    if line[:start].rstrip().endswith(","):
        return len(line[:start].rstrip()) - 1, end
    return None


def _drop_required_input(draw: st.DrawFn, ctx: _Context) -> Mutation | None:
    picked = _pick_input(draw, ctx)
    kind = ctx.kind(picked[0].name) if picked else None
    if picked is None or kind is None:
        return None
    node, key, value = picked
    spec = kind.input(str(key.value))
    if spec is None or spec.optional or len(ctx.inputs(node.name)) < 2:
        return None
    lines = list(ctx.lines)
    span = _drop_span(lines[key.pos.line - 1], key, value)
    if span is None:
        return None
    line = lines[key.pos.line - 1]
    lines[key.pos.line - 1] = line[:span[0]] + line[span[1]:]
    # A deleted line above the node (inside a YAML anchor it borrows) shifts it up.
    shift = int(span == (0, len(line)) and key.pos.line < node.pos.line)
    return Mutation("".join(lines), frozenset({"FG104"}), node.pos.line - shift, None,
                    f"dropped required input `{node.name}.{key.value}`")


def _rewire_misfit(draw: st.DrawFn, ctx: _Context) -> Mutation | None:
    """Wire an input to an upstream output of another rank or dtype (no cycle made)."""
    picked = _pick_input(draw, ctx)
    kind = ctx.kind(picked[0].name) if picked else None
    if picked is None or kind is None:
        return None
    node, key, value = picked
    spec = kind.input(str(key.value))
    if spec is None:
        return None
    below = ctx.descendants(ctx.sharing(value))
    want = len(spec.spec.shape.fixed_axes())
    options = []
    for name, r in ctx.result.table.items():
        for out in r.kind.outputs if r.kind is not None and name not in below else ():
            misfits = (("FG201", len(out.spec.shape.fixed_axes()) != want),
                       ("FG203", not spec.spec.accepts_dtype(out.spec)))
            found = frozenset(code for code, hit in misfits if hit)
            if found:
                options.append((f"{name}.{out.name}", found))
    if not options:
        return None
    ref, codes = draw(st.sampled_from(sorted(options)))
    text = ctx.replace(value.pos, str(value.value), ref)
    if text is None:
        return None
    return Mutation(text, codes, value.pos.line, f"{ref} -> {node.name}.{key.value}",
                    f"rewired `{node.name}.{key.value}` from {value.value} to {ref}")


def _add_cycle(draw: st.DrawFn, ctx: _Context) -> Mutation | None:
    """Rewire an input of the first node in the file to an output of one downstream.

    The cycle check walks nodes in file order, so it enters the cycle at that first node
    and closes it at the rewired edge: that edge and its line are what it reports.
    """
    first = ctx.graph.nodes[0]
    entries = ctx.inputs(first.name)
    later = sorted(ctx.descendants({first.name}) - {first.name})
    if not entries or not later:
        return None
    key, value = draw(st.sampled_from(entries))
    src = draw(st.sampled_from(later))
    src_kind = ctx.kind(src)
    if src_kind is None or not src_kind.outputs:
        return None
    port = draw(st.sampled_from([p.name for p in src_kind.outputs]))
    text = ctx.replace(value.pos, str(value.value), f"{src}.{port}")
    if text is None:
        return None
    return Mutation(text, frozenset({"FG107"}), value.pos.line,
                    f"{src}.{port} -> {first.name}.{key.value}",
                    f"cycle: `{first.name}.{key.value}` reads `{src}.{port}`")


def _break_batch(draw: st.DrawFn, ctx: _Context) -> Mutation | None:
    """Change `dims: Bp` so the first update node's batch no longer divides."""
    dims = ctx.doc.get("dims")
    if not isinstance(dims, YMap) or dims.get("B") is not None:
        return None  # B written out would contradict the new Bp: another error
    bp = dims.get("Bp")
    if not isinstance(bp, YScalar) or not isinstance(bp.value, int):
        return None
    updates = [n for n in ctx.graph.nodes if (k := ctx.kind(n.name)) is not None and k.trains
               and ctx.result.shapes.batch.get(n.name)]
    if not updates:
        return None
    node, dp = updates[0], ctx.result.dp
    batch = ctx.result.shapes.batch[node.name]
    assert batch is not None and batch % bp.value == 0
    mini = node.params.find("mini_batch_size")
    options = []
    for new in range(1, 4 * bp.value + 8):
        b = batch // bp.value * new
        if b % dp:
            options.append((new, node.pos.line))
        elif mini is not None and isinstance(mini.value, int) and b % mini.value:
            options.append((new, mini.pos.line))
    if not options:
        return None
    new, line = draw(st.sampled_from(options))
    text = ctx.replace(bp.pos, str(bp.value), str(new))
    if text is None:
        return None
    return Mutation(text, frozenset({"FG301"}), line, None,
                    f"dims Bp {bp.value} -> {new} (update `{node.name}`, dp={dp})")


MUTATIONS: dict[str, MutationFn] = {
    "misspell_kind": _misspell_kind,
    "misspell_input_port": _misspell_input_port,
    "misspell_output_port": _misspell_output_port,
    "drop_required_input": _drop_required_input,
    "rewire_misfit": _rewire_misfit,
    "add_cycle": _add_cycle,
    "break_batch": _break_batch,
}
"""Every mutation `mutate` may apply, by name."""


@st.composite
def mutate(draw: st.DrawFn, text: str, kinds: tuple[str, ...] = tuple(MUTATIONS)
           ) -> Mutation:
    """One contract-breaking edit of a clean graph file's `text` (see `Mutation`).

    Tries the mutation kinds in a random order and applies the first that fits the
    graph; rejects the example (hypothesis draws another) when none fits or the text
    does not check clean to begin with.
    """
    ctx = _Context.of(text)
    if ctx is None:
        return draw(st.nothing())
    for name in draw(st.permutations(kinds)):
        m = MUTATIONS[name](draw, ctx)
        if m is not None:
            return m
    return draw(st.nothing())
