"""Record TRL 1.16's GRPOConfig field defaults for tests/core/test_trl_names.py.

    /work/benchvenv/bin/python scripts/trl_names_fixture.py   # TRL's venv, not flowgraph's

Writes tests/fixtures/trl/grpo_config_defaults.json: every GRPOConfig field (its own and
those inherited from transformers' TrainingArguments) -> `str` of its default, read from
the dataclass declaration (building a GRPOConfig checks the machine: bf16 needs a GPU),
and the arguments of GRPOTrainer (`peft_config` is one).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import transformers
import trl
from trl import GRPOConfig, GRPOTrainer

OUT = (Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "trl"
       / "grpo_config_defaults.json")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return str(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return str(f.default_factory())
    return "(required)"


def main() -> None:
    fields = {f.name: _default(f) for f in dataclasses.fields(GRPOConfig)}
    record = {"trl": trl.__version__, "transformers": transformers.__version__,
              "defaults": dict(sorted(fields.items())),
              "trainer_args": list(inspect.signature(GRPOTrainer.__init__).parameters)[1:]}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{len(fields)} fields -> {OUT}")


if __name__ == "__main__":
    main()
