"""Handing a model on (issue #26, point 4): `flowgraph.export` is public and writes a
model card (the graph, the data, the metrics, the step, how to load it), as the CLI
does; a run dir given as a model path loads its newest checkpoint's model, saying so,
and `check --data` accepts it; where a run dir cannot be loaded, the message says how
to export it."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

import flowgraph
from flowgraph.errors import FlowgraphError

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"
SFT = ("trainer.steps=2", "dims.Bp=4", "nodes.update.params.mini_batch_size=4")
GRPO = ("trainer.steps=1", "dims.Bp=2", "dims.N=2", "nodes.update_actor.params.mini_batch_size=4",
        "trainer.val_before_train=false", "trainer.eval_every=0")


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("sft") / "run"
    flowgraph.run(GRAPHS / "sft.yaml", overrides=SFT, run_dir=run_dir, tensorboard=False,
                  out=io.StringIO())
    return run_dir


def test_export_writes_a_loadable_model_and_its_card(sft_run: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    from transformers import AutoModelForCausalLM

    from flowgraph.cli import main

    out = flowgraph.export(sft_run, model="policy", out=tmp_path / "hf")
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == 512
    card = (out / "README.md").read_text()
    assert card.startswith("# `policy` of the flowgraph run `sft`\n")
    assert f"exported from checkpoint step 1 of the run dir `{sft_run}`" in card
    assert "- `train`: sft, `builtin:reverse`" in card
    assert "## Metrics at step 1\n\n| metric | value |" in card
    assert 'AutoModelForCausalLM.from_pretrained("<this folder>")' in card
    assert "```yaml\nversion: 1\nname: sft\n" in card and "kind: sft_update" in card
    with pytest.raises(FlowgraphError, match="is not empty; export into a new folder, or "
                                             "pass force=True"):
        flowgraph.export(sft_run, model="policy", out=out)
    assert main(["export", str(sft_run), "--model", "policy", "-o", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "README.md").read_text() == card
    assert main(["export", str(sft_run), "--model", "policy", "-o", str(out)]) == 2
    assert "or pass --force to write over its files" in capsys.readouterr().err


def test_a_run_dir_as_a_model_path_loads_its_newest_checkpoint(sft_run: Path,
                                                              tmp_path: Path) -> None:
    from safetensors.torch import load_file

    models = (f"models.actor.path={sft_run}", f"models.ref.path={sft_run}")
    check = flowgraph.check(GRAPHS / "grpo.yaml", overrides=[*GRPO, *models], data=True)
    assert check.ok, str(check)
    notes = [d.message for d in check.diagnostics if d.code == "FG513"]
    assert notes and notes[0] == (f"model `actor`: `{sft_run}` is a flowgraph run dir: its "
                                  "model `policy` loads from its newest checkpoint (trained "
                                  "from `builtin:tiny-lm`, checked here)")
    said = io.StringIO()
    run = flowgraph.run(GRAPHS / "grpo.yaml", overrides=[*GRPO, *models],
                        run_dir=tmp_path / "grpo", tensorboard=False, out=said)
    assert [r["step"] for r in run.rows] == [0]
    exported = sft_run / "export" / "policy-step_1"
    assert (f"model path `{sft_run}` is a flowgraph run dir: loading its model `policy` from "
            f"checkpoint step 1 (exported to `{exported}`)") in said.getvalue()
    trained = load_file(sft_run / "checkpoints" / "step_1" / "model.policy.safetensors")
    loaded = load_file(exported / "model.safetensors")
    name = next(k for k in trained if k.endswith("embed_tokens.weight"))
    assert torch.equal(trained[name], loaded[name])


def test_where_a_run_dir_cannot_be_loaded_the_message_says_how_to_export(sft_run: Path
                                                                         ) -> None:
    from flowgraph.nodes.models import load_tokenizer

    with pytest.raises(FlowgraphError) as exc:
        load_tokenizer(str(sft_run))
    assert str(exc.value) == (
        f"`{sft_run}` is a flowgraph run dir, not a model folder (a run loads its newest "
        f"checkpoint's model); here, export it and give that folder: flowgraph export "
        f"{sft_run} --model policy -o policy-hf")
