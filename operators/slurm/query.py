"""The status query, once, for both transports: sacct, then squeue where sacct cannot tell.

Written as a generator that yields command lines and is sent their results, so
that the worker's blocking hook and the triggerer's async poller run the very
same decisions (:func:`run_blocking` and ``ClusterPoller._query`` drive it).

* sacct first: only it has exit codes and times.
* squeue for jobs sacct does not know yet, or that may have been requeued.
* When sacct fails (slurmdbd down, accounting disabled), squeue for every job:
  live jobs stay followed; a job neither knows is left out, which its watcher
  reads as unknown, never as finished or failed.
* The round fails (:class:`SlurmCommandError`) only when no status could be
  read at all: the commands ran and failed, so the connection is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field

from operators.slurm import commands
from operators.slurm.errors import SlurmCommandError
from operators.slurm.parse import (
    JobRecord,
    by_name,
    merge_live,
    needs_squeue,
    read_sacct,
    read_squeue,
)


@dataclass(frozen=True)
class Result:
    """What a command line returned."""

    returncode: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class Status:
    """One round's answer for the jobs asked about."""

    records: dict[str, JobRecord]
    degraded: str | None = None  # sacct failed; records are squeue's alone
    skipped: tuple[str, ...] = field(default=())  # lines that were not Slurm rows
    calls: int = 0


Query = Generator[str, Result, Status]
INVALID_JOB_ID = "Invalid job id specified"


def status(job_ids: Sequence[str], names: Mapping[str, str | None] | None = None) -> Query:
    """The status of ``job_ids``; yields each command line, is sent its :class:`Result`.

    ``names``: job id -> the job's name (its key), where known: rows of that id under
    another name are someone else's job (a reused id), left out.
    """
    ours = by_name(names or {})
    sacct = yield commands.sacct_jobs(job_ids)
    rows = read_sacct(sacct.stdout, ours)
    records, skipped, calls = rows.records, rows.skipped, 1
    degraded = None
    if sacct.returncode != 0 and not records:
        degraded = f"sacct exited {sacct.returncode}: {sacct.stderr.strip()[:300]}"
        unsure = list(job_ids)
    else:
        unsure = [j for j in job_ids if needs_squeue(records, j)]
    if unsure:  # not in sacct yet, perhaps requeued, or sacct is down: squeue knows
        squeue = yield commands.squeue_jobs(unsure)
        calls += 1
        live = read_squeue(squeue.stdout, ours)
        skipped += live.skipped
        # "Invalid job id specified" is squeue's answer that it knows none of them.
        if (squeue.returncode != 0 and not live.records and degraded
                and INVALID_JOB_ID not in squeue.stderr):
            raise SlurmCommandError(
                commands.squeue_jobs(unsure), squeue.returncode,
                f"{squeue.stderr.strip()[:300]} (and {degraded})")
        records = merge_live(records, live.records)
    return Status(records, degraded, skipped, calls)


def run_blocking(query: Query, run: Callable[[str], Result]) -> Status:
    """Drive ``query`` with a blocking ``run``."""
    try:
        command = next(query)
        while True:
            command = query.send(run(command))
    except StopIteration as done:
        return done.value
