"""The embedded tiny model and tokenizer: built once, cached, reloaded identically."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch

from flowgraph.builtin_models import BUILTIN_MODELS
from flowgraph.errors import FlowgraphError
from flowgraph.nodes import models
from flowgraph.nodes.models import build_tiny_tokenizer, builtin_dir, load_model, load_tokenizer

VOCAB = BUILTIN_MODELS["tiny-lm"]["vocab_size"]


def test_tokenizer_is_deterministic_with_the_configured_vocab() -> None:
    a, b = build_tiny_tokenizer(), build_tiny_tokenizer()
    assert len(a) == VOCAB
    assert a.get_vocab() == b.get_vocab()
    assert (a.pad_token_id, a.bos_token_id, a.eos_token_id) == (0, 1, 2)


def test_tokenizer_spells_digits_one_per_token_and_round_trips() -> None:
    tok = build_tiny_tokenizer()
    ids = tok("12+7=19", add_special_tokens=False).input_ids
    assert [tok.decode([i]) for i in ids] == ["1", "2", "+", "7", "=", "1", "9"]
    text = "The answer is #### 1,234."
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


def test_chat_template_is_short() -> None:
    tok = build_tiny_tokenizer()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "3+4="}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|user|>3+4=<|assistant|>"
    # role tokens are single special tokens: <|user|> 3 + 4 = <|assistant|>
    assert len(tok(text, add_special_tokens=False).input_ids) == 6


def test_builtin_builds_once_and_reloads_identically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = torch.random.get_rng_state()
    first = load_model("builtin:tiny-lm", cache_dir=tmp_path)
    assert torch.equal(rng, torch.random.get_rng_state()), "building must not consume the RNG"
    weights = tmp_path / "builtin" / "tiny-lm" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns

    def no_rebuild(name: str, target: Path) -> None:
        raise AssertionError("the cache was rebuilt")

    monkeypatch.setattr(models, "_build_builtin", no_rebuild)
    second = load_model("builtin:tiny-lm", cache_dir=tmp_path)
    assert weights.stat().st_mtime_ns == stamp
    for (name, p), q in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert first.config.vocab_size == VOCAB
    assert len(load_tokenizer("builtin:tiny-lm", cache_dir=tmp_path)) == VOCAB


def test_builtin_weights_are_the_same_in_every_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "env"))
    assert builtin_dir("tiny-lm") == tmp_path / "env" / "builtin" / "tiny-lm"
    a = load_model("builtin:tiny-lm")
    b = load_model("builtin:tiny-lm", cache_dir=tmp_path / "other")
    assert (tmp_path / "env" / "builtin" / "tiny-lm" / "config.json").exists()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_concurrent_builds_publish_one_complete_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build = models._build_builtin
    both_building = threading.Barrier(2, timeout=30)

    def overlapping(name: str, target: Path) -> None:
        build(name, target)
        both_building.wait()  # both builders are done before either publishes

    monkeypatch.setattr(models, "_build_builtin", overlapping)
    results: list[Path | BaseException] = []

    def run() -> None:
        try:
            results.append(models._ensure_builtin("tiny-lm", tmp_path))
        except BaseException as exc:
            results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = tmp_path / "builtin" / "tiny-lm"
    assert results == [final, final]
    assert sorted(p.name for p in final.parent.iterdir()) == ["tiny-lm"], "temp folders remain"
    load_model("builtin:tiny-lm", cache_dir=tmp_path)


def test_the_tied_builtin_is_tiny_lm_with_its_head_tied_to_its_embedding(
    tmp_path: Path,
) -> None:
    tied = load_model("builtin:tiny-tied", trainable=True, cache_dir=tmp_path)
    untied = load_model("builtin:tiny-lm", cache_dir=tmp_path)
    assert tied.config.tie_word_embeddings and not untied.config.tie_word_embeddings
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    names = [n for n, _ in tied.named_parameters()]
    assert names == [n for n, _ in untied.named_parameters() if n != "lm_head.weight"]
    assert len(load_tokenizer("builtin:tiny-tied", cache_dir=tmp_path)) == VOCAB
    config = tmp_path / "builtin" / "tiny-tied" / "config.json"
    assert '"tie_word_embeddings": true' in config.read_text()


def test_trainable_controls_mode_and_gradients(tmp_path: Path) -> None:
    frozen = load_model("builtin:tiny-lm", cache_dir=tmp_path)
    trained = load_model(
        "builtin:tiny-lm", trainable=True, cache_dir=tmp_path, dtype=torch.bfloat16
    )
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    assert trained.training and all(p.requires_grad for p in trained.parameters())
    assert next(trained.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("path", ["/no/such/model", "./missing-model", "a/b/c", "~/nope"])
def test_missing_local_path_fails_before_loading(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("from_pretrained must not be reached")

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", no_load)
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", no_load)
    with pytest.raises(FlowgraphError, match="does not exist") as exc:
        load_model(path)
    assert path in str(exc.value)
    with pytest.raises(FlowgraphError, match="does not exist"):
        load_tokenizer(path)


def test_unknown_builtin_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(FlowgraphError, match="builtin:tiny-lm"):
        load_model("builtin:huge-lm", cache_dir=tmp_path)


def test_a_folder_that_is_not_a_model_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FlowgraphError, match=f"cannot load model `{tmp_path}`"):
        load_model(str(tmp_path))


def test_a_rank_other_than_0_builds_a_whole_builtin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fsdp rank or Ray worker of a process group may be the first to need the cache
    (every rank of node 1 on a cluster): transformers saves a model on rank 0 alone, and
    the folder published must still hold the model, not the tokenizer alone."""
    from transformers.distributed import mixin

    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    final = models._ensure_builtin("tiny-lm", tmp_path)
    assert {"config.json", "model.safetensors"} <= {p.name for p in final.iterdir()}


def _offline_hub(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """A hub endpoint nothing listens on (port 9, discard: refused at once, no network
    needed) and an empty hub cache of our own."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def test_a_hub_model_without_network_is_one_message_with_the_offline_hint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, `from_pretrained` retried every file five times with back-off (~70 s,
    ten `Retrying in 8s` lines) and then said `couldn't connect`; now one look at the hub
    decides, and the error says what to do."""
    import time

    _offline_hub(monkeypatch, tmp_path / "hub")
    began = time.monotonic()
    for load in (load_tokenizer, load_model, models.check_model_path):
        with pytest.raises(FlowgraphError) as exc:
            load("someorg/somemodel")
        assert str(exc.value).startswith(
            "model `someorg/somemodel` is no local folder, so it names a Hugging Face hub "
            f"model, and it is not in this machine's hub cache ({tmp_path / 'hub'}); "
            "http://127.0.0.1:9 does not answer (ConnectError"), str(exc.value)
        assert "`hf download someorg/somemodel`" in str(exc.value)
    assert time.monotonic() - began < 15  # no retries with back-off


def test_a_cached_hub_model_loads_without_network(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub cache's snapshot of the id (here: tiny-lm's files under
    `models--someorg--tiny/snapshots/<commit>`) loads when the hub does not answer."""
    monkeypatch.setenv("FLOWGRAPH_CACHE", str(tmp_path / "fg"))
    built = Path(models._resolve("builtin:tiny-lm", None))
    repo = tmp_path / "hub" / "models--someorg--tiny"
    commit = "0" * 40
    shutil.copytree(built, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    _offline_hub(monkeypatch, tmp_path / "hub")
    lm = load_model("someorg/tiny")
    reference = load_model(str(built))
    assert torch.equal(lm.get_input_embeddings().weight, reference.get_input_embeddings().weight)
    assert load_tokenizer("someorg/tiny").get_vocab() == load_tokenizer(str(built)).get_vocab()
