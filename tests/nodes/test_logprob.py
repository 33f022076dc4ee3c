"""Chunked log-probs and entropy against a plain log_softmax + gather reference."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM

from flowgraph.builtin_models import BUILTIN_MODELS
from flowgraph.nodes.logprob import forward_hidden, head_logprob, logprob, sequence_logprob

B, P, T, H, V = 3, 5, 7, 16, 50
CHUNKS = [1, 3, 4, 11, 1000]  # n = 11 valid tokens: 3 and 4 leave a short last chunk


def _batch(seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Left-padded prompts; response rows: full, a hole and a short tail, empty."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, V, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.int64)
    prompt_mask[1, :2] = 0
    prompt_mask[2, :4] = 0
    responses = torch.randint(3, V, (B, T), generator=g)
    response_mask = torch.ones(B, T, dtype=torch.int64)
    response_mask[1, 2] = 0  # a masked tool-output token in the middle
    response_mask[1, 5:] = 0
    response_mask[2, :] = 0
    return prompts, prompt_mask, responses, response_mask


def _reference(logits: Tensor, responses: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The plain O(B·T·V) computation the chunked path must equal."""
    log_p_all = torch.log_softmax(logits.float(), dim=-1)
    log_p = log_p_all.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p_all.exp() * log_p_all).sum(-1)
    return log_p * mask, entropy * mask


def _head() -> tuple[nn.Linear, Tensor]:
    torch.manual_seed(0)
    lm_head = nn.Linear(H, V, bias=True)
    hidden = 3 * torch.randn(B, T, H)  # peaked distributions, not near-uniform ones
    return lm_head, hidden


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_head_logprob_equals_reference(chunk_size: int, temperature: float) -> None:
    lm_head, hidden = _head()
    _, _, responses, mask = _batch()
    with torch.no_grad():
        out = head_logprob(
            lm_head, hidden, responses, mask, chunk_size, temperature, with_entropy=True
        )
        ref_lp, ref_ent = _reference(lm_head(hidden) / temperature, responses, mask)
    torch.testing.assert_close(out["log_prob"], ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(out["entropy"], ref_ent, atol=1e-5, rtol=0)
    assert out["log_prob"].dtype == torch.float32
    assert (out["log_prob"][mask == 0] == 0).all() and (out["entropy"] >= 0).all()


@pytest.mark.parametrize(("temperature", "entropy_coef"), [(1.0, 0.0), (1.0, 0.1), (0.7, 0.1)])
@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_head_logprob_gradients_equal_reference(
    chunk_size: int, temperature: float, entropy_coef: float
) -> None:
    lm_head, hidden = _head()
    _, _, responses, mask = _batch()
    weights = torch.randn(B, T)  # an arbitrary upstream gradient

    def grads(fn: str) -> list[Tensor]:
        h = hidden.clone().requires_grad_(True)
        lm_head.zero_grad()
        if fn == "chunked":
            out = head_logprob(
                lm_head, h, responses, mask, chunk_size, temperature, with_entropy=entropy_coef > 0
            )
            log_p, entropy = out["log_prob"], out.get("entropy", torch.zeros(()))
        else:
            log_p, entropy = _reference(lm_head(h) / temperature, responses, mask)
        ((weights * log_p).sum() + entropy_coef * (weights * entropy).sum()).backward()
        return [h.grad, lm_head.weight.grad, lm_head.bias.grad]

    for got, want in zip(grads("chunked"), grads("reference"), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk_size", [3, 1000])
def test_an_entropy_without_gradient_comes_from_the_same_pass(chunk_size: int) -> None:
    """entropy_grad=False (the actor update's metric when entropy_coeff is 0): the
    entropy of the reference, no gradient through it, and the log-probs' gradient that
    of a pass without entropy."""
    lm_head, hidden = _head()
    _, _, responses, mask = _batch()
    weights = torch.randn(B, T)

    def run(**kw: bool) -> tuple[dict[str, Tensor], list[Tensor]]:
        h = hidden.clone().requires_grad_(True)
        lm_head.zero_grad()
        out = head_logprob(lm_head, h, responses, mask, chunk_size, 0.7, **kw)
        (weights * out["log_prob"]).sum().backward()
        assert h.grad is not None and lm_head.weight.grad is not None
        return out, [h.grad, lm_head.weight.grad]

    metric, got = run(with_entropy=True, entropy_grad=False)
    _, want = run()
    assert not metric["entropy"].requires_grad
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    _, ref_entropy = _reference(lm_head(hidden) / 0.7, responses, mask)
    torch.testing.assert_close(metric["entropy"], ref_entropy.detach(), atol=1e-5, rtol=0)


def test_autograd_keeps_no_full_logits() -> None:
    """With grad, nothing of size n·V outlives a chunk: checkpoint recomputes every chunk
    but the last, whose logits (the backward pass starts with them) are all it keeps."""
    lm_head, hidden = _head()
    _, _, responses, mask = _batch()
    n, chunk = int(mask.sum()), 4
    saved: list[torch.Size] = []

    def pack(t: Tensor) -> Tensor:
        if t.data_ptr() != lm_head.weight.data_ptr():  # not the head's own weight
            saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        head_logprob(
            lm_head, hidden.requires_grad_(True), responses, mask, chunk, with_entropy=True
        )
    logits = [shape for shape in saved if shape[-1] == V]
    assert n % chunk != 0 and logits == [(n % chunk, V)]  # the last, shorter chunk only
    assert max(shape.numel() for shape in saved) < chunk * V < n * V
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _reference(lm_head(hidden), responses, mask)
    assert max(shape.numel() for shape in saved) >= n * V  # the plain path does keep them


def test_the_backward_pass_starts_with_the_kept_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why keeping the last chunk's logits costs no peak memory: its backward runs first,
    before any recomputed chunk is made (the chunks' backward in reverse order)."""
    import flowgraph.nodes.logprob as logprob_module

    lm_head, hidden = _head()
    _, _, responses, mask = _batch()
    n, chunk = int(mask.sum()), 4
    order: list[int] = []
    real = logprob_module._TokenStats.backward

    def backward(ctx: object, g_log_p: Tensor, *rest: Tensor) -> object:
        order.append(len(g_log_p))
        return real(ctx, g_log_p, *rest)

    monkeypatch.setattr(logprob_module._TokenStats, "backward", staticmethod(backward))
    out = head_logprob(lm_head, hidden.requires_grad_(True), responses, mask, chunk,
                       with_entropy=True)
    (out["log_prob"].sum() + out["entropy"].sum()).backward()
    sizes = [min(chunk, n - i) for i in range(0, n, chunk)]
    assert order == sizes[::-1] and order[0] == n % chunk


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    config = {k: v for k, v in BUILTIN_MODELS["tiny-lm"].items() if k != "model_type"}
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**config, "vocab_size": V})).eval()


def _model_reference(model: LlamaForCausalLM) -> tuple[Tensor, Tensor]:
    """Full logits of [prompt | response]; the logit at P-1+t predicts response token t.
    A hole in a response (a tool's output) is attended to, as the policy saw it: the
    attention covers each response up to its last valid token."""
    prompts, prompt_mask, responses, mask = _batch()
    span = mask.clone()
    span[1, 2] = 1  # row 1's hole
    attention = torch.cat([prompt_mask, span], 1)
    positions = (attention.cumsum(-1) - 1).clamp_min(0)
    logits = model(
        input_ids=torch.cat([prompts, responses], 1),
        attention_mask=attention,
        position_ids=positions,
    ).logits[:, P - 1 : P + T - 1]
    return _reference(logits, responses, mask)


@pytest.mark.parametrize(("chunk_size", "micro_batch_size"), [(3, None), (1024, 2), (5, 1)])
def test_logprob_equals_full_model_logits(
    model: LlamaForCausalLM, chunk_size: int, micro_batch_size: int | None
) -> None:
    with torch.no_grad():
        out = logprob(
            model,
            *_batch(),
            chunk_size=chunk_size,
            micro_batch_size=micro_batch_size,
            with_entropy=True,
        )
        ref_lp, ref_ent = _model_reference(model)
    assert out["log_prob"].shape == out["entropy"].shape == (B, T)
    torch.testing.assert_close(out["log_prob"], ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(out["entropy"], ref_ent, atol=1e-5, rtol=0)
    assert "entropy" not in logprob(model, *_batch(), chunk_size=chunk_size)


def test_logprob_gradients_reach_the_backbone(model: LlamaForCausalLM) -> None:
    model.zero_grad()
    logprob(model, *_batch(), chunk_size=4)["log_prob"].sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    _model_reference(model)[0].sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-5, rtol=0, msg=name)
    model.zero_grad()


def test_sequence_logprob_is_the_masked_sum(model: LlamaForCausalLM) -> None:
    with torch.no_grad():
        tokens = logprob(model, *_batch(), chunk_size=3)["log_prob"]
        seq = sequence_logprob(model, *_batch(), chunk_size=3)["log_prob"]
    assert seq.shape == (B,)
    torch.testing.assert_close(seq, tokens.sum(-1))
    assert seq[2] == 0  # the empty response


def test_forward_hidden_positions(model: LlamaForCausalLM) -> None:
    prompts, prompt_mask, responses, mask = _batch()
    with torch.no_grad():
        before = forward_hidden(model, prompts, prompt_mask, responses, mask)
        on = forward_hidden(model, prompts, prompt_mask, responses, mask, on_tokens=True)
    assert before.shape == on.shape == (B, T, model.config.hidden_size)
    torch.testing.assert_close(before[:, 1:], on[:, :-1])  # shifted by one position


def test_mismatched_shapes_are_named(model: LlamaForCausalLM) -> None:
    prompts, prompt_mask, responses, mask = _batch()
    with pytest.raises(ValueError, match=r"response_mask=\(3, 6\)"):
        logprob(model, prompts, prompt_mask, responses, mask[:, :6])


def test_padding_every_row_shares_is_trimmed_and_changes_nothing(model: LlamaForCausalLM
                                                                  ) -> None:
    """The batch with 3 more all-pad prompt columns (left) and 4 more all-pad response
    columns (right): the backbone runs on the original length, and the valid tokens'
    log-probs, entropies and states are those of the unpadded batch."""
    prompts, prompt_mask, responses, mask = _batch()
    wide = (torch.nn.functional.pad(prompts, (3, 0), value=0),
            torch.nn.functional.pad(prompt_mask, (3, 0), value=0),
            torch.nn.functional.pad(responses, (0, 4), value=0),
            torch.nn.functional.pad(mask, (0, 4), value=0))
    lengths: list[int] = []
    hook = model.model.register_forward_pre_hook(
        lambda _m, _a, kw: lengths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        with torch.no_grad():
            narrow_out = logprob(model, prompts, prompt_mask, responses, mask, with_entropy=True)
            wide_out = logprob(model, *wide, with_entropy=True)
            on = forward_hidden(model, *wide, on_tokens=True)
            on_narrow = forward_hidden(model, prompts, prompt_mask, responses, mask,
                                       on_tokens=True)
    finally:
        hook.remove()
    assert lengths == [P + T] * 4
    for name in ("log_prob", "entropy"):
        assert wide_out[name].shape == (B, T + 4)
        torch.testing.assert_close(wide_out[name][:, :T], narrow_out[name], atol=0, rtol=0)
        assert not wide_out[name][:, T:].any()
    torch.testing.assert_close(on[:, :T], on_narrow, atol=0, rtol=0)
    assert not on[:, T:].any()


def _packable(seed: int = 1, rows: int = 5) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Left-padded prompts and right-padded responses of mixed lengths: one full row, one
    with an empty response, one with a single prompt token (what `packing` takes)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, V, (rows, P), generator=g)
    responses = torch.randint(3, V, (rows, T), generator=g)
    p = torch.tensor([P, 3, 1, 4, 2])[:rows]
    r = torch.tensor([T, 0, 5, 2, 6])[:rows]
    prompt_mask = (torch.arange(P) >= P - p.unsqueeze(-1)).long()
    response_mask = (torch.arange(T) < r.unsqueeze(-1)).long()
    return prompts, prompt_mask, responses, response_mask


@pytest.mark.parametrize("name", ["tiny-lm", "tiny-tied"])
def test_packing_gives_the_padded_numbers(name: str) -> None:
    """One row of the 35 valid tokens, positions restarting per sequence and no mask:
    the padded run's log-probs, entropies, states (either side of the tokens) and
    gradients, on a model with its own LM head and on a tied one."""
    config = {k: v for k, v in BUILTIN_MODELS[name].items() if k != "model_type"}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**config, "vocab_size": V})).eval()
    assert model.config.tie_word_embeddings == (name == "tiny-tied")
    batch = _packable()
    shapes: list[tuple[int, ...]] = []
    hook = model.model.register_forward_pre_hook(
        lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    grads = []
    try:
        outs = []
        for packing in (False, True):
            model.zero_grad()
            out = logprob(model, *batch, chunk_size=4, with_entropy=True, packing=packing)
            (out["log_prob"].sum() + out["entropy"].sum()).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            with torch.no_grad():
                out |= {f"hidden_{on}": forward_hidden(model, *batch, on_tokens=on,
                                                       packing=packing) for on in (False, True)}
            outs.append(out)
    finally:
        hook.remove()
    assert shapes == [(5, P + T)] * 3 + [(1, 35)] * 3  # packed: no pad token at all
    padded, packed = outs
    mask = batch[3].bool()
    for key in padded:
        got, want = packed[key], padded[key]
        if key.startswith("hidden"):  # the padded run's pad positions hold states too
            got, want = got[mask], want[mask]
            assert not packed[key][~mask].any()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=key)
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-4, msg=n)


def test_packing_takes_holes_and_refuses_a_response_after_an_empty_prompt(
        model: LlamaForCausalLM) -> None:
    """A masked token inside a response (an agent's tool output) is packed with the rest
    and attended to, as in the padded run; a response after an empty prompt has no
    state to be predicted from: a message naming the row."""
    batch = _batch()  # row 1 has a masked middle token
    with torch.no_grad():
        padded = forward_hidden(model, *batch)
        packed = forward_hidden(model, *batch, packing=True)
    valid = batch[3].bool()
    torch.testing.assert_close(packed[valid], padded[valid], atol=1e-5, rtol=0)
    prompts, prompt_mask, responses, mask = _packable()
    prompt_mask[2] = 0
    with pytest.raises(ValueError, match=r"row 2 has prompt_mask \[0, 0, 0, 0, 0\]"):
        forward_hidden(model, prompts, prompt_mask, responses, mask, packing=True)


def test_no_valid_token_still_reaches_every_parameter(model: LlamaForCausalLM) -> None:
    """A micro-batch whose response tokens are all masked (an agent's masked episodes,
    all on one worker): log-probs of 0 that hang on every parameter's graph, so that a
    sharded model's workers run the same backward (FSDP's collectives; one that skipped
    it left the other waiting forever), with a zero gradient."""
    prompts, prompt_mask, responses, mask = _batch()
    for packing in (False, True):
        out = logprob(model, prompts, prompt_mask, responses, torch.zeros_like(mask),
                      chunk_size=4, packing=packing)["log_prob"]
        assert torch.equal(out, torch.zeros(B, T)) and out.requires_grad
        model.zero_grad(set_to_none=True)
        out.sum().backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and not p.grad.any(), name
    model.zero_grad(set_to_none=True)
