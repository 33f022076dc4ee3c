"""`.ci/run` runs exactly the README's test command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    command = next(b for b in blocks if "python -m pytest" in b)
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == command
    assert "scripts/ensure-prometheus" in command  # the prometheus-marked test needs it


def test_every_package_directory_is_installed() -> None:
    """A wheel holds only the packages pyproject lists: a missing subpackage (as
    flowgraph.checker and flowgraph.runtime once were) works editable and breaks installed."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    roots = {"flowgraph": ROOT / "flowgraph", "flowgraph.nodes": ROOT / "nodes",
             "flowgraph.compilers": ROOT / "compilers"}
    found = set()
    for name, root in roots.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).parts
            found.add(".".join((name, *rel)))
    assert found <= listed, f"not installed: {sorted(found - listed)}"
