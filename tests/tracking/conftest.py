"""Tracking tests: the session's MLflow + moto S3 servers (tests/conftest.py), no credentials
in the environment, and a fresh experiment per test."""

from __future__ import annotations

import uuid

import pytest


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
