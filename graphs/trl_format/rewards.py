"""The rewards of graphs/trl_format/grpo.yaml, written as TRL users write them for
`GRPOTrainer(reward_funcs=[correct, brevity], args=GRPOConfig(reward_weights=[1.0, 0.5]))`:
called once per batch with `prompts`, `completions` (message lists: the dataset is
conversational), `completion_ids` and every dataset column as a keyword argument."""

import re


def _answer(completion):
    """The last number of a reply (a conversational completion: one message)."""
    numbers = re.findall(r"\d+", completion[0]["content"])
    return numbers[-1] if numbers else None


def correct(completions, solution, **kwargs):
    """1 for the right answer (the row's `solution` column), else 0."""
    return [float(_answer(c) == s) for c, s in zip(completions, solution, strict=True)]


def brevity(completions, completion_ids, solution, **kwargs):
    """A little less for every token of a right answer; None for a wrong one (TRL's "not
    applicable": a short wrong answer earns nothing, and is left out of the mean)."""
    return [-0.01 * len(ids) if _answer(c) == s else None
            for c, ids, s in zip(completions, completion_ids, solution, strict=True)]
