"""Multi-turn, tool-using rollouts (the `agent_rollout` kind): token in, token out.

Each of the r = b·n episodes starts from its dataset row (`Env.reset`), rendered with
the chat template and the generation prompt. Then, turn after turn, every active
episode's next turn is sampled in one batch by the `generate` kind's backends (the hf
decoding loop, or vLLM with token-id prompts), and `flowgraph.agent.episodes.Episodes`
runs its tool calls or the env's reply and appends the new messages' ids as a delta.
An episode's prompt for turn k is its first prompt, the ids it sampled and the deltas:

    x_k = x_0 ⊕ y_0 ⊕ d_0 ⊕ y_1 ⊕ d_1 ⊕ … ⊕ y_{k−1} ⊕ d_{k−1}

The response is everything after x_0 (y's and d's), right-padded to T; the response
mask is 1 exactly on the y's, the tokens the policy sampled, so the d's are holes every
loss and advantage skips (the forward still attends to them: `forward_hidden` attends
up to a row's last valid token).

Turn k of sample j of the prompt at global row i draws its noise from
sample_seed(seed, step, i, j) hashed with k: an episode's tokens do not depend on the
batch it is sampled in, nor on how episodes are split across workers. A sharded model
runs each turn's forwards on every worker: a worker with no active episode samples a
placeholder row while others still have some.

Each token records the policy version that sampled it (`policy_version`: the
executor's `NodeContext.version`, -1 on the holes). With partial rollouts
(`trainer.partial_rollouts`) the rollout asks for the newest published weights between
two turns (`NodeContext.newest_weights`), so an episode's turns may come from several
versions.

On its first call in a process, and on every call in strict mode, the rollout checks
itself: every trained token is the one sampled, the mask is 1 exactly on them, and the
model's own log-probs of the assembled rows (the trainer's view) equal the sampler's
(`check_rows`).

A black-box agent's episode may fork (`flowgraph.agent.sessions`): with
`rows_per_episode` c, each episode has c rows, one per chain of turns (unused rows
train nothing), every per-episode output (score, status, messages, …) on each of them,
its reward once, at its last trained token, and `episode` naming it (-1 on unused rows)
for grpo and rloo to count episodes, not rows.

One module past ~450 lines, on purpose: one kind, its turn loop with the tensors,
metrics, failures and self-check (`check_rows`, its `TOLERANCE`) of what the loop made.

Notation: b rows given, n episodes per row, r = b·n, P prompt length, T response
length, K = max_turns, c = rows_per_episode (b·n·c rows out).
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from flowgraph.agent.env import STATUSES
from flowgraph.agent.episodes import FAILED, AgentError, Episodes, Limits, Run
from flowgraph.agent.mcp_servers import declared, server_tools
from flowgraph.agent.parsers import get_parser
from flowgraph.agent.render import ChatRenderer
from flowgraph.agent.routing import route
from flowgraph.agent.sessions import Program, Sessions
from flowgraph.agent.tools import as_tool
from flowgraph.choices import ROUTE_COLUMN
from flowgraph.errors import FlowgraphError
from flowgraph.nodes.generate import SamplingSpec, decode, eval_mode, pad_id, sample_seed, stop_ids
from flowgraph.nodes.logprob import logprob
from flowgraph.nodes.shaping import repeat_rows
from flowgraph.runtime.context import NodeContext
from flowgraph.runtime.reward_call import load_function

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["TOLERANCE", "agent_rollout", "check_rows", "compute_dtype", "sampler_tolerance",
           "turn_seed"]

_CHECKED: set[tuple[str, int]] = set()
"""(node, model) pairs whose first rollout in this process was checked (`check_rows`)."""


def turn_seed(seed: int, turn: int) -> int:
    """The seed of turn `turn` of the episode whose seed is `seed` (turn 0: `seed`)."""
    if turn == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:turn:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _env_factory(env: Any, env_params: Mapping[str, Any]) -> Any:
    """What makes one episode's env: the class (or factory) `env` names, with `env_params`."""
    if env is None:
        return None
    from flowgraph.agent.adapters import load_env

    return load_env(env, params=dict(env_params))


def _sample(ctx: NodeContext, model: PreTrainedModel, tokenizer: Any, backend: str,
            requests: list[tuple[int, list[int], int]], seeds: list[int], spec: SamplingSpec,
            width: int, gpu_memory_utilization: float | None,
            begin: Callable[[int, list[int], list[float], bool], None]) -> None:
    """One turn of every request (episode, ids so far, tokens it may sample), sampled as
    one batch left-padded to `width`; each episode's turn handed to `begin(episode, ids,
    log-probs, ended with a stop)` as soon as it is sampled (the hf backend: as its row
    ends, so its tool calls run while the other rows decode)."""
    pad, device = spec.pad_id, next(model.parameters()).device
    rows = [ids for _, ids, _ in requests] or [[pad]]  # a placeholder keeps a sharded
    prompts = torch.full((len(rows), width), pad, dtype=torch.int64)  # model's workers
    mask = torch.zeros((len(rows), width), dtype=torch.int64)         # in step
    for k, ids in enumerate(rows):
        prompts[k, width - len(ids):] = torch.tensor(ids)
        mask[k, width - len(ids):] = 1
    seeds = seeds or [0]
    begun: set[int] = set()

    def ended(responses: Tensor, log_prob: Tensor, ks: list[int], t: int) -> None:
        for k in ks:  # rows that sampled their stop token at t, within their room
            if k < len(requests) and t < requests[k][2]:
                begun.add(k)
                begin(requests[k][0], responses[k, : t + 1].tolist(),
                      log_prob[k, : t + 1].tolist(), True)

    if backend == "vllm":
        out = ctx.rollout_engine("vllm").rollout(model, tokenizer, prompts, mask, seeds, spec,
                                                 gpu_memory_utilization)
    else:
        with eval_mode(model):
            out = decode(model, prompts.to(device), mask.to(device), seeds, spec, ctx.workers,
                         finished=ended)
    stops = set(spec.stop_ids)
    for k, (i, _, room) in enumerate(requests):
        if k not in begun:
            n = int(out["response_mask"][k].sum())
            ids = out["responses"][k, :n].tolist()[:room]
            log_probs = out["rollout_log_prob"][k, :n].tolist()[:room]
            begin(i, ids, log_probs, bool(ids) and ids[-1] in stops)


def agent_rollout(
    ctx: NodeContext,
    model: PreTrainedModel,
    tokenizer: Any,
    *,
    row: Sequence[Mapping[str, Any]],
    ground_truth: Sequence[Any] | None = None,
    data_source: Sequence[Any] | None = None,
    extra_info: Sequence[Any] | None = None,
    env: Any = None,
    env_params: Mapping[str, Any] | None = None,
    envs: Mapping[str, Any] | None = None,
    route_by: str = ROUTE_COLUMN,
    tools: Sequence[Any] = (),
    mcp_servers: Mapping[str, Any] | None = None,
    agent: Any = None,
    parser: str = "hermes",
    max_turns: int = 4,
    max_new_tokens: int | None = None,
    max_turn_tokens: int | None = None,
    max_tool_tokens: int = 256,
    truncate_side: str = "middle",
    tool_timeout_s: float = 30.0,
    turn_timeout_s: float = 120.0,
    episode_timeout_s: float = 600.0,
    on_error: str = "mask",
    concurrency: int = 64,
    chat_template: str | None = None,
    show_tools: str = "template",
    backend: str = "hf",
    n: int | None = None,
    rows_per_episode: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    do_sample: bool = True,
    gpu_memory_utilization: float | None = None,
) -> dict[str, Any]:
    """The `agent_rollout` kind: n episodes per row, `rows_per_episode` rows each;
    episodes of a row are consecutive, and so are the rows of an episode. With `envs`,
    each row's episodes play the env its `route_by` column names
    (`flowgraph.agent.routing`)."""
    n, rows_each = n or ctx.dims.get("N"), rows_per_episode
    T, P = max_new_tokens or ctx.dims.get("T"), ctx.dims.get("P")
    if n is None or T is None or P is None:
        raise ValueError("agent_rollout: set the params n and max_new_tokens, or bind the "
                         "dims N, T and P")
    turn_tokens = min(max_turn_tokens or T, T)
    spec = SamplingSpec(turn_tokens, temperature, top_p, top_k,
                        not do_sample or temperature == 0, stop_ids(model, tokenizer),
                        pad_id(tokenizer))
    limits = Limits(max_turns, T, turn_tokens, max_tool_tokens, truncate_side,
                    tool_timeout_s, turn_timeout_s, episode_timeout_s, on_error)
    episodes: Episodes | Sessions
    if agent is not None and (env is not None or tools or mcp_servers):
        raise FlowgraphError("agent_rollout: `agent` (a black-box program) with `env`, "
                             "`tools` or `mcp_servers`: the program brings its own tools; "
                             "give one or the other")
    if agent is None and rows_each != 1:
        raise FlowgraphError(f"agent_rollout: rows_per_episode {rows_each} holds a black-box "
                             "agent's forks (`agent`); an env's episode is one row: leave "
                             "it at 1")
    if agent is not None:  # a black-box program behind the endpoint
        program = cast("Program", load_function(agent, {}, "agent_rollout agent"))
        episodes = Sessions(program, tokenizer, _template(chat_template), spec.stop_ids,
                            get_parser(parser), limits, P, ctx.node, temperature, top_p,
                            concurrency, rows_each, show_tools)
    else:
        extra_tools = [as_tool(load_function(t, {}, "agent_rollout tools")) for t in tools]
        where = f"agent_rollout `{ctx.node}`"  # MCP servers: started once per process
        extra_tools += server_tools(declared(mcp_servers, where), where, extra_tools)
        renderer = ChatRenderer(tokenizer, _template(chat_template),
                                [t.schema() for t in extra_tools], spec.stop_ids,
                                show_tools=show_tools)
        episodes = Episodes(_env_factory(env, env_params or {}), extra_tools, renderer,
                            get_parser(parser), limits, concurrency)
    rows = (ctx.row_offset + torch.arange(len(row))).tolist()
    tasks = [dict(task) for task in row for _ in range(n)]
    seeds = [sample_seed(ctx.seed, ctx.step, r, j) for r in rows for j in range(n)]
    named = _routed(ctx, row, n, episodes, envs or {}, env_params or {}, route_by,
                    env is not None or agent is not None)
    first = episodes.reset(tasks, [r for r in rows for _ in range(n)], seeds)
    _check_prompts(first, P, rows, n)
    width = P + T - 1  # an active episode's history is shorter: one width every turn
    # until no episode asks for a turn: each takes max_turns at most (a black-box
    # program waiting for a `concurrency` slot starts its turns later than the others)
    while not ctx.workers.all(not (asks := episodes.requests())):
        version = ctx.newest_weights()  # partial rollouts: an update may have landed
        for run in episodes.runs:
            run.version = version
        # every worker samples turn_tokens (a sharded model's workers decode in step);
        # an episode keeps what fits its budget; turn k draws from turn_seed(seed, k)
        _sample(ctx, model, tokenizer, backend, asks,
                [turn_seed(seeds[i], episodes.runs[i].episode.turns) for i, _, _ in asks],
                spec, width, gpu_memory_utilization, episodes.begin)
        episodes.wait()
    runs = episodes.finish()
    out: dict[str, Any] = dict(_tensors(runs, P, T, max_turns, spec.pad_id, rows_each))
    if (ctx.node, id(model)) not in _CHECKED or ctx.strict:
        _CHECKED.add((ctx.node, id(model)))
        if not (top_k or top_p < 1.0):  # filtered sampling: log-probs of another distribution
            check_rows(ctx, model, out, runs, temperature if do_sample else 0.0,
                       atol=sampler_tolerance(model, backend))
    out |= _objects(runs, n, rows_each, named, ground_truth, data_source, extra_info, row)
    _metrics(ctx, runs, out, rows_each)
    _env_metrics(ctx, runs, named, list(envs or {}), out["scores"][::rows_each])
    _cut_calls(ctx, runs, turn_tokens)
    _failures(ctx, runs, on_error)
    out["index"] = torch.tensor(rows).repeat_interleave(n * rows_each)
    out["episode"] = _episode_ids(runs, rows, n, rows_each)
    device = next(model.parameters()).device
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in out.items()}


def _routed(ctx: NodeContext, row: Sequence[Mapping[str, Any]], n: int,
            episodes: Episodes | Sessions, envs: Mapping[str, Any],
            env_params: Mapping[str, Any], route_by: str, beside: bool) -> list[str]:
    """Each episode's env of `envs` (none without them), by its row's `route_by` column
    (`flowgraph.agent.routing`), handed to `episodes` with each env's own `env_params`.
    A row's env is its own column's: the same on whichever worker the row lands."""
    if not envs:
        return []
    if beside or not isinstance(episodes, Episodes):
        raise FlowgraphError("agent_rollout: `envs` (an env per row) with `env` or `agent`: "
                             "name the one env among `envs`, or give `env` alone")
    names = route(row, route_by, envs, f"agent_rollout `{ctx.node}`", ctx.row_offset)
    made = {name: _env_factory(envs[name], env_params.get(name) or {})
            for name in dict.fromkeys(names)}
    named = [name for name in names for _ in range(n)]
    episodes.route([made[name] for name in named])
    return named


def _template(chat_template: str | None) -> str | None:
    """The template's text: `chat_template` itself, or the `.jinja` file it names (in a
    plan, by the absolute path the checker found it at: `flowgraph.paths.written_file`)."""
    if chat_template is None or not chat_template.endswith(".jinja"):
        return chat_template
    try:
        return Path(chat_template).read_text()
    except OSError as exc:
        raise FlowgraphError(f"agent_rollout: the chat template `{chat_template}` cannot be "
                             f"read: {exc}") from exc


def _check_prompts(first: list[list[int]], P: int, rows: list[int], n: int) -> None:
    over = [(i, len(ids)) for i, ids in enumerate(first) if len(ids) > P]
    if over:
        i, length = over[0]
        raise FlowgraphError(
            f"agent_rollout: the first prompt of row {rows[i // n]} is {length} tokens, over "
            f"P = {P} ({len(over)} episodes over it); raise P (dims.P) or shorten the "
            "messages `Env.reset` returns")


def _tensors(runs: list[Run], P: int, T: int, K: int, pad: int, rows: int
             ) -> dict[str, Tensor]:
    """Each episode's `rows` rows (`Run.rows`, then unused ones): its first prompt or a
    fork's, and the tokens after it; the episode's reward at the last sampled token of
    its last row with one, and its values (`scores` included) on each of its rows."""
    r = len(runs) * rows
    out = {
        "prompts": torch.full((r, P), pad, dtype=torch.int64),
        "prompt_mask": torch.zeros((r, P), dtype=torch.int64),
        "responses": torch.full((r, T), pad, dtype=torch.int64),
        "response_mask": torch.zeros((r, T), dtype=torch.int64),
        "rollout_log_prob": torch.zeros((r, T), dtype=torch.float32),
        "policy_version": torch.full((r, T), -1, dtype=torch.int64),
        "token_level_rewards": torch.zeros((r, T), dtype=torch.float32),
        "turn_rewards": torch.zeros((r, K), dtype=torch.float32),
        "turn_mask": torch.zeros((r, K), dtype=torch.int64),
    }
    for e, run in enumerate(runs):
        chains = run.rows()
        for s in range(rows):
            k, chain = e * rows + s, chains[s] if s < len(chains) else None
            # an episode whose env failed to start, an unused row: a placeholder prompt
            prompt = chain.prompt if chain is not None and chain.prompt else [pad]
            out["prompts"][k, P - len(prompt):] = torch.tensor(prompt)
            out["prompt_mask"][k, P - len(prompt):] = 1
            if chain is None:
                continue
            m = len(chain.ids)
            if m:
                out["responses"][k, :m] = torch.tensor(chain.ids)
                out["response_mask"][k, :m] = torch.tensor(chain.sampled)
                out["rollout_log_prob"][k, :m] = torch.tensor(chain.log_probs)
                out["policy_version"][k, :m] = torch.tensor(chain.versions)
            turns = chain.turn_rewards
            out["turn_rewards"][k, : len(turns)] = torch.tensor(turns, dtype=torch.float32)
            out["turn_mask"][k, : len(turns)] = 1
            for end, reward in zip(chain.ends, turns, strict=False):
                out["token_level_rewards"][k, end] += reward
        last = max((s for s, chain in enumerate(chains) if chain.ends), default=None)
        if last is not None:
            ends = chains[last].ends
            out["token_level_rewards"][e * rows + last, ends[-1]] += run.score
    episode_total = out["token_level_rewards"].sum(-1).view(-1, rows).sum(-1)
    out["scores"] = episode_total.repeat_interleave(rows)
    out["num_turns"] = torch.tensor([run.episode.turns for run in runs],
                                    dtype=torch.int64).repeat_interleave(rows)
    out["tool_calls"] = torch.tensor([run.episode.tool_calls for run in runs],
                                     dtype=torch.int64).repeat_interleave(rows)
    return out


def _objects(runs: list[Run], n: int, rows: int, named: list[str],
             *columns: Sequence[Any] | None) -> dict[str, list[Any]]:
    """The episodes' objects, each on every one of its `rows` rows; with several envs
    (`named`: each episode's), its env in `reward_extra_info` (the validation table's
    `env` column, split by `HeldOut`)."""
    envs: list[str | None] = list(named) or [None] * len(runs)
    out: dict[str, list[Any]] = {
        "status": [run.episode.status for run in runs],
        "messages": [run.episode.messages for run in runs],
        "reward_extra_info": [{"status": run.episode.status, "turns": run.episode.turns,
                               "tool_calls": run.episode.tool_calls, **run.extra,
                               **({"env": name} if name is not None else {}),
                               **({"error": run.episode.error} if run.episode.error else {})}
                              for run, name in zip(runs, envs, strict=True)],
    }
    out = {name: repeat_rows(values, rows) if rows > 1 else values
           for name, values in out.items()}
    for name, rows_of in zip(("ground_truth", "data_source", "extra_info", "row"), columns,
                             strict=True):
        if rows_of is not None:
            out[name] = repeat_rows(rows_of, n * rows)
    return out


_SAID: set[str] = set()
"""Episode errors this process has printed (each once)."""


def _failures(ctx: NodeContext, runs: list[Run], on_error: str) -> None:
    """One line on stderr for each new reason episodes failed (the metric
    `agent/status/<status>` counts them every step): what failed, where, and what the
    episodes then count for. AgentError when every episode on every worker failed."""
    failed = [r for r in runs if r.episode.status in FAILED]
    if ctx.workers.all(len(failed) == len(runs)):
        first = failed[0] if failed else None
        raise AgentError(
            f"every episode of step {ctx.step} ended `timeout` or `error`: nothing to train "
            "on (a bug in the env, its tools or the agent program rather than a flaky call)"
            + (f"; row {first.row}: {first.episode.error}" if first else "")) \
            from (first.failure if first else None)
    new = [r for r in failed if r.episode.error not in _SAID]
    if not new:
        return
    _SAID.add(new[0].episode.error)
    counted = "masked: no token trained" if on_error == "mask" else "trained with score 0"
    print(f"flowgraph: node `{ctx.node}` step {ctx.step}: {len(failed)} of {len(runs)} "
          f"episodes ended `timeout` or `error` ({counted}, on_error: {on_error}); row "
          f"{new[0].row}: {new[0].episode.error}", file=sys.stderr, flush=True)


def _cut_calls(ctx: NodeContext, runs: list[Run], turn_tokens: int) -> None:
    """Once per node and process, on stderr: turns cut by their token limit inside a tool
    call (`agent/finish/length` counts every cut turn each step). Such a call cannot be
    read, so it trains as a turn without a call: an agent whose every call is cut trains
    on nothing it meant to do."""
    cut = sum(r.cut_calls for r in runs)
    if not cut or f"cut:{ctx.node}" in _SAID:
        return
    _SAID.add(f"cut:{ctx.node}")
    turns = sum(r.episode.turns for r in runs)
    print(f"flowgraph: node `{ctx.node}` step {ctx.step}: {cut} of {turns} turns were cut "
          f"inside a tool call by their token limit (a black-box agent's own `max_tokens`, "
          f"or max_turn_tokens = {turn_tokens}): the call cannot be read, so the turn is "
          "answered and trained as text without a call. Raise the limit (said once; "
          "agent/finish/length counts cut turns every step)", file=sys.stderr, flush=True)


def _metrics(ctx: NodeContext, runs: list[Run], out: Mapping[str, Tensor], rows_each: int
             ) -> None:
    """`agent/turns`, `agent/tool_calls`, `agent/tool_time_s`, `agent/forks` (a black-box
    agent's histories that did not extend its session's), `agent/finish/length` (turns
    cut by a token limit before their stop token), `agent/versions_per_episode`
    (the policy versions that sampled an episode's trained tokens, over the episodes that
    have some: more than 1 only with partial rollouts; the others are means per episode) and
    `agent/status/<status>` (fractions), over every worker's episodes. With
    rows_per_episode > 1, `agent/rows` (rows an episode took) and `agent/forks_dropped`
    (forks whose chain so far was not trained: the episode had no row left)."""
    sums = _sums(runs)
    if rows_each > 1:
        sums |= {"rows": float(sum(len(r.rows()) for r in runs)),
                 "forks_dropped": float(sum(r.dropped for r in runs))}
    # the versions that sampled an episode's trained tokens, over the episodes with some
    version, mask = out["policy_version"], out["response_mask"].bool()
    versions = [version[k: k + rows_each][mask[k: k + rows_each]].unique().numel()
                for k in range(0, len(runs) * rows_each, rows_each)]
    sums |= {"trained": float(sum(v > 0 for v in versions)), "versions": float(sum(versions))}
    total = ctx.workers.sum(sums)
    trained, versions_sum = total.pop("trained"), total.pop("versions")
    for key, value in total.items():
        if key != "n":
            ctx.metrics[f"agent/{key}"] = value / max(total["n"], 1.0)
    ctx.metrics["agent/versions_per_episode"] = versions_sum / max(trained, 1.0)


def _sums(runs: list[Run]) -> dict[str, float]:
    """The per-episode counts `agent/*` are the means of, summed over `runs`, and `n`."""
    return {"n": float(len(runs)),
            "turns": float(sum(r.episode.turns for r in runs)),
            "tool_calls": float(sum(r.episode.tool_calls for r in runs)),
            "tool_time_s": sum(r.episode.tool_time_s for r in runs),
            "forks": float(sum(r.extra.get("forks", 0) for r in runs)),
            "finish/length": float(sum(r.cut for r in runs)),
            **{f"status/{s}": float(sum(r.episode.status == s for r in runs))
               for s in STATUSES}}


_NOT_PER_ENV = ("n", "forks", "tool_time_s")
"""Counts `agent/*` reports that no env's own metrics do: a black-box agent's forks (an
env never forks), the tools' seconds (wall clock, reported once for the step)."""


def _env_metrics(ctx: NodeContext, runs: list[Run], named: list[str], declared: list[str],
                 scores: Tensor) -> None:
    """Each env's own `agent/<env>/...` (the means `_metrics` reports, over its episodes,
    but `_NOT_PER_ENV`) and `rewards/<env>/mean`, `/std` (its episodes' `scores`, unbiased
    std: NaN below 2 episodes, as TRL's), over every worker's episodes; an env no row of
    the step named reports nothing. Every worker sums every declared env, its own rows
    naming some or none, so the collective's keys agree."""
    if not declared:
        return
    sums: dict[str, float] = {}
    for env in declared:
        mine = [e for e, name in enumerate(named) if name == env]
        x = scores[mine].double()
        sums |= {f"{env}/{k}": v for k, v in _sums([runs[e] for e in mine]).items()}
        sums |= {f"{env}/score": float(x.sum()), f"{env}/score2": float((x * x).sum())}
    total = ctx.workers.sum(sums)
    for env in declared:
        n = total[f"{env}/n"]
        if not n:
            continue
        for key in _sums([]):
            if key not in _NOT_PER_ENV:
                ctx.metrics[f"agent/{env}/{key}"] = total[f"{env}/{key}"] / n
        mean = total[f"{env}/score"] / n
        ctx.metrics[f"rewards/{env}/mean"] = mean
        var = (total[f"{env}/score2"] - n * mean * mean) / max(n - 1, 1)
        ctx.metrics[f"rewards/{env}/std"] = math.sqrt(max(var, 0.0)) if n > 1 else math.nan


def _episode_ids(runs: list[Run], rows: list[int], n: int, rows_each: int) -> Tensor:
    """Each row's episode, unique in the step (global row × n + sample); -1 on an
    episode's unused rows."""
    ids = [rows[e // n] * n + e % n if s < len(run.rows()) else -1
           for e, run in enumerate(runs) for s in range(rows_each)]
    return torch.tensor(ids, dtype=torch.int64)


TOLERANCE = {("hf", torch.float32): 1e-3, ("hf", torch.bfloat16): 0.25,
             ("hf", torch.float16): 5e-2, ("vllm", torch.float32): 5e-2,
             ("vllm", torch.bfloat16): 0.25, ("vllm", torch.float16): 5e-2}
"""How far the trainer's log-prob of a sampled token may be from the sampler's, by
backend and compute dtype (`check_rows`). hf fp32: the same kernels, cached or not;
measured ~1e-6. bf16 (`dtype: bfloat16`'s autocast, or a bf16 model) keeps 8 bits of
mantissa, and a decode step (one query over the KV cache) rounds otherwise than the
trainer's whole-row forward; the sharper the model, the larger the logits and the
difference. Measured on CPU, the worst token of 384 episodes of 4 turns
(scripts/measure_sampler_tolerance.py): random tiny-lm 4.0e-3, tiny-lm-sft 2.7e-2 (a
user met 2.46e-2), tiny-lm-calc 7.4e-2 (median 4.0e-2). 0.25 is over 3x the worst and
still stops a row that is not what was sampled, off by O(1). fp16: 3 bits finer. vLLM:
other kernels (5e-2 as before; bf16's rounding on top)."""


def compute_dtype(model: PreTrainedModel) -> torch.dtype:
    """The dtype the model computes in here: autocast's (a mixed-precision model's node
    runs under it), else its parameters'."""
    weight = next(model.parameters())
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) \
        else weight.dtype


def sampler_tolerance(model: PreTrainedModel, backend: str) -> float:
    """`TOLERANCE` for the backend and the model's compute dtype (another: bf16's)."""
    key = (backend, compute_dtype(model))
    return TOLERANCE.get(key, TOLERANCE[(backend, torch.bfloat16)])


def check_rows(ctx: NodeContext, model: PreTrainedModel, out: Mapping[str, Tensor],
               runs: list[Run], temperature: float, atol: float = 1e-3) -> None:
    """The rollout's own rows against what was sampled: the response holds each
    episode's ids, the mask is 1 exactly on the sampled ones (masked episodes aside),
    and the model's log-probs of the rows (as a trainer computes them: one forward over
    prompt and response) equal the sampler's within `atol` on the tokens its present
    weights sampled (partial rollouts: earlier turns may be older versions').
    FlowgraphError naming the episode and the first token that differs."""
    rows_each = out["responses"].shape[0] // max(len(runs), 1)
    for e, run in enumerate(runs):
        for s, chain in enumerate(run.rows()):
            k, m = e * rows_each + s, len(chain.ids)
            if out["responses"][k, :m].tolist() != chain.ids or \
                    out["response_mask"][k, :m].tolist() != chain.sampled:
                raise FlowgraphError(f"agent_rollout: episode {e}'s row {s} is not the "
                                     "tokens it sampled and was given (a bug in flowgraph: "
                                     "please report)")
    mask = out["response_mask"]
    device = next(model.parameters()).device
    with ctx.workers.inference(model):
        mine = logprob(model, out["prompts"].to(device), out["prompt_mask"].to(device),
                       out["responses"].to(device), mask.to(device),
                       temperature=temperature, ctx=ctx)
    # partial rollouts: the tokens earlier weights sampled have other log-probs
    mine_too = mask * (out["policy_version"] == ctx.policy_version())
    diff = (mine["log_prob"].float().cpu() - out["rollout_log_prob"]).abs() * mine_too
    worst = float(diff.max())
    if worst > atol:
        k, t = divmod(int(diff.argmax()), mask.shape[1])
        dtype = str(compute_dtype(model)).removeprefix("torch.")
        raise FlowgraphError(
            f"agent_rollout: the log-probs a trainer computes for episode {k}'s token {t} "
            f"differ from the sampler's by {worst:.2e} (over {atol}, the tolerance for "
            f"{dtype} compute): the rows are not what was "
            "sampled, or the forward attends to them differently (the chat template, the "
            "attention mask over tool tokens), or the precision rounds more than that "
            "(a low-precision dtype on a long context: try `dtype: float32` to tell)")
