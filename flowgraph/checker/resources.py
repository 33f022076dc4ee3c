"""A declared pool's GPUs against the device its workers run on (FG406).

`flowgraph check` and the checker in `compile` see `resources.device` as written; when it
is `auto`, the placement pass calls `gpu_problems` again with the device it resolved.
"""

from __future__ import annotations

from flowgraph.diagnostics import Diagnostic, error, warning
from flowgraph.ir import Graph


def gpu_problems(graph: Graph, device: str) -> list[Diagnostic]:
    """Workers that run on cuda need a GPU each (`gpus: 0` is an error); GPUs asked for by
    workers that run on cpu sit idle (a warning). None for `device` `auto`."""
    out = []
    for p in graph.resources.pools:
        where = f"resources.pools.{p.name}.gpus"
        if p.gpus == 0 and device == "cuda":
            out.append(error("FG406", f"pool `{p.name}`'s workers run on cuda and {where} is "
                             "0: a worker without a GPU cannot run them", p.pos,
                             hint=f"remove {where} (one GPU each), or set "
                                  "`resources.device: cpu`"))
        elif p.gpus and device == "cpu":
            out.append(warning("FG406", f"pool `{p.name}` asks {p.gpus} GPU(s) per worker but "
                               "the plan runs on cpu: Ray reserves them and nothing uses "
                               "them", p.pos,
                               hint=f"set `resources.device: cuda`, or remove {where}"))
    return out


def check_pool_gpus(graph: Graph, target: str | None, out: list[Diagnostic]) -> None:
    """`gpu_problems` on the device the graph names, where pools are taken as declared
    (target ray, or no target)."""
    if target not in ("local", "fsdp"):
        out += gpu_problems(graph, graph.resources.device)
