"""One definition per contract: the names of the files a job leaves, the MLflow tags, the DAG
prefix and the campaign directory appear as string literals only in the module that defines
them (docs/contracts.md); everything else imports them. Docstrings and comments may mention
them; code may not."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from jobscripts import checkpoints, job_files
from operators.tracking import artifacts

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("operators", "jobscripts", "plugins", "dags")

JOB_FILES = "jobscripts/job_files.py"
NAMES = "operators/tracking/names.py"
LAYOUT = "operators/campaign/render/layout.py"
# literal (a substring of a code string) -> the modules allowed to hold it
CONTRACTS: dict[str, set[str]] = {
    job_files.TRACKER_FILENAME: {JOB_FILES},
    job_files.SEGMENT_RESULT: {JOB_FILES},
    job_files.RESULT_FILE: {JOB_FILES},
    job_files.MANIFEST_FILE: {JOB_FILES},
    job_files.COMPLETE_MARKER: {JOB_FILES},
    "iter_": {JOB_FILES},  # the iteration directory's format and pattern
    "mlflow.parentRunId": {NAMES},
    "pp.": {NAMES},  # every pp.* tag
    "mlflow_conn:": {NAMES},
    "pretrain__": {"operators/campaign/schema/naming.py"},
    "mlflow_default": {"operators/campaign/schema/config.py"},  # the schema's default connection
    "pp-campaigns": set(),  # the campaign directory comes from the campaign, never a literal
    "pinned_manifest.json": {LAYOUT},
    "segments.jsonl": {LAYOUT},
    "completed.json": {LAYOUT},
    "mlflow_run_id": {LAYOUT},
}


# Names a message may mention: a string with whitespace in it is prose (a log line, an error),
# not a path. Tags and prefixes are caught in any string (a query is written with spaces).
MENTIONABLE = {job_files.TRACKER_FILENAME, job_files.SEGMENT_RESULT, job_files.RESULT_FILE,
               job_files.MANIFEST_FILE, job_files.COMPLETE_MARKER, "iter_",
               "pinned_manifest.json", "segments.jsonl", "completed.json", "mlflow_run_id"}


def _found(literal: str, text: str) -> bool:
    if literal in MENTIONABLE and re.search(r"\s", text):
        return False
    # As a name of its own, not inside a longer one (pinned_manifest.json holds manifest.json).
    tail = r"[a-z]" if literal.endswith(".") else r"(?![\w.-])"
    return re.search(r"(?<![\w.-])" + re.escape(literal) + tail, text) is not None


def _prose_nodes(tree: ast.Module) -> set[int]:
    """Docstrings (bare string statements) and argparse help texts: written for people."""
    nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            nodes.add(id(node.value))
        if isinstance(node, ast.keyword) and node.arg == "help":
            nodes.add(id(node.value))
    return nodes


def _code_strings(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    skip = _prose_nodes(tree)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in skip]


def _product_files() -> list[Path]:
    return sorted(p for top in PRODUCT for p in (REPO / top).rglob("*.py"))


def test_contract_literals_live_only_in_their_defining_module() -> None:
    found = []
    for path in _product_files():
        rel = str(path.relative_to(REPO))
        for line, text in _code_strings(path):
            for literal, owners in CONTRACTS.items():
                if rel not in owners and _found(literal, text):
                    found.append(f"{rel}:{line}: {literal!r} in {text!r}")
    assert found == []


def test_the_check_sees_a_literal_in_code_but_not_in_prose(tmp_path) -> None:
    module = tmp_path / "m.py"
    module.write_text('"""Reads segment.json."""\nNAME = "segment.json"\n'
                      'p.add_argument("--x", help="where segment.json goes")\n'
                      'q = f"tags.`pp.campaign` = {c}"\n')
    strings = _code_strings(module)
    assert [line for line, _ in strings] == [2, 3, 4]  # the help's flag, not its text
    assert _found("segment.json", strings[0][1]) and _found("pp.", strings[2][1])
    assert not _found("manifest.json", "pinned_manifest.json")
    assert not _found("segment.json", "segment.json says iteration %s")  # a log message
    assert _found("segment.json", "/run/segment.json")
    assert not _found("pp.", "app.kind") and not _found("iter_", "export-iter_")


@pytest.mark.parametrize("iteration", [0, 50, 9_999_999, 12_345_678])
def test_every_reader_of_iteration_dirs_agrees_with_the_writer(tmp_path, iteration) -> None:
    # The writer's name for an iteration is found by the tracker's readers and recognised as a
    # checkpoint by tracking (which once matched exactly seven digits).
    root = tmp_path / "ckpt"
    directory = checkpoints.checkpoint_dir(root, iteration)
    directory.mkdir(parents=True)
    assert int(job_files.ITER_DIR_RE.match(directory.name).group(1)) == iteration
    assert artifacts.is_checkpoint(directory / "model.pt")
