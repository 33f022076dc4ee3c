"""`flowgraph check --data`: open what a graph points at, when it is local.

Datasets: readable, with the columns their kind reads and the ground truth a node
reads; every prompt (and preference response) tokenized and measured against P and T
under the data node's `truncation` / `filter_overlong_prompts`; a chat template where
one is applied; enough rows for one batch; the columns a reward function called as TRL
calls one needs, among those of the rows reaching it (FG512, on its `def` line). Model
folders: a readable config, a tokenizer whose vocabulary fits the model's, tied or
untied embeddings (a note). Agent rollouts: the chat template renders an episode turn by
turn, extending the conversation as a prefix (FG606, the rollout's own probe).
A missing local file or folder is an error naming the path it resolved to
(`flowgraph.paths`); hub ids are skipped with a note. Diagnostics sit on the
data source's (or model's) `path` line.

The datasets are read, checked and tokenized by what the data sources themselves use
(`flowgraph.data`: readers, rows, rendering), so this module imports pyarrow; the
tokenizers are loaded by the caller's `load_tokenizer` (the entry points pass
`flowgraph.nodes.models.load_tokenizer`, which builds a built-in model's cache on first
use: torch). The CLI imports it only for `--data`, and `check` without it stays as fast
as it was.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Generator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from flowgraph.agent.render import ChatRenderer, TemplateError
from flowgraph.builtin_models import builtin_config
from flowgraph.checker.agents import offered_schemas
from flowgraph.checker.functions import called_functions
from flowgraph.checker.judges import probe_judges
from flowgraph.checker.routes import route_problems, row_source
from flowgraph.data.held import is_memory
from flowgraph.data.readers import open_table, with_prompt
from flowgraph.data.rendering import check_rendering, overlong, render_prompts, render_responses
from flowgraph.data.rows import (
    has_ground_truth,
    missing_ground_truth,
    missing_ground_truth_rows,
    row_problems,
    same_pairs,
)
from flowgraph.diagnostics import Diagnostic
from flowgraph.document import did_you_mean
from flowgraph.errors import FlowgraphError
from flowgraph.ir import DataSpec, Graph, ModelSpec, NodeSpec
from flowgraph.paths import RULE, is_hub_dataset, is_local, written_file
from flowgraph.registry import KindSpec, Registry
from flowgraph.runs import is_run_dir, trained_lm
from flowgraph.runtime.reward_call import TRL_NOT_COLUMNS, TRL_PASSES, unmet_parameters
from flowgraph.source import SourcePos

__all__ = ["LoadTokenizer", "check_data", "ground_truth_readers", "row_source",
           "unmet_columns"]


def ground_truth_readers(graph: Graph, data: str) -> tuple[str, ...]:
    """The nodes that need data source `data`'s ground truth (`Graph.readers`)."""
    return graph.readers(data, "ground_truth")


def _path_pos(pos: SourcePos) -> SourcePos:
    """Where `path:` is written in the entry that starts at `pos` (the entry's key); a
    graph built in Python: the line that declared the source."""
    if not pos.file.endswith((".yaml", ".yml")):
        return pos
    try:
        lines = Path(pos.file).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return pos
    for i in range(max(pos.line - 1, 0), min(pos.line + 8, len(lines))):
        col = lines[i].find("path:")
        if col >= 0:
            return SourcePos(pos.file, i + 1, col + 1)
    return pos


def _missing(what: str, path: str, pos: SourcePos, code: str, node: str) -> Diagnostic:
    """A local file or folder that is not there, by its resolved path (`flowgraph.paths`)."""
    return Diagnostic(code, "error", f"{what} `{path}` does not exist", pos, node=node,
                      hint=RULE)


def _skipped(what: str, path: str, pos: SourcePos) -> Diagnostic:
    return Diagnostic("FG509", "note", f"{what} `{path}` is not a local path (a hub id, or "
                      f"not on this machine): not checked", pos)


LoadTokenizer = Callable[[str], Any]
"""A model path's tokenizer (`flowgraph.nodes.models.load_tokenizer`); a FlowgraphError
saying why when it cannot be loaded."""


def check_data(graph: Graph, load_tokenizer: LoadTokenizer) -> list[Diagnostic]:
    """Every problem in the graph's local datasets and model folders; the tokenizers
    that measure the datasets are loaded by `load_tokenizer`."""
    diags: list[Diagnostic] = []
    tokenizers: dict[str, Any] = {}
    for m in graph.models:
        diags += _check_model(m, tokenizers, load_tokenizer)
    for d in graph.data:
        diags += _check_source(graph, d, tokenizers)
    for node in graph.nodes:
        diags += _check_agent_template(graph, node, tokenizers)
    return diags + probe_judges(graph, tokenizers)


def _check_agent_template(graph: Graph, node: NodeSpec, tokenizers: dict[str, Any]
                          ) -> list[Diagnostic]:
    """An agent rollout's chat template (its `chat_template`, else its model's tokenizer's)
    probed as the rollout will probe it when it starts (`ChatRenderer`): it must extend a
    conversation as a prefix, turn after turn, and show the tools the checker finds as
    `show_tools` says (FG606)."""
    kind = Registry.default().get(node.kind)
    tok = tokenizers.get(node.model or "")
    if kind is None or not kind.multi_turn or tok is None:
        return []
    given = node.params.find("chat_template")
    template = given.value if given is not None else None
    where = given.pos if given is not None else node.pos
    if isinstance(template, str) and template.endswith(".jinja"):
        path = Path(written_file(template, where))  # as the compiler writes it in the plan
        try:
            template = path.read_text()
        except OSError as exc:
            return [Diagnostic("FG606", "error", f"`{node.name}`: the chat template "
                               f"`{template}` cannot be read: {exc}", where, node=node.name,
                               hint=f"{RULE}; or give the template's text")]
    show = node.params.find("show_tools")
    try:
        ChatRenderer(tok, template if isinstance(template, str) else None,
                     offered_schemas(graph, node, kind),
                     show_tools=str(show.value) if show is not None else "template")
    except TemplateError as exc:
        whose = "its `chat_template`" if given is not None else \
            f"the chat template of model `{node.model}`'s tokenizer"
        return [Diagnostic("FG606", "error", f"`{node.name}` cannot render its episodes turn "
                           f"by turn with {whose}: {exc}", where, node=node.name)]
    except ValueError:  # a show_tools not of SHOW_TOOLS: FG112's
        return []
    return []


def _check_model(m: ModelSpec, tokenizers: dict[str, Any], load_tokenizer: LoadTokenizer
                 ) -> list[Diagnostic]:
    pos = _path_pos(m.pos)
    if is_run_dir(m.path):
        return _check_run_dir(m, tokenizers, load_tokenizer, pos)
    tok_path = m.tokenizer or m.path
    missing = next((p for p in (m.path, tok_path) if Path(p).is_absolute() and not is_local(p)),
                   None)
    if missing is not None:  # resolved to a local path, not kept as a hub id
        return [_missing(f"model `{m.name}`: folder", missing, pos, "FG506", m.name)]
    if not is_local(m.path) or not is_local(tok_path):
        return [_skipped(f"model `{m.name}`:", m.path if not is_local(m.path) else tok_path, pos)]
    builtin = builtin_config(m.path)
    config = dict(builtin) if builtin is not None else _read_config(m.path)
    if isinstance(config, str):
        return [Diagnostic("FG506", "error", f"model `{m.name}`: the config of `{m.path}` "
                           f"cannot be read: {config}", pos, node=m.name,
                           hint="point path at a folder saved with save_pretrained")]
    try:
        tokenizers[m.name] = tok = load_tokenizer(tok_path)
    except FlowgraphError as exc:
        return [Diagnostic("FG506", "error", f"model `{m.name}`: {exc}", pos, node=m.name)]
    diags = []
    vocab, words = int(config.get("vocab_size") or 0), len(tok)
    if words > vocab:
        diags.append(Diagnostic(
            "FG507", "error", f"model `{m.name}`: the tokenizer of `{tok_path}` has {words} "
            f"tokens, the model's vocabulary {vocab}: ids >= {vocab} index past the embedding",
            pos, node=m.name, expected=f"<= {vocab} tokens", actual=str(words),
            hint="use the tokenizer saved with this model, or resize its embeddings"))
    tied = bool(config.get("tie_word_embeddings", True))
    diags.append(Diagnostic("FG508", "note", f"model `{m.name}`: vocabulary {vocab}, tokenizer "
                            f"{words} tokens, input and output embeddings "
                            f"{'tied' if tied else 'untied'}", pos, node=m.name))
    return diags


def _check_run_dir(m: ModelSpec, tokenizers: dict[str, Any], load_tokenizer: LoadTokenizer,
                   pos: SourcePos) -> list[Diagnostic]:
    """A run dir as the model path: its trained causal LM is loaded from its newest
    checkpoint, whose config and tokenizer are those of the model it was trained from."""
    try:
        trained = trained_lm(m.path)
    except FlowgraphError as exc:
        return [Diagnostic("FG506", "error", f"model `{m.name}`: {exc}", pos, node=m.name)]
    base = replace(m, path=trained.path, tokenizer=m.tokenizer or trained.tokenizer)
    note = Diagnostic("FG513", "note", f"model `{m.name}`: `{m.path}` is a flowgraph run dir: "
                      f"its model `{trained.name}` loads from its newest checkpoint (trained "
                      f"from `{trained.path}`, checked here)", pos, node=m.name)
    return [note, *_check_model(base, tokenizers, load_tokenizer)]


def _read_config(path: str) -> dict[str, Any] | str:
    """The model folder's config fields, or why they cannot be read. A composite config
    (Gemma-3, the vision-language models) keeps its vocabulary in its text config."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        return str(exc).splitlines()[0]
    return {**config.to_dict(), "vocab_size": config.get_text_config().vocab_size}


def _data_model(graph: Graph, d: DataSpec) -> str | None:
    """The model whose tokenizer the executor gives the data source (as it chooses)."""
    for node in graph.nodes:
        if node.model and any(ref.node == d.name for _, ref in node.inputs):
            return node.model
    return graph.models[0].name if graph.models else None


def _check_source(graph: Graph, d: DataSpec, tokenizers: dict[str, Any]) -> list[Diagnostic]:
    pos = _path_pos(d.pos)
    params = d.params.to_python()
    paths = [d.path] + ([str(params["eval_path"])] if params.get("eval_path") else [])
    hub = [path for path in paths if is_hub_dataset(path)]
    if hub:
        return [_skipped(f"data source `{d.name}`: hub dataset", hub[0], pos)]
    missing = [_missing(f"data source `{d.name}`: dataset file", path, pos, "FG501", d.name)
               for path in paths if not is_local(path) and not is_memory(path)]
    if missing:
        return missing
    columns = [diag for path in paths for diag in _column_problems(graph, d, path)]
    columns += route_problems(graph, d)
    model = _data_model(graph, d)
    if model is None or model not in tokenizers:
        return [Diagnostic("FG509", "note", f"data source `{d.name}`: no local tokenizer to "
                           f"measure it with: not checked", pos, node=d.name), *columns]
    return [*(Diagnostic(code, sev, f"data source `{d.name}`: {msg}", pos, node=d.name,
                         hint=hint)
              for path in paths
              for code, sev, msg, hint in _dataset_problems(graph, d, path, tokenizers[model])),
            *columns]


def unmet_columns(graph: Graph) -> list[Diagnostic]:
    """FG512 and FG609 alone, on every local dataset (what `check --data` says of the
    columns a reward function called as TRL calls one needs, and of the rows an agent
    rollout routes to its `envs`): `flowgraph run` checks them before the models load, so
    that neither is the first batch's error. No tokenizer, no torch."""
    found = []
    for d in graph.data:
        params = d.params.to_python()
        paths = [d.path] + ([str(params["eval_path"])] if params.get("eval_path") else [])
        found += [diag for path in paths if is_memory(path) or is_local(path)
                  for diag in _column_problems(graph, d, path)]
        found += route_problems(graph, d)
    return found


def _column_problems(graph: Graph, d: DataSpec, path: str) -> list[Diagnostic]:
    """FG512 for each function a node calls as TRL calls reward_funcs, on the rows of `d`,
    that needs a column `path` lacks (TRL would raise a TypeError at the first batch); on
    the function's `def` line."""
    called = [c for c in called_functions(graph, Registry.default())
              if c.style.reads and row_source(graph, c.node, c.style.reads) == d.name]
    if not called:
        return []
    params = d.params.to_python()
    try:
        table = open_table(path, str(params.get("format", "auto")), [])
    except FlowgraphError:
        return []  # the dataset's own check says why
    prompt_key = str(params.get("prompt_key", "prompt"))
    columns = [c for c in table.column_names if c != prompt_key and c not in TRL_NOT_COLUMNS]
    diags = []
    for c in called:
        for name in unmet_parameters(c.fn, columns):
            data = (f"dataset `{path}` (data source `{d.name}`, columns "
                    f"{', '.join(table.column_names)})")
            why = (f"a column of {data} that TRL does not pass as a keyword (the prompt "
                   f"reaches a reward function as `prompts`; `completion` and "
                   f"`completion_ids` columns are dropped)" if name in table.column_names
                   else f"which is no column of {data}")
            diags.append(Diagnostic(
                "FG512", "error", f"reward fn `{c.label}` of `{c.node.name}` needs `{name}`, "
                f"{why}: called as TRL calls reward_funcs, it would raise a TypeError at the "
                f"first batch", c.pos,
                node=c.node.name,
                hint=f"{_guess(name, columns)}; or give `{name}` a default, or take "
                     f"**kwargs and read what is there"))
    return diags


def _guess(name: str, columns: list[str]) -> str:
    """A column close to `name`, else a keyword TRL passes that is a near miss
    (`prompt` for `prompts`), else the columns."""
    guess = did_you_mean(name, columns) if columns else ""
    if guess.startswith("did you mean"):
        return guess
    keyword = difflib.get_close_matches(name, TRL_PASSES, n=1, cutoff=0.85)
    if keyword:
        return f"did you mean `{keyword[0]}` (TRL passes it itself)?"
    return (f"name one of the columns the function is given ({', '.join(columns)})"
            if columns else "the dataset has no column besides its prompt")


Problem = tuple[str, str, str, str | None]
"""(code, severity, message, hint)."""


def response_columns(kind: KindSpec) -> list[str]:
    """The columns of response tokens a data kind reads: its token outputs with a mask
    of their own (`chosen` + `chosen_mask`), read from the column of that name."""
    names = {p.name for p in kind.outputs}
    return [p.name for p in kind.outputs if f"{p.name}_mask" in names]


def _limits(graph: Graph, d: DataSpec, kind: KindSpec) -> dict[str, tuple[str, int | None]]:
    """Column -> (the param that limits it, the limit), as the executor sets them: the
    prompt column first."""
    params, dims = d.params.to_python(), graph.dim_values()

    def limit(name: str, dim: str) -> tuple[str, int | None]:
        value = params.get(name, dims.get(dim))
        return name, value if isinstance(value, int) else None

    return {str(params.get("prompt_key", "prompt")): limit("max_prompt_length", "P"),
            **{c: limit("max_response_length", "T") for c in response_columns(kind)}}


def _dataset_problems(graph: Graph, d: DataSpec, path: str, tok: Any) -> Iterator[Problem]:
    params = d.params.to_python()
    kind = Registry.default().get(d.kind)
    if kind is None:  # a plugin's data kind the CLI did not load
        yield "FG509", "note", f"kind `{d.kind}` is not registered here: not checked", None
        return
    limits = _limits(graph, d, kind)
    responses = response_columns(kind)
    template = next(p for p in kind.params if p.name == "apply_chat_template")
    chat = params.get("apply_chat_template", template.default)
    assert chat is None or isinstance(chat, bool)
    prompt_key = next(iter(limits))
    pairs = len(responses) > 1  # TRL's implicit prompt: the pair's shared messages
    required = [c for c in limits if not (pairs and c == prompt_key)]
    try:
        table = open_table(path, str(params.get("format", "auto")), required)
        table = with_prompt(path, table) if pairs else table
    except FlowgraphError as exc:
        yield "FG501", "error", str(exc), None
        return
    malformed = row_problems(path, table, prompt_key, responses)
    for message in malformed:
        yield "FG510", "error", message, "fix or drop the row in the file"
    if malformed:
        return  # rendering such a row would fail: nothing more to measure
    gives_truth = any(p.name == "ground_truth" for p in kind.outputs)
    readers = ground_truth_readers(graph, d.name) if gives_truth else ()
    if readers and not has_ground_truth(table):
        yield "FG502", "error", missing_ground_truth(path, table.column_names, readers), None
    gap = missing_ground_truth_rows(path, table, readers)
    if gap is not None:
        yield "FG502", "error", gap, None
    yield from _pair_problems(path, table, responses)
    try:
        check_rendering(tok, chat, table, prompt_key, path)
    except FlowgraphError as exc:
        yield "FG504", "error", str(exc), None
        return
    # Pairs render a raw prompt without special tokens, as TRL's `tokenize_row`.
    dropped = yield from _length_problems(path, table, limits, prompt_key, chat,
                                          not responses, tok, params)
    rows, batch = table.num_rows - dropped, graph.dim_values().get("Bp")
    if isinstance(batch, int) and rows < batch:
        yield ("FG505", "error", f"dataset `{path}` has {rows} rows"
               f"{f' after filtering {dropped}' if dropped else ''}, fewer than one batch "
               f"(Bp = {batch})", "add rows, or lower dims.Bp")


def _pair_problems(path: str, table: Any, responses: list[str]) -> Iterator[Problem]:
    """FG511 for preference pairs DPO learns nothing from: equal or empty responses."""
    if len(responses) < 2:
        return
    same, empty = same_pairs(table, responses)
    for rows, what in ((same, "identical responses (chosen == rejected)"),
                       (empty, "an empty response")):
        if rows:
            yield ("FG511", "warning", f"dataset `{path}`: {len(rows)} of {table.num_rows} "
                   f"pairs have {what}, the first row {rows[0]} (0-based); DPO learns "
                   f"nothing from them (their loss stays log 2)", "drop or fix those rows")


def _length_problems(path: str, table: Any, limits: dict[str, tuple[str, int | None]],
                     prompt_key: str, chat: bool | None, special_tokens: bool, tok: Any,
                     params: dict[str, object]) -> Generator[Problem, None, int]:
    """FG503 for the rows over P or T under the data node's policy; returns how many
    rows `filter_overlong_prompts` drops. Prompts are measured as the dataset renders
    them (`special_tokens`: false for preference prompts, as TRL)."""
    found = []
    for column, (name, limit) in limits.items():
        if limit is None:
            continue
        values = table.column(column).to_pylist()
        seqs = (render_prompts(tok, values, chat, special_tokens)
                if column == prompt_key else render_responses(tok, values))
        over = overlong("prompt" if column == prompt_key else column, name, limit, seqs)
        if over is not None:
            found.append(over)
    if not found:
        return 0
    if params.get("filter_overlong_prompts"):
        dropped = len({r for o in found for r in o.rows})
        yield ("FG503", "note", f"dataset `{path}`: filter_overlong_prompts drops {dropped} "
               f"of {table.num_rows} rows over their length limit", None)
        return dropped
    truncation = str(params.get("truncation", "error"))
    for o in found:
        if truncation == "error":
            yield "FG503", "error", o.message(path, table.num_rows), None
        else:
            yield ("FG503", "warning", f"dataset `{path}`: {len(o.rows)} of {table.num_rows} "
                   f"rows have a {o.what} over {o.limit_name} {o.limit} (the longest "
                   f"{max(o.lengths)} tokens), truncated ({truncation})", None)
    return 0
