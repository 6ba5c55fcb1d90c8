"""Download the Parquet files of an ``s3://`` source with boto3, resumably.

    s3://BUCKET/PREFIX              every *.parquet below PREFIX (any depth)
    s3://BUCKET/PREFIX/*.parquet    a glob, with the rules local paths have ('*' stays in
                                    one directory, '**' crosses them)
    s3://BUCKET/KEY.parquet         one object

Ingest then reads the local copies as it reads any Parquet directory. datatrove would read
S3 itself through s3fs, but s3fs pins aiobotocore, which pins botocore to a narrow range
and would drag boto3 with it; boto3 is already a base dependency.

Credentials and endpoint come from boto3's default chain *on the cluster*: the cluster
user's ``~/.aws/credentials`` / ``~/.aws/config`` (or the files ``AWS_SHARED_CREDENTIALS_FILE``
/ ``AWS_CONFIG_FILE`` name), ``AWS_*`` variables of the user's own environment, an instance
role. They never travel through the job script, which Airflow shows in its UI. An
S3-compatible store (MinIO, Ceph) is named by ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``
or ``endpoint_url`` in the config file (boto3 >= 1.28 reads both).

Each object is written to a temporary file and renamed into place, and an index beside the
copies records the ETag and size of each: a rerun (a retried task, a job that hit its time
limit) fetches only the objects it does not already hold unchanged.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from jobscripts.common import StepError, log
from jobscripts.results import read_json, write_json_atomic

S3_SCHEME = "s3://"
INDEX_NAME = ".s3_index.json"
_GLOB_CHARS = set("*?[")
# S3's bucket naming rules (general purpose buckets).
_BUCKET = re.compile(r"^(?!xn--)(?!.*\.\.)[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IP = re.compile(r"^[0-9]+(?:\.[0-9]+){3}$")


@dataclass(frozen=True)
class S3Source:
    bucket: str
    prefix: str  # the key prefix listed ("" or ending in "/"), or the key of one object
    pattern: str  # glob relative to ``prefix``; "" when ``prefix`` names one object

    @property
    def uri(self) -> str:
        return f"{S3_SCHEME}{self.bucket}/{self.prefix}{self.pattern}"


def parse_s3_uri(uri: str) -> S3Source:
    """``s3://BUCKET/...`` -> :class:`S3Source`; ValueError says what is wrong. Pure."""
    if not uri.startswith(S3_SCHEME):
        raise ValueError(f"an S3 source starts with {S3_SCHEME} (got {uri!r})")
    bucket, _, key = uri[len(S3_SCHEME):].partition("/")
    if not _BUCKET.match(bucket) or _IP.match(bucket):
        raise ValueError(f"{bucket!r} is not an S3 bucket name: 3-63 lowercase letters, digits, "
                         f"'.', '-' (in {uri!r})")
    parts = key.rstrip("/").split("/") if key.rstrip("/") else []
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"empty, '.' and '..' key components are not allowed (in {uri!r})")
    glob_at = next((i for i, p in enumerate(parts) if _GLOB_CHARS.intersection(p)), None)
    if glob_at is not None:
        static = "/".join(parts[:glob_at])
        source = S3Source(bucket, static + "/" if static else "", "/".join(parts[glob_at:]))
    elif parts and parts[-1].endswith(".parquet") and not key.endswith("/"):
        source = S3Source(bucket, "/".join(parts), "")
    else:
        source = S3Source(bucket, "/".join(parts) + "/" if parts else "", "**/*.parquet")
    if source.pattern and not source.pattern.endswith(".parquet"):
        raise ValueError(f"the glob must select Parquet files (*.parquet), got "
                         f"{source.pattern!r} (in {uri!r})")
    return source


def client():
    """An S3 client from boto3's default chain, failing in seconds rather than minutes."""
    import boto3
    from botocore.config import Config

    # Retries: the AWS settings (AWS_MAX_ATTEMPTS, max_attempts in the config file) win when
    # given, since a Config passed here would override them.
    retries = None if os.environ.get("AWS_MAX_ATTEMPTS") else {"max_attempts": 4,
                                                               "mode": "standard"}
    config = Config(connect_timeout=10, read_timeout=120, retries=retries)
    return boto3.session.Session().client("s3", config=config)


def _relative(source: S3Source, key: str) -> str:
    """The local path of ``key`` below the download directory; refuses keys that escape it."""
    rel = PurePosixPath(key).name if not source.pattern else key[len(source.prefix):]
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") for p in parts):
        raise StepError(f"s3://{source.bucket}/{key}: a key with empty, '.' or '..' "
                        "components cannot be stored as a local file")
    return rel


def list_objects(s3, source: S3Source) -> list[dict]:
    """``[{"key", "rel", "etag", "size"}]`` of the Parquet objects ``source`` selects."""
    from fsspec.utils import glob_translate

    def listing(prefix: str):
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=source.bucket,
                                                                 Prefix=prefix):
            yield from page.get("Contents", [])

    if not source.pattern:
        exact = [o for o in listing(source.prefix) if o["Key"] == source.prefix]
        if not exact:  # Spark writes directories named like files: data.parquet/part-0.parquet
            source = S3Source(source.bucket, source.prefix + "/", "**/*.parquet")
    else:
        exact = None
    matcher = re.compile(glob_translate(source.pattern)) if source.pattern else None
    selected = []
    for obj in exact if exact else listing(source.prefix):
        key = obj["Key"]
        if matcher is not None and not matcher.match(key[len(source.prefix):]):
            continue
        selected.append({"key": key, "rel": _relative(source, key),
                         "etag": obj["ETag"].strip('"'), "size": obj["Size"]})
    return sorted(selected, key=lambda o: o["rel"])


def _explain(exc: Exception, source: S3Source, endpoint: str) -> StepError:
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    where = f"{source.uri} (endpoint {endpoint})"
    if isinstance(exc, NoCredentialsError):
        return StepError(
            f"no AWS credentials for {where}: boto3 looks on the cluster, as the job's user, in "
            "~/.aws/credentials and ~/.aws/config (or the files AWS_SHARED_CREDENTIALS_FILE "
            "and AWS_CONFIG_FILE name), AWS_* variables of that user's environment, and the "
            "node's instance role. Put them there; never in the campaign")
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        return StepError(f"{where}: {error.get('Code', '?')}: {error.get('Message', exc)}")
    if isinstance(exc, EndpointConnectionError):
        return StepError(f"cannot reach the S3 endpoint for {where}: {exc}. Set "
                         "AWS_ENDPOINT_URL (or endpoint_url in the AWS config) for an "
                         "S3-compatible store; an offline node needs the files staged locally")
    return StepError(f"{where}: {type(exc).__name__}: {exc}")


def download(uri: str, target: Path, s3=None) -> dict:
    """Fetch the objects ``uri`` selects into ``target``.

    Returns ``{"files": [paths relative to target], "fetched", "kept", "fetched_bytes",
    "endpoint"}``. Objects already there with the same ETag and size are kept. Only the
    selected files are listed, so copies an earlier run with another source left behind
    are not read.
    """
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        source = parse_s3_uri(uri)
    except ValueError as exc:
        raise StepError(str(exc)) from exc
    s3 = s3 or client()
    endpoint = s3.meta.endpoint_url
    try:
        objects = list_objects(s3, source)
    except (BotoCoreError, ClientError) as exc:
        raise _explain(exc, source, endpoint) from exc
    if not objects:
        raise StepError(f"no Parquet object matches {uri} (endpoint {endpoint})")
    target.mkdir(parents=True, exist_ok=True)
    index_path = target / INDEX_NAME
    index = read_json(index_path) if index_path.exists() else {}
    fetched = kept = fetched_bytes = 0
    for obj in objects:
        local = target / obj["rel"]
        known = index.get(obj["rel"])
        if (known == {"key": obj["key"], "etag": obj["etag"], "size": obj["size"]}
                and local.is_file() and local.stat().st_size == obj["size"]):
            kept += 1
            continue
        local.parent.mkdir(parents=True, exist_ok=True)
        part = local.with_name(f".{local.name}.part")
        try:
            s3.download_file(source.bucket, obj["key"], str(part))
            if part.stat().st_size != obj["size"]:
                raise StepError(f"s3://{source.bucket}/{obj['key']}: got "
                                f"{part.stat().st_size} bytes, listed {obj['size']} (changed "
                                "while downloading?); rerun to fetch it again")
            os.replace(part, local)
        except (BotoCoreError, ClientError) as exc:
            raise _explain(exc, source, endpoint) from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                part.unlink()
        index[obj["rel"]] = {"key": obj["key"], "etag": obj["etag"], "size": obj["size"]}
        write_json_atomic(index_path, index)  # after each file: a killed job keeps its progress
        fetched += 1
        fetched_bytes += obj["size"]
    log(f"s3: {len(objects)} objects from {uri} via {endpoint}: {fetched} fetched "
        f"({fetched_bytes} bytes), {kept} already here")
    return {"files": [o["rel"] for o in objects], "fetched": fetched, "kept": kept,
            "fetched_bytes": fetched_bytes, "endpoint": endpoint}
