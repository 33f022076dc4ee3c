"""What each worker of a declared pool asks for (issue #29, point 2): `cpus`, `gpus`,
`custom_resources`, `strategy`, `label_selector` under `resources.pools.<p>`; a bad value
is FG004 at its line, GPUs that do not fit the device FG406; the plan carries them (and
its JSON), `compile --target ray` shows them per pool.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from flowgraph.frontend import graph_from_yaml, graph_to_document, load_graph
from flowgraph.ir import Graph
from flowgraph.passes import compile_graph
from flowgraph.plan import (
    Amount,
    Bundle,
    Label,
    plan_from_json,
    plan_summary,
    plan_to_json,
)
from flowgraph.schema import graph_schema

ROOT = Path(__file__).resolve().parents[2]

RESOURCES = """\
resources:
  pools:
    trainer:
      size: 2
      models: [policy, ref]
{settings}"""


def doc_of(name: str) -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "graphs" / f"{name}.yaml").read_text())
    assert isinstance(data, dict)
    return data


def _dpo(settings: str) -> str:
    """graphs/dpo.yaml with a pool `trainer` whose settings (indented 6) end the file."""
    doc = doc_of("dpo")
    doc.pop("resources", None)
    return yaml.safe_dump(doc, sort_keys=False) + RESOURCES.format(settings=settings)


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


@pytest.mark.parametrize(("settings", "needle", "message"), [
    ("      cpus: 0\n", "cpus: 0", "`resources.pools.trainer.cpus` is 0; it must be >= 1"),
    ("      gpus: -1\n", "gpus: -1", "`resources.pools.trainer.gpus` is -1; it must be >= 0"),
    ("      gpus: 0.5\n", "gpus: 0.5",
     "`resources.pools.trainer.gpus` must be an integer or null, got a number 0.5"),
    ("      strategy: spred\n", "strategy", "`resources.pools.trainer.strategy` is `spred`; it "
     "must be one of pack, spread, strict_pack, strict_spread"),
    ("      custom_resources: {TPU: -1}\n", "TPU",
     "`resources.pools.trainer.custom_resources.TPU` must be a number > 0, got an integer -1"),
    ("      custom_resources:\n        GPU: 2\n", "GPU: 2",
     "`resources.pools.trainer.custom_resources` names `GPU`, a resource Ray accounts itself"),
    ("      custom_resources: [TPU]\n", "custom_resources",
     "`resources.pools.trainer.custom_resources` must be a mapping, got a list"),
    ("      label_selector:\n        zone: in(a,\n", "zone",
     "`resources.pools.trainer.label_selector.zone` is a string 'in(a,', not a Ray label "
     "selector"),
    ("      label_selector:\n        -zone: a\n", "-zone",
     "`resources.pools.trainer.label_selector` names `-zone`, which is not a node label's "
     "name"),
])
def test_a_bad_pool_setting_is_fg004_at_its_line(settings: str, needle: str,
                                                 message: str) -> None:
    text = _dpo(settings)
    _, diags = load_graph("g.yaml", text=text)
    assert [(d.code, d.message) for d in diags] == [("FG004", message)]
    assert diags[0].pos is not None and diags[0].pos.line == _line_of(text, needle)


def _graph(**pool: Any) -> Graph:
    doc = doc_of("dpo")
    doc["resources"] = {"pools": {"trainer": {"size": 2, "models": ["policy", "ref"],
                                              **pool}}}
    return graph_from_yaml(yaml.safe_dump(doc, sort_keys=False), "g.yaml")


FULL = {"cpus": 4, "gpus": 1, "custom_resources": {"TPU": 1, "fast_disk": 0.5},
        "strategy": "strict_spread",
        "label_selector": {"ray.io/node-id": "abc123", "zone": "!in(a, b)"}}


def test_declared_resources_reach_the_plan_its_json_and_the_summary() -> None:
    plan = compile_graph(_graph(**FULL), target="ray", device="cuda").plan
    assert plan is not None
    pool = plan.pool("trainer")
    assert pool.bundles == (Bundle(4, 1, (Amount("TPU", 1.0), Amount("fast_disk", 0.5))),) * 2
    assert (pool.strategy, pool.label_selector) == (
        "strict_spread", (Label("ray.io/node-id", "abc123"), Label("zone", "!in(a, b)")))
    again = plan_from_json(plan_to_json(plan))
    assert (again.pools, again.resources) == (plan.pools, plan.resources)
    assert ("  trainer  2 worker(s) on cuda, each {CPU: 4, GPU: 1, TPU: 1, fast_disk: 0.5}, "
            "placed STRICT_SPREAD on nodes labelled {ray.io/node-id: abc123, zone: !in(a, b)}\n"
            in plan_summary(plan))


def test_a_graph_with_declared_resources_writes_back_equal() -> None:
    graph = _graph(**FULL)
    doc = graph_to_document(graph)
    assert doc["resources"] == {"pools": {"trainer": {"size": 2, "models": ["policy", "ref"],
                                                      **FULL}}}
    assert graph_from_yaml(yaml.safe_dump(doc), "g.yaml").resources == graph.resources


def test_the_schema_takes_every_pool_setting() -> None:
    doc = doc_of("dpo")
    doc["resources"] = {"pools": {"trainer": {"size": 2, "models": ["policy", "ref"], **FULL}}}
    jsonschema.validate(doc, graph_schema())
    doc["resources"]["pools"]["trainer"]["custom_resources"] = {"TPU": 0}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, graph_schema())


@pytest.mark.parametrize(("device", "gpus", "bundle"), [
    ("cuda", None, Bundle(1, 1)), ("cpu", None, Bundle(1, 0)), ("cuda", 2, Bundle(1, 2))])
def test_gpus_default_to_one_on_cuda(device: str, gpus: int | None, bundle: Bundle) -> None:
    plan = compile_graph(_graph(**({} if gpus is None else {"gpus": gpus})), target="ray",
                         device=device).plan
    assert plan is not None and plan.pool("trainer").bundles == (bundle, bundle)


@pytest.mark.parametrize(("device", "gpus", "severity", "message"), [
    ("cuda", 0, "error", "pool `trainer`'s workers run on cuda and "
     "resources.pools.trainer.gpus is 0: a worker without a GPU cannot run them"),
    ("cpu", 2, "warning", "pool `trainer` asks 2 GPU(s) per worker but the plan runs on cpu: "
     "Ray reserves them and nothing uses them"),
])
def test_gpus_that_do_not_fit_the_device_are_fg406(device: str, gpus: int, severity: str,
                                                  message: str) -> None:
    result = compile_graph(_graph(gpus=gpus), target="ray", device=device)
    found = [d for d in result.diagnostics if d.code == "FG406"]
    assert [(d.severity, d.message) for d in found] == [(severity, message)]
    assert found[0].pos is not None and found[0].pos.line > 0
    assert (result.plan is None) == (severity == "error")
