"""One definition of the training log's vocabulary (jobscripts/vocabulary.py): no other product
module defines a metric name or a stop reason as a constant, and tracking does not reach up into
campaign/ for them."""

from __future__ import annotations

import ast
from pathlib import Path

from jobscripts import vocabulary as v

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("operators", "jobscripts", "plugins", "dags")
# Metric names and stop/exit reasons; record kinds ("train", "exit", ...) are common words.
GUARDED = {value for name, value in vars(v).items()
           if name.isupper() and isinstance(value, str)} - set(v.RECORD_KINDS)
GUARDED |= set(v.EVAL_METRICS.values())


def _defined_strings(node: ast.stmt) -> list[str]:
    """String constants a module-level statement binds to names: ``A = "x"``,
    ``A, B = "x", "y"``, and the values of ``A = {"key": "x"}``."""
    if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
        return []
    value = node.value
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    if isinstance(value, ast.Tuple):  # only unpacked into names: a tuple of options is data
        items = value.elts if any(isinstance(t, ast.Tuple) for t in targets) else []
    elif isinstance(value, ast.Dict):
        items = value.values
    else:
        items = [value]
    return [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]


def test_guard_sees_the_names():
    assert {v.LM_LOSS, v.MEM_ALLOCATED_GB, v.TOKENS_CONSUMED, v.COMPLETED, "eval_tokens"} <= GUARDED


def test_no_other_module_defines_a_metric_name_or_stop_reason():
    found = []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "jobscripts" / "vocabulary.py":
                continue
            for node in ast.parse(path.read_text()).body:
                found += [f"{path.relative_to(ROOT)}:{node.lineno}: {text!r}"
                          for text in _defined_strings(node) if text in GUARDED]
    assert found == [], "import these from jobscripts/vocabulary.py"


def test_tracking_imports_nothing_from_campaign():
    offenders = []
    for path in sorted((ROOT / "operators" / "tracking").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            offenders += [f"{path.name}:{node.lineno} {n}" for n in names
                          if n.startswith("operators.campaign")]
    assert offenders == []
