"""Tracking settings from one Airflow connection, never from process-wide environment variables.

MLflow and boto3 both fall back to ``MLFLOW_TRACKING_URI``, ``MLFLOW_S3_ENDPOINT_URL`` and
``AWS_*`` when nothing else is given; reading them here would make a campaign's tracking depend
on whatever the worker process happens to carry. The connection (``tracking.mlflow_conn_id`` in
the campaign YAML) is the one source:

    conn_type   http | https | generic
    host/port   the tracking server; host may be a full URL (``https://mlflow.example/prefix``)
    schema      the URL scheme (``http``/``https``), as Airflow's HTTP connections use it
    login       S3 access key id      (or extra ``aws_access_key_id``, which wins)
    password    S3 secret access key  (or extra ``aws_secret_access_key``, which wins)
    extra       experiment, artifact_location (s3://bucket/prefix), s3_endpoint_url, s3_region

Light: standard library only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

CONN_TYPES = ("http", "https", "generic")
DEFAULT_REGION = "us-east-1"  # moto and MinIO accept any; AWS needs the bucket's own


@dataclass(frozen=True)
class TrackingSettings:
    tracking_uri: str
    experiment: str | None = None  # None: the campaign's own (config tracking.experiment or name)
    artifact_location: str | None = None  # for experiments we create; None: the server's default
    s3_endpoint_url: str | None = None  # MinIO/moto; None: AWS's own endpoint
    s3_region: str = DEFAULT_REGION
    # repr=False: a settings object printed in a task log must not print the keys.
    aws_access_key_id: str | None = field(default=None, repr=False)
    aws_secret_access_key: str | None = field(default=None, repr=False)

    def secrets(self) -> tuple[str, ...]:
        """Values that must never reach a param, tag or log line (the key id too: it names the
        account)."""
        return tuple(v for v in (self.aws_access_key_id, self.aws_secret_access_key) if v)


def _extras(conn: Any) -> dict[str, Any]:
    extra = getattr(conn, "extra_dejson", None)
    if extra is None:  # a plain object in tests, or an Airflow 2 style Connection
        raw = getattr(conn, "extra", None) or "{}"
        extra = json.loads(raw) if isinstance(raw, str) else dict(raw)
    return dict(extra or {})


def _tracking_uri(conn: Any, where: str) -> str:
    host = (conn.host or "").strip().rstrip("/")
    if not host:
        raise ValueError(f"{where}: host is empty; it must name the MLflow tracking server")
    port = getattr(conn, "port", None)
    if "://" in host:  # a full URL in host: keep its scheme and path, add the port if missing
        parts = urlsplit(host)
        netloc = parts.netloc if parts.port or not port else f"{parts.netloc}:{port}"
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    scheme = (getattr(conn, "schema", None) or "").strip().lower()
    if scheme in ("", "generic"):
        scheme = "https" if conn.conn_type == "https" else "http"
    if scheme not in ("http", "https"):
        # schema is the URL scheme for HTTP connections; a path prefix belongs in host as a URL.
        raise ValueError(f"{where}: schema {scheme!r} is not http or https; put a path prefix "
                         "in host as a full URL (https://host/prefix)")
    return f"{scheme}://{host}:{port}" if port else f"{scheme}://{host}"


def tracking_settings(conn: Any) -> TrackingSettings:
    """Settings from an Airflow Connection (or anything with its attributes)."""
    where = f"connection {getattr(conn, 'conn_id', None) or '?'}"
    if conn.conn_type not in CONN_TYPES:
        raise ValueError(f"{where}: conn_type {conn.conn_type!r} is not one of "
                         f"{', '.join(CONN_TYPES)}")
    extra = _extras(conn)
    artifact_location = extra.get("artifact_location") or None
    if artifact_location and "://" not in artifact_location:
        raise ValueError(f"{where}: extra artifact_location {artifact_location!r} is not a URI "
                         "(s3://bucket/prefix)")
    return TrackingSettings(
        tracking_uri=_tracking_uri(conn, where),
        experiment=extra.get("experiment") or None,
        artifact_location=artifact_location,
        s3_endpoint_url=extra.get("s3_endpoint_url") or None,
        s3_region=extra.get("s3_region") or DEFAULT_REGION,
        aws_access_key_id=extra.get("aws_access_key_id") or conn.login or None,
        aws_secret_access_key=extra.get("aws_secret_access_key") or conn.password or None,
    )
