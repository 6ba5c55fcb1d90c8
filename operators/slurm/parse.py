"""Parsers for ``sbatch --parsable``, ``sacct --parsable2`` and ``squeue``. Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from datetime import datetime

from operators.slurm.states import normalize_state

# The columns we ask ``sacct`` for, in order; parse_sacct reads them by name.
SACCT_FIELDS = (
    "JobID", "JobIDRaw", "JobName", "State", "ExitCode", "Submit", "Start", "End",
    "ElapsedRaw", "NodeList", "AllocTRES", "Reason",
)
SQUEUE_FORMAT = "%i|%j|%T|%r|%N"  # job id, name, long state, reason, nodes
_JOB_ID = re.compile(r"^[0-9]+(?:_[0-9]+)?$")
_GPU_TRES = re.compile(r"gres/gpu(?::[^=,]+)?=([0-9]+)")


class SlurmParseError(ValueError):
    """Slurm's output did not have the shape we asked for."""


@dataclass(frozen=True)
class JobRecord:
    job_id: str  # "123", or "123_4" for an array task
    name: str
    state: str  # normalised base state, e.g. "CANCELLED"
    state_detail: str = ""  # e.g. "by 1000"
    exit_code: int | None = None
    signal: int | None = None
    submit: datetime | None = None
    start: datetime | None = None
    end: datetime | None = None
    elapsed_s: int | None = None
    nodelist: str = ""
    gpus: int = 0
    reason: str = ""  # why it pends or ended, as Slurm says
    source: str = "sacct"  # "squeue" rows lack exit codes and times: provisional

    @property
    def queue_wait_s(self) -> float | None:
        if self.submit and self.start:
            return max(0.0, (self.start - self.submit).total_seconds())
        return None


def parse_sbatch(output: str) -> str:
    """``sbatch --parsable`` prints ``jobid`` or ``jobid;cluster``."""
    line = output.strip().splitlines()[-1] if output.strip() else ""
    job_id = line.split(";", 1)[0].strip()
    if not _JOB_ID.match(job_id):
        raise SlurmParseError(f"sbatch printed no job id: {output.strip()[:200]!r}")
    return job_id


def _time(value: str) -> datetime | None:
    if value in ("", "Unknown", "None", "N/A"):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def _int(value: str) -> int | None:
    return int(value) if value.isdigit() else None


def _exit(value: str) -> tuple[int | None, int | None]:
    code, _, sig = value.partition(":")
    return _int(code), _int(sig)


def parse_sacct(output: str) -> dict[str, JobRecord]:
    """Rows of ``sacct --parsable2 --noheader --format=<SACCT_FIELDS>`` by job id.

    Step rows (``123.0``, ``123.extern``) are skipped, except that ``123.batch``
    supplies the exit code of the script when the allocation row has none. A
    requeued job appears once per run; the last row wins, as sacct orders them.
    """
    jobs: dict[str, dict[str, str]] = {}
    batch_exit: dict[str, str] = {}
    for lineno, line in enumerate(output.splitlines(), 1):
        if not line.strip():
            continue
        cells = line.split("|")
        if len(cells) != len(SACCT_FIELDS):
            raise SlurmParseError(
                f"sacct line {lineno}: {len(cells)} fields, expected {len(SACCT_FIELDS)}: {line!r}"
            )
        row = dict(zip(SACCT_FIELDS, cells, strict=True))
        job_id, _, step = row["JobID"].partition(".")
        if step == "batch":
            batch_exit[job_id] = row["ExitCode"]
        elif not step:
            jobs[job_id] = row
    records = {}
    for job_id, row in jobs.items():
        base, detail = normalize_state(row["State"])
        code, sig = _exit(row["ExitCode"])
        if job_id in batch_exit and (code in (None, 0)):
            b_code, b_sig = _exit(batch_exit[job_id])
            if b_code or b_sig:
                code, sig = b_code, b_sig
        gpus = _GPU_TRES.search(row["AllocTRES"])
        records[job_id] = JobRecord(
            job_id=job_id, name=row["JobName"], state=base, state_detail=detail,
            exit_code=code, signal=sig, submit=_time(row["Submit"]),
            start=_time(row["Start"]), end=_time(row["End"]),
            elapsed_s=_int(row["ElapsedRaw"]), nodelist=row["NodeList"],
            gpus=int(gpus.group(1)) if gpus else 0,
            reason="" if row["Reason"] == "None" else row["Reason"],
        )
    return records


def job_view(records: dict[str, JobRecord], job_id: str) -> JobRecord | None:
    """The record for ``job_id``; for an array job, one record standing for all its tasks.

    An array is active while any task is, then takes its worst task's state, so
    one failed task fails the array.
    """
    if job_id in records:
        return records[job_id]
    tasks = [r for k, r in records.items() if k.partition("_")[0] == job_id and "_" in k]
    if not tasks:
        return None
    from operators.slurm.states import Outcome

    rank = {Outcome.ACTIVE: 0, Outcome.FAILURE: 1, Outcome.TIME_LIMIT: 2,
            Outcome.RETRYABLE: 3, Outcome.SUCCESS: 4}
    worst = min(tasks, key=lambda r: rank.get(_safe_outcome(r.state), 0))
    exit_codes = [r.exit_code for r in tasks if r.exit_code]
    return JobRecord(
        job_id=job_id, name=worst.name, state=worst.state, state_detail=worst.state_detail,
        exit_code=max(exit_codes) if exit_codes else worst.exit_code, signal=worst.signal,
        submit=min((r.submit for r in tasks if r.submit), default=None),
        start=min((r.start for r in tasks if r.start), default=None),
        end=max((r.end for r in tasks if r.end), default=None),
        elapsed_s=sum(r.elapsed_s or 0 for r in tasks),
        nodelist=",".join(sorted({r.nodelist for r in tasks if r.nodelist})),
        gpus=sum(r.gpus for r in tasks), reason=worst.reason, source=worst.source,
    )


def _safe_outcome(state: str):
    from operators.slurm.states import Outcome, UnknownSlurmState, classify

    try:
        return classify(state)
    except UnknownSlurmState:
        return Outcome.ACTIVE


def _retryable(state: str) -> bool:
    from operators.slurm.states import Outcome

    return _safe_outcome(state) is Outcome.RETRYABLE


def needs_squeue(records: dict[str, JobRecord], job_id: str) -> bool:
    """Whether sacct's view of ``job_id`` needs squeue's: unknown yet, or maybe requeued."""
    view = job_view(records, job_id)
    return view is None or _retryable(view.state)


def merge_live(records: dict[str, JobRecord], live: dict[str, JobRecord]) -> dict[str, JobRecord]:
    """sacct's records completed by squeue's rows.

    squeue fills the seconds after submission when sacct does not know a job yet.
    And after NODE_FAIL or PREEMPTED a requeueable job goes back to the queue under
    the same id while, for a few seconds, sacct's newest row is still the run that
    ended: if squeue holds the job as active, that is the truth, so keep waiting.
    """
    from operators.slurm.states import Outcome

    merged = dict(records)
    for job_id, row in live.items():
        known = merged.get(job_id)
        if known is None:
            merged[job_id] = row
        elif _retryable(known.state) and _safe_outcome(row.state) is Outcome.ACTIVE:
            merged[job_id] = replace(row, state_detail=f"requeued after {known.state}")
    return merged


def parse_squeue(output: str) -> dict[str, JobRecord]:
    """Rows of ``squeue --noheader --format=SQUEUE_FORMAT`` by job id."""
    records = {}
    for lineno, line in enumerate(output.splitlines(), 1):
        if not line.strip():
            continue
        cells = line.split("|")
        if len(cells) != 5:
            raise SlurmParseError(f"squeue line {lineno}: expected 5 fields: {line!r}")
        job_id, name, state, reason, nodes = cells
        base, detail = normalize_state(state)
        records[job_id] = JobRecord(job_id=job_id, name=name, state=base, state_detail=detail,
                                    reason="" if reason == "None" else reason, nodelist=nodes,
                                    source="squeue")
    return records
