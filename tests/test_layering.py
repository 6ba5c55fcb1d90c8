"""The import layers (docs/architecture.md): every import, lazy ones and TYPE_CHECKING ones too,
points down. slurm stands alone; tracking never imports campaign; nothing in operators/ imports
the CLI modules, plugins or DAGs; jobscripts import no Airflow and nothing of operators/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# package -> the first-party packages it may import (itself included)
ALLOWED: dict[str, set[str]] = {
    "jobscripts": {"jobscripts"},
    "operators.slurm": {"operators.slurm"},
    "operators.tracking": {"operators.tracking", "operators.slurm", "jobscripts"},
    # operators/campaign/ in four rooms (docs/architecture.md), each importing only those before it:
    # the schema, rendering runs for the cluster, adapters to the cluster and tracking, and the
    # Airflow side (DAG factory, operators).
    "operators.campaign.schema": {"operators.campaign.schema", "operators.slurm", "jobscripts"},
    "operators.campaign.render": {"operators.campaign.schema", "operators.campaign.render",
                                  "operators.slurm", "jobscripts"},
    "operators.campaign.adapters": {"operators.campaign.schema", "operators.campaign.render",
                                    "operators.campaign.adapters", "operators.tracking",
                                    "operators.slurm", "jobscripts"},
    "operators.campaign.dag": {"operators.campaign.schema", "operators.campaign.render",
                               "operators.campaign.adapters", "operators.campaign.dag",
                               "operators.tracking", "operators.slurm", "jobscripts"},
}
FIRST_PARTY = ("operators", "jobscripts", "plugins", "dags", "tests")
NEVER_IN_JOBSCRIPTS = ("airflow",)  # jobs run in the cluster's venv, which has no Airflow


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return sorted(found)


def _layer(module: str) -> str:
    for layer in sorted(ALLOWED, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    return module.split(".")[0] if module.split(".")[0] != "operators" else module


def _violations(package_dir: Path, layer: str) -> list[str]:
    bad = []
    for path in sorted(package_dir.rglob("*.py")):
        for line, module in _imports(path):
            top = module.split(".")[0]
            upward = top in FIRST_PARTY and _layer(module) not in ALLOWED[layer]
            if upward or (layer == "jobscripts" and top in NEVER_IN_JOBSCRIPTS):
                bad.append(f"{path.relative_to(package_dir.parent)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_imports_point_down(layer: str) -> None:
    assert _violations(REPO / layer.replace(".", "/"), layer) == []


def test_the_check_catches_upward_and_lazy_imports(tmp_path) -> None:
    package = tmp_path / "tracking"
    package.mkdir()
    (package / "m.py").write_text("from operators.slurm import states\n"
                                  "def f():\n    from operators.campaign.render import plan\n"
                                  "import operators.cli\n")
    assert _violations(package, "operators.tracking") == [
        "tracking/m.py:3 imports operators.campaign.render",
        "tracking/m.py:4 imports operators.cli"]
    (package / "m.py").write_text("from airflow.sdk import DAG\n")
    assert _violations(package, "jobscripts") == ["tracking/m.py:1 imports airflow.sdk"]


def test_every_campaign_module_is_in_a_room() -> None:
    """operators/campaign/ keeps no module outside its four rooms, so the layering above covers
    all of it."""
    campaign = REPO / "operators" / "campaign"
    loose = [p.name for p in campaign.glob("*.py") if p.name != "__init__.py"]
    rooms = {p.name for p in campaign.iterdir() if (p / "__init__.py").exists()}
    assert loose == [] and rooms == {"schema", "render", "adapters", "dag"}
