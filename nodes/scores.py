"""Built-in scoring functions with verl's signature, for the `compute_score` kind.

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float

* `gsm8k`: the number after the last `#### ` (commas and `$` dropped) equals the ground
  truth: 1, a different number: 0 (verl's `gsm8k.compute_score`, strict method, which
  reads the last 300 characters; Cobbe et al. 2021's answer format).
* `math`: the content of the last `\\boxed{…}` (or `\\fbox{…}`, `\\boxed …`) equals the
  ground truth after the Hendrycks et al. 2021 normalisation of LaTeX answers (fractions,
  square roots, units, degrees, `\\left`/`\\right`, spaces, a leading variable `k =`):
  1, else 0 (verl's `math_reward.compute_score`, the lm-evaluation-harness rule). With
  `math-verify` installed, `math_verify` is Hugging Face's symbolic checker instead.

Equal to verl 0.9.1's functions on tests/fixtures/verl/reward_scores.json
(scripts/verl_reward_fixtures.py).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["BUILTIN_SCORES", "gsm8k", "math", "math_verify"]

_GSM8K_TAIL = 300
"""verl reads only a solution's last 300 characters (the answer comes last)."""


def gsm8k(data_source: str | None, solution_str: str, ground_truth: str,
          extra_info: Any = None) -> float:
    """1.0 when the number after the last `#### ` equals `ground_truth`, else 0.0."""
    found = re.findall(r"#### (\-?[0-9\.\,]+)", solution_str[-_GSM8K_TAIL:])
    if not found:
        return 0.0
    return 1.0 if found[-1].replace(",", "").replace("$", "") == ground_truth else 0.0


def math(data_source: str | None, solution_str: str, ground_truth: str,
         extra_info: Any = None) -> float:
    """1.0 when the last boxed answer equals `ground_truth` once both are normalised."""
    boxed = _last_boxed(solution_str)
    if boxed is None:
        return 0.0
    try:
        same = _normalise(boxed) == _normalise(ground_truth)
    except (ValueError, IndexError):  # a form the normalisation cannot read: as written
        same = boxed == ground_truth
    return 1.0 if same else 0.0


def math_verify(data_source: str | None, solution_str: str, ground_truth: str,
                extra_info: Any = None) -> float:
    """Hugging Face's `math-verify`: the answer parsed and compared symbolically."""
    from math_verify import parse, verify  # optional: pip install math-verify

    return 1.0 if verify(parse(f"\\boxed{{{ground_truth}}}"), parse(solution_str)) else 0.0


def _last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{…}` (braces balanced), or of `\\boxed …` up to a
    `$`; None when there is none, its braces never close, or it is not `\\boxed{` (an
    `\\fbox{…}`, a `\\boxed\\frac…`), which verl scores 0."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                boxed = text[start:i + 1]
                return boxed[len("\\boxed{"):-1] if boxed.startswith("\\boxed{") else None
    return None


def _normalise(answer: str) -> str:
    """A LaTeX answer in the canonical form the MATH benchmark compares; ValueError or
    IndexError for a form it cannot read (then the raw strings are compared)."""
    s = answer
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"),
                     ("dfrac", "frac"), ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""),
                     ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    if "\\text{ " in s:  # units on the right
        parts = s.split("\\text{ ")
        if len(parts) != 2:
            raise ValueError(f"several unit texts in {answer!r}")
        s = parts[0]
    s = s.replace("\\\\%", "").replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # `k = 5`
        s = sides[1]
    s = _fix_fracs(_fix_sqrt(s).replace(" ", ""))
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def _fix_sqrt(s: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}`."""
    head, *rest = s.split("\\sqrt")
    return head + "".join("\\sqrt" + (p if p[0] == "{" else "{" + p[0] + "}" + p[1:])
                          for p in rest)


def _fix_fracs(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{72}` -> `\\frac{1}{72}`."""
    head, *rest = s.split("\\frac")
    out = head
    for p in rest:
        if p[0] == "{":
            out += "\\frac" + p
        elif len(p) < 2:
            return s
        elif p[1] == "{":
            out += "\\frac{" + p[0] + "}" + p[1:]
        else:
            out += "\\frac{" + p[0] + "}{" + p[1] + "}" + p[2:]
    return out


def _fix_a_slash_b(s: str) -> str:
    """`3/4` -> `\\frac{3}{4}` for integers written plainly."""
    parts = s.split("/")
    if len(parts) != 2 or not all(re.fullmatch(r"-?\d+", p) for p in parts):
        return s
    a, b = (int(p) for p in parts)
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


BUILTIN_SCORES = {"gsm8k": gsm8k, "math": math}
"""The built-in functions by the names `compute_score`'s `fn` takes."""
