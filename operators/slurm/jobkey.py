"""The deterministic job key that makes submission idempotent (docs/contracts.md).

Built from what identifies a unit of work, never from the try number: a retry
of the same task, or the same task re-run after an Airflow restart, computes
the same key and so finds the job its earlier try submitted.
"""

from __future__ import annotations

import hashlib
import re

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
PREFIX = "pp"


def job_key(dag_id: str, run_id: str, task_id: str, map_index: int = -1,
            segment: int | None = None) -> str:
    """``pp-<task slug>-<16 hex>``: readable in ``squeue``, unique by its hash."""
    identity = "\x1f".join(
        [dag_id, run_id, task_id, str(map_index), "" if segment is None else str(segment)]
    )
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    slug = _UNSAFE.sub("_", task_id).strip("._-")[:48] or "task"
    return f"{PREFIX}-{slug}-{digest}"
