"""`models.<m>.optimizer.schedule` (TRL's lr_scheduler_type): constant by default, and
linear / cosine numerically transformers' own schedules, through a checkpoint and a
resume too; `trainer.log_every` (TRL's logging_steps) thins the console only."""

import io
import json
from pathlib import Path

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from flowgraph.compilers.build import make_optimizer
from flowgraph.ir import ModelSpec, OptimizerSpec
from flowgraph.runtime.metrics import MetricsLog

HF = {"linear": get_linear_schedule_with_warmup, "cosine": get_cosine_schedule_with_warmup}


def _ours(schedule: str, warmup: int, total: int) -> tuple[torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    spec = ModelSpec("actor", "builtin:tiny-lm", trainable=True, optimizer=OptimizerSpec(
        lr=1e-3, warmup_steps=warmup, schedule=schedule))
    return make_optimizer(spec, torch.nn.Linear(2, 2), total)


def _lrs(opt: torch.optim.Optimizer, sched: object, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()  # type: ignore[attr-defined]
    return out


def test_the_default_schedule_is_constant() -> None:
    assert OptimizerSpec().schedule == "constant"
    assert _lrs(*_ours("constant", 0, 5), 5) == [1e-3] * 5


@pytest.mark.parametrize("schedule", sorted(HF))
@pytest.mark.parametrize(("warmup", "total"), [(0, 7), (3, 10)])
def test_linear_and_cosine_are_transformers_schedules_through_a_resume(
        schedule: str, warmup: int, total: int) -> None:
    ref_opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
    ref = _lrs(ref_opt, HF[schedule](ref_opt, warmup, total), total)
    opt, sched = _ours(schedule, warmup, total)
    assert _lrs(opt, sched, total) == ref  # bit for bit: the same lambda, the same product
    # a checkpoint after step k (what checkpoint.py saves), loaded into a fresh run
    k = total // 2
    opt, sched = _ours(schedule, warmup, total)
    first = _lrs(opt, sched, k)
    state = (opt.state_dict(), sched.state_dict())  # type: ignore[attr-defined]
    opt, sched = _ours(schedule, warmup, total)
    opt.load_state_dict(state[0])
    sched.load_state_dict(state[1])  # type: ignore[attr-defined]
    assert first + _lrs(opt, sched, total - k) == ref


def test_log_every_prints_every_kth_step_and_the_last_and_writes_every_step(
        tmp_path: Path) -> None:
    out = io.StringIO()
    log = MetricsLog(tmp_path, out=out, total_steps=7, log_every=3)
    for step in range(7):
        log.write(step, {"actor/pg_loss": float(step)})
    log.close()
    printed = [line.split()[1] for line in out.getvalue().splitlines()]
    assert printed == ["2/7", "5/7", "6/7"]  # steps 3 and 6 counted from 1, and the last
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(7))


def test_a_run_decays_as_transformers_and_prints_every_log_every_steps(tmp_path: Path) -> None:
    from flowgraph.compilers import RunOptions, run
    from flowgraph.passes import compile_graph

    graph = Path(__file__).resolve().parents[2] / "graphs" / "dpo.yaml"
    result = compile_graph(graph, overrides=[
        f"trainer.run_dir={tmp_path}", "trainer.steps=4", "trainer.log_every=3",
        "models.policy.optimizer.schedule=linear", "models.policy.optimizer.lr=0.001"])
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]
    out = io.StringIO()
    rows = run(result.plan, RunOptions(tensorboard=False, out=out)).rows
    ref_opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
    assert [r["actor/lr"] for r in rows] == _lrs(
        ref_opt, get_linear_schedule_with_warmup(ref_opt, 0, 4), 4)
    assert [line.split()[1] for line in out.getvalue().splitlines()
            if line.startswith("step ")] == ["2/4", "3/4"]


def test_a_run_resumed_with_more_steps_decays_toward_the_new_end_from_its_first_step(
        tmp_path: Path) -> None:
    """2 steps of a linear schedule to 2, resumed to 4: the resumed steps 2 and 3 take the
    LR of a schedule to 4 (the checkpoint's optimizer held f(2; 2) = 0 for step 2)."""
    from flowgraph.compilers import RunOptions, run
    from flowgraph.passes import compile_graph

    graph = Path(__file__).resolve().parents[2] / "graphs" / "dpo.yaml"

    def rows(steps: int, resume: bool) -> list[dict[str, float]]:
        result = compile_graph(graph, overrides=[
            f"trainer.run_dir={tmp_path}", f"trainer.steps={steps}",
            "models.policy.optimizer.schedule=linear", "models.policy.optimizer.lr=0.001"])
        assert result.plan is not None
        return run(result.plan, RunOptions(resume=resume, tensorboard=False,
                                           out=io.StringIO())).rows

    rows(2, resume=False)
    lrs = [r["actor/lr"] for r in rows(4, resume=True)]
    assert lrs == pytest.approx([1e-3, 5e-4, 5e-4, 2.5e-4], abs=1e-15)
