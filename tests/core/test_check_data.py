"""`flowgraph check --data`: datasets and model folders opened before launch."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flowgraph.cli import main
from flowgraph.errors import FlowgraphError

ROOT = Path(__file__).resolve().parents[2]
GRPO = (ROOT / "graphs" / "grpo.yaml").read_text()


def _graph(tmp_path: Path, data: str = '{kind: prompts, path: "builtin:reverse"}',
           actor: str = '"builtin:tiny-lm-sft"') -> str:
    text = GRPO.replace('train: {kind: prompts, path: "builtin:reverse"}', f"train: {data}")
    text = text.replace('    path: "builtin:tiny-lm-sft"\n', f"    path: {actor}\n", 1)
    path = tmp_path / "g.yaml"
    path.write_text(text)
    return str(path)


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _diags(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[dict[str, Any]]]:
    status = main(["check", *args, "--data", "--format", "json"])
    return status, json.loads(capsys.readouterr().out)


def _line_of(file: str, needle: str) -> int:
    return next(i for i, line in enumerate(Path(file).read_text().splitlines(), 1)
                if needle in line)


# Chat-rendered, `<|user|>` + text + `<|assistant|>`: 2 + one token per digit or operator.
LONG = "1234567890+1234567890="  # 24 tokens, over grpo's P = 16
ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": LONG, "answer": "0"}]


def test_a_dataset_without_ground_truth_too_long_and_too_short(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _jsonl(tmp_path / "q.jsonl", ROWS)
    graph = _graph(tmp_path, f"{{kind: prompts, path: {data}, apply_chat_template: true}}")
    status, diags = _diags(capsys, graph)
    assert status == 1
    by_code = {d["code"]: d for d in diags}
    assert by_code["FG502"]["severity"] == "error"
    for needle in ("q.jsonl", "`reward`", "columns: prompt, answer"):
        assert needle in by_code["FG502"]["message"]
    for needle in ("q.jsonl` row 1 (0-based)", "24 tokens", "max_prompt_length 16",
                   "truncation: left"):
        assert needle in by_code["FG503"]["message"]
    assert "2 rows, fewer than one batch (Bp = 16)" in by_code["FG505"]["message"]
    assert {d["line"] for d in diags if d["code"].startswith("FG50")} >= {
        _line_of(graph, "train: {kind: prompts")}


@pytest.mark.parametrize(("policy", "severity", "needle"), [
    ("filter_overlong_prompts: true", "note", "drops 1 of 2 rows"),
    ("truncation: left", "warning", "1 of 2 rows have a prompt over max_prompt_length 16"),
])
def test_the_length_report_follows_the_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], policy: str, severity: str, needle: str
) -> None:
    rows = [{**r, "ground_truth": r["answer"]} for r in ROWS * 16]  # 16 rows fit: Bp = 16
    data = _jsonl(tmp_path / "q.jsonl", rows)
    status, diags = _diags(capsys, _graph(tmp_path, f"{{kind: prompts, path: {data}, {policy}}}"))
    over = [d for d in diags if d["code"] == "FG503"]
    assert status == 0
    assert [d["severity"] for d in over] == [severity]
    assert needle.replace("2 rows", "32 rows").replace("1 of", "16 of") in over[0]["message"]


def test_model_folders_vocabulary_and_hub_ids(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import LlamaConfig

    from flowgraph.nodes.models import build_tiny_tokenizer

    folder = tmp_path / "small-vocab"
    LlamaConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=1, tie_word_embeddings=True).save_pretrained(folder)
    build_tiny_tokenizer(folder)
    status, diags = _diags(capsys, _graph(tmp_path, actor=str(folder)))
    assert status == 1
    vocab = next(d for d in diags if d["code"] == "FG507")
    assert "512 tokens, the model's vocabulary 100" in vocab["message"]
    notes = [d["message"] for d in diags if d["code"] == "FG508"]
    assert any("`actor`" in m and " tied" in m for m in notes)
    assert any("`ref`" in m and "untied" in m for m in notes)

    status, diags = _diags(capsys, _graph(tmp_path, actor="some-org/some-model"))
    skipped = [d for d in diags if d["code"] == "FG509"]
    assert status == 0
    assert skipped and "some-org/some-model" in skipped[0]["message"]
    assert skipped[0]["severity"] == "note"


@pytest.mark.parametrize(("text_vocab", "status"), [(1000, 0), (300, 1)])
def test_a_composite_config_is_read_for_its_text_vocabulary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text_vocab: int, status: int
) -> None:
    """Gemma-3 (and the vision-language configs) keep vocab_size in text_config; read at
    the top level it was 0, and every tokenizer was `over` it (a false FG507)."""
    from transformers import Gemma3Config

    from flowgraph.nodes.models import build_tiny_tokenizer

    folder = tmp_path / "gemma3"
    Gemma3Config(text_config={"vocab_size": text_vocab}).save_pretrained(folder)
    build_tiny_tokenizer(folder)
    got, diags = _diags(capsys, _graph(tmp_path, actor=str(folder)))
    assert got == status
    assert [d["code"] for d in diags if d["code"] == "FG507"] == ["FG507"] * status
    note = next(d["message"] for d in diags if d["code"] == "FG508" and "`actor`" in d["message"])
    assert f"vocabulary {text_vocab}, tokenizer 512 tokens" in note


def test_a_missing_config_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    status, diags = _diags(capsys, _graph(tmp_path, actor=str(tmp_path / "empty")))
    assert status == 1
    assert any(d["code"] == "FG506" and "`actor`" in d["message"] for d in diags)


def test_check_without_data_imports_no_torch() -> None:
    code = ("import sys; from flowgraph.cli import main; "
            f"main(['check', {str(ROOT / 'graphs' / 'grpo.yaml')!r}]); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip().endswith("False")


DPO = str(ROOT / "graphs" / "dpo.yaml")


def test_preferences_on_a_base_model_and_long_responses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from flowgraph.nodes.models import build_tiny_tokenizer

    base = build_tiny_tokenizer()
    base.chat_template = None
    base.save_pretrained(tmp_path / "base-tok")
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "two hundred and twelve"}] * 8
    data = _jsonl(tmp_path / "p.jsonl", rows)
    args = [DPO, f"data.pairs.path={data}",
            *(f"models.{m}.tokenizer={tmp_path / 'base-tok'}" for m in ("policy", "ref"))]
    status, diags = _diags(capsys, *args, "data.pairs.apply_chat_template=true")
    assert status == 1
    assert [d["code"] for d in diags if d["severity"] == "error"] == ["FG504"]
    assert "apply_chat_template is true: unset it" in diags[-1]["message"]
    status, diags = _diags(capsys, *args)  # string prompts are raw text: no template needed
    assert status == 1
    errors = [d for d in diags if d["severity"] == "error"]
    assert [d["code"] for d in errors] == ["FG503"]
    assert "p.jsonl` row 0 (0-based): the rejected is" in errors[0]["message"]
    assert "max_response_length 8" in errors[0]["message"]


def test_a_missing_column_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _jsonl(tmp_path / "q.jsonl", [{"question": "1+1="}])
    status, diags = _diags(capsys, _graph(tmp_path, f"{{kind: prompts, path: {data}}}"))
    assert status == 1
    missing = next(d for d in diags if d["code"] == "FG501")
    assert "has no column `prompt`; its columns: question" in missing["message"]


ANSWERS_PLUGIN = '''
import torch
from flowgraph.contracts import TensorSpec
from flowgraph.registry import KindSpec, PortSpec, register_kind

register_kind(KindSpec(
    "answer_reward", "reward", "a reward that reads each sample's answer as `answers`",
    inputs=(PortSpec("response_mask", TensorSpec("b T", "mask", ("binary",))),
            PortSpec("answers", TensorSpec("b", "str"))),
    outputs=(PortSpec("scores", TensorSpec("b", "float", ("finite",))),),
    impl="fg_answer_reward:answer_reward", source="fg_answer_reward"))


def answer_reward(response_mask, answers):
    return torch.zeros(response_mask.shape[0])
'''


def test_ground_truth_read_under_another_input_name_is_required(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin reward reading gen.ground_truth as `answers` needs the column too (a
    run stopped with KeyError: ('train', 'ground_truth') at step 0 when it was missing)."""
    from flowgraph.checker.data import ground_truth_readers
    from flowgraph.compilers import RunOptions, run
    from flowgraph.frontend import load_graph
    from flowgraph.passes import compile_graph

    (tmp_path / "fg_answer_reward.py").write_text(ANSWERS_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = _jsonl(tmp_path / "q.jsonl", [{"prompt": f"{a}+{a}="} for a in range(8)])
    text = Path(_graph(tmp_path, f"{{kind: prompts, path: {data}}}")).read_text()
    reward = text[text.index("  reward:\n"):text.index("  adv:\n")]
    text = text.replace(reward, "  reward:\n    kind: answer_reward\n    inputs: {response_mask: "
                                "gen.response_mask, answers: gen.ground_truth}\n")
    graph_file = tmp_path / "g.yaml"
    graph_file.write_text("plugins: [fg_answer_reward]\n" + text)
    graph, _ = load_graph(str(graph_file))
    assert graph is not None
    assert ground_truth_readers(graph, "train") == ("reward",)
    status, diags = _diags(capsys, str(graph_file))
    assert status == 1
    assert "which node `reward` needs" in next(d for d in diags if d["code"] == "FG502")["message"]
    result = compile_graph(graph_file, overrides=[f"trainer.run_dir={tmp_path / 'run'}",
                                                  "trainer.steps=1"])
    assert result.plan is not None
    with pytest.raises(FlowgraphError, match=r"q.jsonl` has no ground truth, which node "
                                             r"`reward` needs; its columns: prompt"):
        run(result.plan, RunOptions(tensorboard=False))


def test_a_trained_builtin_is_checked_without_training_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a fresh cache `check --data` reads builtin:tiny-lm-sft's tokenizer (its base's)
    and trains nothing: the run trains it."""
    monkeypatch.setenv("FLOWGRAPH_CACHE", str(tmp_path / "cache"))
    status, diags = _diags(capsys, _graph(tmp_path))
    assert status == 0, diags
    built = sorted(p.name for p in (tmp_path / "cache" / "builtin").iterdir()
                   if not p.name.startswith("."))
    assert built == ["tiny-lm"]


def test_identical_and_empty_pairs_are_a_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
    data = _jsonl(tmp_path / "pairs.jsonl", [good] * 14 + [{**good, "rejected": "4"},
                                                            {**good, "chosen": ""}])
    text = (ROOT / "graphs" / "dpo.yaml").read_text()
    graph = tmp_path / "dpo.yaml"
    graph.write_text(text.replace('path: "builtin:arith-pairs"', f"path: {data}", 1))
    status, diags = _diags(capsys, str(graph))
    assert status == 0  # a warning: such pairs are wasted, not wrong
    pairs = [d for d in diags if d["code"] == "FG511"]
    assert [d["severity"] for d in pairs] == ["warning", "warning"]
    assert "1 of 16 pairs have identical responses (chosen == rejected), the first row 14" \
        in pairs[0]["message"]
    assert "1 of 16 pairs have an empty response, the first row 15" in pairs[1]["message"]


def test_implicit_prompt_pairs_are_checked_with_their_extracted_prompt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """TRL's implicit-prompt format (only chosen and rejected conversations): the prompt
    is their shared first messages, measured against P like any prompt."""
    def pair(q: str, good: str, bad: str) -> dict[str, Any]:
        user = {"role": "user", "content": q}
        return {"chosen": [user, {"role": "assistant", "content": good}],
                "rejected": [user, {"role": "assistant", "content": bad}]}

    rows = [pair("1+1=", "2", "3")] * 15 + [pair(LONG, "0", "1")]
    data = _jsonl(tmp_path / "p.jsonl", rows)
    status, diags = _diags(capsys, DPO, f"data.pairs.path={data}")
    errors = [d for d in diags if d["severity"] == "error"]
    assert status == 1 and [d["code"] for d in errors] == ["FG503"]
    assert "p.jsonl` row 15 (0-based): the prompt is 24 tokens" in errors[0]["message"]
