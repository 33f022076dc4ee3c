"""`flowgraph export`: a trained model from a run's checkpoint as a Hugging Face folder.

The run dir holds `plan.json` (the graph, so the model's source path and dtype are
known) and `checkpoints/step_N/model.<name>.safetensors` — or, from the fsdp and ray targets,
`checkpoints/step_N/dcp/<name>/`, every worker's shards, read back whole here in one
process. The model is rebuilt from its source, the checkpoint's weights are loaded,
and `save_pretrained` writes weights and tokenizer, loadable with
`AutoModelForCausalLM.from_pretrained(DIR)`. A LoRA model's checkpoint holds its
adapters only: they go on a fresh copy of the base (peft's `get_peft_model`, the module
names training used) and are merged into it (`merge_and_unload`), or written alone
(`--adapter-only`: `PeftModel.from_pretrained(base, DIR)` loads them).
"""

from __future__ import annotations

from pathlib import Path

from flowgraph.compilers.build import lora_config
from flowgraph.compilers.checkpoint import (
    DCP_DIR,
    TrainedPart,
    checkpoint_root,
    dcp_full_model,
    has_dcp,
    latest_checkpoint,
)
from flowgraph.compilers.integrity import checkpoint_damage, load_tensors
from flowgraph.errors import FlowgraphError, UsageError
from flowgraph.ir import ModelSpec
from flowgraph.plan import ExecutionPlan


def export_model(run_dir: Path, model: str, out: Path, *, step: int | None = None,
                 force: bool = False, adapter_only: bool = False) -> Path:
    """Write model `model` of the run's latest (or `step`'s) checkpoint to `out`, a new
    or empty folder (`force`: write over what is there). A LoRA model is written merged
    (a plain Hugging Face model), or with `adapter_only` as its peft adapter alone."""
    from flowgraph.nodes.models import load_model, load_tokenizer

    spec = _trained_lm(run_dir, model, adapter_only)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UsageError(f"`{out}` is not empty; export into a new folder, or pass "
                             "--force to write over its files")
    folder = _checkpoint(run_dir, step)
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
    return out


def _trained_lm(run_dir: Path, model: str, adapter_only: bool) -> ModelSpec:
    """The spec of `model`, a trained causal LM of the run (with LoRA for
    `adapter_only`)."""
    plan_file = run_dir / "plan.json"
    if not plan_file.exists():
        raise UsageError(f"`{run_dir}` is not a flowgraph run dir (no plan.json)")
    plan = ExecutionPlan.from_json(plan_file.read_text())
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
                             "spec): export it without --adapter-only")
    return spec


def _checkpoint(run_dir: Path, step: int | None) -> Path:
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
                             "step (--step N)")
    return folder
