"""Parsers for ``sbatch --parsable``, ``sacct --parsable2`` and ``squeue``. Pure.

Login nodes print banners, MOTDs and warnings on stdout before a command's own
output: a line that is not one of Slurm's rows is skipped and reported in
``Rows.skipped``, never fatal on its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from operators.slurm.jobids import id_order, parse_job_id
from operators.slurm.states import Outcome, UnknownSlurmState, classify, normalize_state
from operators.slurm.wire import JsonMessage

# The columns we ask ``sacct`` for, in order; parse_sacct reads them by name.
SACCT_FIELDS = (
    "JobID", "JobIDRaw", "JobName", "State", "ExitCode", "Submit", "Start", "End",
    "ElapsedRaw", "NodeList", "AllocTRES", "Reason",
)
SQUEUE_FORMAT = "%i|%j|%T|%r|%N"  # job id, name, long state, reason, nodes
_SQUEUE_FIELDS = 5
_GPU_TRES = re.compile(r"gres/gpu(?::[^=,]+)?=([0-9]+)")
# What sbatch prints for the new job: `--parsable` gives "id" or "id;cluster"; sites that wrap
# sbatch print its normal line, sometimes prefixed or naming the cluster (sbatch(1)).
_SBATCH_LINE = re.compile(
    r"^(?:sbatch: )?(?:Submitted batch job )?([0-9]+(?:_[0-9]+)?)(?:;\S+| on cluster \S+)?$")


class SlurmParseError(ValueError):
    """Slurm's output did not have the shape we asked for."""


@dataclass(frozen=True)
class JobRecord(JsonMessage):
    job_id: str  # "123"; "123_4" for an array task; "1853+1" for a het job component
    name: str
    state: str  # normalised base state, e.g. "CANCELLED"
    state_detail: str = ""  # e.g. "by 1000"; for an array or het job, its members' ends
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

    # In an event or XCom the job key is the task's own and the source a poll's detail.
    json_omit = frozenset({"name", "source"})

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobRecord:
        return super().from_json({"name": "", **data})

    @property
    def queue_wait_s(self) -> float | None:
        if self.submit and self.start:
            return max(0.0, (self.start - self.submit).total_seconds())
        return None


@dataclass(frozen=True)
class Rows:
    """Parsed rows by job id as Slurm printed it, and the lines that were not rows."""

    records: dict[str, JobRecord] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()


def parse_sbatch(output: str) -> str:
    """The job id from sbatch's output: its last line that names one."""
    for line in reversed(output.strip().splitlines()):
        match = _SBATCH_LINE.match(line.strip())
        if match:
            return match.group(1)
    raise SlurmParseError(f"sbatch printed no job id: {output.strip()[:200]!r}")


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


# Which rows are ours: (job id as printed, job name) -> keep. Slurm reuses job ids after a
# controller reset, so sacct --jobs=45 can print another user's old job 45 beside ours
# (seen on the local cluster: an old "allocation" job 45 beside het job 45+0, 45+1).
Ours = Callable[[str, str], bool]


def by_name(names: Mapping[str, str | None]) -> Ours:
    """Rows whose name is the one their job (by base id) is known by; any row for a job
    whose name is not known (a sensor given only an id)."""
    def keep(job_id: str, name: str) -> bool:
        parsed = parse_job_id(job_id)
        wanted = names.get(job_id) or (names.get(parsed.base) if parsed else None)
        return wanted is None or wanted == name
    return keep


def read_sacct(output: str, ours: Ours | None = None) -> Rows:
    """Rows of ``sacct --parsable2 --noheader --format=<SACCT_FIELDS>`` by job id.

    Step rows (``123.0``, ``123.extern``) are skipped, except that ``123.batch``
    supplies the exit code of the script when the allocation row has none. A
    requeued job appears once per run (``--duplicates``, oldest first): the last row
    wins, and its detail says how the run before it ended ("requeued after NODE_FAIL"),
    which a poll that missed the few seconds of NODE_FAIL would otherwise never learn.
    Allocation rows that are not ``ours`` are left out, with their steps.
    """
    jobs: dict[str, dict[str, str]] = {}
    batch_exit: dict[str, str] = {}
    requeued_after: dict[str, str] = {}  # job id -> how its previous run ended
    skipped = []
    theirs: set[str] = set()
    for line in output.splitlines():
        if not line.strip():
            continue
        cells = line.split("|")
        job_id, _, step = cells[0].partition(".")
        if len(cells) != len(SACCT_FIELDS) or parse_job_id(job_id) is None:
            skipped.append(line)
            continue
        row = dict(zip(SACCT_FIELDS, cells, strict=True))
        if not step:  # steps follow their allocation's row
            if ours is not None and not ours(job_id, row["JobName"]):
                theirs.add(job_id)
                continue
            theirs.discard(job_id)
            earlier = jobs.get(job_id)
            requeued_after.pop(job_id, None)
            if earlier and earlier["JobName"] == row["JobName"]:  # a requeued job's last run
                requeued_after[job_id] = normalize_state(earlier["State"])[0]
            batch_exit.pop(job_id, None)  # an earlier run's script exit is not this run's
            jobs[job_id] = row
        elif step == "batch" and job_id not in theirs:
            batch_exit[job_id] = row["ExitCode"]
    records = {}
    for job_id, row in jobs.items():
        base, detail = normalize_state(row["State"])
        code, sig = _exit(row["ExitCode"])
        if job_id in batch_exit and (code in (None, 0)):
            b_code, b_sig = _exit(batch_exit[job_id])
            if b_code or b_sig:
                code, sig = b_code, b_sig
        gpus = _GPU_TRES.search(row["AllocTRES"])
        if job_id in requeued_after:
            detail = " ".join(filter(None, (detail, f"requeued after {requeued_after[job_id]}")))
        records[job_id] = JobRecord(
            job_id=job_id, name=row["JobName"], state=base, state_detail=detail,
            exit_code=code, signal=sig, submit=_time(row["Submit"]),
            start=_time(row["Start"]), end=_time(row["End"]),
            elapsed_s=_int(row["ElapsedRaw"]), nodelist=row["NodeList"],
            gpus=int(gpus.group(1)) if gpus else 0,
            reason="" if row["Reason"] == "None" else row["Reason"],
        )
    return Rows(records, tuple(skipped))


def read_squeue(output: str, ours: Ours | None = None) -> Rows:
    """Rows of ``squeue --noheader --format=SQUEUE_FORMAT`` by job id (only ``ours``)."""
    records, skipped = {}, []
    for line in output.splitlines():
        if not line.strip():
            continue
        cells = line.split("|")
        if len(cells) != _SQUEUE_FIELDS or parse_job_id(cells[0]) is None or not cells[2]:
            skipped.append(line)
            continue
        job_id, name, state, reason, nodes = cells
        if ours is not None and not ours(job_id, name):
            continue
        base, detail = normalize_state(state)
        records[job_id] = JobRecord(job_id=job_id, name=name, state=base, state_detail=detail,
                                    reason="" if reason == "None" else reason, nodelist=nodes,
                                    source="squeue")
    return Rows(records, tuple(skipped))


def parse_sacct(output: str) -> dict[str, JobRecord]:
    return read_sacct(output).records


def parse_squeue(output: str) -> dict[str, JobRecord]:
    return read_squeue(output).records


def _safe_outcome(state: str) -> Outcome | None:
    try:
        return classify(state)
    except UnknownSlurmState:
        return None


def _retryable(state: str) -> bool:
    return _safe_outcome(state) is Outcome.RETRYABLE


# Which member's end stands for an array or het job that did not wholly succeed.
_WORST_FIRST = (Outcome.FAILURE, Outcome.TIME_LIMIT, Outcome.RETRYABLE)


def job_view(records: dict[str, JobRecord], job_id: str) -> JobRecord | None:
    """The record for ``job_id``; for an array or het job, one record standing for all
    its members (see :func:`combine`). An array task still pending with others
    (``123_[2-4]``) is found by its own id (``123_3``)."""
    members = [r for k, r in records.items() if _member_of(k, job_id)]
    if members:
        # An exact row beside members is the array's or het job's own record in transit:
        # sacct (22.05.8, local) printed "58|58|allocation|PENDING|..." while tasks 58_0..2 ran.
        return combine(job_id, members)
    if job_id in records:
        return records[job_id]
    wanted = parse_job_id(job_id)
    if wanted is None:
        return None
    if wanted.task is not None:  # one task, maybe inside a pending range row
        for key, record in records.items():
            parsed = parse_job_id(key)
            if parsed and parsed.base == wanted.base and parsed.holds_task(wanted.task):
                return replace(record, job_id=job_id)
        return None
    return None


def _member_of(key: str, base: str) -> bool:
    parsed = parse_job_id(key)
    return parsed is not None and parsed.base == base and parsed.member


def combine(job_id: str, members: list[JobRecord]) -> JobRecord:
    """An array's tasks or a het job's components as one job.

    Active while any member is pending or running; a success only when every member
    succeeded; otherwise the worst member's end (failure before time limit before
    retryable), with every member that did not succeed, and its exit code, named in
    ``state_detail``. A state we have no meaning for is passed on as it is.
    """
    members = sorted(members, key=lambda r: id_order(r.job_id))
    outcomes = [(_safe_outcome(r.state), r) for r in members]
    strange = [r for o, r in outcomes if o is None]
    active = [r for o, r in outcomes if o is Outcome.ACTIVE]
    bad = [(o, r) for o, r in outcomes if o in _WORST_FIRST]
    if strange:
        lead, detail = strange[0], f"member {strange[0].job_id}"
    elif active:
        running = [r for r in active if r.state == "RUNNING"]
        lead = (running or active)[0]
        detail = _counts(members)
    elif bad:
        lead = min(bad, key=lambda item: _WORST_FIRST.index(item[0]))[1]
        detail = "not completed: " + ", ".join(
            f"{r.job_id} {r.state} exit code {r.exit_code}" for _, r in bad)
    else:
        lead, detail = members[-1], ""
    starts = [r.start for r in members if r.start]
    ends = [r.end for r in members if r.end]
    wall = (int((max(ends) - min(starts)).total_seconds()) if starts and ends and not active
            else max((r.elapsed_s or 0 for r in members), default=None))
    return JobRecord(
        job_id=job_id, name=lead.name, state=lead.state, state_detail=detail,
        exit_code=lead.exit_code, signal=lead.signal,
        submit=min((r.submit for r in members if r.submit), default=None),
        start=min(starts, default=None), end=max(ends, default=None) if not active else None,
        elapsed_s=wall,
        nodelist=",".join(sorted({r.nodelist for r in members if r.nodelist})),
        gpus=sum(r.gpus for r in members), reason=lead.reason,
        source="squeue" if any(r.source == "squeue" for r in members) else "sacct",
    )


def _counts(members: Iterable[JobRecord]) -> str:
    by_state: dict[str, int] = {}
    for record in members:
        by_state[record.state] = by_state.get(record.state, 0) + 1
    return ", ".join(f"{n} {state}" for state, n in sorted(by_state.items()))


def newest_job(records: dict[str, JobRecord], name: str) -> JobRecord | None:
    """The newest job named ``name`` (an array or het job as a whole). Rows of other names,
    such as a job id Slurm reused after a controller reset, are not ours."""
    bases = {parse_job_id(k).base for k, r in records.items() if r.name == name}
    if not bases:
        return None
    ours = {k: r for k, r in records.items() if r.name == name}
    return job_view(ours, max(bases, key=int))


def needs_squeue(records: dict[str, JobRecord], job_id: str) -> bool:
    """Whether sacct's view of ``job_id`` needs squeue's: unknown yet, maybe requeued, or
    an array or het job that sacct reads as ended. sacct records members a little late: on
    the local cluster (22.05.8) an array read COMPLETED from its other tasks' rows while its
    failed task had no row yet. squeue still lists every member for MinJobAge. And sacct
    reads PENDING until slurmctld's start message reaches slurmdbd: seen for a second or
    more on the loaded local cluster, after squeue already said RUNNING."""
    view = job_view(records, job_id)
    if view is None or _retryable(view.state) or view.state == "PENDING":
        return True
    grouped = any(_member_of(k, job_id) for k in records)
    return grouped and _safe_outcome(view.state) not in (Outcome.ACTIVE, None)


def merge_live(records: dict[str, JobRecord], live: dict[str, JobRecord]) -> dict[str, JobRecord]:
    """sacct's records completed by squeue's rows.

    squeue fills the seconds after submission when sacct does not know a job yet.
    And after NODE_FAIL or PREEMPTED a requeueable job goes back to the queue under
    the same id while, for a few seconds, sacct's newest row is still the run that
    ended: if squeue holds the job as active, that is the truth, so keep waiting.
    """
    merged = dict(records)
    for job_id, row in live.items():
        known = merged.get(job_id)
        if known is None:
            merged[job_id] = row
        elif _retryable(known.state) and _safe_outcome(row.state) is Outcome.ACTIVE:
            merged[job_id] = replace(row, state_detail=f"requeued after {known.state}")
        elif known.state == "PENDING" and row.state != "PENDING":
            # slurmdbd has not heard of the start yet; the controller's word is newer.
            merged[job_id] = replace(row, submit=known.submit,
                                     state_detail=row.state_detail or known.state_detail)
    return merged

