"""Ship the ``jobscripts`` package with the campaign: the cluster runs the DAG's own code version.

    <campaign dir>/code/<digest>/jobscripts/...     one copy per version, never changed
    <campaign dir>/code/<digest>/SHIPPED.json       written last: the copy is complete

``digest`` hashes every file of the package (names and bytes), so a changed file is a new
directory and an old DAG run's jobs keep the code they started with. Uploaded over the
task's existing SSH connection (SFTP, each file atomically), once per version: a task finds
``SHIPPED.json`` and uploads nothing. Every job of the campaign gets ``PYTHONPATH`` set to
the version's directory, in a venv or a container (the Bridge job sets it inside the
container, where the image's own PYTHONPATH would otherwise win:
operators/campaign/render/bridge.py).
What the cluster must still provide itself: a Python with the jobs' dependencies (the
connection's ``remote_python``, or the training image), not this project.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from operators.campaign.render.layout import Layout
from operators.campaign.render.placement import CODE_DIR_VAR
from operators.slurm.messages import JobRequest
from operators.slurm.operator import SlurmJobOperator

if TYPE_CHECKING:
    from airflow.sdk import Context

    from operators.campaign.schema.config import Campaign
    from operators.slurm.hook import SlurmHook

PACKAGE = "jobscripts"
CODE_DIR = "code"
MARKER = "SHIPPED.json"
DIGEST_CHARS = 16  # 64 bits: a collision between two versions of one campaign is not a risk
_SKIPPED_SUFFIXES = (".pyc", ".pyo")


@dataclass(frozen=True)
class CodeVersion:
    digest: str
    files: dict[str, bytes]  # path under the version directory ('jobscripts/x.py') -> bytes

    def directory(self, layout: Layout) -> str:
        """What PYTHONPATH names: the directory that holds ``jobscripts/``."""
        return posixpath.join(layout.campaign_dir, CODE_DIR, self.digest)


def package_root() -> Path:
    """The ``jobscripts`` this Airflow process runs: what its DAGs were written against."""
    import jobscripts

    return Path(jobscripts.__file__).resolve().parent


def code_version(root: Path | None = None) -> CodeVersion:
    """Every file of the package (``__pycache__`` and bytecode aside) and their digest. Pure
    but for reading the files."""
    root = root or package_root()
    files = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_dir() or "__pycache__" in rel.parts or path.suffix in _SKIPPED_SUFFIXES:
            continue
        files[posixpath.join(PACKAGE, *rel.parts)] = path.read_bytes()
    digest = hashlib.sha256()
    for name, data in files.items():  # sorted: the digest does not depend on listing order
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return CodeVersion(digest.hexdigest()[:DIGEST_CHARS], files)


def ship(hook: SlurmHook, layout: Layout, version: CodeVersion | None = None) -> str:
    """Upload ``version`` under the campaign unless it is there; returns its directory.

    Safe against a concurrent or interrupted upload: each file is renamed into place whole and
    has the same bytes whoever writes it, and the marker comes last, so a version without its
    marker is simply uploaded again.
    """
    version = version or code_version()
    target = version.directory(layout)
    if hook.read_bytes(posixpath.join(target, MARKER)):
        return target
    by_dir: dict[str, dict[str, bytes]] = {}
    for name, data in version.files.items():
        folder, base = posixpath.split(name)
        by_dir.setdefault(posixpath.join(target, folder), {})[base] = data
    for folder, files in by_dir.items():
        hook.upload(folder, files)
    marker = {"digest": version.digest, "files": sorted(version.files)}
    hook.upload(target, {MARKER: json.dumps(marker, indent=1) + "\n"})
    return target


def with_pythonpath(environment: dict[str, str], code_dir: str) -> dict[str, str]:
    """The job's environment with the shipped code on PYTHONPATH (a host job) and named by
    ``CODE_DIR_VAR`` (for a container command: ``CONTAINER_PYTHONPATH``)."""
    return {**environment, "PYTHONPATH": code_dir, CODE_DIR_VAR: code_dir}


class ShipsCode:
    """For a campaign's ``SlurmJobOperator`` subclasses (``self.campaign``, ``self.hook``):
    call :meth:`ship_code` in ``prepare_job`` and put its directory on the request's
    PYTHONPATH (:func:`with_code`)."""

    def ship_code(self) -> str:
        code_dir = ship(self.hook, Layout.for_campaign(self.campaign))
        self.log.info("jobscripts shipped: PYTHONPATH=%s", code_dir)
        return code_dir


def with_code(request: JobRequest, code_dir: str) -> JobRequest:
    """``request`` with the shipped code on its PYTHONPATH (:func:`with_pythonpath`)."""
    return replace(request, environment=with_pythonpath(dict(request.environment), code_dir))


class CampaignJobOperator(ShipsCode, SlurmJobOperator):
    """A campaign's job that runs the shipped code: ``SlurmJobOperator`` plus ``campaign``."""

    def __init__(self, *, campaign: Campaign, **kwargs) -> None:
        super().__init__(ssh_conn_id=campaign.cluster.ssh_conn_id, **kwargs)
        self.campaign = campaign

    def prepare_job(self, context: Context) -> JobRequest:
        return with_code(super().prepare_job(context), self.ship_code())
