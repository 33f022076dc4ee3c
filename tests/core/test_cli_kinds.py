"""`flowgraph kinds`: every kind listed by category; one kind's ports and params, each
param with its type, default and meaning; a plugin's kinds with --plugin."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowgraph.cli import main
from flowgraph.frontend import SECTIONS
from flowgraph.kinds import BUILTIN_KINDS
from flowgraph.settings import declared


def test_the_list_names_every_builtin_kind_by_category(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    assert main(["kinds"]) == 0
    out = capsys.readouterr().out
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("  ")}
    assert listed == set(BUILTIN_KINDS)
    assert "update:\n" in out and "  filter " in out


def test_one_kind_prints_its_ports_params_and_policy_losses(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kinds", "ppo_actor_update"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ppo_actor_update (update): ")
    assert "  old_log_prob           float[b T] {nonpositive} (optional)" in out
    assert ("  clip_ratio_high        float, default 0.2; upper clip range: ratio <= 1 + "
            "clip_ratio_high (DAPO's clip-higher)") in out
    assert "  max_token_len          int|null, default null; token budget" in out
    assert "      gspo       sequence-level importance ratio" in out
    kind = BUILTIN_KINDS["ppo_actor_update"]
    for p in kind.params:
        assert f"\n  {p.name} " in out, p.name


def test_an_unknown_kind_suggests_close_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kinds", "ppo_actor_updat"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowgraph: error: no kind `ppo_actor_updat`; did you mean "
                          "`ppo_actor_update`"), err


def test_a_plugin_s_kinds_are_listed_and_described(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "shorter.py").write_text(
        "from jaxtyping import Float, Int\nfrom torch import Tensor\n"
        "from flowgraph import node_kind\n\n"
        "@node_kind('shorter_is_better', outputs=['scores'], category='reward')\n"
        "def shorter(response_mask: Int[Tensor, 'b T'], ground_truth: list[str],\n"
        "            scale: float = 0.1) -> Float[Tensor, ' b']:\n"
        "    return -scale * response_mask.sum(-1).float()\n")
    monkeypatch.chdir(tmp_path)
    assert main(["kinds", "--plugin", "shorter.py", "shorter_is_better"]) == 0
    out = capsys.readouterr().out
    assert "  ground_truth           str[b]" in out and "  scale                  float" in out


@pytest.mark.parametrize("section", list(SECTIONS))
def test_a_section_prints_its_declared_settings(section: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The same declarations as the reader's checks and the schema (`flowgraph.settings`)."""
    assert main(["kinds", section]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{section}: ")
    for f, s in declared(SECTIONS[section]):
        line = next(line for line in out.splitlines() if line.startswith(f"  {f.name} "))
        assert line.endswith(s.doc) and all(c in line for c in s.choices), line


def test_the_trainer_s_bounds_and_choices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kinds", "trainer"]) == 0
    out = capsys.readouterr().out
    assert "  max_staleness          int, default 0; >= 0; Asynchronous rollouts: " in out
    assert '  admission              str, default "block"; one of block, drop; With ' in out
