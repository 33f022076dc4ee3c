"""The data sources: prompt, preference and SFT datasets read with pyarrow, batched and
exactly resumable.

Layouts:
* prompts (verl; TRL's standard and conversational formats): `prompt` is a string
  (raw text) or a chat-message list (rendered with the tokenizer's chat template and
  the generation prompt), the ground truth sits in
  `reward_model.ground_truth` (a struct column) or `ground_truth`, and `data_source`
  is optional.
* preferences (TRL): `prompt`, `chosen`, `rejected`; each a string or a message list;
  or TRL's implicit-prompt format, `chosen` and `rejected` only: the prompt is their
  shared first messages (`flowgraph.data.readers.with_prompt`, TRL's `extract_prompt`).
  Responses end with EOS, as sampled responses do.
* sft (verl's SFT parquet): a `prompt` and a `response` column, or a `messages` chat
  list whose last message is the assistant's answer (`sft`).

Files are parquet or JSON lines; `builtin:<task>` is a generated table
(`flowgraph.data.tasks`); a table may also be one given in Python or a hub dataset
(`flowgraph.data.held`: its path is then a `memory:` key). Reading, the row checks and
rendering to token ids are torch-free and shared with `flowgraph check --data`
(`flowgraph.data`); here the rows become batches of tensors:

* `datasets`: the table's cursor, the prompt and preference datasets, over-long rows.
* `sft`: the SFT dataset (composed with the preference dataset's `ResponseBatcher`).
* `padding`: cutting and padding token ids into (ids, mask) tensors.
* `sources`: the data kinds' implementations (`Splits`: train and held-out).
"""

from flowgraph.nodes.data.datasets import PreferenceDataset, PromptDataset
from flowgraph.nodes.data.sft import SFTDataset
from flowgraph.nodes.data.sources import Splits, preference_source, prompt_source, sft_source

__all__ = [
    "PreferenceDataset",
    "PromptDataset",
    "SFTDataset",
    "Splits",
    "preference_source",
    "prompt_source",
    "sft_source",
]
