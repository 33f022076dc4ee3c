"""The `agent_rollout` kind on the tiny models: multi-turn rows with holes, the trainer's
log-probs of them equal to the sampler's, packing over holes, and episodes that do not
depend on how rows are split across workers."""

from __future__ import annotations

import time

import pytest
import torch

import flowgraph.nodes.agent as agent_node
import flowgraph.nodes.logprob as logprob_mod
from flowgraph.agent import Env, Step
from flowgraph.agent.routing import RouteError
from flowgraph.errors import FlowgraphError
from flowgraph.nodes.agent import agent_rollout
from flowgraph.nodes.logprob import logprob
from flowgraph.nodes.models import load_model, load_tokenizer
from flowgraph.runtime.context import NodeContext, Workers


class Again(Env):
    """Replies `again` twice; the third answer ends the episode."""

    def reset(self, task):
        self.turn = 0
        return task["prompt"]

    def step(self, message):
        self.turn += 1
        return Step(["again"], reward=0.5, done=self.turn == 3)

    def reward(self, episode):
        return 1.0


ROWS = [{"prompt": "reverse 123"}, {"prompt": "reverse 4567"}, {"prompt": "reverse 89"}]


@pytest.fixture(scope="module", params=["builtin:tiny-lm", "builtin:tiny-tied"])
def model_and_tok(request):
    return load_model(request.param), load_tokenizer(request.param)


def run(model, tok, rows=ROWS, offset=0, node="agent", **params):
    ctx = NodeContext(node, "agent_rollout", step=3, seed=7, row_offset=offset,
                      dims={"P": 16, "T": 40, "N": 2})
    kw = {"env": Again, "max_turns": 4, "max_turn_tokens": 8, "n": 2} | params
    return agent_rollout(ctx, model, tok, row=rows, **kw), ctx


def test_episodes_are_rows_with_holes_and_the_trainer_sees_the_sampled_log_probs(model_and_tok):
    model, tok = model_and_tok
    out, ctx = run(model, tok)
    mask, resp = out["response_mask"], out["responses"]
    assert resp.shape == mask.shape == (6, 40) and out["prompts"].shape == (6, 16)
    assert out["turn_rewards"].shape == out["turn_mask"].shape == (6, 4)
    span = logprob_mod.response_span(mask)
    holes = span.bool() & ~mask.bool()
    assert holes.any(dim=1).all()  # every episode has the env's `again` between its turns
    again = tok("<|user|>again<|assistant|>", add_special_tokens=False).input_ids
    row = resp[0][span[0].bool()].tolist()
    assert any(row[i:i + len(again)] == again for i in range(len(row)))
    assert (out["rollout_log_prob"][~mask.bool()] == 0).all()
    mine = logprob(model, out["prompts"], out["prompt_mask"], resp, mask)["log_prob"]
    assert torch.allclose(mine * mask, out["rollout_log_prob"], atol=1e-4)
    packed = logprob(model, out["prompts"], out["prompt_mask"], resp, mask,
                     packing=True)["log_prob"]
    assert torch.allclose(packed, mine, atol=1e-5)
    assert set(out["status"]) <= {"completed", "context_exhausted"}
    # a turn reward of 0.5 each (the third ends the episode), the episode's 1 at the end
    assert out["scores"].tolist() == pytest.approx((0.5 * out["num_turns"] + 1.0).tolist())
    assert out["token_level_rewards"].sum(-1).tolist() == pytest.approx(out["scores"].tolist())
    assert ctx.metrics["agent/turns"] == pytest.approx(float(out["num_turns"].float().mean()))


def test_episodes_do_not_depend_on_how_rows_are_split(model_and_tok):
    model, tok = model_and_tok
    whole, _ = run(model, tok)
    first, _ = run(model, tok, ROWS[:1], offset=0)
    rest, _ = run(model, tok, ROWS[1:], offset=1)
    for port in ("responses", "response_mask", "index"):
        assert torch.equal(whole[port], torch.cat([first[port], rest[port]])), port
    # the same tokens; their log-probs from batches of other shapes, to rounding
    assert torch.allclose(whole["rollout_log_prob"],
                          torch.cat([first["rollout_log_prob"], rest["rollout_log_prob"]]),
                          atol=1e-5)


def test_the_first_rollout_catches_rows_a_trainer_would_read_otherwise(monkeypatch):
    """Forwards that took the holes for padding (attending only to sampled tokens) would
    score other log-probs than were sampled: the rollout's own check says so."""
    model, tok = load_model("builtin:tiny-lm"), load_tokenizer("builtin:tiny-lm")
    monkeypatch.setattr(logprob_mod, "response_span", lambda mask: mask)
    monkeypatch.setattr(agent_node, "_CHECKED", set())
    with pytest.raises(FlowgraphError, match="differ from the sampler's") as info:
        run(model, tok, node="fresh")
    assert "(over 0.001, the tolerance for float32 compute)" in str(info.value)
    assert "or the precision rounds more than that" in str(info.value)


def test_the_self_checks_tolerance_follows_the_compute_dtype():
    model = load_model("builtin:tiny-lm")
    assert agent_node.sampler_tolerance(model, "hf") == 1e-3
    with torch.autocast("cpu", dtype=torch.bfloat16):  # `dtype: bfloat16`'s node calls
        assert agent_node.sampler_tolerance(model, "hf") == 0.25
    assert agent_node.sampler_tolerance(model.to(torch.bfloat16), "hf") == 0.25
    assert agent_node.sampler_tolerance(model.float(), "vllm") == 5e-2


def test_reward_functions_read_whole_episodes():
    """A TRL function gets each episode's turns and the messages between them as its
    `completions` (`messages` wired); a verl one the decoded response, the env's replies
    included."""
    from flowgraph.nodes.reward import compute_score

    model, tok = load_model("builtin:tiny-lm"), load_tokenizer("builtin:tiny-lm")
    out, ctx = run(model, tok)
    seen: dict[str, list] = {}

    def turns(prompts, completions, **columns):
        seen["completions"] = completions
        return [float(sum(m["role"] == "assistant" for m in c)) for c in completions]

    def replies(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str.count("again"))

    trl = compute_score(out["responses"], out["response_mask"], row=out["row"],
                        messages=out["messages"], ctx=ctx, tokenizer=tok, fn=turns)
    assert [m["role"] for m in seen["completions"][0]][:3] == ["assistant", "user", "assistant"]
    assert seen["completions"][0] == out["messages"][0][1:]
    assert trl["scores"].tolist() == out["num_turns"].float().tolist()
    verl = compute_score(out["responses"], out["response_mask"], ctx=ctx, tokenizer=tok,
                         fn=replies)
    replied = [sum(m["content"] == "again" for m in ms[1:-1]) for ms in out["messages"]]
    assert verl["scores"].tolist() == [float(n) for n in replied]


def test_an_env_sees_the_dataset_row_as_it_is():
    seen = []

    class Columns(Env):
        def reset(self, task):
            seen.append(dict(task))
            return task["prompt"]

    model, tok = load_model("builtin:tiny-lm"), load_tokenizer("builtin:tiny-lm")
    run(model, tok, rows=[{"prompt": "reverse 12", "answer": "21"}], env=Columns)
    assert seen == [{"prompt": "reverse 12", "answer": "21"}] * 2


class Flaky(Env):
    """The reward of the first task's episodes raises."""

    def reset(self, task):
        self.bad = task["prompt"] == ROWS[0]["prompt"]
        return task["prompt"]

    def reward(self, episode):
        if self.bad:
            raise KeyError("no score for this one")
        return 1.0


def test_failed_episodes_are_said_once_and_all_failed_stops_the_run(capsys):
    from flowgraph.agent.episodes import AgentError

    model, tok = load_model("builtin:tiny-lm"), load_tokenizer("builtin:tiny-lm")
    out, _ = run(model, tok, env=Flaky, max_turns=1)
    assert out["status"] == ["error"] * 2 + ["completed"] * 4
    assert not out["response_mask"][:2].any() and out["response_mask"][2:].any()
    assert out["reward_extra_info"][0]["error"].startswith("KeyError: 'no score for this one'")
    said = capsys.readouterr().err
    assert "2 of 6 episodes ended `timeout` or `error` (masked" in said
    assert "test_agent.py" in said  # the user's line
    run(model, tok, env=Flaky, max_turns=1)
    assert capsys.readouterr().err == ""  # said once
    with pytest.raises(AgentError, match="every episode of step 3 ended"):
        run(model, tok, rows=ROWS[:1], env=Flaky, max_turns=1)


class Sleepy(Env):
    """Sleeps past the turn's timeout in `reset`: every episode times out."""

    def reset(self, task):
        time.sleep(2.0)
        return task["prompt"]


async def never_asks(task, client):
    """A black-box agent that never calls the endpoint."""
    return 1.0


@pytest.mark.parametrize("fails", [
    {"env": Sleepy, "turn_timeout_s": 0.2},
    {"agent": never_asks, "env": None},
], ids=["timeout", "never_calls_the_endpoint"])
def test_when_every_episode_fails_the_report_is_one_clear_message(fails):
    # the reporter crashed: an episode's failure is made, never raised, so the
    # AgentError's cause has no traceback (IndexError in worker.user_frame)
    from flowgraph.agent.episodes import AgentError
    from flowgraph.compilers.worker import user_frame

    model, tok = load_model("builtin:tiny-lm"), load_tokenizer("builtin:tiny-lm")
    with pytest.raises(AgentError) as info:
        run(model, tok, rows=ROWS[:1], **{"max_turns": 1} | fails)
    assert str(info.value).startswith("every episode of step 3 ended `timeout` or `error`")
    assert ("ran past turn_timeout_s = 0.2 s" if fails["env"] else
            "returned without asking the endpoint") in str(info.value)
    assert info.value.__cause__ is not None and info.value.__cause__.__traceback__ is None
    frame = user_frame(info.value)  # where the AgentError was raised
    assert frame.filename.endswith("agent.py") and "AgentError" in (frame.line or "")


def test_an_env_knows_its_row_and_seed_however_rows_are_split():
    class Seeded(Env):
        def reward(self, episode):
            return {"score": 0.0, "row": self.row, "seed": self.seed}

    model, tok = load_model("builtin:tiny-lm"), load_tokenizer("builtin:tiny-lm")
    whole, _ = run(model, tok, env=Seeded, max_turns=1)
    first, _ = run(model, tok, ROWS[:1], offset=0, env=Seeded, max_turns=1)
    rest, _ = run(model, tok, ROWS[1:], offset=1, env=Seeded, max_turns=1)
    info = [(e["row"], e["seed"]) for e in whole["reward_extra_info"]]
    assert info == [(e["row"], e["seed"]) for e in
                    first["reward_extra_info"] + rest["reward_extra_info"]]
    assert [r for r, _ in info] == [0, 0, 1, 1, 2, 2] and len({s for _, s in info}) == 6


def test_partial_rollouts_take_new_weights_between_turns_and_record_their_versions(
        monkeypatch):
    """An executor's `refresh` (partial rollouts) publishes new weights after the first
    turn: every later turn samples with them. Each token records the version that sampled
    it (-1 on the env's replies and padding); the episode spans two versions; the rollout's
    own check holds the new weights to their own tokens only (the first turn's log-probs
    are the old weights', which the new ones no longer give)."""
    model, tok = load_model("builtin:tiny-lm"), load_tokenizer("builtin:tiny-lm")
    old = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def refresh():  # asked before each turn; the update lands during the first one
        calls.append(1)
        if len(calls) == 1:
            return 4
        if len(calls) == 2:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
        return 5

    monkeypatch.setattr(agent_node, "_CHECKED", set())
    ctx = NodeContext("partial", "agent_rollout", step=6, seed=7, dims={"P": 16, "T": 40},
                      version=4, refresh=refresh)
    out = agent_rollout(ctx, model, tok, row=ROWS, env=Again, max_turns=4, max_turn_tokens=8,
                        n=2)  # checks its rows: the new weights on the new tokens
    versions, mask = out["policy_version"], out["response_mask"].bool()
    assert versions.shape == mask.shape == (6, 40)
    assert (versions[~mask] == -1).all() and set(versions[mask].tolist()) == {4, 5}
    for row, m, turns in zip(versions, mask, out["num_turns"].tolist(), strict=True):
        sampled = row[m].tolist()  # the first turn by version 4, the rest by 5
        assert sampled == sorted(sampled) and sampled[0] == 4
        assert (5 in sampled) == (turns > 1)
    assert ctx.metrics["agent/versions_per_episode"] == pytest.approx(
        sum(len(set(r[m].tolist())) for r, m in zip(versions, mask, strict=True)) / 6)
    assert ctx.metrics["agent/versions_per_episode"] > 1.0
    assert len(calls) == int(out["num_turns"].max())  # before each turn, not after the last
    # the first turn's tokens were sampled by the old weights: the new ones differ there
    first = (versions == 4) & mask
    mine = logprob(model, out["prompts"], out["prompt_mask"], out["responses"],
                   out["response_mask"])["log_prob"]
    assert (mine - out["rollout_log_prob"]).abs()[first].max() > 1e-3
    model.load_state_dict(old)
    before = logprob(model, out["prompts"], out["prompt_mask"], out["responses"],
                     out["response_mask"])["log_prob"]
    assert torch.allclose(before[first], out["rollout_log_prob"][first], atol=1e-4)


def test_without_partial_rollouts_every_token_is_the_version_of_the_step(model_and_tok):
    """No executor hook: the rollout of step 3 is sampled by the weights of 3 updates."""
    model, tok = model_and_tok
    out, ctx = run(model, tok)
    mask = out["response_mask"].bool()
    assert (out["policy_version"][mask] == 3).all() and (out["policy_version"][~mask] == -1).all()
    assert ctx.metrics["agent/versions_per_episode"] == 1.0


# --- an env per row (`envs`, routed by a column) -------------------------------------------


class OneShot(Env):
    """Ends the episode at its first answer, reward 0 (the default `Env`'s step)."""

    def reset(self, task):
        return task["prompt"]


ROUTED = [{"prompt": "reverse 123", "env_class": "again"},
          {"prompt": "reverse 4567", "env_class": "one_shot"},
          {"prompt": "reverse 89", "env_class": "again"},
          {"prompt": "reverse 31", "env_class": "one_shot"}]
ENVS = {"again": Again, "one_shot": OneShot}


class Recorded(Workers):
    """One worker that records the keys of each `sum` (a collective's on several)."""

    def __init__(self):
        self.keys: list[set[str]] = []

    def sum(self, values):
        self.keys.append(set(values))
        return dict(values)


def routed(model, tok, rows=ROUTED, offset=0, **params):
    return run(model, tok, rows, offset, env=None, envs=ENVS, **params)


def test_each_row_plays_the_env_its_column_names_and_groups_never_mix_envs():
    """Rows 0 and 2 name `again` (two replies of 0.5, then 1 at the end), rows 1 and 3
    `one_shot` (one turn, 0): each row's n = 2 episodes play its env, so a GRPO group
    (one `index`) is one env's; the per-env metrics are the means over that env's
    episodes, from the same counts as agent/*."""
    model, tok = load_model("builtin:tiny-lm"), load_tokenizer("builtin:tiny-lm")
    out, ctx = routed(model, tok)
    envs = [info["env"] for info in out["reward_extra_info"]]
    assert envs == ["again"] * 2 + ["one_shot"] * 2 + ["again"] * 2 + ["one_shot"] * 2
    turns, scores = out["num_turns"].tolist(), out["scores"].tolist()
    for env, t, s in zip(envs, turns, scores, strict=True):
        if env == "one_shot":
            assert (t, s) == (1, 0.0)
        else:  # 0.5 a reply (a third turn ends it, or T does), 1 at the end
            assert t >= 2 and s == pytest.approx(0.5 * t + 1.0)
    index = out["index"].tolist()
    assert {i: {e for e, j in zip(envs, index, strict=True) if j == i} for i in index} == \
        {0: {"again"}, 1: {"one_shot"}, 2: {"again"}, 3: {"one_shot"}}
    again = [k for k, e in enumerate(envs) if e == "again"]
    m = ctx.metrics
    assert m["agent/one_shot/turns"] == 1.0 and m["rewards/one_shot/mean"] == 0.0
    assert m["rewards/one_shot/std"] == 0.0
    assert m["agent/again/turns"] == pytest.approx(sum(turns[k] for k in again) / 4)
    assert m["rewards/again/mean"] == pytest.approx(sum(scores[k] for k in again) / 4)
    assert m["rewards/again/std"] == pytest.approx(
        float(torch.tensor([scores[k] for k in again]).std()))
    assert m["agent/turns"] == pytest.approx((m["agent/again/turns"] +
                                              m["agent/one_shot/turns"]) / 2)
    assert m["agent/again/status/completed"] + m["agent/again/status/context_exhausted"] == 1


def test_a_workers_rows_route_as_the_whole_batchs_and_every_worker_sums_every_env():
    """Rows split across two workers (offsets 0 and 2, as fsdp and ray split them): each
    half's episodes are the whole batch's, and a worker whose rows name one env still
    sums both envs' counts (a collective's keys agree on every worker)."""
    model, tok = load_model("builtin:tiny-lm"), load_tokenizer("builtin:tiny-lm")
    whole, _ = routed(model, tok)
    halves = [routed(model, tok, ROUTED[k:k + 2], offset=k)[0] for k in (0, 2)]
    for port in ("responses", "response_mask", "num_turns", "scores", "index"):
        assert torch.equal(whole[port], torch.cat([h[port] for h in halves])), port
    assert whole["reward_extra_info"] == [i for h in halves for i in h["reward_extra_info"]]
    workers = Recorded()
    ctx = NodeContext("agent", "agent_rollout", step=3, seed=7, dims={"P": 16, "T": 40},
                      workers=workers)
    agent_rollout(ctx, model, tok, row=[ROUTED[1]], envs=ENVS, n=2, max_turns=4,
                  max_turn_tokens=8)
    assert any({"again/n", "one_shot/n", "again/score"} <= keys for keys in workers.keys)
    assert "agent/one_shot/turns" in ctx.metrics and "agent/again/turns" not in ctx.metrics


def test_verls_agent_name_routes_a_row_without_env_class_and_route_by_names_another():
    model, tok = load_model("builtin:tiny-lm"), load_tokenizer("builtin:tiny-lm")
    verl = [{"prompt": r["prompt"], "agent_name": r["env_class"]} for r in ROUTED]
    task = [{"prompt": r["prompt"], "task": r["env_class"]} for r in ROUTED]
    want = routed(model, tok)[0]["reward_extra_info"]
    assert routed(model, tok, verl)[0]["reward_extra_info"] == want
    assert routed(model, tok, task, route_by="task")[0]["reward_extra_info"] == want


@pytest.mark.parametrize(("rows", "route_by", "message"), [
    ([{"prompt": "x", "env_class": "again"}, {"prompt": "y", "env_class": "one-shot"}],
     "env_class", "agent_rollout `agent`: row 6 names the env `one-shot` (column "
     "`env_class`), which the node does not declare in `envs`: did you mean `one_shot`?"),
    ([{"prompt": "x"}], "env_class", "agent_rollout `agent`: row 5 has no `env_class` (nor "
     "`agent_name`, verl's name) naming its env: add the column (one of again, one_shot), "
     "or set `route_by` to the column that names it"),
    ([{"prompt": "x", "env_class": "again"}], "task", "agent_rollout `agent`: row 5 has no "
     "`task` naming its env"),
])
def test_a_row_naming_no_declared_env_is_refused_naming_the_row(rows, route_by, message):
    model, tok = load_model("builtin:tiny-lm"), load_tokenizer("builtin:tiny-lm")
    with pytest.raises(RouteError) as info:
        routed(model, tok, rows, offset=5, route_by=route_by)
    assert str(info.value).startswith(message)


def test_envs_beside_env_is_refused():
    model, tok = load_model("builtin:tiny-lm"), load_tokenizer("builtin:tiny-lm")
    with pytest.raises(FlowgraphError, match=r"`envs` \(an env per row\) with `env` or `agent`"):
        run(model, tok, ROUTED, envs=ENVS)
