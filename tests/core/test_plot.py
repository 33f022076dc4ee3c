"""`flowgraph plot`: learning-curve panels from metrics.jsonl, several runs overlaid."""

import json
from pathlib import Path

import pytest

from flowgraph.cli import main
from flowgraph.errors import FlowgraphError
from flowgraph.plot import PANELS, figure, load_run


def _run_dir(path: Path, rows: list[dict[str, float | str]], tail: str = "") -> Path:
    path.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in rows) + tail
    (path / "metrics.jsonl").write_text(text)
    return path


def _grpo_rows(shift: float) -> list[dict[str, float | str]]:
    return [{"step": s, "critic/score/mean": 0.1 * s + shift, "actor/kl_loss": 0.01 * s,
             "actor/pg_loss": "nan" if s == 1 else -0.01, "response_length/mean": 8.0,
             "timing_s/gen": 0.5, "timing_s/step": 1.0}
            for s in range(3)] + [{"step": 3, "val/accuracy": 0.25}]


def test_load_run_reads_series_and_skips_a_half_written_line(tmp_path: Path) -> None:
    run = load_run(_run_dir(tmp_path / "a", _grpo_rows(0.0), tail='{"step": 4, "crit'))
    steps, values = run.series["critic/score/mean"]
    assert steps == [0, 1, 2] and values == pytest.approx([0.0, 0.1, 0.2])
    assert run.series["val/accuracy"] == ([3], [0.25])
    assert str(run.series["actor/pg_loss"][1][1]) == "nan"  # written as "nan" in JSON


def test_one_figure_overlays_runs_with_a_legend(tmp_path: Path) -> None:
    a = _run_dir(tmp_path / "a", _grpo_rows(0.0))
    b = _run_dir(tmp_path / "b", _grpo_rows(0.5))
    fig = figure([a, b])
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert list(axes) == [p.title for p in PANELS]
    reward = [line.get_label() for line in axes["reward"].get_lines()]
    assert reward == ["a · critic/score/mean", "b · critic/score/mean"]
    stages = [line.get_label() for line in axes["stage seconds"].get_lines()]
    assert stages == ["a · gen", "a · step", "b · gen", "b · step"]
    assert axes["reward"].get_legend() is not None
    # a panel the runs have no metric for says so instead of staying blank
    assert [t.get_text() for t in axes["held-out"].texts] == []
    assert [t.get_text() for t in axes["losses"].texts] == []
    dpo = _run_dir(tmp_path / "dpo", [{"step": 0, "actor/dpo_loss": 0.69}])
    empty = {ax.get_title(): ax for ax in figure([dpo]).axes}
    assert [t.get_text() for t in empty["KL"].texts] == ["no data"]


def test_cli_writes_the_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _run_dir(tmp_path / "a", _grpo_rows(0.0))
    out = tmp_path / "curves.png"
    assert main(["plot", str(a), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert f"written to {out}" in capsys.readouterr().out


@pytest.mark.parametrize(("make", "message"), [
    (lambda d: None, "does not exist: give a run dir"),
    (lambda d: d.mkdir(), "has no metrics.jsonl: give a run dir"),
    (lambda d: _run_dir(d, []), "holds no step rows yet"),
    (lambda d: _run_dir(d, [], tail='{"step": 0\n{"step": 1}\n'), "metrics.jsonl:1: not a JSON"),
])
def test_not_a_run_dir_is_a_clear_error(tmp_path: Path, make: object, message: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    make(run)  # type: ignore[operator]
    with pytest.raises(FlowgraphError, match=message):
        load_run(run)
    assert main(["plot", str(run), "-o", str(tmp_path / "c.png")]) == 2
    assert message.split(":")[0] in capsys.readouterr().err
