"""A model node that reports, from the Ray worker it runs in, what the cluster calls the
run's actors and placement groups: the ray target's naming and log tests read it from
the worker's log (`run_dir/logs/<pool>-<rank>.log`)."""

import json
import sys
import warnings

import torch
from jaxtyping import Float, Int
from torch import Tensor

from flowgraph.registry import node_kind

NAMES = "ray names: "
"""The prefix of the line with the cluster's named actors and placement groups."""


@node_kind("naming_logprob", outputs=["log_prob"], category="model", model="required")
def naming_logprob(ctx, model, prompts: Int[Tensor, "b P"], prompt_mask: Int[Tensor, "b P"],
                   responses: Int[Tensor, "b T"], response_mask: Int[Tensor, "b T"]
                   ) -> Float[Tensor, "b T"]:
    """Zero log-probs; prints the cluster's live named actors (name, namespace) and placement
    groups (name) on stdout, a line on stderr and a warning, as a user's node does."""
    import ray

    actors = ray.util.list_named_actors(all_namespaces=True)
    groups = [g["name"] for g in ray.util.placement_group_table().values()
              if g["state"] != "REMOVED"]
    print(NAMES + json.dumps({"actors": actors, "groups": groups}), flush=True)
    print(f"naming_logprob on stderr at step {ctx.step}", file=sys.stderr, flush=True)
    warnings.warn(f"naming_logprob warns at step {ctx.step}", stacklevel=1)
    return torch.zeros(responses.shape, dtype=torch.float32)
