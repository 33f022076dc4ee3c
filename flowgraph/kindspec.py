"""What a node kind is: its ports with their contracts, its params, its implementation and
every other fact about it (`KindSpec`), and what a policy loss is (`LossSpec`). Plain
records, declared by `flowgraph.kinds` for the built-ins and by plugins for theirs;
`flowgraph.registry` finds them by name."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from flowgraph.contracts import TensorSpec
from flowgraph.errors import RegistryError
from flowgraph.ir import NAME_RE, ParamValue
from flowgraph.runtime.reward_call import CallStyle
from flowgraph.runtime.update import LOOP_PARAMS, one_optimizer_step

PARAM_TYPES = ("float", "int", "bool", "str", "list", "mapping", "any", "null")
HOISTABLE_CATEGORIES = ("model", "reward", "transform")
"""Deterministic, row-wise categories: a node of one whose inputs come from data and
whose model is frozen computes the same rows at every step (pass `hoist`). Not
`rollout` (sampling), not `update` (changes weights), not `advantage` (batch
statistics such as whitening would change if computed over the whole dataset), not
`custom` (nothing is known about it)."""
HEADS = ("lm", "scalar", "tokenizer")
"""What a kind uses its model as: `KindSpec.head`."""
CATEGORIES = ("data", "rollout", "model", "reward", "transform", "advantage", "update", "custom",
              "filter")
"""`filter`: keeps some sample groups of a generation batch; the executor repeats the
stages before it (data, generate, reward) until enough groups are kept (`ResamplePlan`)."""


@dataclass(frozen=True, slots=True)
class PortSpec:
    """A named input or output and its contract."""

    name: str
    spec: TensorSpec
    optional: bool = False
    """Inputs: may stay unwired. Outputs: computed only when consumed."""
    doc: str = ""


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter of a kind."""

    name: str
    types: tuple[str, ...]
    """Allowed value types from `PARAM_TYPES`; an int is also a float."""
    default: ParamValue = None
    required: bool = False
    choices: tuple[str, ...] = ()
    doc: str = ""
    dim: str | None = None
    """A dim this param's value binds (`n` -> the node's group size, `max_new_tokens` -> T)."""
    minimum: float | None = None
    names: str | None = None
    """Set (`policy_loss`) when the value names an entry of that registry; the entry's own
    params are given in the mapping param `<this param>_params`, checked against it."""
    functions: tuple[str, ...] | None = None
    """Set when the value names a function (a mapping param: each of its values does):
    one of these built-in names, or `file.py:function` / `module:function` of a plugin
    the graph lists. A kind with such params needs one of them set."""
    calls: tuple[CallStyle, ...] = ()
    """The ways the node calls such a function, chosen by its signature; `flowgraph
    check` holds a plugin file's function (or a Python callable) to the one it picks
    (`compute_score`: TRL's batch call for a function taking `completions`, verl's
    per-row call for one taking `solution_str`)."""
    replaces: str | None = None
    """Set (`filter`'s `fn`: `metric`) on a function param that stands in for another
    param: it is optional (the kind does not need a function), and set, the graph may not
    set that param too (the checker's FG112)."""
    one_per: str | None = None
    """Set (`weights`: `fn`) when this list has one number per entry of that list param
    (TRL's reward_weights, one per reward function); the checker holds it to that."""
    evaluation: bool = False
    """Read by the compiler to make the node's params at evaluation (`NodePlan.eval_params`:
    a rollout's `val_n`, `val_temperature`); never passed to the implementation."""
    executor: bool = False
    """Read by the executor around the node's call (`timeout_s`), every kind has it
    (`NODE_PARAMS`); passed to the implementation only where it declares it."""
    agent: str | None = None
    """`env`, `tools` or `program` (`agent_rollout`): the value names an agent environment
    (a class), tools or an agent program, which `flowgraph check` finds in the plugins the
    graph lists and whose tools' schemas it builds (`flowgraph.checker.agents`: FG603,
    FG605) instead of holding them to a function's call style. `mcp`: the value declares
    MCP servers (`flowgraph.agent.mcp_servers`), whose `cwd` the compiler makes absolute
    and which `flowgraph check` starts to list their tools (FG610)."""
    files: tuple[str, ...] = ()
    """Endings of a value that names a file (`env`: `.yaml`, a verl tool config;
    `chat_template`: `.jinja`): relative as a dataset path is (`flowgraph.paths.written_file`),
    looked for there by the checker and written absolute into the plan by the compiler, so
    that the run opens the file the check found from any working directory."""
    per_sequence: tuple[str, ...] = ()
    """Values of this param that weigh a whole sequence by one number (`rollout_is:
    sequence`, TIS of the sequence's ratio): on multi-turn episodes the sequence is the
    episode, which the checker says (FG604)."""
    fields: tuple[tuple[str, str], ...] = ()
    """Set on a format-string param (`judge`'s `template`): (field, input port) for each
    field it may name, the port whose rows fill it; the checker holds the string to these
    fields, each field's port wired (FG611)."""
    names_model: bool = False
    """The value names a model of the graph (`judge`'s `policy`: the tokenizer that decodes
    its inputs); the checker holds it to the graph's models (FG611)."""
    instead_of_model: bool = False
    """Set (`judge`'s `url`) on a param that stands in for the node's model binding: the
    node needs exactly one of the two (FG611), and `check --data` probes it."""

    def __post_init__(self) -> None:
        bad = [t for t in self.types if t not in PARAM_TYPES]
        if bad:
            raise RegistryError(f"param `{self.name}`: unknown type(s) {bad}; known {PARAM_TYPES}")


NODE_PARAMS = (ParamSpec(
    "timeout_s", ("float",), 0.0, minimum=0, executor=True,
    doc="stop the run when one call of this node takes longer (seconds; a reward, filter "
        "or plugin that hangs names its node and line); 0: no limit"),)
"""Params every kind takes, appended to its own (`KindSpec.params`)."""


@dataclass(frozen=True, slots=True)
class KindSpec:
    """Everything the checker and the executors need to know about a kind."""

    name: str
    category: str
    doc: str
    inputs: tuple[PortSpec, ...] = ()
    outputs: tuple[PortSpec, ...] = ()
    params: tuple[ParamSpec, ...] = ()
    model: str = "none"
    """`none`, `required` or `optional` model binding."""
    head: str = "lm"
    """What the node uses its model as, when it has one: `lm`, a causal LM (its logits
    over the vocabulary); `scalar`, a backbone with a scalar head, one number per token
    (a critic, a reward model); `tokenizer`, its tokenizer only (no weights load)."""
    sequences_per_row: int = 1
    """Sequences the model runs per batch row (DPO: the chosen and the rejected one)."""
    trains: bool = False
    """An update node: its model must be trainable, and it is a sink; its implementation
    returns a `flowgraph.runtime.update.Update` that the executor's update loop trains on."""
    grouped: bool = False
    """Needs whole sample groups (GRPO, RLOO): its batch is split only group-aligned."""
    impl: str = ""
    """`module:function`, imported lazily by executors only."""
    required_when: tuple[tuple[str, str, str], ...] = ()
    """(optional input, param, value): the input is required when the param has the value
    (`reward` needs `ground_truth` when `fn` is `exact_match`)."""
    dim_defaults: tuple[tuple[str, str], ...] = ()
    """Node-local dims and the global expression they take when no param binds them."""
    source: str = "builtin"
    """`builtin`, the plugin module, or the entry point that declared the kind."""
    on_policy_input: str = ""
    """An input holding log π_old, the log-probs of the policy that sampled the batch
    (PPO's `old_log_prob`), which an update may replace by its own, detached, when it
    takes one optimizer step per call (`ppo_epochs` 1, one mini-batch): pass `on_policy`
    then unwires it, and left unwired it is required unless that holds."""
    terms: PortSpec | None = None
    """Inputs the graph names itself (`weighted_sum`'s reward terms): every wired input
    the kind does not declare takes this contract, and at least one must be wired."""
    not_taken: tuple[tuple[str, str], ...] = ()
    """(param, why): params that kinds like it take and it does not, with the reason,
    which the checker gives when a graph sets one (`dpo_update`: `loss_agg_mode`)."""

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise RegistryError(f"kind name {self.name!r} is not an identifier")
        if self.category not in CATEGORIES:
            raise RegistryError(
                f"kind `{self.name}`: category {self.category!r} not in {CATEGORIES}"
            )
        if self.model not in ("none", "required", "optional"):
            raise RegistryError(f"kind `{self.name}`: model must be none/required/optional")
        if self.head not in HEADS:
            raise RegistryError(f"kind `{self.name}`: head must be one of {HEADS}")
        if self.sequences_per_row < 1:
            raise RegistryError(f"kind `{self.name}`: sequences_per_row must be >= 1")
        own = {p.name for p in self.params}
        object.__setattr__(self, "params", self.params + tuple(
            p for p in NODE_PARAMS if p.name not in own))
        for group in (self.inputs, self.outputs, self.params):
            names = [p.name for p in group]
            if len(names) != len(set(names)):
                raise RegistryError(f"kind `{self.name}` declares a name twice: {names}")
        both = [n for n, _ in self.not_taken if self.param(n) is not None]
        if both:
            raise RegistryError(f"kind `{self.name}` declares {both} as params and as not taken")
        missing = [n for n in LOOP_PARAMS if self.trains and self.param(n) is None]
        if missing:
            raise RegistryError(f"kind `{self.name}` trains but does not declare the update "
                                f"loop's params {missing}: add flowgraph.kinds.MINI_BATCH to "
                                "its params")

    @property
    def sink(self) -> bool:
        return self.trains

    @property
    def multi_turn(self) -> bool:
        """Its rows are multi-turn episodes: a rollout that takes `max_turns` (the
        checker's budgets and timeouts, `check --data`'s template probe)."""
        return self.param("max_turns") is not None

    @property
    def row_wise_forward(self) -> bool:
        """It runs its model's weights (head `lm` or `scalar`) row by row, each output row
        a function of its own input rows (a category in `HOISTABLE_CATEGORIES`, not an
        update): nodes of it may run as one forward over their rows stacked (`fusion`)."""
        return (self.category in HOISTABLE_CATEGORIES and not self.trains
                and self.head in ("lm", "scalar"))

    def input(self, name: str) -> PortSpec | None:
        declared = next((p for p in self.inputs if p.name == name), None)
        if declared is None and self.terms is not None:
            return replace(self.terms, name=name)
        return declared

    def wired_inputs(self, wired: Iterable[str]) -> tuple[PortSpec, ...]:
        """The declared inputs, then a term for each wired name the kind does not declare."""
        declared = {p.name for p in self.inputs}
        extra = [self.input(n) for n in wired if n not in declared]
        return self.inputs + tuple(p for p in extra if p is not None)

    def output(self, name: str) -> PortSpec | None:
        return next((p for p in self.outputs if p.name == name), None)

    def param(self, name: str) -> ParamSpec | None:
        return next((p for p in self.params if p.name == name), None)

    def param_values(self, given: Mapping[str, object]) -> dict[str, object]:
        """Every param's value: `given` where set, else the kind's default."""
        return {**{p.name: p.default for p in self.params}, **given}

    def call_values(self, given: Mapping[str, object]) -> dict[str, object]:
        """The params the implementation is called with: every param's value but the
        evaluation-only ones (`ParamSpec.evaluation`)."""
        skip = {p.name for p in self.params if p.evaluation}
        return {k: v for k, v in self.param_values(given).items() if k not in skip}

    def eval_values(self, given: Mapping[str, object],
                    eval_dims: Mapping[str, int] | None = None) -> dict[str, object]:
        """The params at evaluation on held-out data: a rollout answers each prompt once,
        greedily, or `val_n` times at `val_temperature` > 0 (verl's val_kwargs). A param
        of another kind left to default to a global dim (`repeat`'s n -> N) takes that
        dim's value at evaluation, `eval_dims` (N: the rollouts' held-out n)."""
        values = self.call_values(given)
        every = self.param_values(given)
        n, temperature = every.get("val_n", 1), every.get("val_temperature", 0.0)
        if self.category != "rollout":
            defaults, at_eval = dict(self.dim_defaults), eval_dims or {}
            values.update({p.name: at_eval[defaults[p.dim]] for p in self.params
                           if p.dim in defaults and values.get(p.name) is None
                           and defaults[p.dim] in at_eval})
            return values
        val_n = n if isinstance(n, int) else 1
        t = float(temperature) if isinstance(temperature, (int, float)) else 0.0
        sampled = {"do_sample": True, "n": val_n, "temperature": t}
        greedy = {"do_sample": False, "n": 1}  # n greedy answers would be n copies
        values.update({k: v for k, v in (sampled if t > 0 else greedy).items()
                       if self.param(k) is not None})
        return values

    def needs(self, port: PortSpec, params: Mapping[str, object],
              batch: int | None = None) -> str | None:
        """Why `port` must be wired with these params (defaults filled in) on a batch of
        `batch` rows (None: not known), or None."""
        if not port.optional:
            return "it is required"
        if port.name == self.on_policy_input and not one_optimizer_step(params, batch):
            rows = f"of {batch} rows" if batch is not None else "of rows not known here"
            return (f"the update takes more than one optimizer step per call (ppo_epochs "
                    f"{params.get('ppo_epochs')}, mini_batch_size "
                    f"{params.get('mini_batch_size')} on a batch {rows}); only one step "
                    "can use its own log-probs as the old policy's")
        for name, param, value in self.required_when:
            if name == port.name and params.get(param) == value:
                return f"`{param}` is `{value}`"
        return None


@dataclass(frozen=True, slots=True)
class LossSpec:
    """A policy loss `ppo_actor_update` may use: its name, own params and implementation."""

    name: str
    params: tuple[ParamSpec, ...]
    """Its own params (set in `policy_loss_params`); the clip ratios are the update's."""
    impl: str
    """`module:function`, imported by the update."""
    doc: str = ""
    per_sequence: bool = False
    """Its importance ratio is one per sequence (GSPO), not one per token: on multi-turn
    episodes, one per episode (the checker's FG604)."""
