"""Prompt and preference datasets: file layouts, padding, shuffling, resume, errors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from flowgraph.data.tasks import arith_problems, reverse_problems
from flowgraph.errors import FlowgraphError
from flowgraph.nodes.data import (
    PreferenceDataset,
    PromptDataset,
    preference_source,
    prompt_source,
    sft_source,
)
from flowgraph.nodes.models import build_tiny_tokenizer

TOK = build_tiny_tokenizer()

# verl layout: chat-list prompts, ground truth nested in `reward_model`.
ROWS = [
    {
        "prompt": [{"role": "user", "content": f"{a}+{a}="}],
        "data_source": "toy",
        "reward_model": {"ground_truth": str(2 * a), "style": "rule"},
    }
    for a in range(10)
]


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_verl_layout_round_trip(tmp_path: Path, suffix: str) -> None:
    ds = PromptDataset(
        str(_write(tmp_path / f"d{suffix}", ROWS)), TOK, max_prompt_length=10, shuffle=False
    )
    batch = ds.next_batch(3)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (3, 10)
    assert batch["input_ids"].dtype == batch["attention_mask"].dtype == torch.int64
    assert batch["uid"].tolist() == [0, 1, 2]
    assert batch["ground_truth"] == ["0", "2", "4"]
    assert batch["data_source"] == ["toy"] * 3
    # left padding: <|user|> 1 + 1 = <|assistant|> is 6 tokens, behind 4 pads
    assert batch["attention_mask"][1].tolist() == [0] * 4 + [1] * 6
    assert (batch["input_ids"][1, :4] == TOK.pad_token_id).all()
    assert TOK.decode(batch["input_ids"][1, 4:]) == "<|user|>1+1=<|assistant|>"


def test_string_prompts_flat_ground_truth_and_raw_text(tmp_path: Path) -> None:
    """String prompts are raw text unless the chat template is asked for (TRL's standard
    format); false says the same as unset."""
    rows = [{"question": f"what is {a} plus 1?", "ground_truth": a + 1} for a in range(4)]
    path = str(_write(tmp_path / "q.jsonl", rows))
    chat = PromptDataset(path, TOK, prompt_key="question", shuffle=False,
                         apply_chat_template=True).next_batch(2)
    raw = PromptDataset(
        path, TOK, prompt_key="question", shuffle=False, apply_chat_template=False
    ).next_batch(2)
    unset = PromptDataset(path, TOK, prompt_key="question", shuffle=False).next_batch(2)
    assert torch.equal(unset["input_ids"], raw["input_ids"])
    assert chat["ground_truth"] == [1, 2]  # JSON numbers stay numbers, as verl passes them
    assert "data_source" not in chat
    text = TOK.decode(chat["input_ids"][0][chat["attention_mask"][0].bool()])
    assert text == "<|user|>what is 0 plus 1?<|assistant|>"
    assert TOK.decode(raw["input_ids"][0]) == "what is 0 plus 1?"
    assert raw["attention_mask"].all()  # the longest prompt sets P when no max is given


# raw-text prompts of 4, 6 and 8 tokens (digits are one token each)
SUMS = [{"prompt": q, "ground_truth": "0"} for q in ("1+1=", "12+12=", "123+123=")]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_an_overlong_prompt_stops_the_load_by_default(tmp_path: Path, suffix: str) -> None:
    path = str(_write(tmp_path / f"d{suffix}", SUMS))
    with pytest.raises(FlowgraphError) as exc:
        PromptDataset(path, TOK, max_prompt_length=5, apply_chat_template=False)
    message = str(exc.value)
    for needle in (f"d{suffix}` row 1 (0-based)", "6 tokens", "max_prompt_length 5",
                   "2 of 3 rows", "longest 8", "filter_overlong_prompts: true", "truncation: left"):
        assert needle in message


@pytest.mark.parametrize(("truncation", "kept"), [("left", "+123="), ("right", "123+1")])
def test_truncation_left_keeps_the_end_right_the_start(
    tmp_path: Path, truncation: str, kept: str
) -> None:
    ds = PromptDataset(str(_write(tmp_path / "d.jsonl", SUMS)), TOK, max_prompt_length=5,
                       apply_chat_template=False, shuffle=False, truncation=truncation)
    batch = ds.next_batch(3)
    assert TOK.decode(batch["input_ids"][2]) == kept
    assert TOK.decode(batch["input_ids"][0][batch["attention_mask"][0].bool()]) == "1+1="


def test_filter_overlong_prompts_drops_rows_and_says_how_many(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = PromptDataset(str(_write(tmp_path / "d.jsonl", SUMS)), TOK, max_prompt_length=6,
                       apply_chat_template=False, shuffle=False, filter_overlong_prompts=True)
    assert (len(ds), ds.filtered_overlong) == (2, 1)
    out = capsys.readouterr().out
    assert "data/filtered_overlong=1" in out and "d.jsonl" in out and "1 of 3 rows" in out
    assert TOK.decode(ds.next_batch(2)["input_ids"][1]) == "12+12="


def test_preference_responses_over_T_stop_or_are_dropped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "two hundred and twelve"},
            {"prompt": "2+2=", "chosen": "4", "rejected": "5"}]
    path = str(_write(tmp_path / "p.jsonl", rows))
    kw: dict[str, Any] = {"max_response_length": 3, "apply_chat_template": False}
    with pytest.raises(FlowgraphError, match=r"p.jsonl` row 0 \(0-based\): the rejected is "
                       r"\d+ tokens, over max_response_length 3"):
        PreferenceDataset(path, TOK, **kw)
    kept = PreferenceDataset(path, TOK, filter_overlong_prompts=True, **kw)
    assert len(kept) == 1 and "data/filtered_overlong=1" in capsys.readouterr().out
    cut = PreferenceDataset(path, TOK, truncation="left", shuffle=False, **kw).next_batch(2)
    assert cut["rejected"].shape == (2, 3)
    assert TOK.decode(cut["rejected"][0]) == TOK.decode(TOK("two hundred").input_ids[:3])


def test_dpo_on_a_base_model_tokenizes_strings_as_raw_text(tmp_path: Path) -> None:
    base = build_tiny_tokenizer()
    base.chat_template = None
    rows = [{"prompt": "2+2=", "chosen": "4", "rejected": "5"}]
    splits = preference_source(str(_write(tmp_path / "p.jsonl", rows)), tokenizer=base,
                               apply_chat_template=False)
    batch = splits.train.next_batch(1)
    assert TOK.decode(batch["prompts"][0]) == "2+2="
    assert TOK.decode(batch["chosen"][0]) == "4<|eos|>"


def test_raw_preference_prompts_carry_no_special_tokens_as_in_trl(tmp_path: Path) -> None:
    """TRL's DPOTrainer.tokenize_row: `tokenizer(prompt, add_special_tokens=False)` for a
    decoder-only model; a raw `prompts` row keeps the BOS a base model generates after."""
    from tokenizers import processors

    bos = build_tiny_tokenizer()  # a base model's tokenizer: BOS first, no chat template
    bos.chat_template = None
    bos._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", bos.bos_token_id)])
    assert bos("2+2=").input_ids == [bos.bos_token_id, *TOK("2+2=").input_ids]
    rows = [{"prompt": "2+2=", "chosen": "4", "rejected": "5"}]
    path = str(_write(tmp_path / "p.jsonl", rows))
    pairs = PreferenceDataset(path, bos, max_prompt_length=4, apply_chat_template=False)
    assert pairs.next_batch(1)["prompts"][0].tolist() == TOK("2+2=").input_ids  # 4 fit P=4
    prompts = PromptDataset(path, bos, max_prompt_length=5, apply_chat_template=False)
    assert prompts.next_batch(1)["input_ids"][0, 0] == bos.bos_token_id


def test_a_missing_ground_truth_is_named_before_any_batch(tmp_path: Path) -> None:
    path = str(_write(tmp_path / "q.jsonl", [{"prompt": "1+1=", "answer": "2"}]))
    assert len(prompt_source(path, tokenizer=TOK).train) == 1  # nobody reads it: fine
    with pytest.raises(FlowgraphError) as exc:
        prompt_source(path, tokenizer=TOK, ground_truth_for=("reward",))
    for needle in ("q.jsonl", "no ground truth", "`reward`", "columns: prompt, answer",
                   "add a `ground_truth` column"):
        assert needle in str(exc.value)


def test_cursor_resume_gives_the_same_batches(tmp_path: Path) -> None:
    path = str(_write(tmp_path / "d.parquet", ROWS))
    ds = PromptDataset(path, TOK, seed=3)
    for _ in range(4):  # 10 rows, batches of 3: into the second epoch
        ds.next_batch(3)
    state = ds.state_dict()
    assert state == {"epoch": 1, "position": 3}
    expected = [ds.next_batch(3) for _ in range(3)]
    resumed = PromptDataset(path, TOK, seed=3)
    resumed.load_state_dict(state)
    assert all(_equal(resumed.next_batch(3), want) for want in expected)


def _epoch_orders(seed: int, epochs: int = 2) -> list[list[int]]:
    ds = PromptDataset("builtin:arith", TOK, seed=seed)
    n = len(ds) // 4  # 124 rows: 31 batches of 4 per epoch, none dropped
    return [torch.cat([ds.next_batch(4)["uid"] for _ in range(n)]).tolist() for _ in range(epochs)]


def test_shuffling_is_deterministic_per_seed_and_epoch() -> None:
    first, again, other = _epoch_orders(0), _epoch_orders(0), _epoch_orders(1)
    assert first == again
    assert first != other
    assert first[0] != first[1]  # a new order each epoch
    assert sorted(first[0]) == sorted(first[1]) == list(range(124))  # without replacement


def test_the_last_incomplete_batch_is_dropped(tmp_path: Path) -> None:
    ds = PromptDataset(str(_write(tmp_path / "d.parquet", ROWS)), TOK, shuffle=False)
    assert [ds.next_batch(4)["uid"].tolist() for _ in range(3)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [0, 1, 2, 3],
    ]


def test_builtin_arith_is_small_and_learnable() -> None:
    train, test = arith_problems("train"), arith_problems("test")
    assert (len(train), len(test)) == (124, 31)
    assert not {q for q, _ in train} & {q for q, _ in test}
    assert all(len(TOK(a, add_special_tokens=False).input_ids) <= 2 for _, a in train + test)
    splits = prompt_source("builtin:arith", tokenizer=TOK, max_prompt_length=16)
    assert (len(splits.train), len(splits.eval)) == (124, 31)
    batch = splits.eval.next_batch(31)
    assert batch["attention_mask"].sum(-1).max() <= 16
    questions = [TOK.decode(ids, skip_special_tokens=True) for ids in batch["input_ids"]]
    assert [(q, a) for q, a in zip(questions, batch["ground_truth"], strict=True)] == test


def test_builtin_reverse_has_disjoint_splits_and_sft_rows() -> None:
    train, test = reverse_problems("train"), reverse_problems("test")
    assert (len(train), len(test)) == (1000, 100)
    assert not {q for q, _ in train} & {q for q, _ in test}
    assert all(a == q.removeprefix("reverse ")[::-1] for q, a in train + test)
    splits = sft_source("builtin:reverse", tokenizer=TOK, max_prompt_length=16,
                        max_response_length=8)
    batch = splits.eval.next_batch(4)
    for p, r, m in zip(batch["prompts"], batch["responses"], batch["response_mask"],
                       strict=True):
        question = TOK.decode(p, skip_special_tokens=True)
        assert TOK.decode(r[m.bool()], skip_special_tokens=True) == dict(test)[question]
        assert r[m.bool()][-1] == TOK.eos_token_id  # the response ends with EOS


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_sft_reads_verl_columns_struct_fields_and_chat_messages(
        tmp_path: Path, suffix: str) -> None:
    flat = sft_source(str(_write(tmp_path / f"flat{suffix}", [
        {"prompt": "reverse 12", "response": "21"}])), tokenizer=TOK)
    nested = sft_source(str(_write(tmp_path / f"nested{suffix}", [
        {"extra_info": {"question": "reverse 12", "answer": "21"}}])), tokenizer=TOK,
        prompt_key="extra_info.question", response_key="extra_info.answer")
    chat = sft_source(str(_write(tmp_path / f"chat{suffix}", [{"messages": [
        {"role": "user", "content": "reverse 12"},
        {"role": "assistant", "content": "21"}]}])), tokenizer=TOK)
    batches = [s.train.next_batch(1) for s in (flat, nested, chat)]
    assert _equal(batches[0], batches[1]) and _equal(batches[0], batches[2])
    prompt = TOK.apply_chat_template([{"role": "user", "content": "reverse 12"}],
                                     add_generation_prompt=True, tokenize=False)
    assert batches[0]["prompts"][0].tolist() == TOK(prompt, add_special_tokens=False).input_ids
    assert batches[0]["responses"][0].tolist() == [*TOK("21").input_ids, TOK.eos_token_id]


CONVERSATION = [{"role": "user", "content": "reverse 12"}, {"role": "assistant", "content": "21"},
                {"role": "user", "content": "reverse 345"},
                {"role": "assistant", "content": "543"}]


@pytest.mark.parametrize(("row", "needle"), [
    ({"question": "q", "response": "r"}, "reads `prompt` (param prompt_key)"),
    ({"messages": [{"role": "user", "content": "q"}]}, "must be the assistant's answer"),
    ({"messages": CONVERSATION}, "1 rows (the first: row 0) are conversations with several "
     "assistant turns, and no node reads this source's loss_mask"),
])
def test_sft_layout_errors_name_the_file_row_and_param(
        tmp_path: Path, row: dict[str, Any], needle: str) -> None:
    path = _write(tmp_path / "bad.jsonl", [row])
    with pytest.raises(FlowgraphError, match=r"bad\.jsonl") as exc:
        sft_source(str(path), tokenizer=TOK, loss_mask_read=False)
    assert needle in str(exc.value)


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_a_multi_turn_conversation_trains_its_assistant_turns_only(
        tmp_path: Path, suffix: str) -> None:
    """The response is everything after the first user turn, as the chat template
    renders it; loss_mask marks the assistant turns (with their EOS), not the user turn
    between them; a one-answer row in the same batch is trained whole."""
    single = [{"role": "user", "content": "reverse 12"}, {"role": "assistant", "content": "21"}]
    splits = sft_source(str(_write(tmp_path / f"chat{suffix}", [
        {"messages": CONVERSATION}, {"messages": single}])), tokenizer=TOK, shuffle=False)
    batch = splits.train.next_batch(2)
    text = TOK.apply_chat_template(CONVERSATION, tokenize=False)
    prompt = TOK.apply_chat_template(CONVERSATION[:1], add_generation_prompt=True, tokenize=False)
    assert TOK.decode(batch["prompts"][0][batch["prompt_mask"][0].bool()]) == prompt
    response, mask = batch["responses"][0], batch["response_mask"][0].bool()
    assert TOK.decode(response[mask]) == text.removeprefix(prompt)
    trained = batch["loss_mask"][0].bool()
    assert TOK.decode(response[trained]) == "21<|eos|>543<|eos|>"
    assert TOK.decode(response[mask & ~trained]) == "<|user|>reverse 345<|assistant|>"
    assert torch.equal(batch["loss_mask"][1], batch["response_mask"][1])


def test_builtin_arith_pairs() -> None:
    splits = preference_source("builtin:arith-pairs", tokenizer=TOK, max_response_length=4)
    batch = splits.train.next_batch(8)
    for name in ("chosen", "rejected"):
        assert batch[name].shape == batch[f"{name}_mask"].shape == (8, 4)
    assert batch["prompts"].shape[0] == 8
    chosen_eos = batch["chosen"].gather(1, batch["chosen_mask"].sum(1, keepdim=True) - 1)
    assert (chosen_eos == TOK.eos_token_id).all()  # responses end with EOS
    answers = dict(arith_problems("train"))
    for p, c, r in zip(batch["prompts"], batch["chosen"], batch["rejected"], strict=True):
        question = TOK.decode(p, skip_special_tokens=True)
        assert TOK.decode(c, skip_special_tokens=True) == answers[question]
        assert TOK.decode(r, skip_special_tokens=True) != answers[question]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_preference_file_with_message_lists(tmp_path: Path, suffix: str) -> None:
    rows = [
        {
            "prompt": [{"role": "user", "content": "2+2="}],
            "chosen": [{"role": "assistant", "content": "4"}],
            "rejected": [{"role": "assistant", "content": "five"}],
        }
    ]
    ds = PreferenceDataset(str(_write(tmp_path / f"p{suffix}", rows)), TOK)
    batch = ds.next_batch(1)
    assert TOK.decode(batch["chosen"][0][batch["chosen_mask"][0].bool()]) == "4<|eos|>"
    assert TOK.decode(batch["rejected"][0][batch["rejected_mask"][0].bool()]) == "five<|eos|>"
    assert batch["chosen"].shape == batch["rejected"].shape


@pytest.mark.parametrize(
    ("make", "needles"),
    [
        (
            lambda d: PromptDataset(str(_write(d / "d.parquet", ROWS)), TOK, prompt_key="question"),
            ["d.parquet", "`question`", "prompt, data_source, reward_model"],
        ),
        (
            lambda d: PreferenceDataset(str(_write(d / "d.jsonl", ROWS)), TOK),
            ["d.jsonl", "`chosen`, `rejected`", "its columns: prompt"],
        ),
        (lambda d: PromptDataset(str(d / "nope.parquet"), TOK), ["nope.parquet", "does not exist"]),
        (
            lambda d: PromptDataset(str(_garbage(d / "bad.parquet")), TOK),
            ["bad.parquet", "cannot read", "as parquet"],
        ),
        (
            lambda d: PromptDataset(str(_garbage(d / "bad.jsonl")), TOK),
            ["bad.jsonl", "cannot read", "as jsonl"],
        ),
        (lambda d: PromptDataset(str(d / "data.csv"), TOK), ["data.csv", "set the param format"]),
        (lambda d: PromptDataset("builtin:nope", TOK), ["builtin:nope", "builtin:arith"]),
        (
            lambda d: PromptDataset("builtin:arith", TOK, apply_chat_template=False),
            [
                "builtin:arith",
                "column `prompt` holds chat-message lists",
                "apply_chat_template: true",
            ],
        ),
        (lambda d: PromptDataset("builtin:arith", TOK).next_batch(500), ["124 rows", "500"]),
    ],
)
def test_errors_name_the_file_and_the_column(tmp_path: Path, make: Any, needles: list[str]) -> None:
    with pytest.raises(FlowgraphError) as exc:
        make(tmp_path)
    for needle in needles:
        assert needle in str(exc.value)


def test_a_tokenizer_without_chat_template_is_refused() -> None:
    tok = build_tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(FlowgraphError, match="holds chat messages: give string prompts"):
        PromptDataset("builtin:arith", tok)  # conversational prompts always need it


def test_string_prompts_need_no_template_unless_asked(tmp_path: Path) -> None:
    tok = build_tiny_tokenizer()
    tok.chat_template = None
    path = str(_write(tmp_path / "q.jsonl", [{"prompt": "1+1="}] * 2))
    assert PromptDataset(path, tok).next_batch(1)["input_ids"].shape == (1, 4)
    with pytest.raises(FlowgraphError, match="apply_chat_template is true: unset it"):
        PromptDataset(path, tok, apply_chat_template=True)


def _garbage(path: Path) -> Path:
    path.write_bytes(b"\x00not a table{")
    return path


@pytest.mark.parametrize(
    ("row", "needles"),
    [
        ({"prompt": "1+1=", "answer": "2"},
         ["q.jsonl", "no ground truth", "`reward`", "columns: prompt, answer"]),
        ({"prompt": "1234567890+1234567890=", "ground_truth": "0"},
         # raw text (a string prompt, TRL's standard format): one token per character
         ["q.jsonl` row 0 (0-based)", "22 tokens", "max_prompt_length 16"]),
    ],
)
def test_a_run_stops_at_load_before_any_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, row: dict[str, str], needles: list[str]
) -> None:
    import flowgraph.nodes.models as models
    from flowgraph.compilers import RunOptions, run
    from flowgraph.compilers.builtin_training import ensure_builtin
    from flowgraph.passes import compile_graph

    ensure_builtin("tiny-lm-sft")  # trained (loading models) on a fresh cache; not the point

    def no_loading(*args: object, **kw: object) -> None:
        raise AssertionError("a model was loaded before the dataset was checked")

    monkeypatch.setattr(models, "load_model", no_loading)
    data = _write(tmp_path / "q.jsonl", [row] * 8)
    graph = Path(__file__).resolve().parents[2] / "graphs" / "grpo.yaml"
    result = compile_graph(graph, overrides=[f"trainer.run_dir={tmp_path / 'run'}",
                                             f"data.train.path={data}", "trainer.steps=1"])
    assert result.plan is not None
    with pytest.raises(FlowgraphError) as exc:
        run(result.plan, RunOptions(tensorboard=False))
    for needle in needles:
        assert needle in str(exc.value)


def test_the_filtered_count_is_logged_in_the_first_row(tmp_path: Path) -> None:
    from flowgraph.compilers import RunOptions, run
    from flowgraph.passes import compile_graph

    rows = [{"prompt": f"{a}+{a}=", "ground_truth": str(2 * a)} for a in range(16)]  # Bp
    rows += [{"prompt": "1234567890+1234567890=", "ground_truth": "0"}] * 3  # 24 tokens > 16
    data = _write(tmp_path / "q.jsonl", rows)
    graph = Path(__file__).resolve().parents[2] / "graphs" / "grpo.yaml"
    result = compile_graph(graph, overrides=[
        f"trainer.run_dir={tmp_path / 'run'}", f"data.train.path={data}", "trainer.steps=2",
        "trainer.eval_every=0", "data.train.filter_overlong_prompts=true"])
    assert result.plan is not None
    with open(os.devnull, "w") as out:
        logged = run(result.plan, RunOptions(tensorboard=False, out=out)).rows
    assert [r.get("data/train/filtered_overlong") for r in logged] == [3.0, None]


def test_multi_turn_rows_are_verls(tmp_path: Path) -> None:
    """Prompt + response and the loss mask of each conversation are verl 0.9.1's
    `MultiTurnSFTDataset` input_ids and loss_mask (scripts/verl_sft_fixtures.py), a
    system message and two user turns in a row included."""
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "verl" / "multiturn_sft.json"
    rows = json.loads(fixture.read_text())["rows"]
    splits = sft_source(str(_write(tmp_path / "chat.jsonl", [
        {"messages": r["messages"]} for r in rows])), tokenizer=TOK, shuffle=False)
    batch = splits.train.next_batch(len(rows))
    for i, row in enumerate(rows):
        prompt = batch["prompts"][i][batch["prompt_mask"][i].bool()].tolist()
        valid = batch["response_mask"][i].bool()
        response = batch["responses"][i][valid].tolist()
        assert prompt + response == row["input_ids"], i
        assert [0] * len(prompt) + batch["loss_mask"][i][valid].tolist() == row["loss_mask"], i


@pytest.mark.faults
def test_identical_or_empty_preference_pairs_are_counted_at_load(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
    rows = [good, {**good, "rejected": "4"}, {**good, "chosen": ""}, good,
            {"prompt": "1+1=", "chosen": "2", "rejected": "2"}]
    path = _write(tmp_path / "pairs.jsonl", rows)
    ds = PreferenceDataset(str(path), TOK, apply_chat_template=False)
    assert (ds.same_pairs, ds.empty_pairs) == (2, 1)
    out = capsys.readouterr().out
    assert f"data/same_pairs=2: dataset `{path}`: 2 of 5 pairs have identical responses " \
           "(the first: row 1)" in out
    assert f"data/empty_pairs=1: dataset `{path}`: 1 of 5 pairs have an empty response " \
           "(the first: row 2)" in out


def test_an_empty_message_list_is_an_empty_response_not_a_malformed_row(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    answer = [{"role": "assistant", "content": "4"}]
    rows = [{"prompt": [{"role": "user", "content": "2+2="}], "chosen": answer,
             "rejected": [{"role": "assistant", "content": "5"}]}] * 3
    rows.append({**rows[0], "chosen": []})  # an empty response: counted, not refused
    ds = PreferenceDataset(str(_write(tmp_path / "pairs.parquet", rows)), TOK)
    assert (ds.same_pairs, ds.empty_pairs) == (0, 1)
    assert "(the first: row 3)" in capsys.readouterr().out
    rows.append({**rows[0], "prompt": []})  # an empty prompt is refused
    with pytest.raises(FlowgraphError, match="row 4 \\(0-based\\), column `prompt`: an "
                                             "empty message list"):
        PreferenceDataset(str(_write(tmp_path / "pairs2.parquet", rows)), TOK)
