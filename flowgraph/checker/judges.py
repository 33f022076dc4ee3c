"""Judges (`judge`, a model scoring responses): what must hold before one can run (FG611).

Read from the kind's params, never from its name:
* a format-string param (`ParamSpec.fields`, the rubric `template`) names only its
  fields, and each field's input port is wired (`{ground_truth}` reads `ground_truth`);
* a param naming a model (`ParamSpec.names_model`, `policy`) names one of the graph's;
* a param standing in for the model (`ParamSpec.instead_of_model`, `url`): the node
  binds a model or sets it, not both, not neither.

`check --data` then probes the judge itself (`flowgraph.checker.data`): the judge model's
tokenizer renders the template, or the url answers one request.
"""

from __future__ import annotations

import os
from string import Formatter
from typing import Any

from flowgraph.checker.structure import Resolved
from flowgraph.diagnostics import Diagnostic, error
from flowgraph.document import did_you_mean
from flowgraph.ir import Graph, NodeSpec
from flowgraph.registry import Registry
from flowgraph.source import SourcePos

__all__ = ["check_judges", "probe_judges", "template_fields"]


def template_fields(template: str) -> list[str]:
    """The field names a format string fills, in order (ValueError when malformed)."""
    return [name for _, name, _, _ in Formatter().parse(template) if name is not None]


def check_judges(graph: Graph, table: dict[str, Resolved], out: list[Diagnostic]) -> None:
    models = [m.name for m in graph.models]
    for r in table.values():
        if r.kind is None or not isinstance(r.spec, NodeSpec):
            continue
        for spec in r.kind.params:
            given = r.spec.params.find(spec.name)
            value = given.value if given is not None else spec.default
            where = given.pos if given is not None else r.pos
            if spec.fields and isinstance(value, str):
                _check_fields(r.spec, spec.name, value, dict(spec.fields), where, out)
            if spec.names_model and isinstance(value, str) and value not in models:
                out.append(error("FG611", f"`{r.name}`: `{spec.name}` names model `{value}`, "
                                 "which the graph does not declare", where, node=r.name,
                                 hint=did_you_mean(value, models) if models else
                                 "declare the model under models:"))
            if spec.instead_of_model and (value is None) == (r.spec.model is None):
                both = "both a model and" if value is not None else "neither a model nor"
                out.append(error("FG611", f"`{r.name}` (kind {r.kind.name}) has {both} "
                                 f"`{spec.name}`: it needs exactly one", where, node=r.name,
                                 hint=f"bind the judge model (`model: judge`) or set "
                                      f"`{spec.name}`"))


def _check_fields(node: NodeSpec, param: str, template: str, ports: dict[str, str],
                  where: SourcePos | None, out: list[Diagnostic]) -> None:
    try:
        named = template_fields(template)
    except ValueError as exc:
        out.append(error("FG611", f"`{node.name}`: `{param}` is not a format string: {exc}",
                         where, node=node.name, hint="write a literal brace as {{ or }}"))
        return
    for field in dict.fromkeys(named):
        port = ports.get(field)
        if port is None:
            out.append(error("FG611", f"`{node.name}`: `{param}` names the field {{{field}}}, "
                             "which does not exist", where, node=node.name,
                             expected=", ".join(f"{{{f}}}" for f in ports), actual=field,
                             hint=did_you_mean(field, list(ports))))
        elif node.input(port) is None:
            out.append(error("FG611", f"`{node.name}`: `{param}` names {{{field}}}, but its "
                             f"input `{port}` is not wired", where, node=node.name,
                             hint=f"wire `{port}` (e.g. gen.{port}) or drop {{{field}}}"))


def probe_judges(graph: Graph, tokenizers: dict[str, Any]) -> list[Diagnostic]:
    """`check --data`: each judge answers a probe. A url gets one chat completion of the
    template filled with placeholder text (its `api_key_env` read as the run reads it);
    a judge model's tokenizer renders that text as the run will (its chat template)."""
    out: list[Diagnostic] = []
    for node in graph.nodes:
        spec = Registry.default().get(node.kind)
        url = next((p for p in spec.params if p.instead_of_model), None) if spec else None
        if spec is None or url is None:
            continue
        given = node.params.find(url.name)
        text = "Task: probe\nAnswer: probe\nScore: 0"
        if given is not None and isinstance(given.value, str):
            problem = _ask(given.value, text, node.params.to_python())
            where = f"the judge server {given.value}"
        else:
            problem = _render(tokenizers.get(node.model or ""), text)
            where = f"model `{node.model}`'s tokenizer"
        if problem:
            out.append(error("FG611", f"`{node.name}`: {where} does not answer a probe: "
                             f"{problem}", given.pos if given else node.pos, node=node.name,
                             hint="start the server, check the URL and key, or fix the "
                                  "model's chat template"))
    return out


def _ask(url: str, text: str, params: dict[str, Any]) -> str | None:
    import httpx

    key = params.get("api_key_env")
    if isinstance(key, str) and not os.environ.get(key):
        return f"api_key_env names `{key}`, which is not set in the environment"
    headers = {"Authorization": f"Bearer {os.environ[key]}"} if isinstance(key, str) else {}
    body = {"model": params.get("api_model") or "judge", "max_tokens": 8, "temperature": 0.0,
            "messages": [{"role": "user", "content": text}]}
    try:
        got = httpx.post(url.rstrip("/") + "/chat/completions", json=body, headers=headers,
                         timeout=float(params.get("request_timeout_s", 60.0)))
        got.raise_for_status()
        got.json()["choices"][0]["message"]["content"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _render(tok: Any, text: str) -> str | None:
    if tok is None or not getattr(tok, "chat_template", None):
        return None  # no tokenizer here (a hub id, said by FG509), or raw text
    try:
        tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                add_generation_prompt=True)
    except Exception as exc:  # a template's own error: whatever jinja raises
        return f"{type(exc).__name__}: {exc}"
    return None
