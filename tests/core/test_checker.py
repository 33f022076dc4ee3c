"""The checker: every problem collected, each with code, position, edge and hint."""

import dataclasses
from pathlib import Path

import pytest

from flowgraph.checker import CheckResult, check_graph
from flowgraph.contracts import TensorSpec
from flowgraph.frontend import load_graph
from flowgraph.kinds import BUILTIN_KINDS
from flowgraph.registry import KindSpec, PortSpec, Registry

ROOT = Path(__file__).resolve().parents[2]
# graphs/grpo.yaml at small dims (4 prompts x 4 samples, mini-batches of 8): the numbers
# in the messages below are of these; the checks are of the graph's structure.
GRPO = ((ROOT / "graphs" / "grpo.yaml").read_text()
        .replace("dims: {Bp: 16, N: 8,", "dims: {Bp: 4, N: 4,")
        .replace("mini_batch_size: 128}", "mini_batch_size: 8}"))


def _check(text: str, overrides: tuple[str, ...] = (), dp: int | None = None):
    graph, diags = load_graph("g.yaml", overrides, text=text)
    assert graph is not None, diags
    assert not [d for d in diags if d.is_error], diags
    return check_graph(graph, dp=dp).diagnostics


def _last_line_of(text: str, needle: str) -> int:
    return max(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_grpo_checks_clean() -> None:
    assert _check(GRPO) == ()


# (replace this, with this) in grpo.yaml -> expected code, edge, words in the message
CASES = [
    ("kind: grpo", "kind: grpoo", "FG102", None, "unknown node kind `grpoo`"),
    ("index: gen.index}", "idx: gen.index}", "FG103", "gen.index -> adv.idx",
     "has no input `idx`"),
    ("scores: reward.scores,", "scores: rewad.scores,", "FG105", "rewad.scores -> adv.scores",
     "`rewad` is not a node"),
    ("scores: reward.scores,", "scores: reward.score,", "FG106", "reward.score -> adv.scores",
     "has no output `score`"),
    ("    model: ref\n", "    model: reff\n", "FG109", None, "not declared"),
    ("kind: grpo\n    inputs: {scores: reward.scores,",
     "kind: grpo\n    model: actor\n    inputs: {scores: reward.scores,",
     "FG111", None, "takes no model"),
    ("scores: reward.scores,", "scores: old_logprob.log_prob,", "FG201",
     "old_logprob.log_prob -> adv.scores", "takes 1 axes"),
    ("index: gen.index}", "index: reward.scores}", "FG203", "reward.scores -> adv.index",
     "takes int"),
    ("ground_truth: gen.ground_truth", "ground_truth: train.ground_truth", "FG202",
     "train.ground_truth -> reward.ground_truth", "which differs from the expected Bp*N=16"),
    ("params: {norm_by_std: true}", "params: {norm_by_sdt: true}", "FG112", None,
     "no parameter `norm_by_sdt`"),
    ("params: {norm_by_std: true}", "params: {norm_by_std: 3}", "FG112", None,
     "expected bool"),
    ("params: {backend: hf, temperature: 1.0}", "params: {backend: hf, max_new_tokens: 9}",
     "FG205", None, "but T = 8"),
]


@pytest.mark.parametrize(("old", "new", "code", "edge", "words"), CASES,
                         ids=[c[2] + "-" + c[4][:20] for c in CASES])
def test_single_bugs_are_reported_precisely(old: str, new: str, code: str, edge: str | None,
                                            words: str) -> None:
    assert old in GRPO
    text = GRPO.replace(old, new, 1)
    errors = [d for d in _check(text) if d.is_error]
    assert code in [d.code for d in errors], errors
    d = next(d for d in errors if d.code == code)
    assert words in d.message
    assert d.edge == edge or edge is None
    assert d.pos is not None and d.pos.file == "g.yaml" and d.pos.line > 0
    assert d.hint


def test_binding_chain_is_shown() -> None:
    text = GRPO.replace("ground_truth: gen.ground_truth", "ground_truth: train.ground_truth")
    d = next(d for d in _check(text) if d.code == "FG202")
    # reported at the reward's input, not at gen's identical-looking line above it
    assert d.pos is not None
    assert d.pos.line == _last_line_of(text, "ground_truth: train.ground_truth")
    assert any("`b` of `reward` = Bp*N=16, from edge gen.responses -> reward.responses" in n
               for n in d.notes)
    assert any(n.startswith("N = 4 from dims") for n in d.notes)
    assert "per prompt (Bp)" in (d.hint or "")


def test_everything_is_collected_not_just_the_first() -> None:
    text = (GRPO.replace("kind: grpo", "kind: grpoo")
            .replace("scores: reward.scores,", "scores: rewad.scores,")
            .replace("    model: ref\n", "    model: reff\n"))
    graph, _ = load_graph("g.yaml", text=text)
    assert graph is not None
    codes = sorted(d.code for d in check_graph(graph).diagnostics if d.is_error)
    # the unknown kind hides adv's ports, so the missing `rewad` is not reported twice
    assert codes == ["FG102", "FG109"]
    text2 = GRPO.replace("    model: ref\n", "    model: reff\n").replace(
        "scores: reward.scores,", "scores: rewad.scores,")
    graph2, _ = load_graph("g.yaml", text=text2)
    assert graph2 is not None
    assert sorted(d.code for d in check_graph(graph2).diagnostics if d.is_error) == [
        "FG105", "FG109"]


def test_cycle_is_reported_with_its_path() -> None:
    text = GRPO.replace("      prompts: train.input_ids", "      prompts: old_logprob.log_prob")
    cycles = [d for d in _check(text) if d.code == "FG107"]
    assert len(cycles) == 1
    assert "cycle: gen -> old_logprob -> gen" in cycles[0].message


def test_a_name_two_nodes_share_is_reported_once() -> None:
    # Only a graph built in Python can list two nodes of one name (YAML keys are unique).
    graph, _ = load_graph("g.yaml", text=GRPO)
    assert graph is not None
    twice = dataclasses.replace(graph, nodes=(*graph.nodes, graph.nodes[1]))
    assert [d.one_line() for d in check_graph(twice).diagnostics] == [
        "g.yaml:28:3: error[FG101]: the name `old_logprob` is used twice"]


def _check_three(kind: KindSpec) -> CheckResult:
    """grpo.yaml plus three nodes of `kind` (x0, x1, x2) reading old_logprob.log_prob."""
    nodes = "".join(f"  x{i}:\n    kind: {kind.name}\n    inputs: {{x: old_logprob.log_prob}}\n"
                    for i in range(3))
    graph, diags = load_graph("g.yaml", text=GRPO.replace("\ntrainer:", nodes + "\ntrainer:", 1))
    assert graph is not None and not diags
    result = check_graph(graph, Registry({**BUILTIN_KINDS, kind.name: kind}))
    assert not result.errors
    return result


def test_a_local_dim_no_edge_binds_is_named_after_its_node() -> None:
    widen = KindSpec("widen", "custom", "adds an axis of its own size",
                     inputs=(PortSpec("x", TensorSpec("b T")),),
                     outputs=(PortSpec("y", TensorSpec("b T c")),))
    outputs = _check_three(widen).shapes.outputs
    assert [str(outputs[(f"x{i}", "y")].dims[2]) for i in range(3)] == ["x0.c", "x1.c", "x2.c"]


def test_a_local_dim_is_solved_from_an_axis_expression() -> None:
    # `b+1` fed Bp*N sequences: b = Bp*N-1 (16 - 1 with Bp=4, N=4), for every node.
    shifted = KindSpec("shifted", "custom", "gives one sequence fewer than it takes",
                       inputs=(PortSpec("x", TensorSpec("b+1 T")),),
                       outputs=(PortSpec("y", TensorSpec("b T")),))
    shapes = _check_three(shifted).shapes
    assert [str(shapes.outputs[(f"x{i}", "y")].dims[0]) for i in range(3)] == ["Bp*N-1"] * 3
    assert shapes.env.why["x2.b"] == ("`b` of `x2` = Bp*N-1=15, from edge old_logprob.log_prob "
                                      "-> x2.x (g.yaml:69:17)")


def test_trainable_model_without_update_and_unused_outputs() -> None:
    text = GRPO.replace("kind: ppo_actor_update", "kind: ppo_actor_updat")
    codes = {d.code for d in _check(text)}
    assert "FG102" in codes
    graph, _ = load_graph("g.yaml", text=GRPO.replace("ref: {path", "ref: {trainable: true, path"))
    assert graph is not None
    d = [d for d in check_graph(graph).diagnostics if d.code == "FG110"]
    assert len(d) == 1 and "`ref` is trainable" in d[0].message


@pytest.mark.parametrize(
    ("overrides", "dp", "code", "words"),
    [
        (("nodes.update_actor.params.mini_batch_size=6",), 1, "FG301",
         "global batch 16 is not divisible by mini_batch_size 6"),
        ((), 3, "FG301", "does not split evenly over 3"),
        (("dims.Bp=6",), 4, "FG302", "6 groups of 4 samples"),
        (("nodes.update_actor.params.micro_batch_size=3",), 1, "FG303",
         "the 8 sequences of a mini-batch on each rank are not divisible by "
         "micro_batch_size 3"),
        (("nodes.update_actor.params.micro_batch_size=3",), 2, "FG303",
         "the 4 sequences of a mini-batch on each rank are not divisible by "
         "micro_batch_size 3"),
        (("nodes.update_actor.params.mini_batch_size=2",), 4, "FG301",
         "mini_batch_size 2 does not split evenly over 4 data-parallel ranks"),
        (("nodes.update_actor.params.max_token_len=100",
          "nodes.update_actor.params.micro_batch_size=2"), 1, "FG303",
         "micro_batch_size 2 and max_token_len 100 both cut the micro-batches"),
        (("nodes.old_logprob.params.max_token_len=20",), 1, "FG303",
         "`old_logprob`: max_token_len 20 cannot hold one row of 24 tokens (P + T = 24)"),
    ],
)
def test_batch_arithmetic(overrides: tuple[str, ...], dp: int, code: str, words: str) -> None:
    diags = _check(GRPO, overrides, dp=dp)
    hits = [d for d in diags if d.code == code]
    assert hits and words in hits[0].message, diags
    assert hits[0].hint


def test_groups_fit_when_bp_divides_dp() -> None:
    # Bp=4 prompts x N=4 over dp=2: 2 whole groups per rank, mini-batch 8 per rank divides 8.
    assert _check(GRPO, dp=2) == ()


def test_a_log_prob_scored_at_another_temperature_is_a_warning() -> None:
    diags = _check(GRPO, ("nodes.gen.params.temperature=0.7",))
    hits = [d for d in diags if d.code == "FG116"]
    assert {d.node for d in hits} == {"old_logprob", "update_actor"}
    assert all(not d.is_error for d in hits)
    assert "nodes.old_logprob.params.temperature: 0.7" in next(
        d.hint for d in hits if d.node == "old_logprob")
    matched = _check(GRPO, ("nodes.gen.params.temperature=0.7",
                            "nodes.old_logprob.params.temperature=0.7",
                            "nodes.update_actor.params.temperature=0.7"))
    assert not [d for d in matched if d.code == "FG116"]
    greedy = _check(GRPO, ("nodes.gen.params.temperature=0",))
    assert not [d for d in greedy if d.code == "FG116"]


def test_packing_without_varlen_attention_is_a_warning() -> None:
    """SDPA would see one N x N mask: allowed (same numbers), warned; flash_attention_2
    packs by varlen and is not warned about."""
    diags = _check(GRPO, ("nodes.old_logprob.params.packing=true",))
    hits = [d for d in diags if d.code == "FG305"]
    assert [(d.node, d.is_error) for d in hits] == [("old_logprob", False)]
    assert hits[0].message == ("`old_logprob` packs its sequences, but model `actor` runs sdpa "
                               "attention: one N x N mask over every token of a micro-batch, "
                               "more work than the padding it saves")
    assert hits[0].hint and "attn_implementation: flash_attention_2" in hits[0].hint
    varlen = _check(GRPO, ("nodes.old_logprob.params.packing=true",
                           "models.actor.attn_implementation=flash_attention_2"))
    assert not [d for d in varlen if d.code == "FG305"]


POOLS = GRPO + """resources:
  pools:
    actor_rollout_ref: {size: 3, models: [actor, ref]}
"""


@pytest.mark.parametrize(("target", "code"), [(None, "FG301"), ("ray", "FG301"),
                                              ("fsdp", None), ("local", None)])
def test_an_update_splits_over_the_workers_of_its_declared_pool(
        target: str | None, code: str | None) -> None:
    # Under ray the actor's update runs on the 3 workers of its pool, whatever nproc
    # says: 16 sequences do not split over them. On fsdp one SPMD pool of nproc ranks
    # runs everything and declared pools are not used for placement.
    graph, diags = load_graph("g.yaml", text=POOLS)
    assert graph is not None and not diags
    hits = [d for d in check_graph(graph, target=target).diagnostics if d.code == "FG301"]
    assert [d.code for d in hits] == ([code] if code else [])
    if code:
        assert ("`update_actor`: the batch of 16 sequences does not split evenly over the 3 "
                "workers of pool `actor_rollout_ref`") in hits[0].message
        assert hits[0].node == "update_actor"
        assert hits[0].hint and "a size for pool `actor_rollout_ref` among [1, 2, 4" in \
            hits[0].hint


def test_a_pool_that_fits_checks_clean_at_any_nproc() -> None:
    graph, _ = load_graph("g.yaml", ["resources.pools.actor_rollout_ref.size=2"], text=POOLS)
    assert graph is not None
    assert check_graph(graph, dp=1, target="ray").diagnostics == ()


@pytest.mark.parametrize(("overrides", "warned"), [
    (("data.train.path=prompts.parquet",), True),
    (("data.train.path=prompts.parquet", "data.train.eval_path=held_out.parquet"), False),
    (("data.train.path=builtin:arith",), False),  # its `:test` split
    (("data.train.path=builtin:arith:train",), True),
    (("data.train.path=prompts.parquet", "trainer.eval_every=0"), False),
])
def test_eval_every_without_held_out_data_warns(overrides: tuple[str, ...], warned: bool) -> None:
    found = [d for d in _check(GRPO, ("trainer.eval_every=5", *overrides)) if d.code == "FG117"]
    assert bool(found) == warned
    if warned:
        assert found[0].message == ("`trainer.eval_every` is 5, but data source `train` has no "
                                    "held-out rows: no evaluation will run")


REMAX = (ROOT / "graphs" / "remax.yaml").read_text()
SHAPED = GRPO.replace("""  adv:
    kind: grpo
    inputs: {scores: reward.scores,""", """  overlong:
    kind: overlong_penalty
    inputs: {scores: reward.scores, response_mask: gen.response_mask}
    params: {overlong_buffer_len: 4}
  brevity:
    kind: length_penalty
    inputs: {scores: reward.scores, response_mask: gen.response_mask}
  total:
    kind: weighted_sum
    inputs: {acc: reward.scores, overlong: overlong.penalty, brevity: brevity.penalty}
    params: {weights: {acc: 1.0, brevity: 0.5}}
  adv:
    kind: grpo
    inputs: {scores: total.scores,""")


def test_shaping_kinds_check_clean_and_name_their_terms() -> None:
    assert _check(SHAPED) == ()
    # A term is any input name, checked like a declared port: one number per sequence.
    bad = SHAPED.replace("brevity: brevity.penalty}", "brevity: gen.response_mask}")
    errors = [(d.code, d.edge) for d in _check(bad) if d.is_error]
    assert errors == [("FG201", "gen.response_mask -> total.brevity"),
                      ("FG203", "gen.response_mask -> total.brevity")]


def test_a_weighted_sum_with_no_term_and_an_overlong_penalty_without_its_buffer() -> None:
    bad = SHAPED.replace("inputs: {acc: reward.scores, overlong: overlong.penalty, "
                         "brevity: brevity.penalty}", "inputs: {}")
    bad = bad.replace("    params: {overlong_buffer_len: 4}\n", "")
    found = {(d.code, d.node): d.message for d in _check(bad) if d.is_error}
    assert "none is wired" in found[("FG104", "total")]
    assert "overlong_buffer_len" in found[("FG112", "overlong")]


def test_repeat_broadcasts_the_greedy_baseline_to_the_prompts_samples() -> None:
    assert _check(REMAX) == ()
    # The baseline of every sample instead of every prompt: N times too many rows.
    bad = REMAX.replace("inputs: {x: reward_greedy.scores}", "inputs: {x: reward.scores}")
    errors = [d for d in _check(bad) if d.is_error]
    assert [(d.code, d.edge) for d in errors] == [("FG202", "baseline.x -> adv.reward_baselines")]
    assert "Bp*N*N=64, which differs from the expected Bp*N=16" in errors[0].message
    # `repeat` carries its input's dtype: float scores stay float for the advantage.
    wrong = REMAX.replace("inputs: {x: reward_greedy.scores}", "inputs: {x: gen_greedy.index}")
    assert [d.code for d in _check(wrong) if d.is_error] == ["FG203"]


def test_old_log_prob_may_stay_unwired_only_for_one_optimizer_step() -> None:
    unwired = GRPO.replace("      old_log_prob: old_logprob.log_prob\n", "")
    assert unwired != GRPO
    errors = [d for d in _check(unwired) if d.is_error]
    assert [(d.code, d.node) for d in errors] == [("FG104", "update_actor")]
    assert "only one step can use its own log-probs" in errors[0].message
    one_step = ("nodes.update_actor.params.mini_batch_size=null",)
    assert [d.code for d in _check(unwired, one_step)] == ["FG108"]  # old_logprob unread


DAPO = (ROOT / "graphs" / "dapo.yaml").read_text()


def test_dpo_refuses_loss_agg_mode_and_says_why() -> None:
    # verl's loss_agg_mode aggregates per-token losses; DPO's loss is per pair (it was
    # accepted and ignored before dpo_update took only the params its loss uses).
    text = (ROOT / "graphs" / "dpo.yaml").read_text()
    [error] = [d for d in _check(text, ("nodes.update.params.loss_agg_mode=token-mean",))
               if d.is_error]
    assert (error.code, error.node, error.hint) == ("FG112", "update", "remove `loss_agg_mode`")
    assert error.message == (
        "kind `dpo_update` has no parameter `loss_agg_mode`: DPO's loss is one number per "
        "pair, from each response's log-prob summed over its tokens (Rafailov et al. 2023), "
        "averaged over the pairs: there are no per-token losses to aggregate")


@pytest.mark.parametrize(("text", "keep"), [(GRPO, ()), (DAPO, ()),
                                            (DAPO, ("nodes.keep.params.groups=2",))],
                         ids=["grpo", "dapo", "dapo-2-groups"])
def test_fg104_counts_optimizer_steps_on_the_updates_batch(text: str,
                                                           keep: tuple[str, ...]) -> None:
    # Bp=4 prompts x N=4 samples: 16 rows (the filter keeping 2 groups: 8); a mini-batch
    # of the whole batch is one optimizer step, as the update loop takes it, and needs no
    # old_log_prob; one row fewer per mini-batch is two steps and does.
    unwired = text.replace("      old_log_prob: old_logprob.log_prob\n", "")
    assert unwired != text
    rows = 8 if keep else 16
    one_step = (*keep, f"nodes.update_actor.params.mini_batch_size={rows}")
    assert [d.code for d in _check(unwired, one_step) if d.is_error] == []
    two_steps = (*keep, f"nodes.update_actor.params.mini_batch_size={rows // 2}")
    errors = [d for d in _check(unwired, two_steps) if d.is_error]
    assert [(d.code, d.node) for d in errors] == [("FG104", "update_actor")]
    assert (f"ppo_epochs 1, mini_batch_size {rows // 2} on a batch of {rows} rows"
            in errors[0].message)


VERL_FORMAT = (ROOT / "graphs" / "verl_format" / "grpo.yaml").read_text()


@pytest.mark.parametrize(("old", "new", "code", "words"), [
    ('fn: "rewards.py:compute_score"', 'fn: "rewards.py:compute_scor"', "FG112",
     "`rewards.py` has no function `compute_scor`"),
    ('fn: "rewards.py:compute_score"', 'fn: "other.py:compute_score"', "FG113",
     "`other.py` is not listed under plugins:"),
    ('fn: "rewards.py:compute_score"', "fn: gsm9k", "FG112", "no built-in function `gsm9k`"),
    ('fn: "rewards.py:compute_score"', "fns: {arith: gsm8k, other: 3}", "FG112",
     "names a function as a string or a callable, got 3"),
    ('{fn: "rewards.py:compute_score"}', "{}", "FG112", "needs `fn` or `fns`"),
])
def test_a_reward_function_is_checked_before_launch(
        tmp_path: Path, old: str, new: str, code: str, words: str) -> None:
    (tmp_path / "rewards.py").write_text(
        (ROOT / "graphs" / "verl_format" / "rewards.py").read_text())
    file = tmp_path / "g.yaml"
    assert old in VERL_FORMAT
    file.write_text(VERL_FORMAT.replace(old, new))
    graph, _ = load_graph(str(file), ())
    assert graph is not None
    errors = [d for d in check_graph(graph).diagnostics if d.is_error]
    assert [(d.code, d.node) for d in errors] == [(code, "reward")]
    assert words in errors[0].message


PLAIN_PG = '''
from flowgraph.registry import policy_loss


@policy_loss("test_checker_plain_pg")
def plain(old_log_prob, log_prob, advantages, response_mask, clip_ratio_high: float = 0.2,
          scale: float = 1.0):
    return -scale * advantages * log_prob, {}
'''


@pytest.mark.parametrize(("params", "words"), [
    ("{policy_loss: test_checker_plain_pg, policy_loss_params: {scale: 2.0}}", None),
    ("{policy_loss: test_checker_plain_pg, policy_loss_params: {scale: two}}",
     "`policy_loss_params` of `update_actor`: expected float"),
    ("{policy_loss: test_checker_plain_pg, policy_loss_params: {clip_ratio_high: 0.3}}",
     "takes no param `clip_ratio_high` (its params: scale)"),
    ("{policy_loss: clip_cov, policy_loss_params: {kl_cov_ratio: 0.1}}",
     "takes no param `kl_cov_ratio` (its params: clip_cov_ratio, clip_cov_lb, clip_cov_ub)"),
    ("{policy_loss: gspoo}", "no policy loss `gspoo`"),
])
def test_a_policy_loss_and_its_params_are_checked(tmp_path: Path, params: str,
                                                  words: str | None) -> None:
    (tmp_path / "plain_pg.py").write_text(PLAIN_PG)
    old = "params: {kl_loss_coef: 0.001, kl_loss_type: low_var_kl, mini_batch_size: 8}"
    assert old in GRPO
    file = tmp_path / "g.yaml"
    file.write_text("plugins: [plain_pg.py]\n" + GRPO.replace(old, "params: " + params))
    graph, _ = load_graph(str(file), ())
    assert graph is not None
    errors = [d for d in check_graph(graph).diagnostics if d.is_error]
    assert [d.message for d in errors if words is None] == []
    if words is not None:
        assert [(d.code, d.node) for d in errors] == [("FG112", "update_actor")]
        assert words in errors[0].message


@pytest.mark.parametrize(("params", "errors"), [
    ("val_n: 4, val_temperature: 1.0", []), ("val_n: 4", ["FG118"]), ("val_n: 1", [])])
def test_n_held_out_responses_need_a_sampling_temperature(params: str, errors: list[str]) -> None:
    text = GRPO.replace("params: {backend: hf, temperature: 1.0}",
                        f"params: {{backend: hf, temperature: 1.0, {params}}}")
    found = [d for d in _check(text) if d.is_error]
    assert [d.code for d in found] == errors
    if errors:
        assert "val_temperature" in found[0].hint and found[0].pos.line == _last_line_of(
            text, "val_n")


@pytest.mark.parametrize(("overrides", "words"), [
    (("models.actor.lora.r=8",), None),
    (("models.ref.lora.r=8",), "`ref` has `lora` but is frozen"),
    (("models.critic.lora.r=8",), "runs with a scalar head (node `values`)"),
])
def test_lora_goes_on_a_trained_causal_lm(overrides: tuple[str, ...], words: str | None) -> None:
    text = (ROOT / "graphs" / "ppo.yaml").read_text()
    found = [d for d in _check(text, overrides) if d.is_error]
    assert [(d.code, words in d.message) for d in found] == ([] if words is None else
                                                            [("FG119", True)])


@pytest.mark.parametrize(("lora", "words"), [
    ("{r: 0}", "lora.r` is 0; it must be >= 1"), ("{dropout: 1.0}", "dropout` is 1.0"),
    ("{alpha: 0}", "alpha` is 0.0"), ("{target_modules: []}", "must name modules"),
    ("{rank: 8}", "unknown key `rank`"),
])
def test_a_malformed_lora_is_an_error_at_its_line(lora: str, words: str) -> None:
    text = (ROOT / "graphs" / "grpo_lora.yaml").read_text()
    old = "    lora: {r: 8, alpha: 16, target_modules: all-linear}\n"
    assert old in text
    _, diags = load_graph("g.yaml", (), text=text.replace(old, f"    lora: {lora}\n"))
    errors = [d for d in diags if d.is_error]
    assert len(errors) == 1 and words in errors[0].message, errors
    assert errors[0].pos.line == _last_line_of(text, "lora:")
