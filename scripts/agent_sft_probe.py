"""How the agent warm-ups behave before RL: tool-call rate, well-formed calls, copying.

For the calculator (`--task mul`): each held-out problem's turn 1 is sampled (hf
decode, temperature `-t`); a Hermes call is parsed by hand, run (`calculator` of
graphs/agent_calculator.py), its `tool` message rendered with the chat template, and
turn 2 sampled. For guess the number (`--task guess`): whole games against the
higher / lower answers. Not a rollout kind: a check of the warm-up data and recipe.

    python scripts/agent_sft_probe.py builtin:tiny-lm-calc --task mul -n 4
    python scripts/agent_sft_probe.py builtin:tiny-lm-guess --task guess -n 8
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import torch

from flowgraph.builtin_models import BUILTIN_PREFIX, TRAINED_BUILTINS
from flowgraph.compilers.builtin_training import ensure_builtin
from flowgraph.data.agent_tasks import GUESS_PROMPT, guess_problems, mul_problems
from flowgraph.nodes.generate import SamplingSpec, decode
from flowgraph.nodes.models import load_model, load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "graphs"))
from agent_calculator import calculator

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def sample(model, tok, texts: list[str], seed: int, t: float, T: int) -> list[str]:
    """One turn per text (the conversation so far, rendered), sampled with the hf backend."""
    enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt",
              padding_side="left")
    spec = SamplingSpec(max_new_tokens=T, temperature=t, top_p=1.0, top_k=0, greedy=t == 0,
                        stop_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id)
    out = decode(model, enc.input_ids, enc.attention_mask,
                 [seed * 100003 + i for i in range(len(texts))], spec)
    rows = []
    for ids, mask in zip(out["responses"], out["response_mask"], strict=True):
        rows.append(tok.decode(ids[mask.bool()], skip_special_tokens=True))
    return rows


def render(tok, messages: list[dict[str, str]]) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def probe_mul(model, tok, n: int, t: float) -> dict[str, float]:
    problems = mul_problems("test")
    calls = formed = right_args = copied = direct = direct_right = total = 0
    answered_right = 0
    for seed in range(n):
        chats = [[{"role": "user", "content": q}] for q, _ in problems]
        first = sample(model, tok, [render(tok, c) for c in chats], seed, t, 80)
        second_idx, second_chats = [], []
        for i, ((q, a), turn) in enumerate(zip(problems, first, strict=True)):
            total += 1
            match = CALL.search(turn)
            if match is None:
                direct += 1
                direct_right += turn.strip() == a
                answered_right += turn.strip() == a
                continue
            calls += 1
            try:
                call = json.loads(match.group(1))
                result = str(calculator(**call["arguments"]))
                formed += call.get("name") == "calculator"
            except Exception as exc:  # a malformed call: the model sees the error
                result = f"error: {exc}"
            else:
                right_args += call["arguments"].get("expression") == q.rstrip("=")
            second_idx.append(i)
            second_chats.append([*chats[i], {"role": "assistant", "content": turn},
                                 {"role": "tool", "content": result}])
        if second_chats:
            second = sample(model, tok, [render(tok, c) for c in second_chats], seed + 7, t, 16)
            for i, c, turn in zip(second_idx, second_chats, second, strict=True):
                copied += turn.strip() == c[-1]["content"]
                answered_right += turn.strip() == problems[i][1]
    out = {"tool_rate": calls / total, "well_formed": formed / max(calls, 1),
           "right_arguments": right_args / max(calls, 1), "copied": copied / max(calls, 1),
           "direct_right": direct_right / max(direct, 1), "accuracy": answered_right / total}
    print(f"turns: {total}; tool calls {out['tool_rate']:.1%}; well-formed "
          f"{out['well_formed']:.1%}; arguments = the question {out['right_arguments']:.1%}; "
          f"final answer copies the tool result {out['copied']:.1%}; direct answers right "
          f"{out['direct_right']:.1%} of {direct}; accuracy {out['accuracy']:.1%}")
    return out


def probe_guess(model, tok, n: int, t: float, max_turns: int) -> dict[str, float]:
    numbers = [int(a) for _, a in guess_problems("test")] * n
    chats = [[{"role": "user", "content": GUESS_PROMPT}] for _ in numbers]
    turns = [0] * len(numbers)
    done = [False] * len(numbers)
    invalid = 0
    for k in range(max_turns):
        live = [i for i, d in enumerate(done) if not d]
        if not live:
            break
        out = sample(model, tok, [render(tok, chats[i]) for i in live], k, t, 4)
        for i, turn in zip(live, out, strict=True):
            turns[i] += 1
            chats[i].append({"role": "assistant", "content": turn})
            try:
                g = int(turn.strip())
            except ValueError:
                invalid += 1
                g = -1
            if g == numbers[i]:
                done[i] = True
            else:
                chats[i].append({"role": "user",
                                 "content": "higher" if numbers[i] > g else "lower"})
    won = [tu for tu, d in zip(turns, done, strict=True) if d]
    out = {"won": len(won) / len(numbers), "turns": statistics.mean(turns)}
    print(f"games: {len(numbers)}; won {out['won']:.1%} within {max_turns} turns; "
          f"mean turns {out['turns']:.2f} (won games: "
          f"{statistics.mean(won) if won else 0:.2f}); unparsable guesses {invalid}")
    return out


def probe(model_path: str, task: str = "mul", n: int = 4, t: float = 1.0,
          max_turns: int = 8) -> dict[str, float]:
    """The probe's numbers for a model (a trained built-in is trained first if absent)."""
    name = model_path.removeprefix(BUILTIN_PREFIX)
    if model_path.startswith(BUILTIN_PREFIX) and name in TRAINED_BUILTINS:
        ensure_builtin(name)
    torch.manual_seed(0)
    model = load_model(model_path).eval()
    tok = load_tokenizer(model_path)
    with torch.inference_mode():
        if task == "mul":
            return probe_mul(model, tok, n, t)
        return probe_guess(model, tok, n, t, max_turns)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="builtin:<trained built-in> or an exported model folder")
    ap.add_argument("--task", choices=("mul", "guess"), default="mul")
    ap.add_argument("-n", type=int, default=4, help="samples per held-out problem")
    ap.add_argument("-t", type=float, default=1.0, help="temperature")
    ap.add_argument("--max-turns", type=int, default=8)
    args = ap.parse_args()
    probe(args.model, args.task, args.n, args.t, args.max_turns)


if __name__ == "__main__":
    main()
