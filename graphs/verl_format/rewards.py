"""The reward of graphs/verl_format/grpo.yaml, written as verl users write one: a
`compute_score(data_source, solution_str, ground_truth, extra_info=None)` returning a
float, or a dict with `score` and more numbers (logged as `critic/<key>/mean`)."""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 for the right number (the last one in the response), 0.1 for a wrong one, 0 for
    none, as graphs/grpo.yaml's exact_match with format_score 0.1."""
    numbers = re.findall(r"-?\d+", solution_str)
    answer = numbers[-1] if numbers else None
    correct = answer == str(ground_truth)
    return {
        "score": 1.0 if correct else 0.1 if answer is not None else 0.0,
        "acc": float(correct),
        "answered": float(answer is not None),
    }
