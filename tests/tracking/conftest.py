"""A real MLflow server with its artifacts on a real moto S3 server, one of each per session.

mlflow's boot is the slow part (20-60 s of imports on 2 cores), so both start booting as soon
as collection shows a test that needs them, and the boot overlaps the tests that run before.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.support.mlflow_server import MlflowServer, MotoS3, TrackingStack

BUCKET = "pp-artifacts"
_stack: dict[str, TrackingStack] = {}


def _boot() -> TrackingStack:
    if "stack" not in _stack:
        home = Path(tempfile.mkdtemp(prefix="pp-tracking-servers-"))
        _stack["stack"] = TrackingStack(home, BUCKET).start()
    return _stack["stack"]


def pytest_collection_modifyitems(items):
    if any("servers" in getattr(item, "fixturenames", ()) for item in items):
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


@pytest.fixture(autouse=True)
def _no_process_credentials(monkeypatch):
    """Nothing may reach boto3 or MLflow through the environment: only the connection."""
    import os

    for name in list(os.environ):
        if name.startswith(("AWS_", "MLFLOW_")):
            monkeypatch.delenv(name)


@pytest.fixture
def settings(mlflow_server):
    from operators.tracking.settings import tracking_settings

    return tracking_settings(mlflow_server.connection())


@pytest.fixture
def client(settings):
    from operators.tracking.client import make_client

    return make_client(settings)


@pytest.fixture
def experiment() -> str:
    """A fresh experiment name per test, so tests never see each other's runs."""
    return f"test-{uuid.uuid4().hex[:8]}"
