"""S3 transfers with the connection's credentials, through a boto3 client of our own.

Why not MLflow's S3 artifact repository: it takes the endpoint only from the process-wide
``MLFLOW_S3_ENDPOINT_URL`` and, without explicit keys, boto3's default chain (``AWS_*``). Setting
those around each call would leak, for that time, into every other thread of the process and
into any subprocess it starts. A ``boto3.session.Session`` given the keys and a client given the
endpoint carry them as objects instead: nothing in ``os.environ`` changes, and two campaigns
with different stores can upload from one process. With no keys in the connection, boto3's own
chain applies (instance profile, IRSA, ~/.aws): the usual choice on AWS.

The layout is MLflow's (``<run artifact_uri>/<artifact_path>/<file name>``), so the MLflow UI
and ``mlflow artifacts download`` find the files; the server reads them with its own keys.
"""

from __future__ import annotations

import mimetypes
import os
import posixpath
from pathlib import Path
from urllib.parse import urlsplit

from operators.tracking.settings import TrackingSettings


def s3_client(settings: TrackingSettings):
    import boto3
    from botocore.config import Config

    session = boto3.session.Session(
        aws_access_key_id=settings.aws_access_key_id,
        aws_secret_access_key=settings.aws_secret_access_key,
        region_name=settings.s3_region,
    )
    # MinIO and moto serve buckets as paths, not as virtual hosts (no DNS per bucket there).
    config = Config(
        s3={"addressing_style": "path" if settings.s3_endpoint_url else "auto"},
        retries={"max_attempts": 3, "mode": "standard"},
        connect_timeout=5, read_timeout=60,
    )
    return session.client("s3", endpoint_url=settings.s3_endpoint_url, config=config)


def split(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> (bucket, "some/prefix")."""
    parts = urlsplit(uri)
    if parts.scheme != "s3" or not parts.netloc:
        raise ValueError(f"not an s3:// URI: {uri!r}")
    return parts.netloc, parts.path.strip("/")


def _put(client, local: Path, bucket: str, key: str) -> None:
    content_type, _ = mimetypes.guess_type(local.name)
    # A content type lets the MLflow UI show HTML reports and images instead of offering a file.
    extra = {"ContentType": content_type} if content_type else None
    client.upload_file(str(local), bucket, key, ExtraArgs=extra)


def upload(client, local_path: str | os.PathLike, dest_uri: str) -> list[str]:
    """A file to ``<dest_uri>/<its name>``, or a directory's files below ``<dest_uri>/``
    (``log_artifact`` and ``log_artifacts`` semantics). Returns the keys written."""
    bucket, prefix = split(dest_uri)
    local = Path(local_path)
    if local.is_file():
        files = [(local, local.name)]
    elif local.is_dir():
        files = [(p, p.relative_to(local).as_posix()) for p in sorted(local.rglob("*"))
                 if p.is_file()]
    else:
        raise FileNotFoundError(local)
    keys = []
    for path, relative in files:
        key = posixpath.join(prefix, relative) if prefix else relative
        _put(client, path, bucket, key)
        keys.append(key)
    return keys


def list_files(client, uri: str) -> list[tuple[str, int]]:
    """(path relative to ``uri``, size) of every object below it."""
    bucket, prefix = split(uri)
    base = prefix + "/" if prefix else ""
    found = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base):
        for item in page.get("Contents", []):
            found.append((item["Key"][len(base):], item["Size"]))
    return found
