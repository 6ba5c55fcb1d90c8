"""``make test`` runs the suite in lanes (tests/lanes.py); the lanes are only safe if every
test that disturbs the cluster carries the ``disruptive`` marker, or ``fault_nodes`` when what
it disturbs is the fault partition's nodes only. Checked from the source."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import lanes
from tests.support.airflow import SESSION_PORT_ENV
from tests.support.tiers import (
    DISRUPTIVE,
    DISRUPTIVE_CALLS,
    DISRUPTIVE_COMMANDS,
    FAULT_NODES,
    HAZARD_MARKERS,
)

TESTS = Path(__file__).parent


def _marks(node: ast.AST) -> set[str]:
    """``pytest.mark.X`` names anywhere in ``node`` (decorators or a pytestmark list)."""
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}


def _module_marks(tree: ast.Module) -> set[str]:
    """The markers a module's ``pytestmark`` gives all its tests."""
    return {mark for node in tree.body if isinstance(node, ast.Assign)
            and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
            for mark in _marks(node)}


def _disturbs(node: ast.AST, also: set[str]) -> bool:
    for n in ast.walk(node):
        name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else None
        if name in DISRUPTIVE_CALLS or name in also:
            return True
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and any(
                word in n.value for word in DISRUPTIVE_COMMANDS):
            return True
    return False


def _is_fixture(func: ast.FunctionDef) -> bool:
    def name(node: ast.AST) -> str:
        node = node.func if isinstance(node, ast.Call) else node
        return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return any(name(d) == "fixture" for d in func.decorator_list)


def unmarked_disruptive_tests(source: str) -> list[str]:
    """The tests (and fixtures) of a module that disturb the cluster without the marker."""
    tree = ast.parse(source)
    module_marked = bool(_module_marks(tree) & HAZARD_MARKERS)
    funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    # Module helpers that disturb make their callers disturb too (to a fixed point).
    helpers: set[str] = set()
    while True:
        found = {f.name for f in funcs if not f.name.startswith("test_")
                 and _disturbs(f, helpers)}
        if found <= helpers:
            break
        helpers |= found
    bad = []
    for func in funcs:
        if not _disturbs(func, helpers - {func.name}):
            continue
        if _is_fixture(func) and not module_marked:
            bad.append(f"fixture {func.name} (mark the module)")
        elif func.name.startswith("test_") and not (
                module_marked or _marks(ast.Module(func.decorator_list, [])) & HAZARD_MARKERS):
            bad.append(func.name)
    return bad


def test_every_test_that_disturbs_the_cluster_is_marked_disruptive() -> None:
    offenders = {str(path.relative_to(TESTS)): found for path in sorted(TESTS.rglob("test_*.py"))
                 if path.name != Path(__file__).name  # its examples are strings
                 and (found := unmarked_disruptive_tests(path.read_text()))}
    assert offenders == {}


@pytest.mark.parametrize(("source", "expected"), [
    ("def test_a():\n    cluster.stop_slurmdbd()\n", ["test_a"]),
    ("import pytest\n@pytest.mark.disruptive\ndef test_a():\n    cluster.drop_sshd()\n", []),
    ("import pytest\npytestmark = [pytest.mark.cluster, pytest.mark.disruptive]\n"
     "def test_a():\n    cluster.drop_sshd()\n", []),
    ("def _down(n):\n    run(['scontrol', 'update', f'nodename={n}'])\n"
     "def test_a():\n    _down('node1')\n", ["test_a"]),
    ("import pytest\n@pytest.fixture\ndef outage():\n    cluster.stop_slurmdbd()\n",
     ["fixture outage (mark the module)"]),
    ("def test_reads_only():\n    cluster.remote('squeue')\n", []),
    ("import pytest\npytestmark = [pytest.mark.cluster, pytest.mark.fault_nodes]\n"
     "def test_a():\n    cluster.cut_node_link('node4')\n", []),
])
def test_the_check_finds_calls_helpers_and_fixtures(source, expected) -> None:
    assert unmarked_disruptive_tests(source) == expected


@functools.cache  # a real collection takes ~10 s; two tests ask for the same lanes
def _collected(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *args], capture_output=True, text=True,
                         cwd=TESTS.parent)
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_the_lanes_run_every_test_once_as_pytest_collects_them() -> None:
    """Collected for real: phase 1's lanes together are exactly the suite's non-disruptive
    tests, none in two lanes (a module split over two processes would run its fixtures twice),
    and phase 2 is the disruptive ones."""
    # One collection of the whole suite per lane and one more, at once: ~40 s each at CI's load.
    with ThreadPoolExecutor(len(lanes.PHASE_1) + 1) as pool:
        whole = pool.submit(_collected, "tests", *lanes.NOT_DISRUPTIVE)
        lane_futures = {lane.name: pool.submit(_collected, *lane.args) for lane in lanes.PHASE_1}
        everything = whole.result()
        per_lane = {name: future.result() for name, future in lane_futures.items()}
    assert all(per_lane.values()), {name: len(ids) for name, ids in per_lane.items()}
    together = [test for ids in per_lane.values() for test in ids]
    assert sorted(together) == sorted(everything)
    assert [lane.args for lane in lanes.PHASE_2] == [("tests", "-m", DISRUPTIVE)]
    # What each lane was given to take is where its tests come from.
    assert any(t.startswith("tests/pipeline/test_campaign_faults.py") for t in per_lane["main-b"])
    assert any(t.startswith(lanes.STACK_TESTS) for t in per_lane["stack"])
    # The fault partition's stories, and only they, have their lane: the modules whose
    # pytestmark names the marker.
    marked = {str(path.relative_to(TESTS.parent)) for path in sorted(TESTS.rglob("test_*.py"))
              if FAULT_NODES in _module_marks(ast.parse(path.read_text()))}
    assert marked
    assert {t.split("::")[0] for t in per_lane[lanes.FAULT_NODES_LANE]} == marked


def test_the_rest_leaves_out_what_other_lanes_take_from_inside_it(tmp_path, monkeypatch) -> None:
    for name in ("a/test_x.py", "a/test_y.py", "b/test_z.py", "test_top.py", "support/x.py",
                 "empty/helper.py"):
        (tmp_path / "tests" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests" / name).write_text("")
    monkeypatch.setattr(lanes, "TESTS_DIR", tmp_path / "tests")
    assert lanes.the_rest(("tests/a/test_x.py", "tests/b")) == (
        "tests/a", "tests/test_top.py", "--ignore=tests/a/test_x.py")
    assert lanes.the_rest(("tests/a",), ("tests/a/test_y.py",)) == (
        "tests/b", "tests/test_top.py", "tests/a/test_y.py")
    assert lanes.taking(("tests/a",), ("tests/a/test_y.py", "tests/b")) == (
        "tests/a", "--ignore=tests/a/test_y.py")


def test_module_seconds_reads_a_junit_report_pytest_wrote(tmp_path) -> None:
    """The per-module times of the summary, from a report a real pytest run wrote."""
    (tmp_path / "test_some.py").write_text(
        "import time\n"
        "def test_a():\n    time.sleep(0.2)\n"
        "class TestGroup:\n    def test_b(self):\n        time.sleep(0.1)\n")
    report = tmp_path / "lane.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={report}", "--rootdir", str(tmp_path), str(tmp_path)],
                   check=True, capture_output=True, cwd=tmp_path)
    seconds = lanes.module_seconds(report.read_text())
    assert list(seconds) == ["test_some.py"]
    assert seconds["test_some.py"] >= 0.3  # both tests, the one in a class too


def test_failure_lines_name_each_message_once_from_a_real_report(tmp_path, monkeypatch) -> None:
    """The summary's FAILED lines, from a report a real pytest run wrote: a module fixture's
    error that repeats for its tests is one line with a count, a failure its own."""
    (tmp_path / "test_bad.py").write_text(
        "import pytest\n"
        "@pytest.fixture(scope='module')\ndef story():\n    raise TimeoutError('no segment')\n"
        "def test_a(story):\n    pass\n"
        "def test_b(story):\n    pass\n"
        "def test_c():\n    assert 1 == 2, 'numbers differ'\n"
        "def test_d():\n    pass\n"
        "def test_e():\n    raise RuntimeError('up failed:\\n' + 'starting\\n' * 80"
        " + '[x] error: port taken')\n")
    monkeypatch.setattr(lanes, "REPORTS", tmp_path)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={tmp_path / 'x.xml'}", "--rootdir", str(tmp_path),
                    str(tmp_path)], capture_output=True, cwd=tmp_path)
    lines = lanes.failure_lines(lanes.Lane("x", ()))
    assert len(lines) == 3, lines
    assert lines[0].startswith("test_bad::test_a (+1 more): ") and "no segment" in lines[0]
    assert lines[1].startswith("test_bad::test_c: ") and "numbers differ" in lines[1]
    # A wrapped error's reason is its last line: both ends, not the middle, and not where JUnit's
    # message attribute cuts a long one off.
    assert lines[2].startswith("test_bad::test_e: ") and lines[2].endswith(
        "up failed: ... [x] error: port taken") and "starting" not in lines[2], lines[2]
    assert lanes.failure_lines(lanes.Lane("absent", ())) == []


def _uses_standalone(source: str) -> bool:
    return any("standalone" in {a.arg for a in f.args.args} for f in ast.walk(ast.parse(source))
               if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef))


def test_each_lane_running_the_session_airflow_has_its_own_port() -> None:
    """``standalone`` listens on its lane's port: two lanes starting it on one would collide,
    and a lane running its users without a port would take the default."""
    users = {str(path.relative_to(TESTS.parent)) for path in TESTS.rglob("test_*.py")
             if _uses_standalone(path.read_text())}
    assert users  # the check looks at something
    ports = {}
    for lane in lanes.PHASE_1:
        modules = {test.split("::")[0] for test in _collected(*lane.args)}
        if modules & users:
            assert lane.airflow_port, (lane.name, sorted(modules & users))
            ports.setdefault(lane.airflow_port, []).append(lane.name)
    assert ports and all(len(names) == 1 for names in ports.values()), ports


def test_a_lanes_airflow_port_reaches_its_pytest(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(lanes, "REPORTS", tmp_path)
    assert lanes._env(lanes.Lane("x", (), airflow_port=18180))[SESSION_PORT_ENV] == "18180"
    monkeypatch.delenv(SESSION_PORT_ENV, raising=False)
    assert SESSION_PORT_ENV not in lanes._env(lanes.Lane("y", ()))


@pytest.mark.parametrize(("output", "summary"), [
    ("x\n==== 3 passed, 1 failed in 12.00s ====\n", "3 passed, 1 failed in 12.00s"),
    ("1151 passed, 19 warnings in 3223.37s (0:53:43)\n",
     "1151 passed, 19 warnings in 3223.37s (0:53:43)"),
    ("crash\n", "no pytest summary"),
])
def test_summary_of_reads_pytests_last_line(output, summary) -> None:
    assert lanes.summary_of(output) == summary


def test_a_lanes_notes_reach_its_summary(tmp_path, monkeypatch) -> None:
    """What a test recovered from (a retried start-up) is noted by the lane's own process and
    read back for the summary, one line each; a fresh lane starts with no notes."""
    monkeypatch.setattr(lanes, "REPORTS", tmp_path)
    lane = lanes.Lane("x", ())
    (tmp_path / "x.notes").write_text("an old run's note\n")
    env = lanes._env(lane)
    assert lanes.notes_of(lane) == []
    subprocess.run([sys.executable, "-c",
                    "from tests.lanes import note; note('up failed once,\\n retried: port taken');"
                    " note('second')"], env=env, check=True, cwd=TESTS.parent)
    assert lanes.notes_of(lane) == ["up failed once, retried: port taken", "second"]
