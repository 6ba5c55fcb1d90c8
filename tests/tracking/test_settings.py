"""Connection -> settings: URI forms, where the S3 keys come from, and that they never print."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from operators.tracking.settings import tracking_settings


def conn(**kw):
    base = dict(conn_id="mlflow_default", conn_type="http", host="mlflow.internal", port=5000,
                schema=None, login=None, password=None, extra="{}")
    base.update(kw)
    if isinstance(base["extra"], dict):
        base["extra"] = json.dumps(base["extra"])
    return SimpleNamespace(**base)


@pytest.mark.parametrize(("kw", "uri"), [
    ({}, "http://mlflow.internal:5000"),
    ({"schema": "https", "port": None}, "https://mlflow.internal"),
    ({"conn_type": "generic", "schema": ""}, "http://mlflow.internal:5000"),
    ({"host": "https://ml.example.org/mlflow/", "port": None}, "https://ml.example.org/mlflow"),
    ({"host": "http://ml.example.org", "port": 8080}, "http://ml.example.org:8080"),
])
def test_tracking_uri(kw, uri):
    assert tracking_settings(conn(**kw)).tracking_uri == uri


def test_extras_and_credentials():
    s = tracking_settings(conn(login="AKIAFROMLOGIN", password="from-password", extra={
        "experiment": "pretrain", "artifact_location": "s3://bucket/mlflow",
        "s3_endpoint_url": "http://minio:9000"}))
    assert (s.experiment, s.artifact_location, s.s3_endpoint_url) == (
        "pretrain", "s3://bucket/mlflow", "http://minio:9000")
    assert (s.aws_access_key_id, s.aws_secret_access_key) == ("AKIAFROMLOGIN", "from-password")
    # Extras name the S3 keys explicitly: they win over login/password.
    s = tracking_settings(conn(login="x", password="y", extra={
        "aws_access_key_id": "AKIAEXTRA", "aws_secret_access_key": "extra-secret"}))
    assert (s.aws_access_key_id, s.aws_secret_access_key) == ("AKIAEXTRA", "extra-secret")
    assert "extra-secret" not in repr(s) and "AKIAEXTRA" not in repr(s)
    assert set(s.secrets()) == {"AKIAEXTRA", "extra-secret"}


def test_extra_dejson_is_read_like_airflow_connections():
    c = conn()
    c.extra_dejson = {"experiment": "from-dejson"}
    assert tracking_settings(c).experiment == "from-dejson"


@pytest.mark.parametrize(("kw", "message"), [
    ({"conn_type": "ssh"}, "conn_type"),
    ({"host": ""}, "host is empty"),
    ({"schema": "mlflow"}, "not http or https"),
    ({"extra": {"artifact_location": "bucket/prefix"}}, "not a URI"),
])
def test_bad_connections_name_the_problem(kw, message):
    with pytest.raises(ValueError, match=message):
        tracking_settings(conn(**kw))
