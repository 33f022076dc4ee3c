"""The local executor's held-out metrics: KL to the reference, diversity, accuracy."""

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from flowgraph.compilers.metrics import HeldOut, log_ratio_to_reference, step_metrics
from flowgraph.frontend import load_graph
from flowgraph.ir import Graph
from flowgraph.nodes.models import load_tokenizer
from flowgraph.passes import PassPipeline, compile_graph
from flowgraph.plan import ExecutionPlan

ROOT = Path(__file__).resolve().parents[2]


def _graph(name: str, *disabled: str) -> tuple[Graph, ExecutionPlan]:
    """The graph, and its plan (which says each node's kind facts and wiring)."""
    graph, diags = load_graph(str(ROOT / "graphs" / name), [])
    assert graph is not None, diags
    plan = compile_graph(graph, pipeline=PassPipeline.default(disabled)).plan
    assert plan is not None
    return graph, plan


@pytest.mark.parametrize("name", ["grpo.yaml", "ppo.yaml"])
def test_log_ratio_to_reference_is_the_masked_mean_log_ratio(name: str) -> None:
    _, plan = _graph(name, "on_policy")  # GRPO: keep the old log-prob the update reads
    env = {
        ("old_logprob", "log_prob"): torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]]),
        ("ref_logprob", "log_prob"): torch.tensor([[-1.5, -2.5, -9.0], [-1.0, -1.0, 0.0]]),
        ("gen", "response_mask"): torch.tensor([[1, 1, 0], [1, 1, 0]]),
    }
    # log π − log π_ref = [[.5, .5, 6], [.5, .5, 0]]; the masked-out 6 does not count:
    # (0.5 + 0.5 + 0.5 + 0.5) / 4 valid tokens
    assert log_ratio_to_reference(plan, env) == {"log_ratio_to_ref": pytest.approx(0.5)}


def test_no_reference_no_kl() -> None:
    _, plan = _graph("dpo.yaml")
    assert log_ratio_to_reference(plan, {}) == {}


def test_held_out_responses_give_diversity_and_accuracy() -> None:
    _, plan = _graph("grpo.yaml")
    tok = load_tokenizer("builtin:tiny-lm")
    eos, pad = tok.eos_token_id, tok.pad_token_id
    texts = ["7", "12", "#### 7", "7"]
    rows = [[*tok(t, add_special_tokens=False).input_ids, eos] for t in texts]
    T = max(len(r) for r in rows) + 1
    responses = torch.tensor([r + [pad] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    env = {("gen", "responses"): responses, ("gen", "response_mask"): mask,
           ("gen", "ground_truth"): ["7", "12", "8", "3"], ("gen", "index"): torch.arange(4),
           **_prompts(tok, ["3+4=", "6+6=", "4+4=", "1+1="])}
    held_out = HeldOut()
    held_out.add(plan, env, {"actor": tok, "ref": tok})
    # eos is special and left out; the builtin BPE reads `#### 7` as `##` `##` `␣` `7`
    assert held_out.tokens == [r[:-1] for r in rows]
    hashes, space, seven = rows[2][:-1][1:]
    assert rows[2][0] == hashes and rows[0][:-1] == [seven] and space not in rows[1]
    metrics = held_out.metrics()
    # exact match: 7 = 7, 12 = 12, 7 ≠ 8, 7 ≠ 3
    assert metrics["accuracy"] == pytest.approx(2 / 4)
    # unigrams: 7 | 1 2 | ## ## ␣ 7 | 7 -> {7, 1, 2, ##, ␣} = 5 distinct of 8
    assert metrics["diversity/distinct_1"] == pytest.approx(5 / 8)
    assert set(metrics) == {"accuracy", "diversity/distinct_1", "diversity/distinct_2",
                            "diversity/entropy_1", "diversity/entropy_2",
                            "diversity/repetition_2"}


def _prompts(tok: Any, questions: list[str]) -> dict[tuple[str, str], torch.Tensor]:
    ids = [tok(q, add_special_tokens=False).input_ids for q in questions]
    P = max(len(i) for i in ids)
    return {("gen", "prompts"): torch.tensor([[0] * (P - len(i)) + i for i in ids]),
            ("gen", "prompt_mask"): torch.tensor([[0] * (P - len(i)) + [1] * len(i)
                                                  for i in ids])}


def _responses(tok: Any, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [[*tok(t, add_special_tokens=False).input_ids, tok.eos_token_id] for t in texts]
    T = max(len(r) for r in rows)
    return (torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in rows]),
            torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows]))


def test_n_responses_a_prompt_give_mean_and_pass_at_n_and_a_table() -> None:
    """Two held-out batches of 2 prompts x 2 samples; the second repeats prompt `2+1=`
    (the last batch is the last Bp rows), so only its second prompt counts."""
    _, plan = _graph("grpo.yaml")
    tok = load_tokenizer("builtin:tiny-lm")
    held_out = HeldOut()
    batches = [(["3+4=", "5+0="], ["7", "8", "5", "5"], ["7", "5"], 0),
               (["5+0=", "2+1="], ["5", "9", "0", "1"], ["5", "3"], 1)]
    for questions, texts, truths, skip in batches:
        responses, mask = _responses(tok, texts)
        env = {("gen", "responses"): responses, ("gen", "response_mask"): mask,
               ("gen", "ground_truth"): [t for t in truths for _ in range(2)],
               ("gen", "index"): torch.tensor([0, 0, 1, 1]),
               ("reward", "scores"): torch.tensor([1.0, 0.1, 1.0, 0.0]),
               **_prompts(tok, [q for q in questions for _ in range(2)])}
        held_out.add(plan, env, {"actor": tok, "ref": tok}, skip=skip)
    # 3+4: 7 right, 8 wrong; 5+0: 5, 5 right; 2+1: 0, 1 wrong (the repeated 5+0 skipped)
    assert [(r["prompt_id"], r["prompt"], r["response"], r["correct"])
            for r in held_out.table] == [
        (0, "3+4=", "7", True), (0, "3+4=", "8", False), (1, "5+0=", "5", True),
        (1, "5+0=", "5", True), (2, "2+1=", "0", False), (2, "2+1=", "1", False)]
    assert [r["score"] for r in held_out.table] == pytest.approx([1.0, 0.1, 1.0, 0.0, 1.0, 0.0])
    assert held_out.prompts == 3
    metrics = held_out.metrics()
    assert metrics["accuracy"] == metrics["accuracy/mean@2"] == pytest.approx(3 / 6)
    assert metrics["accuracy/pass@2"] == pytest.approx(2 / 3)


def test_sampled_validation_logs_a_table_and_mean_at_n(tmp_path: Path) -> None:
    """val_n 3 at temperature 1 on the 100 held-out strings: 300 table rows per
    evaluation in run_dir/validation, accuracy = mean@3 <= pass@3."""
    import json

    import flowgraph
    from flowgraph.passes import compile_graph

    graph = Path(__file__).resolve().parents[2] / "graphs" / "grpo.yaml"
    result = compile_graph(graph, overrides=[
        f"trainer.run_dir={tmp_path}", "trainer.steps=1", "trainer.eval_every=1",
        "trainer.checkpoint_every=0", "dims.Bp=4", "dims.N=2",
        "nodes.update_actor.params.mini_batch_size=8", "nodes.gen.params.val_n=3",
        "nodes.gen.params.val_temperature=1.0"])
    assert result.plan is not None
    with open(os.devnull, "w") as out:
        (row,) = flowgraph.run(result.plan, tensorboard=False, out=out).rows
    table = [json.loads(line) for line in
             (tmp_path / "validation" / "step_0.jsonl").read_text().splitlines()]
    assert len(table) == 300 and len({r["prompt_id"] for r in table}) == 100
    assert set(table[0]) == {"prompt_id", "prompt", "response", "ground_truth",
                             "data_source", "score", "correct"}
    assert not any(k.startswith("val/reverse/") for k in row)  # one source: no split
    assert row["val/accuracy"] == row["val/accuracy/mean@3"] == pytest.approx(
        sum(r["correct"] for r in table) / 300)
    assert row["val/accuracy/mean@3"] <= row["val/accuracy/pass@3"]


def test_step_metrics_count_response_tokens() -> None:
    _, plan = _graph("dpo.yaml")
    assert "perf/response_tokens" not in step_metrics(plan, {})
    _, plan = _graph("grpo.yaml")
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    env = {("gen", "response_mask"): mask, ("gen", "prompt_mask"): torch.tensor([[0, 1], [1, 1]]),
           ("reward", "scores"): torch.zeros(2), ("adv", "advantages"): torch.zeros(2, 3),
           ("adv", "returns"): torch.zeros(2, 3)}
    got = step_metrics(plan, env)
    # 3 response tokens; with the 3 prompt tokens, 6 tokens in all
    assert got["perf/response_tokens"] == 3.0 and got["perf/tokens"] == 6.0


def test_an_agent_episode_of_several_rows_counts_once() -> None:
    """rows_per_episode 2 (a black-box agent's forks): episode 0 took both its rows (a
    sub-agent's chain, then the answer), episode 1 one (its second row unused, episode
    -1, a 1-token placeholder prompt). Lengths and tokens are over the rows that hold a
    chain; a held-out episode is one response, its last row, to its first row's prompt."""
    _, plan = _graph("grpo.yaml")
    tok = load_tokenizer("builtin:tiny-lm")
    responses, mask = _responses(tok, ["12", "7", "5", "5"])
    mask[3] = 0  # the unused row
    episode = torch.tensor([0, 0, 1, -1])
    prompt_mask = torch.tensor([[1, 1], [1, 1], [1, 1], [0, 1]])
    env = {("gen", "response_mask"): mask, ("gen", "prompt_mask"): prompt_mask,
           ("gen", "episode"): episode, ("reward", "scores"): torch.zeros(4),
           ("adv", "advantages"): torch.zeros(mask.shape),
           ("adv", "returns"): torch.zeros(mask.shape)}
    got = step_metrics(plan, env)
    used = mask[:3].sum(-1).float()
    assert got["response_length/mean"] == pytest.approx(float(used.mean()))
    assert got["perf/response_tokens"] == float(used.sum())
    assert got["perf/tokens"] == float(used.sum()) + 6  # not the placeholder's token
    held_out = HeldOut()
    held_out.add(plan, {**env, ("gen", "responses"): responses,
                        ("gen", "ground_truth"): ["7", "7", "5", "5"],
                        ("gen", "index"): torch.tensor([0, 0, 1, 1]),
                        **_prompts(tok, ["3+4=", "draft:", "2+3=", "2+3="])},
                 {"actor": tok, "ref": tok})
    assert [(r["prompt_id"], r["prompt"], r["response"], r["correct"])
            for r in held_out.table] == [(0, "3+4=", "7", True), (1, "2+3=", "5", True)]
    assert len(held_out.tokens) == 2 and held_out.metrics()["accuracy"] == 1.0


def test_every_held_out_row_counts_once_and_val_before_train_is_the_baseline(
        tmp_path: Path) -> None:
    """31 held-out arithmetic rows in batches of Bp=4: the last batch is the last 4 rows
    and only its 3 new ones count, so the accuracy is k/31; val_before_train puts the
    untrained model's evaluation in the first row."""
    import flowgraph
    from flowgraph.passes import compile_graph

    graph = Path(__file__).resolve().parents[2] / "graphs" / "grpo.yaml"
    result = compile_graph(graph, overrides=[
        f"trainer.run_dir={tmp_path}", "trainer.steps=2", "trainer.eval_every=2",
        "trainer.val_before_train=true", "trainer.checkpoint_every=0",
        "data.train.path=builtin:arith", "dims.Bp=4", "dims.N=4",
        "nodes.update_actor.params.mini_batch_size=8"])
    assert result.plan is not None
    with open(os.devnull, "w") as out:
        rows = flowgraph.run(result.plan, tensorboard=False, out=out).rows
    assert ["val/accuracy" in r for r in rows] == [True, True]
    for row in rows:
        hits = row["val/accuracy"] * 31
        assert abs(hits - round(hits)) < 1e-9, row["val/accuracy"]


REWARDS = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    right = solution_str.strip() == str(ground_truth["answer"])
    return {"score": 1.0 if right else 0.1, "acc": right, "pred": solution_str[:3]}
'''


def test_validation_for_a_compute_score_reward(tmp_path: Path) -> None:
    """verl's validation for any reward: val/accuracy from the function's `acc`,
    val/<key>/mean, a split per data_source, and the table with every dict entry
    (`pred`, text, is said once and kept)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    import flowgraph

    rows = [{"prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
             "data_source": "add" if op == "+" else "sub",
             "reward_model": {"ground_truth": {"answer": a + b if op == "+" else a - b}}}
            for a in range(4) for b in range(3) for op in "+-"]
    for name in ("train", "test"):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{name}.parquet")
    (tmp_path / "rewards.py").write_text(REWARDS)
    graph = (ROOT / "graphs" / "verl_format" / "grpo.yaml").read_text()
    (tmp_path / "g.yaml").write_text(graph.replace("columns: [ability]", ""))
    result = compile_graph(tmp_path / "g.yaml", overrides=[
        f"trainer.run_dir={tmp_path / 'run'}", "trainer.steps=1", "trainer.eval_every=1",
        "trainer.checkpoint_every=0", "trainer.val_before_train=false"])
    assert result.plan is not None, result.diagnostics
    with pytest.warns(UserWarning, match="`pred` = .* not a number") as seen, \
            open(os.devnull, "w") as out:
        (row,) = flowgraph.run(result.plan, tensorboard=False, out=out).rows
    assert len([w for w in seen if "`pred`" in str(w.message)]) == 1
    table = [json.loads(line) for line in
             (tmp_path / "run" / "validation" / "step_0.jsonl").read_text().splitlines()]
    assert len(table) == len(rows)  # greedy: one response a held-out prompt
    assert set(table[0]) == {"prompt_id", "prompt", "response", "ground_truth",
                             "data_source", "score", "correct", "acc", "pred"}
    assert table[0]["ground_truth"] == {"answer": 0}  # as the parquet holds it
    assert row["val/accuracy"] == pytest.approx(sum(r["acc"] for r in table) / len(table))
    assert row["val/acc/mean"] == pytest.approx(row["val/accuracy"])
    for source in ("add", "sub"):
        mine = [r for r in table if r["data_source"] == source]
        assert len(mine) == 12
        assert row[f"val/{source}/score/mean"] == pytest.approx(
            sum(r["score"] for r in mine) / 12)
        assert row[f"val/{source}/accuracy"] == pytest.approx(
            sum(r["acc"] for r in mine) / 12)
        assert row[f"val/{source}/acc/mean"] == row[f"val/{source}/accuracy"]
