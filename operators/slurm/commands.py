"""The command lines run on the login node. Pure, and every argument quoted.

Kept apart from the transports so that the exact text sent over SSH can be
tested without a cluster, and so that the worker's blocking hook and the
triggerer's async poller send the same commands.
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Iterable

from operators.slurm.errors import SlurmCommandError
from operators.slurm.parse import SACCT_FIELDS, SQUEUE_FORMAT

# Set on every sacct/squeue call, whatever the site's or user's environment says: ISO times
# (a site's SLURM_TIME_FORMAT=relative prints "Ystday 10:02", which reads as no time at all),
# and array task expressions printed whole (by default cut at 64 bytes, which would hide
# pending tasks of an array from us). sacct(1)/squeue(1), ENVIRONMENT VARIABLES.
_QUERY_ENV = ("SLURM_TIME_FORMAT=standard", "SLURM_BITSTR_LEN=0")
_SACCT = ["sacct", "--parsable2", "--noheader", "--format=" + ",".join(SACCT_FIELDS)]
# --array: one row per array task, pending ones included, so a task is found by its own id.
_SQUEUE = ["squeue", "--noheader", "--array", "--format=" + SQUEUE_FORMAT]
# How far back a key lookup searches: sacct's default (midnight) would miss a
# job submitted yesterday by the same DAG run.
KEY_LOOKBACK = "now-30days"

# Ids of jobs cancelled because their task was killed (marked failed, or cleared), one per
# line, in the run dir. Clearing a deferred task starts its next try at once, and that try
# may re-attach to the job before the old trigger's cancel lands: seeing the job here, it
# submits its own job instead of failing with the cancelled one.
KILLED_JOBS = ".killed-jobs"

# Ids of jobs a log watcher stopped (docs/log-watch.md), one per line, in the run dir: such a
# job may end COMPLETED (it saved on SIGTERM and exited 0), and the task's retry must not
# re-attach to it as a finished result.
STOPPED_JOBS = ".stopped-jobs"

# scancel on a job that already ended is a success for us: cancel is idempotent.
CANCEL_ALREADY_DONE = ("already completing or completed", "Invalid job id specified")


def _join(argv: Iterable[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def _query(argv: Iterable[str]) -> str:
    return " ".join(_QUERY_ENV) + " " + _join(argv)


def sbatch(run_dir: str, script_name: str) -> str:
    return f"cd {shlex.quote(run_dir)} && " + _join(["sbatch", "--parsable", script_name])


def sacct_jobs(job_ids: Iterable[str]) -> str:
    """Every run of each job: with --jobs, sacct alone prints only a requeued job's newest
    run, and a poll that came after the requeue could not tell it ever failed."""
    ids = sorted(set(job_ids))
    if not ids:
        raise ValueError("sacct_jobs needs at least one job id")
    return _query([*_SACCT, "--duplicates", "--jobs=" + ",".join(ids)])


def sacct_name(name: str) -> str:
    return _query([*_SACCT, "--name=" + name, "--starttime=" + KEY_LOOKBACK])


def squeue_name(name: str) -> str:
    return _query([*_SQUEUE, "--name=" + name])


def squeue_jobs(job_ids: Iterable[str]) -> str:
    # --states=all keeps recently finished jobs that sacct may not show yet.
    ids = ",".join(sorted(set(job_ids)))
    return _query([*_SQUEUE, "--states=all", "--jobs=" + ids])


def sinfo_nodes(partition: str | None = None) -> str:
    argv = ["sinfo", "--noheader", "--format=%D"]
    if partition:
        argv.append("--partition=" + partition)
    return _join(argv)


def sinfo_node_states(nodelist: str) -> str:
    """One line per node of ``nodelist``: its name and compact state (nodes.unhealthy_nodes)."""
    return _join(["sinfo", "--noheader", "--Node", "--format=%N %t", "--nodes=" + nodelist])


def sinfo_node_count(output: str) -> int:
    """The node count from :func:`sinfo_nodes`'s output: only lines that are a number
    (a login banner's words are not nodes)."""
    return sum(int(line) for line in output.split("\n") if line.strip().isdigit())


def scancel(job_id: str, killed_in: str | None = None) -> str:
    """``scancel``; with ``killed_in`` (the job's run dir), first note the job there as
    cancelled because its task was killed (see :data:`KILLED_JOBS`)."""
    cancel = _join(["scancel", job_id])
    if killed_in is None:
        return cancel
    note = posixpath.join(killed_in, KILLED_JOBS)
    return f"printf '%s\\n' {shlex.quote(job_id)} >> {shlex.quote(note)}; {cancel}"


def scancel_signal(job_id: str, signal: str, stopped_in: str | None = None) -> str:
    """``scancel --signal``: to the batch shell and every step (``--full``), as Slurm signals
    a job at its time limit, so a trainer that runs under srun or as the batch shell sees it.
    With ``stopped_in`` (the job's run dir), first note the job there (:data:`STOPPED_JOBS`)."""
    send = _join(["scancel", "--full", "--signal=" + signal, job_id])
    if stopped_in is None:
        return send
    note = posixpath.join(stopped_in, STOPPED_JOBS)
    return f"printf '%s\\n' {shlex.quote(job_id)} >> {shlex.quote(note)}; {send}"


def check_cancel(job_id: str, returncode: int, stderr: str) -> None:
    """Raise :class:`SlurmCommandError` unless ``scancel`` cancelled the job or it had
    already ended (cancel is idempotent). One rule for the hook and the poller."""
    if returncode != 0 and not any(s in stderr for s in CANCEL_ALREADY_DONE):
        raise SlurmCommandError(f"scancel {job_id}", returncode, stderr)


def mkdir_p(path: str) -> str:
    return _join(["mkdir", "-p", "-m", "0750", path])

