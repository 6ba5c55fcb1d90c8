"""Shared fixtures: the local cluster, a real Airflow (``dags test`` and ``standalone``), and a
real MLflow server with its artifacts on a real moto S3 server.

mlflow's boot is the slow part (20-60 s of imports on 2 cores), so the tracking servers start
booting as soon as the *selected* tests (after ``-m``/``-k`` deselection) include one that needs
them, and the boot overlaps the tests that run before.

Every test is marked by cost (tests/support/tiers.py): ``-m pure`` runs what needs nothing.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support import cluster, tiers
from tests.support.airflow import SESSION_PORT, SESSION_PORT_ENV, Standalone, airflow_env, migrate
from tests.support.fault_nodes import FaultNodes, the_fault_nodes
from tests.support.mlflow_server import BUCKET, MlflowServer, MotoS3, TrackingStack

pytest_plugins = ["pytester"]  # tests/test_tiers.py runs these hooks on a small suite

DAGS = Path(__file__).parent / "dags"
_stack: dict[str, TrackingStack] = {}


def _boot() -> TrackingStack:
    if "stack" not in _stack:
        home = Path(tempfile.mkdtemp(prefix="pp-tracking-servers-"))
        _stack["stack"] = TrackingStack(home, BUCKET).start()
    return _stack["stack"]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items) -> None:
    # tryfirst: the tier markers must be on the items before -m deselects by them.
    for item in items:
        own = {mark.name for mark in item.iter_markers()}
        for name in sorted(tiers.tiers_of(getattr(item, "fixturenames", ()), own) - own):
            item.add_marker(name)


sys.addaudithook(tiers.GUARD)


@pytest.fixture(autouse=True)
def _pure_stays_off_the_cluster(request):
    tiers.GUARD.active = request.node.get_closest_marker(tiers.PURE) is not None
    yield
    tiers.GUARD.active = False


def pytest_collection_finish(session) -> None:
    # session.items is what survived -m/-k: boot only if a selected test needs the stack.
    if session.config.option.collectonly:
        return
    if any(tiers.STACK_FIXTURE in getattr(item, "fixturenames", ()) for item in session.items):
        _boot()


def pytest_sessionfinish():
    stack = _stack.pop("stack", None)
    if stack is not None:
        stack.stop()
        shutil.rmtree(stack.mlflow.db_path.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def servers():
    stack = _boot().wait_ready()
    return stack.s3, stack.mlflow


@pytest.fixture(scope="session")
def s3_server(servers) -> MotoS3:
    return servers[0]


@pytest.fixture(scope="session")
def mlflow_server(servers) -> MlflowServer:
    return servers[1]


@pytest.fixture(scope="session")
def local_cluster() -> dict:
    """The cluster must be up (``make cluster-up``); a missing cluster fails, never skips."""
    cluster.check_up()
    return cluster.connection()


@pytest.fixture
def hook(local_cluster, monkeypatch):
    """A ``SlurmHook`` on the local cluster, its connection from the environment as Airflow
    reads ``AIRFLOW_CONN_*``. (paramiko: imported when a test asks, not at collection.)"""
    from operators.slurm.hook import SlurmHook

    for name, value in cluster.connection_env().items():
        monkeypatch.setenv(name, value)
    return SlurmHook(cluster.CONN_ID)


@pytest.fixture(scope="session")
def dags_test_env(local_cluster, tmp_path_factory) -> dict[str, str]:
    """An Airflow home with a migrated SQLite DB for ``airflow dags test``."""
    home = tmp_path_factory.mktemp("airflow-dags-test")
    env = airflow_env(home, DAGS, port=18090)
    migrate(env)
    return env


@pytest.fixture(scope="module")
def fault_nodes(local_cluster) -> FaultNodes:
    """The ``faults`` partition's nodes (tests/support/fault_nodes.py)."""
    return the_fault_nodes()


@pytest.fixture(scope="session")
def standalone(local_cluster, tmp_path_factory):
    """One real ``airflow standalone`` (scheduler, triggerer, dag-processor, api-server) per
    pytest process, on port 18080 unless ``PP_TEST_AIRFLOW_PORT`` names another: each lane of
    `make test` that needs it has its own port, as two developers' runs on one machine may."""
    home = tmp_path_factory.mktemp("airflow-standalone")
    port = int(os.environ.get(SESSION_PORT_ENV, SESSION_PORT))
    server = Standalone(airflow_env(home, DAGS, port=port), home / "standalone.log").start()
    yield server
    server.stop()
    if os.environ.get("PP_KEEP_AIRFLOW_LOGS"):
        shutil.copy(home / "standalone.log", os.environ["PP_KEEP_AIRFLOW_LOGS"])
