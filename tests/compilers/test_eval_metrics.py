"""The local executor's held-out metrics: KL to the reference, diversity, accuracy."""

import os
from pathlib import Path

import pytest
import torch

from flowgraph.check import check_graph
from flowgraph.compilers.metrics import HeldOut, log_ratio_to_reference, step_metrics
from flowgraph.frontend import load_graph
from flowgraph.ir import Graph
from flowgraph.nodes.models import load_tokenizer
from flowgraph.registry import KindSpec

ROOT = Path(__file__).resolve().parents[2]


def _graph(name: str) -> tuple[Graph, dict[str, KindSpec]]:
    graph, diags = load_graph(str(ROOT / "graphs" / name), [])
    assert graph is not None, diags
    table = check_graph(graph).table
    return graph, {n: r.kind for n, r in table.items() if r.kind is not None}


@pytest.mark.parametrize("name", ["grpo.yaml", "ppo.yaml"])
def test_log_ratio_to_reference_is_the_masked_mean_log_ratio(name: str) -> None:
    graph, _ = _graph(name)
    env = {
        ("old_logprob", "log_prob"): torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]]),
        ("ref_logprob", "log_prob"): torch.tensor([[-1.5, -2.5, -9.0], [-1.0, -1.0, 0.0]]),
        ("gen", "response_mask"): torch.tensor([[1, 1, 0], [1, 1, 0]]),
    }
    # log π − log π_ref = [[.5, .5, 6], [.5, .5, 0]]; the masked-out 6 does not count:
    # (0.5 + 0.5 + 0.5 + 0.5) / 4 valid tokens
    assert log_ratio_to_reference(graph, env) == {"log_ratio_to_ref": pytest.approx(0.5)}


def test_no_reference_no_kl() -> None:
    graph, _ = _graph("dpo.yaml")
    assert log_ratio_to_reference(graph, {}) == {}


def test_held_out_responses_give_diversity_and_accuracy() -> None:
    graph, kinds = _graph("grpo.yaml")
    tok = load_tokenizer("builtin:tiny-lm")
    eos, pad = tok.eos_token_id, tok.pad_token_id
    texts = ["7", "12", "#### 7", "7"]
    rows = [[*tok(t, add_special_tokens=False).input_ids, eos] for t in texts]
    T = max(len(r) for r in rows) + 1
    responses = torch.tensor([r + [pad] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    env = {("gen", "responses"): responses, ("gen", "response_mask"): mask,
           ("gen", "ground_truth"): ["7", "12", "8", "3"]}
    held_out = HeldOut()
    held_out.add(graph, kinds, env, {"actor": tok, "ref": tok})
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


def test_step_metrics_count_response_tokens() -> None:
    graph, kinds = _graph("dpo.yaml")
    assert "perf/response_tokens" not in step_metrics(graph, kinds, {})
    graph, kinds = _graph("grpo.yaml")
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    env = {("gen", "response_mask"): mask, ("gen", "prompt_mask"): torch.tensor([[0, 1], [1, 1]]),
           ("reward", "scores"): torch.zeros(2), ("adv", "advantages"): torch.zeros(2, 3),
           ("adv", "returns"): torch.zeros(2, 3)}
    got = step_metrics(graph, kinds, env)
    # 3 response tokens; with the 3 prompt tokens, 6 tokens in all
    assert got["perf/response_tokens"] == 3.0 and got["perf/tokens"] == 6.0


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
        "trainer.val_before_train=true", "trainer.checkpoint_every=0"])
    assert result.plan is not None
    with open(os.devnull, "w") as out:
        rows = flowgraph.run(result.plan, tensorboard=False, out=out).rows
    assert ["val/accuracy" in r for r in rows] == [True, True]
    for row in rows:
        hits = row["val/accuracy"] * 31
        assert abs(hits - round(hits)) < 1e-9, row["val/accuracy"]
