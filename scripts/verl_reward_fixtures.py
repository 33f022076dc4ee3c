"""Write tests/fixtures/verl/reward_scores.json: verl 0.9.1's GSM8K and MATH scoring
functions (`verl.utils.reward_score.gsm8k` and `.math_reward`) on a set of solution
strings, the reference for `flowgraph.nodes.scores` (tests/nodes/test_reward.py).

The strings cover what the rules read: the `#### ` marker (last one, commas, `$`,
negatives, no marker, a long solution whose marker is past verl's 300-character window),
and boxed answers (nested braces, `\\boxed ` with a space, `\\fbox`, unclosed braces,
fractions written `\\frac12`, `\\dfrac`, `a/b`, `0.5`, square roots, degrees, units,
`\\left(`, `k = `, percentages, leading dots, spaces).

Run (verl is not a dependency of flowgraph; see scripts/verl_fixtures.py):

    python scripts/verl_reward_fixtures.py
"""

from __future__ import annotations

import json
from pathlib import Path

import verl
from verl.utils.reward_score import gsm8k, math_reward

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "verl" / "reward_scores.json"

GSM8K = [
    ("The answer is #### 72", "72"), ("#### 72", "71"), ("#### 1,234", "1234"),
    ("#### -5", "-5"), ("#### $5", "5"), ("first #### 3 then #### 4", "4"),
    ("first #### 3 then #### 4", "3"), ("no marker, 72", "72"), ("####72", "72"),
    ("#### 3.50", "3.5"), ("#### 3.5", "3.5"), ("x" * 400 + " #### 9", "9"),
    ("#### 9 " + "y" * 400, "9"), ("", "0"), ("#### ,", ","), ("#### 1.0.0", "1.0.0"),
]
MATH = [
    ("so \\boxed{4}", "4"), ("\\boxed{4}", "5"), ("\\boxed{\\frac{1}{2}}", "\\frac12"),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}"), ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("\\boxed{1/2}", "\\frac{1}{2}"), ("\\boxed{\\sqrt3}", "\\sqrt{3}"),
    ("\\boxed{90^\\circ}", "90"), ("\\boxed{90^{\\circ}}", "90"),
    ("\\boxed{5 \\text{ cm}}", "5"), ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)"),
    ("\\boxed{k = 7}", "7"), ("\\boxed{x=7}", "7"), ("\\boxed{50\\%}", "50"),
    ("\\boxed{.5}", "0.5"), ("\\boxed{ 3 }", "3"), ("\\boxed 3$ done", "3"),
    ("\\boxed 3", "3"), ("\\fbox{3}", "3"), ("\\boxed{3", "3"), ("no box 3", "3"),
    ("\\boxed{\\boxed{2}}", "2"), ("\\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{1} then \\boxed{2}", "1"), ("\\boxed{\\frac{a}{b}}", "a/b"),
    ("\\boxed{\\frac1{72}}", "\\frac{1}{72}"), ("\\boxed{\\frac{72}1}", "72"),
    ("\\boxed{2 \\text{ m} 3 \\text{ s}}", "2 \\text{ m} 3 \\text{ s}"),
    ("\\boxed{\\sqrt}", "\\sqrt"), ("\\boxed{\\frac}", "\\frac"), ("\\boxed{\\frac1}", "1"),
    ("\\boxed{\\$5}", "5"), ("\\boxed{-3/4}", "-\\frac{3}{4}"), ("\\boxed{03/4}", "3/4"),
    ("\\boxed{\\tfrac{3}{4}}", "\\frac34"), ("\\boxed{}", ""), ("\\boxed{a\\!b}", "ab"),
    ("\\boxed{x \\in [0, 1]}", "x\\in[0,1]"), ("\\boxed{10}", "10.0"),
    ("\\boxed\\frac{1}{2}", "\\frac{1}{2}"),
]


def main() -> None:
    cases = {
        "gsm8k": [{"solution": s, "ground_truth": g, "score": float(gsm8k.compute_score(s, g))}
                  for s, g in GSM8K],
        "math": [{"solution": s, "ground_truth": g,
                  "score": float(math_reward.compute_score(s, g))} for s, g in MATH],
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"verl": verl.__version__, "cases": cases}, indent=1) + "\n")
    print(f"wrote {OUT} (verl {verl.__version__})")


if __name__ == "__main__":
    main()
