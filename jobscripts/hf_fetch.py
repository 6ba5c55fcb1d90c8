"""Download part of a Hugging Face dataset repository, or fail at once when offline.

Compute nodes of many clusters have no route to the internet, and
``huggingface_hub`` would then retry for minutes before giving up. We check the
two cheap signs first: ``HF_HUB_OFFLINE`` set, or no TCP connection to the hub
within a few seconds.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from jobscripts.common import StepError, log

TRUTHY = {"1", "true", "yes", "on"}
CONNECT_TIMEOUT_S = 5.0


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
) -> Path:
    """snapshot_download the matching files of a dataset repo into ``target``."""
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
    files = sorted(Path(path).rglob("*.parquet"))
    if not files:
        raise StepError(f"{repo_id}: no Parquet file matched {allow_patterns}")
    log(f"downloaded {len(files)} Parquet files")
    return Path(path)
