"""Shared fixtures: the local cluster, and a real Airflow (``dags test`` and ``standalone``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.support import cluster
from tests.support.airflow import Standalone, airflow_env, migrate

DAGS = Path(__file__).parent / "dags"


@pytest.fixture(scope="session")
def local_cluster() -> dict:
    """The cluster must be up (``make cluster-up``); a missing cluster fails, never skips."""
    cluster.check_up()
    return cluster.connection()


@pytest.fixture(scope="session")
def dags_test_env(local_cluster, tmp_path_factory) -> dict[str, str]:
    """An Airflow home with a migrated SQLite DB for ``airflow dags test``."""
    home = tmp_path_factory.mktemp("airflow-dags-test")
    env = airflow_env(home, DAGS, port=18090)
    migrate(env)
    return env


@pytest.fixture(scope="session")
def standalone(local_cluster, tmp_path_factory):
    """One real ``airflow standalone`` (scheduler, triggerer, dag-processor, api-server)."""
    home = tmp_path_factory.mktemp("airflow-standalone")
    server = Standalone(airflow_env(home, DAGS), home / "standalone.log").start()
    yield server
    server.stop()
    if os.environ.get("PP_KEEP_AIRFLOW_LOGS"):
        shutil.copy(home / "standalone.log", os.environ["PP_KEEP_AIRFLOW_LOGS"])
