"""The command lines run on the login node. Pure, and every argument quoted.

Kept apart from the transports so that the exact text sent over SSH can be
tested without a cluster, and so that the worker's blocking hook and the
triggerer's async poller send the same commands.
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Iterable

from operators.slurm.parse import SACCT_FIELDS, SQUEUE_FORMAT

_SACCT = ["sacct", "--parsable2", "--noheader", "--format=" + ",".join(SACCT_FIELDS)]
# How far back a key lookup searches: sacct's default (midnight) would miss a
# job submitted yesterday by the same DAG run.
KEY_LOOKBACK = "now-30days"

# Ids of jobs cancelled because their task was killed (marked failed, or cleared), one per
# line, in the run dir. Clearing a deferred task starts its next try at once, and that try
# may re-attach to the job before the old trigger's cancel lands: seeing the job here, it
# submits its own job instead of failing with the cancelled one.
KILLED_JOBS = ".killed-jobs"

# scancel on a job that already ended is a success for us: cancel is idempotent.
CANCEL_ALREADY_DONE = ("already completing or completed", "Invalid job id specified")


def _join(argv: Iterable[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def sbatch(run_dir: str, script_name: str) -> str:
    return f"cd {shlex.quote(run_dir)} && " + _join(["sbatch", "--parsable", script_name])


def sacct_jobs(job_ids: Iterable[str]) -> str:
    ids = sorted(set(job_ids))
    if not ids:
        raise ValueError("sacct_jobs needs at least one job id")
    return _join([*_SACCT, "--jobs=" + ",".join(ids)])


def sacct_name(name: str) -> str:
    return _join([*_SACCT, "--name=" + name, "--starttime=" + KEY_LOOKBACK])


def squeue_name(name: str) -> str:
    return _join(["squeue", "--noheader", "--name=" + name, "--format=" + SQUEUE_FORMAT])


def squeue_jobs(job_ids: Iterable[str]) -> str:
    # --states=all keeps recently finished jobs that sacct may not show yet.
    ids = ",".join(sorted(set(job_ids)))
    return _join(["squeue", "--noheader", "--states=all", "--jobs=" + ids,
                  "--format=" + SQUEUE_FORMAT])


def sinfo_nodes(partition: str | None = None) -> str:
    argv = ["sinfo", "--noheader", "--format=%D"]
    if partition:
        argv.append("--partition=" + partition)
    return _join(argv)


def scancel(job_id: str, killed_in: str | None = None) -> str:
    """``scancel``; with ``killed_in`` (the job's run dir), first note the job there as
    cancelled because its task was killed (see :data:`KILLED_JOBS`)."""
    cancel = _join(["scancel", job_id])
    if killed_in is None:
        return cancel
    note = posixpath.join(killed_in, KILLED_JOBS)
    return f"printf '%s\\n' {shlex.quote(job_id)} >> {shlex.quote(note)}; {cancel}"


def mkdir_p(path: str) -> str:
    return _join(["mkdir", "-p", "-m", "0750", path])

