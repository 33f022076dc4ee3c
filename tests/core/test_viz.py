"""`flowgraph viz`: Mermaid and DOT goldens, failing edges in red, SVG, usage errors."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from flowgraph.cli import main
from flowgraph.frontend import load_graph
from flowgraph.viz import dot_quote, mermaid_escape, write_viz

ROOT = Path(__file__).resolve().parents[2]
PPO = ROOT / "graphs" / "ppo.yaml"

TINY = """\
name: tiny
dims: {Bp: 2, N: 2, P: 4, T: 3}
models:
  actor: {path: "builtin:tiny-lm", trainable: true}
data:
  train: {kind: prompts, path: "builtin:arith"}
nodes:
  gen:
    kind: generate
    model: actor
    inputs: {prompts: train.input_ids, prompt_mask: train.attention_mask}
  score:
    kind: reward
    inputs: {responses: gen.responses, response_mask: gen.response_mask}
    params: {fn: format}
  adv:
    kind: grpo
    inputs: {scores: score.scores, response_mask: gen.response_mask, index: gen.index}
  update:
    kind: ppo_actor_update
    model: actor
    inputs: {prompts: gen.prompts, prompt_mask: gen.prompt_mask, responses: gen.responses,
             response_mask: gen.response_mask, old_log_prob: gen.rollout_log_prob,
             advantages: adv.advantages}
"""

# Shapes by hand: Bp=2 prompts of P=4 tokens; generate repeats each N=2 times, so
# B = Bp*N = 4 sequences of T=3 response tokens.
TINY_MERMAID = """\
%% flowgraph: tiny
flowchart LR
  classDef source fill:#e8f1fb,stroke:#4a78b5
  classDef compute fill:#ffffff,stroke:#555555
  classDef update fill:#fde9d9,stroke:#c0504d,stroke-width:3px
  classDef unknown fill:#ffffff,stroke:red,stroke-dasharray:5 5
  n_train[("train<br/>prompts")]:::source
  n_gen["gen<br/>generate<br/>model: actor"]:::compute
  n_score["score<br/>reward"]:::compute
  n_adv["adv<br/>grpo"]:::compute
  n_update[["update<br/>ppo_actor_update<br/>trains: actor"]]:::update
  n_train -->|"input_ids → prompts<br/>(Bp, P) = (2, 4)"| n_gen
  n_train -->|"attention_mask → prompt_mask<br/>(Bp, P) = (2, 4)"| n_gen
  n_gen -->|"responses → responses<br/>(Bp*N, T) = (4, 3)"| n_score
  n_gen -->|"response_mask → response_mask<br/>(Bp*N, T) = (4, 3)"| n_score
  n_score -->|"scores → scores<br/>(Bp*N,) = (4,)"| n_adv
  n_gen -->|"response_mask → response_mask<br/>(Bp*N, T) = (4, 3)"| n_adv
  n_gen -->|"index → index<br/>(Bp*N,) = (4,)"| n_adv
  n_gen -->|"prompts → prompts<br/>(Bp*N, P) = (4, 4)"| n_update
  n_gen -->|"prompt_mask → prompt_mask<br/>(Bp*N, P) = (4, 4)"| n_update
  n_gen -->|"responses → responses<br/>(Bp*N, T) = (4, 3)"| n_update
  n_gen -->|"response_mask → response_mask<br/>(Bp*N, T) = (4, 3)"| n_update
  n_gen -->|"rollout_log_prob → old_log_prob<br/>(Bp*N, T) = (4, 3)"| n_update
  n_adv -->|"advantages → advantages<br/>(Bp*N, T) = (4, 3)"| n_update
"""

TINY_DOT = """\
digraph "tiny" {
  graph [rankdir=LR, label="tiny", labelloc=t, fontname=Helvetica];
  node [fontname=Helvetica, fontsize=11];
  edge [fontname=Helvetica, fontsize=9];
  "train" [label="train\\nprompts", shape=cylinder, style=filled, fillcolor="#e8f1fb", \
color="#4a78b5"];
  "gen" [label="gen\\ngenerate\\nmodel: actor", shape=box, style="rounded,filled", \
fillcolor="#ffffff", color="#555555"];
  "score" [label="score\\nreward", shape=box, style="rounded,filled", fillcolor="#ffffff", \
color="#555555"];
  "adv" [label="adv\\ngrpo", shape=box, style="rounded,filled", fillcolor="#ffffff", \
color="#555555"];
  "update" [label="update\\nppo_actor_update\\ntrains: actor", shape=box, style="filled,bold", \
peripheries=2, fillcolor="#fde9d9", color="#c0504d"];
  "train" -> "gen" [label="input_ids → prompts\\n(Bp, P) = (2, 4)"];
  "train" -> "gen" [label="attention_mask → prompt_mask\\n(Bp, P) = (2, 4)"];
  "gen" -> "score" [label="responses → responses\\n(Bp*N, T) = (4, 3)"];
  "gen" -> "score" [label="response_mask → response_mask\\n(Bp*N, T) = (4, 3)"];
  "score" -> "adv" [label="scores → scores\\n(Bp*N,) = (4,)"];
  "gen" -> "adv" [label="response_mask → response_mask\\n(Bp*N, T) = (4, 3)"];
  "gen" -> "adv" [label="index → index\\n(Bp*N,) = (4,)"];
  "gen" -> "update" [label="prompts → prompts\\n(Bp*N, P) = (4, 4)"];
  "gen" -> "update" [label="prompt_mask → prompt_mask\\n(Bp*N, P) = (4, 4)"];
  "gen" -> "update" [label="responses → responses\\n(Bp*N, T) = (4, 3)"];
  "gen" -> "update" [label="response_mask → response_mask\\n(Bp*N, T) = (4, 3)"];
  "gen" -> "update" [label="rollout_log_prob → old_log_prob\\n(Bp*N, T) = (4, 3)"];
  "adv" -> "update" [label="advantages → advantages\\n(Bp*N, T) = (4, 3)"];
}
"""

MERMAID_EDGE = re.compile(r'^  n_(\w+) -->\|"(.*)"\| n_(\w+)$', re.M)
DOT_EDGE = re.compile(r'^  "(\w+)" -> "(\w+)" \[label="(.*?)"(.*)\];$', re.M)


def _viz(src: Path | str, out: Path, fmt: str | None = None) -> tuple[int, str]:
    code = write_viz(str(src), str(out), overrides=(), fmt=fmt)
    return code, out.read_text(encoding="utf-8") if out.exists() else ""


def _wired_inputs(path: Path) -> int:
    graph, _ = load_graph(path)
    assert graph is not None
    return sum(1 for _ in graph.edges())


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY, encoding="utf-8")
    return path


@pytest.fixture
def broken_ppo(tmp_path: Path) -> Path:
    """PPO with the per-sequence (b,) scores wired straight into gae's (b, T) input."""
    text = PPO.read_text(encoding="utf-8")
    wired = "token_level_rewards: kl.token_level_rewards"
    assert text.count(wired) == 1
    path = tmp_path / "broken_ppo.yaml"
    path.write_text(text.replace(wired, "token_level_rewards: reward.scores"), encoding="utf-8")
    return path


# --- goldens -------------------------------------------------------------------------


@pytest.mark.parametrize(("ext", "golden"), [("mmd", TINY_MERMAID), ("dot", TINY_DOT)])
def test_tiny_golden(tiny: Path, tmp_path: Path, ext: str, golden: str) -> None:
    code, text = _viz(tiny, tmp_path / f"tiny.{ext}")
    assert code == 0
    assert text == golden


def test_ppo_mermaid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, text = _viz(PPO, tmp_path / "ppo.mmd")
    assert code == 0
    assert text.startswith("%% flowgraph: ppo\nflowchart LR\n")
    assert '  n_train[("train<br/>prompts")]:::source\n' in text
    assert '  n_gen["gen<br/>generate<br/>model: actor"]:::compute\n' in text
    assert '  n_adv["adv<br/>gae"]:::compute\n' in text
    assert '  n_update_actor[["update_actor<br/>ppo_actor_update<br/>trains: actor"]]:::update\n' \
        in text
    assert '  n_update_critic[["update_critic<br/>ppo_critic_update<br/>trains: critic"]]' \
        ':::update\n' in text
    edges = MERMAID_EDGE.findall(text)
    assert len(edges) == _wired_inputs(PPO) == 39
    assert ("gen", "responses → responses<br/>(Bp*N, T) = (64, 8)", "old_logprob") in edges
    assert ("train", "input_ids → prompts<br/>(Bp, P) = (64, 16)", "gen") in edges
    assert all("(Bp" in label for _, label, _ in edges)
    assert "linkStyle" not in text
    assert capsys.readouterr().err == ""


def test_ppo_dot(tmp_path: Path) -> None:
    code, text = _viz(PPO, tmp_path / "ppo.dot")
    assert code == 0
    assert text.startswith('digraph "ppo" {\n') and text.endswith("}\n")
    assert '  "train" [label="train\\nprompts", shape=cylinder' in text
    assert '  "update_actor" [label="update_actor\\nppo_actor_update\\ntrains: actor", ' \
        'shape=box, style="filled,bold", peripheries=2' in text
    edges = DOT_EDGE.findall(text)
    assert len(edges) == _wired_inputs(PPO)
    assert ("kl", "adv", "token_level_rewards → token_level_rewards\\n(Bp*N, T) = (64, 8)", "") \
        in edges
    assert "red" not in text


def test_output_is_deterministic(tmp_path: Path) -> None:
    for ext in ("mmd", "dot"):
        first = _viz(PPO, tmp_path / f"a.{ext}")
        assert _viz(PPO, tmp_path / f"b.{ext}") == first


# --- a graph that breaks a contract ------------------------------------------------------


def test_failing_edge_is_red_in_mermaid(broken_ppo: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, text = _viz(broken_ppo, tmp_path / "broken.mmd")
    assert code == 1
    edges = MERMAID_EDGE.findall(text)
    assert len(edges) == _wired_inputs(broken_ppo)
    red = [int(i) for i in re.findall(r"^  linkStyle (\d+) stroke:red\b", text, re.M)]
    assert len(red) == 1 == text.count("linkStyle")
    assert edges[red[0]] == ("reward", "scores → token_level_rewards<br/>(Bp*N,) = (64,)", "adv")
    err = capsys.readouterr().err
    assert "error[FG201]: edge `reward.scores -> adv.token_level_rewards`" in err
    assert "Traceback" not in err


def test_failing_edge_is_red_in_dot(broken_ppo: Path, tmp_path: Path) -> None:
    code, text = _viz(broken_ppo, tmp_path / "broken.dot")
    assert code == 1
    red = [e for e in DOT_EDGE.findall(text) if "red" in e[3]]
    assert red == [("reward", "adv", "scores → token_level_rewards\\n(Bp*N,) = (64,)",
                    ", color=red, fontcolor=red, penwidth=2")]


def test_graph_with_errors_draws_what_is_known(tmp_path: Path) -> None:
    src = tmp_path / "g.yaml"
    src.write_text("""\
data:
  train: {kind: prompts, path: "builtin:arith"}
nodes:
  end:
    kind: mystery
    inputs: {a: train.input_ids, b: ghost.out}
  r:
    kind: reward
    inputs: {responses: end.x, response_mask: train.nope}
""", encoding="utf-8")
    code, text = _viz(src, tmp_path / "g.mmd")
    assert code == 1
    # `end` is a Mermaid keyword: ids carry a prefix. `ghost` does not exist: no edge.
    assert '  n_end["end<br/>mystery (unknown kind)"]:::unknown\n' in text
    assert MERMAID_EDGE.findall(text) == [
        ("train", "input_ids → a", "end"), ("end", "x → responses", "r"),
        ("train", "nope → response_mask", "r")]
    # train.nope names an output `prompts` lacks (FG106): that edge is red.
    assert re.findall(r"linkStyle (\d+)", text) == ["2"]


# --- escaping --------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "escaped"), [
    ('say "hi"', "say #quot;hi#quot;"),
    ("<b>x</b>", "#lt;b#gt;x#lt;/b#gt;"),
    ("a|b", "a#124;b"),
    ("[x] {y}", "#91;x#93; #123;y#125;"),
    ("#35; & `x`", "#35;35; #amp; #96;x#96;"),
    ("two\nlines", "two lines"),
    ("(Bp*N, T-1)", "(Bp*N, T-1)"),
])
def test_mermaid_escape(text: str, escaped: str) -> None:
    assert mermaid_escape(text) == escaped


@pytest.mark.parametrize(("text", "quoted"), [
    ('say "hi"', '"say \\"hi\\""'),
    ("back\\slash", '"back\\\\slash"'),
    ("<b>|{x}[y]", '"<b>|{x}[y]"'),
    ("two\nlines", '"two lines"'),
])
def test_dot_quote(text: str, quoted: str) -> None:
    assert dot_quote(text) == quoted


def test_hostile_names_stay_inside_their_labels(tmp_path: Path) -> None:
    src = tmp_path / "g.yaml"
    src.write_text("""\
name: 'a "graph" <x>'
models:
  m: {path: p}
nodes:
  n:
    kind: 'k"]):::update --> n_x["pwned'
    model: 'q"<b>|[x]'
""", encoding="utf-8")
    code, mmd = _viz(src, tmp_path / "g.mmd")
    assert code == 1
    node_line = next(line for line in mmd.splitlines() if line.startswith("  n_n["))
    assert node_line == ('  n_n["n<br/>k#quot;#93;):::update --#gt; n_x#91;#quot;pwned '
                         '(unknown kind)<br/>model: q#quot;#lt;b#gt;#124;#91;x#93;"]:::unknown')
    _, dot = _viz(src, tmp_path / "g.dot")
    assert dot.startswith('digraph "a \\"graph\\" <x>" {')
    assert '[label="n\\nk\\"]):::update --> n_x[\\"pwned (unknown kind)\\nmodel: q\\"<b>|[x]"' \
        in dot


# --- SVG -------------------------------------------------------------------------------


def test_svg(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ppo.svg"
    code = write_viz(str(PPO), str(out), overrides=(), fmt=None)
    if shutil.which("dot") is None:
        assert code == 1
        assert "Graphviz" in capsys.readouterr().err
        return
    assert code == 0
    svg = out.read_text(encoding="utf-8")
    assert "<svg" in svg and "</svg>" in svg
    assert "update_actor" in svg


def test_svg_without_graphviz(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    out = tmp_path / "ppo.svg"
    assert main(["viz", str(PPO), "-o", str(out)]) == 1  # a tool missing: not a usage error
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "not installed" in err
    assert "apt-get install graphviz" in err and "brew install graphviz" in err
    assert ".dot or .mmd" in err
    assert "Traceback" not in err
    assert not out.exists()


def test_svg_with_broken_graphviz(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    fake = tmp_path / "dot"
    fake.write_text("#!/bin/sh\necho 'Error: syntax error in line 1' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: str(fake))
    assert write_viz(str(PPO), str(tmp_path / "ppo.svg"), overrides=(), fmt=None) == 1
    assert "exited with status 1: Error: syntax error in line 1" in capsys.readouterr().err


# --- the command line ------------------------------------------------------------------


def test_cli_writes_mermaid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ppo.mmd"
    assert main(["viz", str(PPO), "-o", str(out)]) == 0
    assert out.read_text(encoding="utf-8").startswith("%% flowgraph: ppo\nflowchart LR")
    assert "11 nodes, 39 edges, 0 failing" in capsys.readouterr().out


def test_cli_overrides_reach_the_labels(tmp_path: Path) -> None:
    out = tmp_path / "ppo.mmd"
    assert main(["viz", str(PPO), "dims.T=4", "-o", str(out)]) == 0
    assert "(Bp*N, T) = (64, 4)" in out.read_text(encoding="utf-8")


@pytest.mark.parametrize("name", ["out.png", "out", "out.mmd.txt"])
def test_unknown_extension_is_a_usage_error(tmp_path: Path, name: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / name
    assert main(["viz", str(PPO), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: flowgraph viz")
    assert "--format" in err
    assert not out.exists()


def test_unknown_format_through_the_api(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert write_viz(PPO, tmp_path / "g.png", fmt="png") == 2
    assert "unknown format `png`" in capsys.readouterr().err


def test_format_flag_beats_the_extension(tmp_path: Path) -> None:
    out = tmp_path / "graph.txt"
    assert main(["viz", str(PPO), "-o", str(out), "--format", "dot"]) == 0
    assert out.read_text(encoding="utf-8").startswith('digraph "ppo"')


@pytest.mark.parametrize(("content", "code"), [
    (None, "FG001"),
    ("nodes: [unclosed\n", "FG001"),
    (b"\xff\xfe binary", "FG001"),
])
def test_unreadable_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                         content: str | bytes | None, code: str) -> None:
    src = tmp_path / "g.yaml"
    if isinstance(content, str):
        src.write_text(content, encoding="utf-8")
    elif isinstance(content, bytes):
        src.write_bytes(content)
    out = tmp_path / "g.mmd"
    assert main(["viz", str(src), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error[{code}]" in err
    assert "Traceback" not in err
    assert not out.exists()


def test_unwritable_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "missing" / "dir" / "g.mmd"
    assert main(["viz", str(PPO), "-o", str(out)]) == 1  # the command ran and failed
    assert "cannot write" in capsys.readouterr().err


# --- a compiled plan ---------------------------------------------------------------------


def test_a_compiled_plan_is_drawn_as_it_runs(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`flowgraph viz plan.json` (it printed 18 errors and wrote an empty file): the plan's
    nodes with their pool and stage, one edge per wired input with the shape the plan
    records and, on fsdp, how the tensor moves."""
    plan = tmp_path / "plan.json"
    assert main(["compile", str(PPO), "--target", "fsdp", "--nproc", "2", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["viz", str(plan), "-o", str(tmp_path / "plan.mmd")]) == 0
    out = capsys.readouterr()
    assert out.err == "" and "11 nodes, 39 edges (the plan for target fsdp)" in out.out
    text = (tmp_path / "plan.mmd").read_text()
    assert text.startswith("%% flowgraph: ppo (plan, target fsdp)\nflowchart LR\n")
    assert '  n_train[("train<br/>prompts<br/>pool spmd, step.0")]:::source\n' in text
    assert '  n_update_actor[["update_actor<br/>ppo_actor_update<br/>trains: actor<br/>' \
        'pool spmd, step.6 (data-parallel)"]]:::update\n' in text
    edges = MERMAID_EDGE.findall(text)
    assert len(edges) == _wired_inputs(PPO) == 39
    assert ("train", "input_ids → prompts<br/>(Bp, P) = (64, 16)<br/>split", "gen") in edges
    code, dot = _viz(plan, tmp_path / "plan.dot")
    assert code == 0 and len(DOT_EDGE.findall(dot)) == 39


def test_a_plan_is_drawn_as_compiled_and_a_broken_one_is_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.json"
    assert main(["compile", str(PPO), "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["viz", str(plan), "dims.Bp=3", "-o", str(tmp_path / "a.mmd")]) == 2
    assert "a compiled plan is drawn as it is: dims.Bp=3" in capsys.readouterr().err
    plan.write_text("{nope")
    assert main(["viz", str(plan), "-o", str(tmp_path / "b.mmd")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowgraph: error: ") and "not valid JSON" in err
    assert "Traceback" not in err and not (tmp_path / "b.mmd").exists()
