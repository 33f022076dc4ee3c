"""The rewards of graphs/trl_format/grpo.yaml, written as TRL users write them for
`GRPOTrainer(reward_funcs=[correct, brevity], args=GRPOConfig(reward_weights=[1.0, 0.5]))`:
called once per batch with `prompts`, `completions` (message lists: the dataset is
conversational), `completion_ids` and every dataset column as a keyword argument."""

import re


def correct(completions, solution, **kwargs):
    """1 for the right number (the last one in the reply), 0 for a wrong one, None for
    a reply without a number (TRL's "not applicable": left out of the mean)."""
    scores = []
    for completion, answer in zip(completions, solution, strict=True):
        numbers = re.findall(r"-?\d+", completion[0]["content"])
        scores.append(None if not numbers else float(numbers[-1] == answer))
    return scores


def brevity(completion_ids, **kwargs):
    """A little less for every token."""
    return [-0.01 * len(ids) for ids in completion_ids]
