"""Fuzzing `flowgraph check`: no input makes it raise, print a traceback or run code.

Every input goes through `flowgraph.cli.main(["check", path])` in-process: it must
return 1 or 2 (0 only when the file really is a clean graph), print a message, never
print "Traceback", and never create the sentinel file a YAML tag tries to `touch`.
The worst inputs are also run as `python -m flowgraph check` subprocesses, to prove
no traceback reaches stderr and the runtime stays bounded (a C-level stack overflow
in the YAML composer would show up there as a crash, not as an exception).
"""

from __future__ import annotations

import string
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowgraph.cli import main

ROOT = Path(__file__).resolve().parents[2]
PPO = ROOT / "graphs" / "ppo.yaml"
BASE = """\
dims: {Bp: 16, N: 1, P: 16, T: 8}
models:
  actor: {path: "builtin:tiny-lm", trainable: true}
  critic: {path: "builtin:tiny-lm", trainable: true}
data:
  train: {kind: prompts, path: "builtin:arith"}
nodes:
  gen:
    kind: generate
    model: actor
    inputs: {prompts: train.input_ids, prompt_mask: train.attention_mask}
  values:
    kind: values
    model: critic
    inputs: &seq
      prompts: gen.prompts
      prompt_mask: gen.prompt_mask
      responses: gen.responses
      response_mask: gen.response_mask
  old_logprob:
    kind: logprob
    model: actor
    inputs: *seq
  reward:
    kind: reward
    inputs: {responses: gen.responses, response_mask: gen.response_mask}
    params: {fn: format}
  token_reward:
    kind: token_reward
    inputs: {scores: reward.scores, response_mask: gen.response_mask}
  adv:
    kind: gae
    inputs:
      token_level_rewards: token_reward.token_level_scores
      values: values.values
      response_mask: gen.response_mask
    params: {lam: 0.95}
  update_actor:
    kind: ppo_actor_update
    model: actor
    inputs: {<<: *seq, old_log_prob: old_logprob.log_prob, advantages: adv.advantages}
    params: {mini_batch_size: 8}
  update_critic:
    kind: ppo_critic_update
    model: critic
    inputs: {<<: *seq, values: values.values, returns: adv.returns}
    params: {mini_batch_size: 8}
trainer: {steps: 40}
resources: {nproc: 1}
"""
"""A clean PPO graph that the hostile cases below edit (fixed here, unlike graphs/)."""
FUZZ = settings(max_examples=60, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


def run_check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`flowgraph check ARGS` in-process; its status and everything it printed."""
    try:
        status = main(["check", *args])
    except BaseException as exc:  # SystemExit included: main() must return a status
        pytest.fail(f"main(['check', ...]) raised {type(exc).__name__}: {exc}")
    out, err = capsys.readouterr()
    return status, out + err


def assert_handled(status: int, output: str) -> None:
    assert status in (0, 1, 2), status
    assert "Traceback" not in output
    assert output.strip(), "no message at all"
    if status == 0:
        assert "ok: 1 file(s), 0 error(s)" in output, output[-2000:]
    else:
        assert "error" in output, output[-2000:]


def check_file(path: Path, data: bytes | str, capsys: pytest.CaptureFixture[str]) -> int:
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8", errors="surrogatepass")
    else:
        path.write_bytes(data)
    status, output = run_check(capsys, str(path))
    assert_handled(status, output)
    return status


# --- random input ---------------------------------------------------------------------


@FUZZ
@given(data=st.binary(max_size=2000))
def test_random_bytes(data: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    check_file(tmp_path / "fuzz.yaml", data, capsys)


@FUZZ
@given(text=st.text(max_size=2000))
def test_random_unicode(text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    check_file(tmp_path / "fuzz.yaml", text, capsys)


VOCAB = ("version", "name", "dims", "models", "data", "nodes", "trainer", "resources",
         "plugins", "kind", "model", "inputs", "params", "path", "trainable", "optimizer",
         "Bp", "N", "P", "T", "B", "gen", "adv", "train", "actor", "nproc", "pools", "lr",
         "betas", "n", "max_new_tokens", "mini_batch_size", "<<", "generate", "gae", "grpo")
"""Keys and values of real graph files, so random documents reach the deeper checks."""

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(VOCAB), st.sampled_from(("gen.responses", "train.input_ids", "a.b", ".x")),
)
STRUCTURES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.one_of(st.sampled_from(VOCAB), st.text(max_size=8)), inner,
                      max_size=6),
    max_leaves=40,
)


@FUZZ
@given(doc=STRUCTURES)
def test_random_yaml_structures(doc: object, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    check_file(tmp_path / "fuzz.yaml", yaml.safe_dump(doc), capsys)


@FUZZ
@given(doc=st.dictionaries(st.sampled_from(VOCAB), STRUCTURES, max_size=8))
def test_random_graph_like_mappings(doc: dict[str, object], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    check_file(tmp_path / "fuzz.yaml", yaml.safe_dump(doc), capsys)


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 2700), st.integers(0, 8),
                                st.text(string.printable, max_size=4)), min_size=1, max_size=4))
def test_random_edits_of_a_real_graph(edits: list[tuple[int, int, str]], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    # Splice random characters into graphs/ppo.yaml: near-valid files reach every check.
    text = PPO.read_text(encoding="utf-8")
    for at, cut, new in edits:
        text = text[:at] + new + text[at + cut:]
    check_file(tmp_path / "fuzz.yaml", text, capsys)


@FUZZ
@given(override=st.one_of(
    st.text(max_size=30),
    st.tuples(st.sampled_from(("nodes.gen.params.", "nodes.adv.", "dims.", "trainer.",
                               "models.actor.", "resources.", "nodes.", "plugins.", "")),
              st.sampled_from(VOCAB), st.sampled_from(("=", "=[", "={", "=3", "=null",
                                                      "=!!python/name:os.system", "=1e999",
                                                      "=*a", "=- x", "==")),
              st.text(max_size=6)).map("".join),
).filter(lambda o: not o.startswith("-")))  # `-x` is an option: argparse's usage error
def test_random_overrides(override: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, output = run_check(capsys, str(PPO), override)
    assert_handled(status, output)


# --- hostile input, one by one --------------------------------------------------------


def deep_list(n: int) -> str:
    return "[" * n + "]" * n


def unclosed_list(n: int) -> str:
    return "[" * n


def deep_flow_map(n: int) -> str:
    return "{a: " * n + "1" + "}" * n


def deep_block_map(n: int) -> str:
    # Block style needs n*(n+1)/2 spaces of indentation: 100,000 levels would be 5 GB,
    # so that depth is covered by the flow form `{a: {a: ...}}` above.
    return "".join(" " * i + "a:\n" for i in range(n)) + " " * n + "1\n"


def laughs(levels: int = 9) -> str:
    lines = ["nodes: {}", "l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def edited(*edits: tuple[str, str]) -> str:
    """BASE with each (old, new) replaced; every `old` must be there."""
    text = BASE
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    return text


def with_value(value: str) -> Callable[[], str]:
    """BASE with one value replaced: a dim, a param and a trainer field."""
    return lambda: edited(("Bp: 16", f"Bp: {value}"), ("lam: 0.95", f"lam: {value}"),
                          ("steps: 40", f"steps: {value}"))


def tagged(tag: str) -> Callable[[Path], str]:
    return lambda sentinel: edited(("kind: gae", f"kind: {tag.replace('SENTINEL', str(sentinel))}"))


def huge_batch() -> str:
    # The FG301 hint lists divisors of the batch: it once counted to 10**12.
    return edited(("Bp: 16", "Bp: 1000000000000"), ("nproc: 1", "nproc: 3"))


HOSTILE: dict[str, Callable[[], str | bytes]] = {
    "empty": lambda: "",
    "only a comment": lambda: "# nothing here\n",
    "bom": lambda: "\ufeff" + BASE,
    "nul bytes": lambda: "nodes:\x00 {}\n",
    "nul in the middle": lambda: edited(("gae", "g\x00ae")),
    "latin-1 bytes": lambda: "name: caf\xe9\n".encode("latin-1"),
    "utf-16": lambda: BASE.encode("utf-16"),
    "lone surrogate escape": lambda: 'name: "\\ud800"\nnodes: {}\n',
    "list 10 deep": lambda: deep_list(10),
    "list 1000 deep": lambda: deep_list(1000),
    "list 100000 deep": lambda: deep_list(100_000),
    "unclosed 100000": lambda: unclosed_list(100_000),
    "flow map 10 deep": lambda: deep_flow_map(10),
    "flow map 1000 deep": lambda: deep_flow_map(1000),
    "flow map 100000 deep": lambda: deep_flow_map(100_000),
    "block map 10 deep": lambda: deep_block_map(10),
    "block map 1000 deep": lambda: deep_block_map(1000),
    "3 million values": lambda: "[" + "1," * 3_000_000 + "1]",
    "10**5000": with_value("1" + "0" * 5000),
    "1e999": with_value("1e999"),
    "-1e999": with_value("-1e999"),
    ".nan": with_value(".nan"),
    "2**64": with_value(str(2**64)),
    "10**12 sequences over 3 ranks": huge_batch,
    "billion laughs": laughs,
    "recursive alias": lambda: "nodes: &a {x: *a}\n",
    "recursive list alias": lambda: "a: &a [*a]\nnodes: {}\n",
    "alias to undefined anchor": lambda: "nodes: *nope\n",
    "merge of a scalar": lambda: "x: &x 3\nnodes: {<<: *x}\n",
    "two documents": lambda: "nodes: {}\n---\nnodes: {}\n",
    "a list at the top": lambda: "- nodes\n- {}\n",
    "complex key": lambda: "? [a, b]\n: c\nnodes: {}\n",
    "tab indentation": lambda: "nodes:\n\tgen: {}\n",
    "very long line": lambda: "name: " + "x" * 1_000_000 + "\nnodes: {}\n",
}
TAGS = {
    "python/object/apply": '!!python/object/apply:os.system ["touch SENTINEL"]',
    "python/object/new": '!!python/object/new:os.system ["touch SENTINEL"]',
    "python/name": "!!python/name:os.system",
    "python/module": "!!python/module:os",
    "custom tag": "!custom gae",
    "binary": "!!binary dG91Y2g=",
    "set": "!!set {a, b}",
    "full tag uri": '!<tag:yaml.org,2002:python/object/apply:os.system> ["touch SENTINEL"]',
}


VALID = frozenset({"bom", "2**64", "very long line"})
"""Hostile-looking but clean graphs: a BOM, a huge Bp (2**64 divides fine), a long name."""


def test_the_base_graph_is_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert check_file(tmp_path / "base.yaml", BASE, capsys) == 0


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_input(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = check_file(tmp_path / "hostile.yaml", HOSTILE[name](), capsys)
    assert (status == 0) == (name in VALID)


@pytest.mark.parametrize("name", sorted(TAGS))
def test_tags_are_reported_never_constructed(name: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    sentinel = tmp_path / "pwned"
    path = tmp_path / "tagged.yaml"
    path.write_text(tagged(TAGS[name])(sentinel), encoding="utf-8")
    status, output = run_check(capsys, str(path))
    assert_handled(status, output)
    assert status == 1
    assert "error[FG002]: YAML tag" in output
    assert not sentinel.exists(), "a YAML tag ran code"


def test_a_directory_is_not_a_graph(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, output = run_check(capsys, str(tmp_path))
    assert status == 2
    assert "is a directory" in output and "Traceback" not in output


def test_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, output = run_check(capsys, str(tmp_path / "nope.yaml"))
    assert status == 2
    assert "cannot read" in output and "Traceback" not in output


def test_a_path_with_a_nul_byte(capsys: pytest.CaptureFixture[str]) -> None:
    # os.stat raises ValueError, not OSError, for it: that was a traceback.
    status, output = run_check(capsys, "graph\x00.yaml")
    assert status == 2
    assert "cannot read" in output and "Traceback" not in output


def test_a_file_over_the_size_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "huge.yaml"
    with path.open("wb") as f:
        f.truncate(17 * 1024 * 1024)  # sparse: 17 MiB of NUL without writing them
    status, output = run_check(capsys, str(path))
    assert status == 2
    assert "larger than 16 MiB" in output


def test_an_unreadable_file_among_good_ones(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    status, output = run_check(capsys, str(PPO), str(tmp_path / "nope.yaml"), str(PPO))
    assert status == 2
    assert "3 file(s), 1 error(s)" in output


# --- the worst inputs as real processes ------------------------------------------------

WORST = ("list 100000 deep", "unclosed 100000", "flow map 100000 deep", "billion laughs",
         "3 million values", "10**5000", "recursive alias", "nul bytes",
         "10**12 sequences over 3 ranks")


@pytest.mark.parametrize("name", WORST)
def test_worst_inputs_in_a_subprocess(name: str, tmp_path: Path) -> None:
    path = tmp_path / "worst.yaml"
    data = HOSTILE[name]()
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        path.write_bytes(data)
    def check(file: Path) -> tuple[subprocess.CompletedProcess[str], float]:
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "flowgraph", "check", str(file)],
                              capture_output=True, text=True, timeout=60, check=False)
        return done, time.monotonic() - start

    _, plain = check(ROOT / "graphs" / "grpo.yaml")  # side by side: the same load
    run, elapsed = check(path)
    assert run.returncode in (1, 2), (run.returncode, run.stderr[-2000:])  # -11: a crash
    assert "Traceback" not in run.stderr + run.stdout
    assert "error[FG" in run.stdout
    # At most 16 plain checks' time (the 20 s this test allowed when a plain check took
    # 1.2 s); the slowest input, 3 million values, measured 4.7 plain checks.
    assert elapsed < 16 * plain, f"{name} took {elapsed:.1f} s, a plain check {plain:.1f} s"


def test_a_tag_in_a_subprocess_runs_no_code(tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    path = tmp_path / "tagged.yaml"
    path.write_text(tagged(TAGS["python/object/apply"])(sentinel), encoding="utf-8")
    run = subprocess.run([sys.executable, "-m", "flowgraph", "check", str(path)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 1
    assert "error[FG002]" in run.stdout and "Traceback" not in run.stderr
    assert not sentinel.exists()
