"""FG304: a filter node where it cannot work, each case on graphs/dapo.yaml with one edit
(graphs/broken/filter_*.yaml hold two more: a node reading one try's tensor, too many
groups)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowgraph.checker import check_graph
from flowgraph.frontend import load_graph

DAPO = (Path(__file__).resolve().parents[2] / "graphs" / "dapo.yaml").read_text()


def _errors(text: str, tmp_path: Path) -> list[str]:
    path = tmp_path / "g.yaml"
    path.write_text(text)
    graph, diags = load_graph(path)
    assert graph is not None, diags
    return [f"{d.code}: {d.message}" for d in check_graph(graph).diagnostics if d.is_error]


def test_dapo_checks_clean(tmp_path: Path) -> None:
    assert _errors(DAPO, tmp_path) == []


@pytest.mark.parametrize(("old", "new", "message"), [
    ("  old_logprob:\n",
     "  again:\n    kind: filter\n    inputs: {scores: keep.scores, index: keep.index, "
     "prompts: keep.prompts, prompt_mask: keep.prompt_mask, responses: keep.responses, "
     "response_mask: keep.response_mask}\n  old_logprob:\n",
     "FG304: `again` is a second filter node (the first is `keep`); a step has one refill "
     "loop"),
    ("      index: gen.index\n      prompts: gen.prompts",
     "      index: reward.scores\n      prompts: gen.prompts",
     "FG304: filter `keep`: its `index` (reward.scores) is not a rollout's group index, so "
     "there are no groups to keep"),
    ("      old_log_prob: old_logprob.log_prob\n",
     "      old_log_prob: old_logprob.log_prob\n      ref_log_prob: keep.rollout_log_prob\n",
     "FG304: `keep.rollout_log_prob` is read downstream, but the filter's input "
     "`rollout_log_prob` is not wired, so it has nothing to pass through"),
], ids=["second_filter", "index_not_a_rollouts", "optional_output_unwired"])
def test_a_filter_that_cannot_work_is_fg304(old: str, new: str, message: str,
                                            tmp_path: Path) -> None:
    assert old in DAPO
    errors = _errors(DAPO.replace(old, new, 1), tmp_path)
    fg304 = [e for e in errors if e.startswith("FG304")]
    assert fg304 == [message], errors
