"""Slurm's job id shapes, read once. Pure.

``sacct`` and ``squeue`` print a job as one row, an array as one row per task
(``123_4``) plus one row for the tasks still pending together (``123_[5-9%2]``),
and a heterogeneous job as one row per component (``1853+0``, ``1853+1``) —
never as the plain id ``sbatch`` printed (sacct(1) "JobID", squeue(1) "%i").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ID = re.compile(
    r"^(?P<base>[0-9]+)(?:_(?P<task>[0-9]+)|_\[(?P<range>[0-9,:%-]+)\]|\+(?P<het>[0-9]+))?$")
_RANGE_PART = re.compile(r"^([0-9]+)(?:-([0-9]+)(?::([0-9]+))?)?$")


@dataclass(frozen=True)
class JobId:
    base: str  # the id sbatch printed: the array job or the het job leader
    task: int | None = None  # an array task
    pending: str | None = None  # "2-4%25": array tasks pending together, one row
    component: int | None = None  # a het job component

    @property
    def member(self) -> bool:
        """A task (or pending tasks) of an array, or a component of a het job."""
        return self.task is not None or self.pending is not None or self.component is not None

    def holds_task(self, task: int) -> bool:
        """Whether this row stands for array task ``task``."""
        if self.task is not None:
            return self.task == task
        return self.pending is not None and task in _expand(self.pending)


def parse_job_id(text: str) -> JobId | None:
    """``"123_[2-4%25]"`` -> ``JobId("123", pending="2-4%25")``; None for other text."""
    match = _ID.match(text.strip())
    if not match:
        return None
    task, het = match.group("task"), match.group("het")
    pending = match.group("range")
    if pending is not None and not _valid_range(pending):
        return None
    return JobId(base=match.group("base"), task=int(task) if task is not None else None,
                 pending=pending, component=int(het) if het is not None else None)


def _valid_range(text: str) -> bool:
    body = text.partition("%")[0]
    return bool(body) and all(_RANGE_PART.match(p) for p in body.split(","))


def _expand(text: str) -> range | set[int]:
    """``"1,3-7:2%4"`` -> {1, 3, 5, 7}. Bounded by Slurm's MaxArraySize, so small."""
    found: set[int] = set()
    for part in text.partition("%")[0].split(","):
        match = _RANGE_PART.match(part)
        if match is None:
            continue
        low, high, step = match.groups()
        found.update(range(int(low), int(high or low) + 1, int(step or 1)))
    return found


def id_order(job_id: str) -> tuple[int, int]:
    """Sort key: newest job last, then by task or component."""
    parsed = parse_job_id(job_id)
    if parsed is None:
        return (-1, -1)
    index = parsed.task if parsed.task is not None else parsed.component
    return int(parsed.base), -1 if index is None else index
