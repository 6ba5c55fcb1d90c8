"""Download part of a Hugging Face dataset repository, or fail at once when offline.

A campaign names the files as ``hf://datasets/ORG/NAME[@REVISION]/<path or glob>``
(the form ``huggingface_hub``'s own file system uses); :func:`parse_hf_uri` turns that
into the repository, the ``allow_patterns`` of ``snapshot_download`` and the revision.
It is pure and cheap: the campaign schema calls it at DAG parse, so a bad URI fails
there, naming ``data.source``, instead of on the cluster.

Compute nodes of many clusters have no route to the internet, and
``huggingface_hub`` would then retry for minutes before giving up. We check the
two cheap signs first: ``HF_HUB_OFFLINE`` set, or no TCP connection to the hub
within a few seconds.
"""

from __future__ import annotations

import fnmatch
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from jobscripts.common import StepError, log

TRUTHY = {"1", "true", "yes", "on"}
CONNECT_TIMEOUT_S = 5.0
HF_SCHEME = "hf://"
HF_FORM = "hf://datasets/ORG/NAME[@REVISION]/<path or glob>"
# The Hub's rule for an owner or repository name: letters, digits, '-', '_', '.', at most 96,
# not starting or ending with '-' or '.', and no '--' or '..' inside.
_REPO_PART = re.compile(r"^(?![-.])(?!.*(?:--|\.\.))[A-Za-z0-9._-]{1,96}(?<![-.])$")
# Branch, tag or commit. A branch with '/' would need %2F here, which campaign strings refuse.
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_GLOB_CHARS = set("*?[")


@dataclass(frozen=True)
class HfSource:
    repo_id: str  # ORG/NAME
    allow_pattern: str  # for snapshot_download(allow_patterns=[...]), fnmatch syntax
    revision: str | None = None  # None: the repository's default branch


def parse_hf_uri(uri: str) -> HfSource:
    """``hf://datasets/ORG/NAME[@REV]/PATH`` -> :class:`HfSource`; ValueError says why not.

    PATH is a file, a glob, or a directory (every Parquet file below it). It must name
    Parquet files: the whole of a repository like FineWeb is tens of terabytes, so a
    URI without a path is refused rather than read as "download everything".
    """
    if not uri.startswith(HF_SCHEME):
        raise ValueError(f"a Hugging Face source starts with {HF_SCHEME} (got {uri!r})")
    parts = uri[len(HF_SCHEME):].split("/")
    if parts[0] != "datasets":
        raise ValueError(f"only dataset repositories can be read: {HF_FORM} (got {uri!r})")
    if len(parts) < 4 or parts[3:] == [""]:
        raise ValueError(f"name the files to read: {HF_FORM} (got {uri!r})")
    org, name_rev, path_parts = parts[1], parts[2], parts[3:]
    if path_parts[-1] == "":  # dir/ names a directory, as dir does
        path_parts = path_parts[:-1]
    if not all(path_parts):
        raise ValueError(f"empty path components ('//') in {uri!r}")
    name, _, revision = name_rev.partition("@")
    for what, value in (("owner", org), ("dataset name", name)):
        if not _REPO_PART.match(value):
            raise ValueError(f"{what} {value!r} is not a Hugging Face repository name: letters, "
                             f"digits, '-', '_', '.', at most 96 (in {uri!r})")
    if "@" in name_rev and not _REVISION.match(revision):
        raise ValueError(f"revision {revision!r} must be a branch, tag or commit of letters, "
                         f"digits, '.', '_', '-' (in {uri!r})")
    if ".." in path_parts or "." in path_parts:
        raise ValueError(f"'.' and '..' path components are not allowed (in {uri!r})")
    path = "/".join(path_parts)
    if not _GLOB_CHARS.intersection(path) and not path.endswith(".parquet"):
        path += "/*.parquet"  # a directory; fnmatch's '*' also crosses '/', so: all below it
    if not path.endswith(".parquet"):
        raise ValueError(f"the path must select Parquet files (*.parquet), got {path!r} "
                         f"(in {uri!r})")
    return HfSource(f"{org}/{name}", path, revision or None)


def matching_files(root: Path, allow_patterns: list[str]) -> list[str]:
    """Parquet files under ``root`` (POSIX paths relative to it) that the patterns select.

    The same fnmatch rule ``snapshot_download`` applies, so files an earlier download with
    other patterns left in ``root`` are not read.
    """
    found = []
    for path in root.rglob("*.parquet"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(".cache/"):  # huggingface_hub's own bookkeeping
            continue
        if any(fnmatch.fnmatchcase(rel, pattern) for pattern in allow_patterns):
            found.append(rel)
    return sorted(found)


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def check_online(endpoint: str | None = None, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Raise StepError unless the hub is reachable (pure socket check, no retries)."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in TRUTHY:
            raise StepError(
                f"a Hugging Face download was requested but {var}={os.environ[var]} is set: "
                "this node is offline. Stage the Parquet files on shared storage and pass "
                "their path as --input instead"
            )
    url = urlparse(endpoint or hub_endpoint())
    host, port = (
        url.hostname or "huggingface.co",
        url.port or (443 if url.scheme == "https" else 80),
    )
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        raise StepError(
            f"a Hugging Face download was requested but {host}:{port} is unreachable from this "
            f"node ({type(exc).__name__}: {exc}). Stage the Parquet files on shared storage and "
            "pass their path as --input instead"
        ) from exc


def download(
    repo_id: str, allow_patterns: list[str], target: Path, revision: str | None = None
) -> list[str]:
    """snapshot_download the matching files of a dataset repo into ``target``; return the
    Parquet files it selected, relative to ``target``."""
    check_online()
    from huggingface_hub import snapshot_download

    log(f"downloading {repo_id} ({', '.join(allow_patterns)}) to {target}")
    path = snapshot_download(
        repo_id=repo_id,
        repo_type="dataset",
        revision=revision,
        allow_patterns=allow_patterns,
        local_dir=str(target),
    )
    files = matching_files(Path(path), allow_patterns)
    if not files:
        raise StepError(f"{repo_id}: no Parquet file matched {allow_patterns}")
    log(f"downloaded {len(files)} Parquet files")
    return files
