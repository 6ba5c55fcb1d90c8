"""The test tiers: markers come from fixtures before -m selects, and the tracking servers boot
only when a *selected* test needs them."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

import tests.conftest as root_conftest
from tests.support import tiers

TESTS = Path(__file__).parent
REPO = TESTS.parent

INNER_CONFTEST = """
import pytest
from tests.conftest import pytest_collection_finish, pytest_collection_modifyitems

@pytest.fixture
def servers():
    return None

@pytest.fixture
def local_cluster():
    return None
"""

INNER_TESTS = """
import pytest

def test_plain():
    pass

def test_tracked(servers):
    pass

def test_on_cluster(local_cluster):
    pass

@pytest.mark.training
def test_marked_by_hand():
    pass
"""


@pytest.fixture
def inner(pytester, monkeypatch):
    """Runs pytest on a small suite with this repository's tier hooks; counts stack boots."""
    boots: list[int] = []
    monkeypatch.setattr(root_conftest, "_boot", lambda: boots.append(1))
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_inner=INNER_TESTS)
    markers = "\n".join(f"    {m}: x" for m in (*tiers.COSTLY, tiers.PURE))
    pytester.makeini(f"[pytest]\nmarkers =\n{markers}\n")

    def run(*args: str):
        boots.clear()
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider", *args)
        return result, len(boots)

    return run


def test_pure_selects_only_tests_without_a_costly_fixture_or_marker(inner) -> None:
    result, boots = inner("-m", "pure", "-v")
    result.assert_outcomes(passed=1, deselected=3)
    result.stdout.fnmatch_lines(["*test_plain PASSED*"])
    assert boots == 0


@pytest.mark.parametrize("args", [("-m", "cluster"), ("-m", "pure"), ("-k", "plain"),
                                  ("--collect-only",), ("-m", "training")])
def test_servers_do_not_boot_when_no_selected_test_needs_them(inner, args) -> None:
    _, boots = inner(*args)
    assert boots == 0


@pytest.mark.parametrize("args", [(), ("-m", "servers"), ("-m", "not cluster")])
def test_servers_boot_once_when_a_selected_test_needs_them(inner, args) -> None:
    result, boots = inner(*args)
    assert boots == 1
    assert result.ret == 0


def test_markers_are_registered_and_fixtures_exist() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    registered = {m.split(":")[0] for m in config["tool"]["pytest"]["ini_options"]["markers"]}
    assert {*tiers.COSTLY, tiers.PURE, *tiers.HAZARD_MARKERS} <= registered
    defined = {name for path in TESTS.rglob("conftest.py")
               for name in re.findall(r"^def (\w+)\(", path.read_text(), re.M)}
    assert set(tiers.FIXTURE_TIERS) <= defined, set(tiers.FIXTURE_TIERS) - defined


def test_a_pure_test_cannot_reach_the_cluster() -> None:
    # This test is pure: the guard refuses Slurm's commands and ssh run directly (a shell
    # script that calls them is not seen), and lets others run.
    import subprocess

    for argv in (["sacct", "--version"], ["/usr/bin/ssh", "-V"], ["squeue", "--version"]):
        with pytest.raises(RuntimeError, match="a pure test ran"):
            subprocess.run(argv, capture_output=True)
    assert subprocess.run(["true"]).returncode == 0
