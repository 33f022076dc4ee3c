"""`flowgraph check`: renderers and exit codes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flowgraph.cli import main

ROOT = Path(__file__).resolve().parents[2]
PPO = str(ROOT / "graphs" / "ppo.yaml")
BROKEN = """\
dims: {Bp: 2, N: 1, P: 4, T: 4}
models:
  actor: {path: "builtin:tiny-lm", trainable: true}
data:
  train: {kind: prompts, path: "builtin:arith"}
nodes:
  gen:
    kind: generate
    model: actor
    inputs: {prompts: train.input_ids, prompt_mask: train.attention_mask}
  rew:
    kind: reward
    inputs: {responses: gen.responses, response_mask: gen.response_mask}
  adv:
    kind: gae
    inputs:
      token_level_rewards: rew.scores
      values: rew.scores
      response_mask: gen.response_mask
"""


@pytest.fixture
def broken(tmp_path: Path) -> str:
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN)
    return str(path)


def test_clean_graph_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", PPO]) == 0
    assert "ok: 1 file(s), 0 error(s)" in capsys.readouterr().out


def test_text_renderer_shows_a_snippet_with_a_caret(broken: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", broken]) == 1
    out = capsys.readouterr().out
    assert f"{broken}:17:28: error[FG201]: edge `rew.scores -> adv.token_level_rewards`" in out
    assert "17 |       token_level_rewards: rew.scores\n" in out
    assert "   |                            ^^^^^^^^^^\n" in out
    assert "hint: this input is per token" in out
    assert "failed: 1 file(s)" in out


def test_json_renderer(broken: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", broken, "--format", "json"]) == 1
    items = json.loads(capsys.readouterr().out)
    first = next(i for i in items if i["code"] == "FG201")
    assert first["file"] == broken and (first["line"], first["column"]) == (17, 28)
    assert first["edge"] == "rew.scores -> adv.token_level_rewards"
    assert first["expected"].startswith("float[b T]")
    assert {i["severity"] for i in items} <= {"error", "warning"}


def test_github_renderer(broken: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", broken, "--format", "github"]) == 1
    lines = capsys.readouterr().out.splitlines()
    head = f"::error file={broken},line=17,col=28,title=FG201"
    assert any(line.startswith(head) for line in lines)
    assert all(line.startswith("::") for line in lines)


def test_several_files_and_overrides(broken: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", PPO, broken]) == 1
    assert main(["check", PPO, "nodes.update_actor.params.mini_batch_size=5"]) == 1
    assert "FG301" in capsys.readouterr().out


def test_overrides_after_flags_in_every_command(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """argparse stops taking positionals after an option; a `key=value` after one is
    still an override, in every command that takes them (not `unrecognized arguments`)."""
    assert main(["check", PPO, "--data", "trainer.steps=3"]) == 0  # the command
    bad = "nodes.update_actor.params.mini_batch_size=5"  # FG301: does not divide the batch
    for args in (["check", PPO, "--format", "json", bad],
                 ["check", PPO, "--nproc", "1", "trainer.steps=3", bad],
                 ["compile", PPO, "--target", "local", bad],
                 ["run", PPO, "--strict", bad],
                 ["viz", PPO, "-o", str(tmp_path / "g.mmd"), bad]):
        capsys.readouterr()
        assert main(args) == 1, args
        both = capsys.readouterr()
        assert "FG301" in both.out + both.err and "unrecognized" not in both.err, args


@pytest.mark.parametrize("args", [["check", "/no/such/file.yaml"], ["check", "/"]])
def test_unreadable_input_exits_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    assert "FG001" in capsys.readouterr().out


def test_usage_errors_exit_2() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["check"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["check", PPO, "--format", "xml"])
    assert exc.value.code == 2


def test_check_imports_no_heavy_module() -> None:
    code = (
        f"import sys; from flowgraph.cli import main; rc = main(['check', {PPO!r}]);"
        "heavy = {'torch', 'transformers', 'ray', 'vllm', 'networkx', 'jaxtyping'};"
        "print(sorted(heavy & set(sys.modules)), rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip().endswith("[] 0")


def test_python_dash_m_runs_the_cli() -> None:
    proc = subprocess.run([sys.executable, "-m", "flowgraph", "check", PPO],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "ok:" in proc.stdout
