"""The `generate` node: hf decoding loop against HF's own generate and the logprob node,
per-sample seeds, the kind's contract; then one engine of the vLLM backend.

The built-in tiny model is random and almost never says EOS, so the tests that need
responses of several lengths use a copy whose EOS row of the LM head is twice the row
of token 356, a token its greedy continuations often pick: greedy responses to two of
the four test prompts then end after 3 tokens, and samples at τ = 0.2 sometimes end
early, sometimes run to T.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from transformers import TopKLogitsWarper, TopPLogitsWarper

import flowgraph.nodes.generate as generate_module
from flowgraph.compilers.vllm import weight_sync
from flowgraph.compilers.worker import rollout_engine
from flowgraph.errors import FlowgraphError
from flowgraph.nodes.data import prompt_source
from flowgraph.nodes.generate import (
    SamplingSpec,
    _pick,
    counter_uniform,
    decode,
    filter_logits,
    generate,
)
from flowgraph.nodes.logprob import logprob
from flowgraph.nodes.models import load_model, load_tokenizer
from flowgraph.runtime.context import NodeContext

MODEL = "builtin:tiny-lm"
EOS, PAD = 2, 0
BP, P = 4, 12


def _ctx(n: int = 2, T: int = 16, *, seed: int = 0, step: int = 0, row_offset: int = 0
         ) -> NodeContext:
    return NodeContext("gen", "generate", step=step, seed=seed, dims={"N": n, "T": T},
                       row_offset=row_offset, engines=rollout_engine)


def _eos_prone(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        model.lm_head.weight[EOS] = 2.0 * model.lm_head.weight[356]
    return model


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return load_model(MODEL)


@pytest.fixture(scope="module")
def eos_model() -> nn.Module:
    return _eos_prone(load_model(MODEL))


@pytest.fixture(scope="module")
def batch(tokenizer: Any) -> dict[str, Any]:
    """Four arithmetic prompts left-padded to P = 12, cut to 6, 5, 6 and 4 real tokens."""
    rows = prompt_source("builtin:arith", tokenizer=tokenizer, max_prompt_length=P,
                         shuffle=False).train.next_batch(BP)
    for row, cut in ((1, 1), (3, 2)):  # drop the first tokens: more left padding
        rows["input_ids"][row, : P - 6 + cut] = PAD
        rows["attention_mask"][row, : P - 6 + cut] = 0
    assert rows["attention_mask"].sum(-1).tolist() == [6, 5, 6, 4]
    return rows


def _call(ctx: NodeContext, model: nn.Module, tokenizer: Any, batch: dict[str, Any],
          rows: slice = slice(None), **params: Any) -> dict[str, Any]:
    return generate(ctx, model, tokenizer, prompts=batch["input_ids"][rows],
                    prompt_mask=batch["attention_mask"][rows], **params)


def _rescore(model: nn.Module, out: dict[str, Any], temperature: float) -> Tensor:
    return logprob(model, out["prompts"], out["prompt_mask"], out["responses"],
                   out["response_mask"], temperature=temperature)["log_prob"]


def _check_contract(out: dict[str, Any], batch: dict[str, Any], n: int, T: int) -> None:
    """The `generate` kind's outputs; EOS ends a response and is part of it."""
    r = BP * n
    assert set(out) == {"prompts", "prompt_mask", "responses", "response_mask",
                        "rollout_log_prob", "index", "ground_truth"}
    assert torch.equal(out["prompts"], batch["input_ids"].repeat_interleave(n, 0))
    assert torch.equal(out["prompt_mask"], batch["attention_mask"].repeat_interleave(n, 0))
    assert out["responses"].shape == out["response_mask"].shape == (r, T)
    assert out["responses"].dtype == out["response_mask"].dtype == torch.int64
    assert out["rollout_log_prob"].shape == (r, T)
    assert out["rollout_log_prob"].dtype == torch.float32
    assert torch.equal(out["index"], torch.arange(BP).repeat_interleave(n))
    assert out["ground_truth"] == [g for g in batch["ground_truth"] for _ in range(n)]
    mask, responses, log_p = out["response_mask"], out["responses"], out["rollout_log_prob"]
    lengths = mask.sum(-1)
    assert torch.equal(mask, (torch.arange(T) < lengths[:, None]).long()), "a valid prefix"
    assert (responses[mask == 0] == PAD).all() and (log_p[mask == 0] == 0).all()
    assert (log_p[mask == 1] <= 0).all()
    for row, length in zip(responses, lengths.tolist(), strict=True):
        eos_at = (row[:length] == EOS).nonzero().flatten().tolist()
        assert eos_at in ([], [length - 1]), "stops at the first EOS, which it keeps"
        assert eos_at or length == T, "a response shorter than T ends with EOS"


# --- sampling primitives -----------------------------------------------------------------


@pytest.mark.parametrize("top_k", [0, 1, 3, 50, 80])
@pytest.mark.parametrize("top_p", [1.0, 0.95, 0.5, 0.01])
@pytest.mark.parametrize("ties", [False, True])
def test_filter_logits_equals_hf_warpers(top_k: int, top_p: float, ties: bool) -> None:
    g = torch.Generator().manual_seed(0)
    scores = 3 * torch.randn(6, 50, generator=g)
    if ties:
        scores = scores.round()  # many equal scores at the top-k and top-p borders
    expected = scores.clone()
    if top_k > 0:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    assert torch.equal(filter_logits(scores, top_k, top_p), expected)


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (2, 1.0), (0, 0.7)])
def test_inverse_cdf_draws_from_the_filtered_softmax(top_k: int, top_p: float) -> None:
    # log-probs of 5 tokens: 0.4, 0.3, 0.15, 0.1, 0.05. top-k 2 keeps {0, 1} -> 4/7, 3/7;
    # top-p 0.7 drops the tail of mass <= 0.3 (tokens 2, 3, 4) -> the same two tokens.
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = probs.log().expand(20000, 5)
    spec = SamplingSpec(1, 1.0, top_p, top_k, False, (EOS,), PAD)
    tokens, log_p = _pick(logits, counter_uniform(torch.arange(len(logits)) * 7919, 3), spec)
    kept = probs if (top_k, top_p) == (0, 1.0) else torch.tensor([4 / 7, 3 / 7, 0, 0, 0])
    freq = torch.bincount(tokens, minlength=5) / len(tokens)
    torch.testing.assert_close(freq, kept, atol=0.012, rtol=0)  # ~3.5 standard errors
    torch.testing.assert_close(log_p, kept[tokens].log())


@pytest.mark.parametrize("u", [0.0, 1.0 - 2.0**-53, 1.0])
def test_inverse_cdf_never_picks_a_filtered_token_at_the_ends(u: float) -> None:
    # Filtered tokens at both ends (top-k 2 keeps tokens 1 and 2 of 4); a draw at, or
    # rounded to, either end of (0, 1) still lands on a kept token.
    logits = torch.tensor([[-5.0, 1.0, 1.5, -4.0]]).expand(3, 4)
    tokens, log_p = _pick(logits, torch.full((3,), u, dtype=torch.float64),
                          SamplingSpec(1, 1.0, 1.0, 2, False, (EOS,), PAD))
    assert tokens.tolist() == [1 if u == 0.0 else 2] * 3
    assert torch.isfinite(log_p).all()


def _splitmix64(seed: int, counter: int) -> int:
    """splitmix64's output function on seed + γ·counter, in Python integers (mod 2**64)."""
    m = (1 << 64) - 1
    x = (seed + 0x9E3779B97F4A7C15 * counter) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_counter_noise_is_splitmix64_of_seed_and_position() -> None:
    seeds = [0, 1, 12345, (1 << 63) - 1]
    u = counter_uniform(torch.tensor(seeds), t=5)
    expected = [((_splitmix64(s, 5 + 1) >> 12) + 0.5) / 2**52 for s in seeds]
    assert u.dtype == torch.float64
    torch.testing.assert_close(u, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=0)
    # A row's numbers are its own: the same seed in another batch draws the same noise.
    assert torch.equal(counter_uniform(torch.tensor(seeds[2:3]), 5), u[2:3])
    # Many positions in one call (the decode draws a row's whole noise at once): the same
    # numbers, column by column.
    table = counter_uniform(torch.tensor(seeds), range(8))
    assert table.shape == (4, 8) and torch.equal(table[:, 5], u)
    for t in range(8):
        assert torch.equal(table[:, t], counter_uniform(torch.tensor(seeds), t))


def test_counter_noise_is_uniform() -> None:
    seeds = torch.arange(1024) * 1_000_003
    u = torch.cat([counter_uniform(seeds, t) for t in range(256)])
    assert u.min() > 0 and u.max() < 1
    # 10 equal bins of 262,144 draws: each holds 10% within ~4 standard errors (0.06%).
    share = torch.histc(u, bins=10, min=0, max=1) / len(u)
    torch.testing.assert_close(share, torch.full((10,), 0.1, dtype=u.dtype), atol=0.0025,
                               rtol=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_k": -1}, r"top_k must be >= 0 \(0: off\), got -1"),
        ({"stop_ids": ()}, "the tokenizer has no eos_token_id"),
    ],
)
def test_sampling_spec_rejects_bad_params(change: dict[str, Any], message: str) -> None:
    fields = {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
              "greedy": False, "stop_ids": (EOS,), "pad_id": PAD} | change
    with pytest.raises(ValueError, match=message):
        SamplingSpec(**fields)


def test_unknown_backend_and_unbound_dims_are_errors(model: nn.Module, tokenizer: Any,
                                                     batch: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="backend must be `hf` or `vllm`, got `tgi`"):
        _call(_ctx(), model, tokenizer, batch, backend="tgi")
    unbound = NodeContext("gen", "generate", step=0, seed=0)
    with pytest.raises(ValueError, match="set the params n and max_new_tokens"):
        _call(unbound, model, tokenizer, batch)
    no_engine = NodeContext("gen", "generate", step=0, seed=0, dims={"N": 2, "T": 4})
    with pytest.raises(FlowgraphError, match=r"node `gen`: backend `vllm` needs a rollout "
                       r"engine, which the executor provides"):
        _call(no_engine, model, tokenizer, batch, backend="vllm")


# --- hf backend ------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.2, 1.0])
def test_hf_outputs_honour_the_contract(eos_model: nn.Module, tokenizer: Any,
                                        batch: dict[str, Any], temperature: float) -> None:
    n, T = 4, 16
    out = _call(_ctx(n, T), eos_model, tokenizer, batch, ground_truth=batch["ground_truth"],
                temperature=temperature)
    _check_contract(out, batch, n, T)
    if temperature == 0.2:
        lengths = out["response_mask"].sum(-1)
        assert (lengths < T).any() and (lengths == T).any(), "the EOS-prone model changed"


def test_hf_greedy_equals_hf_generate(eos_model: nn.Module, tokenizer: Any,
                                      batch: dict[str, Any]) -> None:
    T = 12
    out = _call(_ctx(1, T), eos_model, tokenizer, batch, do_sample=False)
    ref = eos_model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             do_sample=False, max_new_tokens=T, pad_token_id=PAD)[:, P:]
    ref = torch.nn.functional.pad(ref, (0, T - ref.shape[1]), value=PAD)  # all stopped early
    assert torch.equal(out["responses"], ref)
    lengths = out["response_mask"].sum(-1)
    assert (lengths < T).any() and (lengths > 1).any(), "the EOS-prone model changed"
    zero_temperature = _call(_ctx(1, T), eos_model, tokenizer, batch, temperature=0.0)
    assert torch.equal(zero_temperature["responses"], out["responses"])


@pytest.mark.parametrize(("temperature", "do_sample"), [(1.0, True), (0.7, True), (0.0, True),
                                                        (1.0, False)])
def test_hf_rollout_log_prob_equals_logprob_node(eos_model: nn.Module, tokenizer: Any,
                                                 batch: dict[str, Any], temperature: float,
                                                 do_sample: bool) -> None:
    out = _call(_ctx(3, 16), eos_model, tokenizer, batch, temperature=temperature,
                do_sample=do_sample)
    # Greedy scores the untempered distribution: logprob's temperature 0.
    rescored = _rescore(eos_model, out, temperature if do_sample else 0.0)
    torch.testing.assert_close(out["rollout_log_prob"], rescored, atol=1e-4, rtol=0)


def test_hf_top_k_one_is_greedy(model: nn.Module, tokenizer: Any,
                                batch: dict[str, Any]) -> None:
    sampled = _call(_ctx(2, 8), model, tokenizer, batch, top_k=1)
    greedy = _call(_ctx(2, 8), model, tokenizer, batch, do_sample=False)
    assert torch.equal(sampled["responses"], greedy["responses"])
    assert (sampled["rollout_log_prob"] == 0).all(), "top-k 1 leaves one token: log 1 = 0"


def test_hf_samples_do_not_depend_on_batch_or_split(model: nn.Module, tokenizer: Any,
                                                    batch: dict[str, Any]) -> None:
    params = {"temperature": 1.0, "top_p": 0.9, "top_k": 40}
    whole = _call(_ctx(2), model, tokenizer, batch, **params)
    halves = [_call(_ctx(2, row_offset=k * BP // 2), model, tokenizer, batch,
                    slice(2 * k, 2 * k + 2), **params) for k in (0, 1)]
    for name in ("responses", "response_mask", "rollout_log_prob", "index"):
        torch.testing.assert_close(torch.cat([h[name] for h in halves]), whole[name],
                                   atol=1e-5, rtol=0, msg=name)
    again = _call(_ctx(2), model, tokenizer, batch, **params)
    assert torch.equal(again["responses"], whole["responses"]), "same seed, same samples"
    responses = whole["responses"].view(BP, 2, -1)
    assert not torch.equal(responses[:, 0], responses[:, 1]), "sample j has its own seed"
    for other in (_ctx(2, step=1), _ctx(2, seed=1)):
        assert not torch.equal(_call(other, model, tokenizer, batch, **params)["responses"],
                               whole["responses"])


@pytest.mark.parametrize("name", [MODEL, "builtin:tiny-tied"])
def test_hf_lean_decoding_changes_no_sample(name: str, tokenizer: Any, batch: dict[str, Any],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # The decode's shortcuts (padding columns dropped, a prepared boolean mask, a KV cache
    # in reserved buffers, inference mode) against the plain loop without any of them.
    lean_model = load_model(name).eval()
    prompts = batch["input_ids"].repeat_interleave(2, 0)
    mask = batch["attention_mask"].repeat_interleave(2, 0)
    seeds = list(range(len(prompts)))
    spec = SamplingSpec(12, 1.0, 0.9, 40, False, (EOS,), PAD)
    lean = decode(lean_model, prompts, mask, seeds, spec)
    assert not any(v.is_inference() for v in lean.values()), "usable by autograd"
    monkeypatch.setattr(generate_module, "first_prompt_column", lambda m: 0)
    monkeypatch.setattr(generate_module, "_takes_boolean_masks", lambda m: False)
    monkeypatch.setattr(generate_module, "_reserve", lambda cache, capacity: None)
    with torch.no_grad():
        plain = generate_module._decode(lean_model, prompts, mask, seeds, spec, bool)
    assert torch.equal(lean["responses"], plain["responses"])
    assert torch.equal(lean["response_mask"], plain["response_mask"])
    torch.testing.assert_close(lean["rollout_log_prob"], plain["rollout_log_prob"],
                               atol=1e-5, rtol=0)


def test_boolean_masks_only_for_sdpa_with_full_attention_layers(model: nn.Module) -> None:
    assert model.config._attn_implementation == "sdpa"
    assert generate_module._takes_boolean_masks(model)
    full = {"_attn_implementation": "sdpa", "sliding_window": None, "layer_types": None}
    assert generate_module._takes_boolean_masks(SimpleNamespace(config=SimpleNamespace(**full)))
    for change in ({"_attn_implementation": "eager"}, {"sliding_window": 16},
                   {"layer_types": ["full_attention", "sliding_attention"]}):
        config = SimpleNamespace(**{**full, **change})
        assert not generate_module._takes_boolean_masks(SimpleNamespace(config=config)), change


def test_hf_params_override_dims_and_keep_the_model_mode(model: nn.Module, tokenizer: Any,
                                                         batch: dict[str, Any]) -> None:
    model.train()
    try:
        out = _call(_ctx(n=2, T=16), model, tokenizer, batch, n=3, max_new_tokens=5)
        assert model.training, "generate restores train mode"
    finally:
        model.eval()
    assert out["responses"].shape == (BP * 3, 5) and "ground_truth" not in out


# --- vllm backend: one engine for the whole section ------------------------------------------

def _memory(sequences: int, max_model_len: int) -> Any:
    """What the node asks of its engine (a KV cache sized for the rollout)."""
    from flowgraph.compilers.vllm import engine as _vllm

    return _vllm.Memory(max_model_len, _vllm.kv_cache_size(load_model(MODEL), sequences,
                                                           max_model_len))


@pytest.fixture(scope="module")
def vllm_model(tokenizer: Any) -> Iterator[nn.Module]:
    """A model with a running engine (built once: ~40 s on 2 CPU cores)."""
    try:
        from flowgraph.compilers.vllm import engine as _vllm
    except ImportError as exc:
        pytest.fail(f"vLLM is not importable: {exc}", pytrace=False)
    model = _eos_prone(load_model(MODEL))
    # enforce_eager: no torch.compile warm-up (~30 s more) for this small test. Sized for
    # the largest call below (4 samples of each prompt, T = 16), so no call restarts it.
    _vllm.engine(model, tokenizer, _memory(BP * 4, P + 16), enforce_eager=True)
    yield model
    _vllm.close_engines()


def _vllm_call(ctx: NodeContext, model: nn.Module, tokenizer: Any, batch: dict[str, Any],
               rows: slice = slice(None), **params: Any) -> dict[str, Any]:
    return _call(ctx, model, tokenizer, batch, rows, backend="vllm", **params)


def test_vllm_backend(vllm_model: nn.Module, tokenizer: Any, batch: dict[str, Any]) -> None:
    """Contract, EOS, seeds and greedy agreement with hf, against one running engine."""
    n, T = 4, 16
    out = _vllm_call(_ctx(n, T), vllm_model, tokenizer, batch,
                     ground_truth=batch["ground_truth"], temperature=0.2)
    _check_contract(out, batch, n, T)
    lengths = out["response_mask"].sum(-1)
    assert (lengths < T).any() and (lengths == T).any(), "some samples end at EOS"
    torch.testing.assert_close(out["rollout_log_prob"], _rescore(vllm_model, out, 0.2),
                               atol=1e-3, rtol=0)

    halves = [_vllm_call(_ctx(n, T, row_offset=k * BP // 2), vllm_model, tokenizer, batch,
                         slice(2 * k, 2 * k + 2), temperature=0.2) for k in (0, 1)]
    assert torch.equal(torch.cat([h["responses"] for h in halves]), out["responses"])

    greedy = _vllm_call(_ctx(1, T), vllm_model, tokenizer, batch, do_sample=False)
    hf = _call(_ctx(1, T), vllm_model, tokenizer, batch, do_sample=False)
    assert torch.equal(greedy["responses"], hf["responses"])
    torch.testing.assert_close(greedy["rollout_log_prob"], hf["rollout_log_prob"],
                               atol=1e-4, rtol=0)


def test_vllm_sync_weights(vllm_model: nn.Module, tokenizer: Any,
                           batch: dict[str, Any]) -> None:
    """Changed weights reach the running engine: vLLM's log-probs follow the HF model's."""
    from flowgraph.compilers.vllm import engine as _vllm

    llm = _vllm.engine(vllm_model, tokenizer, _memory(BP * 4, P + 16))
    # A fused AdamW step writes the weights without bumping their version counters.
    params = list(vllm_model.parameters())
    generator = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    torch.optim.AdamW(params, lr=0.02, fused=True).step()
    vllm_model.zero_grad(set_to_none=True)
    stale = _vllm.rollout(llm, batch["input_ids"], batch["attention_mask"], [0] * BP,
                          SamplingSpec(8, 1.0, 1.0, 0, True, (EOS,), PAD))
    out = _vllm_call(_ctx(1, 8), vllm_model, tokenizer, batch, do_sample=False)  # syncs
    assert not torch.allclose(stale["rollout_log_prob"], out["rollout_log_prob"], atol=1e-3)
    torch.testing.assert_close(out["rollout_log_prob"], _rescore(vllm_model, out, 0.0),
                               atol=1e-3, rtol=0)
    hf = _call(_ctx(1, 8), vllm_model, tokenizer, batch, do_sample=False)
    assert torch.equal(out["responses"], hf["responses"])

    # A second model from the same folder shares the engine; the explicit call syncs it.
    other = load_model(MODEL)
    _vllm.sync_weights(llm, other)
    fresh = _vllm.rollout(llm, out["prompts"], out["prompt_mask"], [0] * BP,
                          SamplingSpec(8, 1.0, 1.0, 0, True, (EOS,), PAD))
    rescored = logprob(other, out["prompts"], out["prompt_mask"], fresh["responses"],
                       fresh["response_mask"], temperature=0.0)["log_prob"]
    torch.testing.assert_close(fresh["rollout_log_prob"], rescored, atol=1e-3, rtol=0)


def test_vllm_takes_a_lora_model_merged_and_each_sync_is_verified(
        vllm_model: nn.Module, tokenizer: Any, batch: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A LoRA model's layers reach the engine merged (W + scale*B*A); `verify_sync` finds
    the peers' silent failure, an engine left sampling the base model."""
    from flowgraph.compilers.build import add_adapters
    from flowgraph.compilers.vllm import engine as _vllm
    from flowgraph.ir import LoraSpec

    llm = _vllm.engine(vllm_model, tokenizer, _memory(BP * 4, P + 16))
    lora = add_adapters(load_model(MODEL), LoraSpec(r=4), 0, "actor")
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    probe = [ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"],
                                                      batch["attention_mask"], strict=True)]
    _vllm.sync_weights(llm, lora)
    assert weight_sync.verify(llm, lora, probe, "actor") < 1e-3
    out = _vllm.rollout(llm, batch["input_ids"], batch["attention_mask"], [0] * BP,
                        SamplingSpec(8, 1.0, 1.0, 0, True, (EOS,), PAD))
    torch.testing.assert_close(out["rollout_log_prob"], logprob(
        lora, batch["input_ids"], batch["attention_mask"], out["responses"],
        out["response_mask"])["log_prob"], atol=1e-3, rtol=0)

    _vllm.sync_weights(llm, load_model(MODEL))  # the adapters never arrived
    with pytest.raises(weight_sync.WeightSyncError, match=r"model `actor`.* differ from the "
                       r"trainer's by up to .*a LoRA adapter"):
        weight_sync.verify(llm, lora, probe, "actor")

    # engine() checks its first sync: a sync that drops the adapters stops the run
    def unmerged(model: nn.Module, whole: Any) -> Iterator[tuple[str, Tensor]]:
        for name, p in model.named_parameters():
            if "lora_" not in name:
                yield name.replace(".base_layer", ""), whole(p.detach())

    monkeypatch.setattr(weight_sync, "merged_parameters", unmerged)
    monkeypatch.setattr(_vllm._ENGINES[str(vllm_model.name_or_path)], "syncs", 0)
    with pytest.raises(weight_sync.WeightSyncError):
        _vllm.engine(lora, tokenizer, _memory(BP * 4, P + 16), probe=probe)
    monkeypatch.undo()
    _vllm.sync_weights(llm, vllm_model)  # the engine as the other tests expect it


def test_vllm_serves_a_tied_model_with_its_own_head(tokenizer: Any) -> None:
    """A tied LM head is the embedding (sent once): after each sync the engine's head is
    tied to it again. Before that fix the engine kept its random start's head and
    sampled another policy (verify_sync measured a log-prob gap of 0.5-1.1)."""
    from flowgraph.compilers.vllm import engine as _vllm

    tied = load_model("builtin:tiny-tied")
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    llm = _vllm.engine(tied, load_tokenizer("builtin:tiny-tied"), _memory(BP, P + 16),
                       enforce_eager=True)
    probe = [[5, 17, 42, 99, 7, 3, 8], [11, 12, 13, 14]]
    try:
        assert weight_sync.verify(llm, tied, probe, "tied") < 1e-4
        with torch.no_grad():  # a second sync: the new embedding is the new head
            tied.get_input_embeddings().weight.mul_(1.5)
        _vllm.sync_weights(llm, tied)
        assert weight_sync.verify(llm, tied, probe, "tied") < 1e-4
    finally:
        _vllm.close_engines(str(tied.name_or_path))


def test_a_synced_tensor_keeps_a_resizable_storage() -> None:
    """FSDP frees an unsharded parameter by resizing its storage to 0; reading it for a
    weight sync must not pin its size (`.numpy()` on the tensor itself would)."""

    tensor = torch.arange(6, dtype=torch.float32)
    name, dtype, shape, data = weight_sync.wire("w", tensor)
    assert (name, dtype, shape) == ("w", "float32", [6]) and data == tensor.numpy().tobytes()
    tensor = torch.arange(6, dtype=torch.float32)
    weight_sync.wire("w", tensor)
    tensor.untyped_storage().resize_(0)


def test_vllm_kv_cache_is_sized_for_the_rollout(model: nn.Module) -> None:
    """Per token: 2 layers × (K, V) × 2 KV heads × head_dim 64 × 4 bytes = 2048 bytes; a
    sequence takes whole 128-token blocks; 1.25 margin. 16 sequences of P+T = 28 tokens:
    16 × 128 × 2048 × 1.25 = 5 MiB; of 129 tokens, two blocks each: 10 MiB."""
    from flowgraph.compilers.vllm import engine as _vllm

    assert _vllm.kv_cache_size(model, 16, 28) == 5 * 2**20
    assert _vllm.kv_cache_size(model, 16, 129) == 10 * 2**20
    small, longer = _vllm.Memory(28, 5 * 2**20), _vllm.Memory(129, 10 * 2**20)
    assert longer.serves(small) and not small.serves(longer)
    assert not _vllm.Memory(28, None, 0.3).serves(small)


def test_vllm_engine_that_cannot_start_names_what_it_asked_for(tokenizer: Any) -> None:
    """A KV cache no machine has: one error with the size asked for, not vLLM's stack.
    (Last in the module: it replaces the engine the tests above share.)"""
    from flowgraph.compilers.vllm import engine as _vllm
    from flowgraph.errors import FlowgraphError

    with pytest.raises(FlowgraphError, match=r"did not start with a KV cache of 1048576\.000 "
                                             r"GiB \(sequences of up to 28 tokens\).*NUMA"):
        _vllm.engine(load_model(MODEL), tokenizer, _vllm.Memory(28, 2**50), enforce_eager=True)
    _vllm.close_engines()
