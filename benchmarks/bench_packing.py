"""Benchmark: a packed forward + backward (`packing: true`) against the padded one.

Run:  python benchmarks/bench_packing.py                      (CPU, SDPA, T = 32 and 256)
      python benchmarks/bench_packing.py --device cuda --dtype bfloat16 \\
          --attn flash_attention_2 --hidden 1024 --layers 8 --lengths 512 2048

A random Llama (the built-in tiny-lm's architecture; `--hidden`, `--layers` widen it)
scores B = 32 responses of uniformly drawn lengths (prompts 4..16 tokens, left-padded
to 16; responses 1..T, right-padded to T) as the update does: `logprob` with gradients,
then backward. Padded, the backbone computes B × (longest prompt + longest response)
tokens; packed, one row of the valid ones, position ids restarting per sequence. Each
variant is warmed up once, then the two alternate `--repeats` times and the fastest
run of each is printed with the ratio padded / packed, and the largest difference of
the log-probs and of the gradients (the numbers must be the padded run's).

Packing pays where attention is varlen (flash_attention_2 on a GPU); with SDPA or
eager, transformers attends through one N × N block-diagonal mask over all N tokens,
which costs more than the padding saved once responses are long. That is why pass
`packing` turns it on only for varlen attention.

Notation: B sequences, P prompt length, T response length, N valid tokens.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flowgraph.builtin_models import BUILTIN_MODELS
from flowgraph.nodes.logprob import logprob

B, P = 32, 16


def _model(args: argparse.Namespace) -> LlamaForCausalLM:
    config = {k: v for k, v in BUILTIN_MODELS["tiny-lm"].items() if k != "model_type"}
    if args.hidden:
        config |= {"hidden_size": args.hidden, "intermediate_size": 4 * args.hidden,
                   "num_attention_heads": args.hidden // 64,
                   "num_key_value_heads": args.hidden // 64}
    if args.layers:
        config["num_hidden_layers"] = args.layers
    config["max_position_embeddings"] = max(int(config.get("max_position_embeddings", 0)),
                                            P + max(args.lengths))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config, attn_implementation=args.attn))
    return model.to(device=args.device, dtype=getattr(torch, args.dtype))


def _batch(T: int, V: int, device: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(T)
    p = torch.randint(4, P + 1, (B,), generator=g)
    r = torch.randint(1, T + 1, (B,), generator=g)
    prompts = torch.randint(3, V, (B, P), generator=g)
    responses = torch.randint(3, V, (B, T), generator=g)
    prompt_mask = (torch.arange(P) >= P - p.unsqueeze(-1)).long()
    response_mask = (torch.arange(T) < r.unsqueeze(-1)).long()
    return tuple(t.to(device) for t in (prompts, prompt_mask, responses, response_mask))


def _step(model: LlamaForCausalLM, batch: tuple[torch.Tensor, ...], packing: bool,
          device: str) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = logprob(model, *batch, packing=packing)["log_prob"]
    out.sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return seconds, out.detach(), {n: p.grad.detach().clone()
                                   for n, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 256],
                        help="response lengths T to run")
    parser.add_argument("--attn", default="sdpa",
                        choices=("sdpa", "eager", "flash_attention_2"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--hidden", type=int, default=0, help="hidden size (0: tiny-lm's)")
    parser.add_argument("--layers", type=int, default=0, help="layers (0: tiny-lm's)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = _model(args)
    print(f"{args.attn} on {args.device} ({args.dtype}), B = {B}, P = {P}, hidden "
          f"{model.config.hidden_size}, {model.config.num_hidden_layers} layers")
    for T in args.lengths:
        batch = _batch(T, model.config.vocab_size, args.device)
        valid = int(batch[1].sum() + batch[3].sum())
        width = int(batch[1].any(0).sum() + batch[3].any(0).sum())
        # a warm-up of each, whose numbers are compared
        (_, lp0, g0), (_, lp1, g1) = (_step(model, batch, packing, args.device)
                                      for packing in (False, True))
        best = {False: float("inf"), True: float("inf")}
        for _ in range(args.repeats):
            for packing in (False, True):
                best[packing] = min(best[packing], _step(model, batch, packing, args.device)[0])
        grad_diff = max(float((g1[n] - g0[n]).abs().max()) for n in g0)
        print(f"T = {T}: {valid} valid tokens of {B * width} padded "
              f"({B * width / valid:.2f}x); padded {1e3 * best[False]:.1f} ms, packed "
              f"{1e3 * best[True]:.1f} ms: packed is {best[False] / best[True]:.2f}x as "
              f"fast; max |d log-prob| {float((lp1 - lp0).abs().max()):.1e}, max "
              f"|d grad| {grad_diff:.1e}")


if __name__ == "__main__":
    main()
