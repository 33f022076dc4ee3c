"""`flowgraph export`: a trained model from a run's checkpoint as a Hugging Face folder.

The run dir holds `plan.json` (the graph, so the model's source path and dtype are
known) and `checkpoints/step_N/model.<name>.safetensors` — or, from the fsdp and ray targets,
`checkpoints/step_N/dcp/<name>/`, every worker's shards, read back whole here in one
process. The model is rebuilt from its source, the checkpoint's weights are loaded,
and `save_pretrained` writes weights and tokenizer, loadable with
`AutoModelForCausalLM.from_pretrained(DIR)`. A LoRA model's checkpoint holds its
adapters only: they go on a fresh copy of the base (peft's `get_peft_model`, the module
names training used) and are merged into it (`merge_and_unload`), or written alone
(`--adapter-only`: `PeftModel.from_pretrained(base, DIR)` loads them). Beside them a
model card, `README.md`: the graph, its data sources, the checkpoint's step and the
run's final metrics, and how to load the folder (`model_card`).

A run dir given as a model path (`models.actor.path: runs/sft`) is exported here too,
once per checkpoint, into `RUN_DIR/export/<model>-step_N` (`from_run_dirs`). A model
that starts from another run's (`models.<m>.init_from`) takes that run's weights straight
into the model its worker built, before it is sharded (`load_from_run`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from torch import nn

from flowgraph.compilers.build import lora_config
from flowgraph.compilers.checkpoint.integrity import checkpoint_damage, load_tensors
from flowgraph.compilers.checkpoint.store import (
    DCP_DIR,
    TrainedPart,
    dcp_full_model,
    dcp_whole,
    has_dcp,
    intact_checkpoint,
    latest_checkpoint,
    mismatch,
)
from flowgraph.errors import FlowgraphError, UsageError
from flowgraph.ir import ModelSpec
from flowgraph.plan import ExecutionPlan, plan_document, plan_from_json
from flowgraph.runs import checkpoint_root, export_command, is_run_dir, trained_lm
from flowgraph.spelling import Word, option


def export_model(run_dir: Path, model: str, out: Path, *, step: int | None = None,
                 force: bool = False, adapter_only: bool = False) -> Path:
    """Write model `model` of the run's latest (or `step`'s) checkpoint to `out`, a new
    or empty folder (`force`: write over what is there). A LoRA model is written merged
    (a plain Hugging Face model), or with `adapter_only` as its peft adapter alone."""
    from flowgraph.nodes.models import load_model, load_tokenizer

    plan, spec = _trained_lm(run_dir, model, adapter_only)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UsageError(f"`{out}` is not empty; export into a new folder, or pass "
                         f"{option('force')} to write over its files")
    step, folder = _checkpoint(run_dir, step)
    sharded = has_dcp(folder)  # written by the fsdp or ray target
    weights = (folder / DCP_DIR / model / ".metadata" if sharded
               else folder / f"model.{model}.safetensors")
    if not weights.exists():
        raise FlowgraphError(f"checkpoint `{folder}` holds no weights for `{model}`")
    lm = load_model(spec.path, trainable=True)  # what a checkpoint holds: the trained part
    peft_model = None
    if spec.lora is not None:  # peft's own wrapper, around the same module names
        from peft import get_peft_model

        peft_model = get_peft_model(lm, lora_config(spec.lora))
        lm = peft_model.base_model.model
    if sharded:
        dcp_full_model(folder, model, lm)
    else:
        TrainedPart(lm).load_state_dict(load_tensors(weights))
    out.mkdir(parents=True, exist_ok=True)
    if peft_model is not None and adapter_only:
        peft_model.save_pretrained(out)
    else:
        (peft_model.merge_and_unload() if peft_model is not None else lm).save_pretrained(out)
    load_tokenizer(spec.tokenizer or spec.path).save_pretrained(out)
    card = model_card(plan, spec, run_dir, step, adapter_only=peft_model is not None
                      and adapter_only)
    (out / "README.md").write_text(card, encoding="utf-8")
    return out


def model_card(plan: ExecutionPlan, spec: ModelSpec, run_dir: Path, step: int, *,
               adapter_only: bool = False) -> str:
    """The exported folder's README.md: what the model is, what trained it (the graph,
    its data sources), the checkpoint's step and the run's metrics there, how to load it."""
    weights = ("its LoRA adapter" if adapter_only else
               "LoRA merged into the base" if spec.lora is not None else "full weights")
    lines = [f"# `{spec.name}` of the flowgraph run `{plan.name}`", "",
             f"Model `{spec.name}` ({weights}), trained from `{spec.path}` by the graph "
             f"`{plan.name}` (`{plan.source}`), exported from checkpoint step {step} of the "
             f"run dir `{run_dir}`.", "", "## Data", ""]
    lines += [f"- `{d.name}`: {d.kind}, `{d.path}`" for d in plan.data]
    lines += ["", f"## Metrics at step {step}", "", *_metrics_table(run_dir, step)]
    lines += ["", "## Load it", "", "```python", _LOAD_ADAPTER.format(base=spec.path)
              if adapter_only else _LOAD, "```", ""]
    lines += ["## The graph", "", "```yaml", _yaml(plan_document(plan)), "```", ""]
    return "\n".join(lines)


_LOAD = """from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("<this folder>")
tokenizer = AutoTokenizer.from_pretrained("<this folder>")"""
_LOAD_ADAPTER = """from peft import PeftModel
from transformers import AutoModelForCausalLM
base = AutoModelForCausalLM.from_pretrained("{base}")
model = PeftModel.from_pretrained(base, "<this folder>")"""


def _metrics_table(run_dir: Path, step: int) -> list[str]:
    """The run's metrics row of `step` (else its last) as a Markdown table, without the
    timings."""
    rows = [json.loads(line) for line in _lines(run_dir / "metrics.jsonl")]
    row = next((r for r in reversed(rows) if r.get("step") == step), rows[-1] if rows else {})
    shown = {k: v for k, v in sorted(row.items()) if k != "step" and isinstance(v, (int, float))
             and not k.startswith(("timing_s/", "phase_s/", "perf/"))}
    if not shown:
        return ["(the run dir holds no metrics for this step)"]
    return ["| metric | value |", "|---|---|", *(f"| `{k}` | {v:.6g} |" for k, v in shown.items())]


def _yaml(document: dict[str, object]) -> str:
    import yaml

    return str(yaml.safe_dump(document, sort_keys=False, default_flow_style=None,
                              width=100)).rstrip()


def _lines(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def from_run_dirs(plan: ExecutionPlan, out: TextIO | None = None) -> ExecutionPlan:
    """`plan` with every model (and tokenizer) path that is a flowgraph run dir replaced
    by the folder its trained causal LM is exported to from its newest intact checkpoint
    (`RUN_DIR/export/<model>-step_N`, written once); each such load is said on `out`."""
    def folder(path: str | None) -> str | None:
        return _exported(path, out) if path is not None and is_run_dir(path) else path

    models = tuple(replace(m, path=folder(m.path) or m.path, tokenizer=folder(m.tokenizer))
                   for m in plan.models)
    if models == plan.models:
        return plan
    return plan.with_models(models)


def _exported(run_dir: str, out: TextIO | None) -> str:
    """The folder model path `run_dir` (a run dir) loads from: its one trained causal
    LM at its newest intact checkpoint, exported there the first time."""
    spec = trained_lm(run_dir)
    say = out or sys.stdout
    found = intact_checkpoint(Path(run_dir), lambda line: print(line, file=say))
    if found is None:
        raise FlowgraphError(f"model path `{run_dir}` is a flowgraph run dir with no "
                             "checkpoint yet: train it first (or give a model folder)")
    step = found[0]
    target = Path(run_dir) / "export" / f"{spec.name}-step_{step}"
    if not (target / "config.json").exists():
        target.parent.mkdir(exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            export_model(Path(run_dir), spec.name, tmp, step=step, force=True)
            os.rename(tmp, target)  # atomic; another process may have published it first
        except OSError as exc:
            if not (target / "config.json").exists():
                raise FlowgraphError(f"cannot export model `{spec.name}` of `{run_dir}` "
                                     f"into `{target}`: {exc.strerror or exc}; export it "
                                     f"yourself: {export_command(run_dir, spec.name)}, and "
                                     "give that folder") from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"model path `{run_dir}` is a flowgraph run dir: loading its model `{spec.name}` "
          f"from checkpoint step {step} (exported to `{target}`)", file=say, flush=True)
    return str(target)


def _trained_lm(run_dir: Path, model: str, adapter_only: bool
                ) -> tuple[ExecutionPlan, ModelSpec]:
    """The spec of `model`, a trained causal LM of the run (with LoRA for
    `adapter_only`)."""
    plan_file = run_dir / "plan.json"
    if not plan_file.exists():
        raise UsageError(f"`{run_dir}` is not a flowgraph run dir (no plan.json)")
    plan = plan_from_json(plan_file.read_text())
    spec = next((m for m in plan.models if m.name == model), None)
    if spec is None:
        names = ", ".join(m.name for m in plan.models)
        raise UsageError(f"the run has no model `{model}`; its models: {names}")
    heads = {m.name: m.head for p in plan.pools for m in p.models}
    if heads.get(model) != "lm":
        raise UsageError(f"model `{model}` is not a causal LM (a critic or reward model); "
                             "only causal LMs export as Hugging Face models")
    if not spec.trainable:
        raise UsageError(f"model `{model}` is frozen (not trainable): checkpoints do not "
                             f"hold it, its weights are those of `{spec.path}`")
    if adapter_only and spec.lora is None:
        raise UsageError(f"model `{model}` has no LoRA adapter (no `lora` in its "
                         f"spec): export it without {option('adapter_only')}")
    return plan, spec


def _checkpoint(run_dir: Path, step: int | None) -> tuple[int, Path]:
    """The checkpoint of `step` (None: the newest), its files verified."""
    if step is None:
        found = latest_checkpoint(run_dir)
        if found is None:
            raise FlowgraphError(f"`{run_dir}` holds no checkpoint yet")
        step = found[0]
    folder = checkpoint_root(run_dir) / f"step_{step}"
    if not folder.is_dir():
        raise UsageError(f"no checkpoint for step {step} in `{run_dir}`")
    problem = checkpoint_damage(folder, step)
    if problem is not None:
        raise FlowgraphError(f"checkpoint `{folder}` is damaged: {problem}; export another "
                             f"step ({option('step', Word('N'))})")
    return step, folder


def load_from_run(run_dir: Path, name: str, model: nn.Module) -> int:
    """Model `name`'s weights from the newest intact checkpoint of the run in `run_dir`
    into `model` (built from its base, before it is sharded): what a graph's
    `models.<m>.init_from` starts from. A checkpoint of any target (whole tensors or DCP
    shards) loads; returns its step. A trained model's checkpoint holds every weight (a
    LoRA model's: its adapters), which a frozen model takes too."""
    found = intact_checkpoint(run_dir, lambda line: None)
    if found is None:
        raise FlowgraphError(f"`{run_dir}` holds no checkpoint to start model `{name}` from: "
                             "train it first (init_from)")
    step, folder = found
    lora = any("lora_" in k for k in model.state_dict())
    part: Any = TrainedPart(model) if lora else model
    if has_dcp(folder):
        weights = dcp_whole(folder, name, part.state_dict())
    else:
        file = folder / f"model.{name}.safetensors"
        if not file.exists():
            raise FlowgraphError(f"checkpoint `{folder}` holds no weights of model `{name}` "
                                 "(a frozen model is never saved): name a trained model of "
                                 "that run (init_from_model)")
        weights = load_tensors(file)
    try:
        if lora:
            TrainedPart(model).load_state_dict(weights)
        else:  # every weight, frozen or not
            missing, unexpected = model.load_state_dict(weights, strict=False)
            if missing or unexpected:
                raise FlowgraphError(mismatch(sorted(missing), sorted(unexpected)))
    except FlowgraphError as exc:
        raise FlowgraphError(f"model `{name}` of checkpoint `{folder}`: {exc}") from None
    return step
