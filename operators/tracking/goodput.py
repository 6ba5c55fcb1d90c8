"""Goodput of a campaign: the share of its allocation that trained, and where the rest went.

Pure (standard library and the log parser): computed from typed inputs, one
:class:`SegmentJob` per segment job, built by :func:`segment_job` from what the real tools
print: the job's sacct row (``JobRecord``: Submit, Start, End) and its log (Megatron Bridge's
iteration, checkpoint and timer lines, which the reference trainer prints too, read by
logparse; plus the ``[pretrain-pipeline] job N restart R on HOST at T`` line that every job
script prints first, operators/slurm/render.py, so a requeued job's appended log shows where
each of its runs starts).

The components, in seconds (node-seconds where the name says so):

    span_node_s       the campaign's node time: its first segment job's Start to its last
                      one's End, x nodes (the allocations plus the gaps between them)
    allocated_node_s  (End - Start) x nodes of every run of every segment job, failed ones too
    train_s           time in training steps of iterations that were kept
    redone_s          time in steps of iterations that were trained again later (work lost
                      to a failure between two saves)
    startup_s         a run's start to its first training step (container, imports, model
                      build, checkpoint load)
    save_s / load_s   checkpoint saves and loads (the trainers' save/load-checkpoint timers)
    queue_s           Submit -> Start (sacct), plus a requeued run's wait for its restart
    gap_s             one segment job's End to the next one's Start (Airflow's turn-around
                      plus the next queue wait: it overlaps queue_s)
    hang_s            a job the hang watchdog stopped: its last step line to its End (the
                      whole run when it hung before its first step; then it overlaps
                      startup_s). A hang nothing stopped cannot be told from a slow job.

``goodput`` = train_s x nodes / span_node_s: the share of the campaign's node time that
trained, Llama 3's "effective training time". The gaps between segments are in it, since the
campaign holds (or waits for) its nodes through them: they are what pre-queueing removes.
``goodput_in_jobs`` = train_s x nodes / allocated_node_s: the share of what the segment jobs
themselves held, which no gap changes. Times in the log and in sacct are the cluster's wall
clock without a zone (sacct prints local time; on the local cluster, UTC); the restart
line's time is UTC.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from itertools import pairwise

from jobscripts import vocabulary as v
from operators.slurm.parse import JobRecord
from operators.tracking import logparse

# The job script's first line (operators/slurm/render.py render_script).
_RUN_START = re.compile(r"\[pretrain-pipeline\] job \S+ restart (\d+) on \S+ at (\S+Z)")
# slurmstepd's cancel line carries when a requeued/cancelled run stopped.
_CANCELLED_AT = re.compile(r"\*\*\* (?:JOB|STEP) \S+ ON \S+ CANCELLED AT (\S+)")


@dataclass(frozen=True)
class Step:
    iteration: int
    seconds: float  # this iteration's share of the logged interval's time


@dataclass(frozen=True)
class Run:
    """One run of a segment job: a requeued job has one per restart, the last one sacct's."""

    start: datetime | None
    end: datetime | None
    first_step_at: datetime | None  # when the first step began (its line's time - its time)
    last_step_at: datetime | None  # the last iteration line's time: the last progress seen
    steps: tuple[Step, ...]
    save_s: float
    load_s: float
    resumed_from: int | None  # the iteration the checkpoint load named


@dataclass(frozen=True)
class SegmentJob:
    job_id: str
    submit: datetime | None
    nodes: int
    runs: tuple[Run, ...]
    failed: bool  # the job (last run) did not end in COMPLETED
    hung: bool = False  # the hang watchdog stopped it

    @property
    def start(self) -> datetime | None:
        return self.runs[0].start if self.runs else None

    @property
    def first_submit(self) -> datetime | None:
        """Submit, when it is the first run's: a requeue sets sacct's Submit anew, and then
        the first run's queue wait is unknown (None)."""
        if self.submit is not None and self.start is not None and self.submit <= self.start:
            return self.submit
        return None

    @property
    def end(self) -> datetime | None:
        return self.runs[-1].end if self.runs else None


@dataclass(frozen=True)
class Goodput:
    segments: int  # segment jobs, failed ones included
    runs: int  # runs of all segment jobs: more than segments when Slurm requeued one
    span_node_s: float
    allocated_node_s: float
    train_s: float
    redone_s: float
    startup_s: float
    save_s: float
    load_s: float
    queue_s: float
    gap_s: float  # the sum of the gaps between consecutive segment jobs
    gap_median_s: float | None
    hang_s: float
    iterations_trained: int
    iterations_redone: int
    goodput: float | None  # train over span; None without allocated time
    goodput_in_jobs: float | None  # train over allocated

    def components(self) -> dict[str, float]:
        """The figures as name -> number, for MLflow and tables (None left out)."""
        return {k: float(val) for k, val in vars(self).items() if val is not None}


def _clock(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def _naive_utc(moment: datetime | None) -> datetime | None:
    if moment is not None and moment.tzinfo is not None:
        return moment.astimezone(UTC).replace(tzinfo=None)
    return moment


def _split_runs(lines: Iterable[str]) -> list[list[str]]:
    """The log's lines per run: a new run at every restart line after the first."""
    runs: list[list[str]] = [[]]
    for line in lines:
        if _RUN_START.search(line) and any(_RUN_START.search(x) for x in runs[-1]):
            runs.append([])
        runs[-1].append(line)
    return runs


def _run(lines: list[str], start: datetime | None, end: datetime | None) -> Run:
    steps: list[Step] = []
    save_ms = load_ms = 0.0
    resumed = first_at = None
    previous: int | None = None
    clocks = [c for c in map(logparse.step_clock, lines) if c is not None]
    for record in logparse.parse_lines(lines):
        if record.kind == v.CHECKPOINT_LOAD:
            resumed = previous = record.iteration
        elif record.kind == v.TIMER:
            save_ms += record.metrics.get(v.SAVE_CHECKPOINT_MS, 0.0)
            load_ms += record.metrics.get(v.LOAD_CHECKPOINT_MS, 0.0)
        elif record.kind == v.TRAIN and v.ELAPSED_MS in record.metrics:
            # "elapsed time per iteration" is the mean over the logging interval: every
            # iteration since the last line (or the checkpoint) took that long.
            base = previous if previous is not None and previous < record.iteration else 0
            each = record.metrics[v.ELAPSED_MS] / 1000.0
            if not steps and clocks:
                first_at = clocks[0].timestamp() - each * (record.iteration - base)
            steps += [Step(i, each) for i in range(base + 1, record.iteration + 1)]
            previous = record.iteration
    first = datetime.fromtimestamp(first_at) if first_at is not None else None
    last = clocks[-1] if clocks and steps else None
    return Run(start, end, first, last, tuple(steps), save_ms / 1000.0, load_ms / 1000.0,
               resumed)


def _run_end(lines: list[str]) -> datetime | None:
    """When an interrupted run stopped: slurmstepd's cancel time, else its last step line."""
    for line in reversed(lines):
        match = _CANCELLED_AT.search(line)
        if match:
            return _naive_utc(_clock(match.group(1)))
        clock = logparse.step_clock(line)
        if clock is not None:
            return clock
    return None


def segment_job(record: JobRecord, log_lines: Iterable[str], nodes: int,
                reported_load_s: float | None = None, *, hung: bool = False) -> SegmentJob:
    """A segment job from its sacct row and its log. ``reported_load_s``: the load time the
    trainer wrote in ``segment.json`` (the reference trainer prints no load timer line), used
    for the last run when its log has none; ``hung``: the hang watchdog stopped it."""
    chunks = _split_runs(log_lines)
    runs: list[Run] = []
    for index, lines in enumerate(chunks):
        last = index == len(chunks) - 1
        marker = next((m for m in map(_RUN_START.search, lines) if m), None)
        start = record.start if last else _naive_utc(_clock(marker.group(2)) if marker else None)
        run = _run(lines, start, record.end if last else _run_end(lines))
        if last and run.load_s == 0 and reported_load_s:
            run = replace(run, load_s=float(reported_load_s))
        runs.append(run)
    return SegmentJob(record.job_id, record.submit, nodes, tuple(runs),
                      failed=record.state != "COMPLETED" or hung, hung=hung)


def _seconds(a: datetime | None, b: datetime | None) -> float:
    return max(0.0, (b - a).total_seconds()) if a is not None and b is not None else 0.0


def ordered(jobs: Iterable[SegmentJob]) -> list[SegmentJob]:
    """Segment jobs in the order they ran."""
    return sorted(jobs, key=lambda j: (j.start or j.submit or datetime.min))


def numbered(jobs: Iterable[SegmentJob]) -> list[tuple[int, SegmentJob]]:
    """Each job in the order they ran with the campaign's segment number: a failed job has the
    number of the job after it (its retry). Not the task's number: a new DAG run of the
    campaign starts again at ``segment_1`` and goes on from the checkpoint."""
    numbers, number = [], 1
    for job in ordered(jobs):
        numbers.append((number, job))
        number += not job.failed
    return numbers


def compute(jobs: Sequence[SegmentJob]) -> Goodput:
    """The campaign's goodput from its segment jobs."""
    jobs = ordered(jobs)
    runs = [(job, run) for job in jobs for run in job.runs]
    # An iteration trained more than once: every occurrence but the last was lost work.
    last_seen: dict[int, int] = {}
    order = [(job, step) for job, run in runs for step in run.steps]
    for position, (_job, step) in enumerate(order):
        last_seen[step.iteration] = position
    train = redone = 0.0
    for position, (job, step) in enumerate(order):
        if last_seen[step.iteration] == position:
            train += step.seconds * job.nodes
        else:
            redone += step.seconds * job.nodes
    allocated = sum(_seconds(r.start, r.end) * j.nodes for j, r in runs)
    starts = [r.start for _, r in runs if r.start is not None]
    ends = [r.end for _, r in runs if r.end is not None]
    # Segment jobs run one after another (a pre-queued one waits on its predecessor), so the
    # span covers the allocations; max() keeps it honest if they ever overlapped.
    span = max(allocated, _seconds(min(starts), max(ends)) * max(j.nodes for j in jobs)
               if starts and ends else 0.0)
    hang = sum(_seconds(job.runs[-1].last_step_at or job.runs[-1].start, job.runs[-1].end)
               * job.nodes for job in jobs if job.hung and job.runs)
    startup = sum(_seconds(r.start, r.first_step_at or r.end) * j.nodes for j, r in runs)
    queue = sum(_seconds(j.first_submit, j.start) for j in jobs)
    for job in jobs:  # a requeued run waited again between its predecessor's end and its start
        queue += sum(_seconds(a.end, b.start) for a, b in pairwise(job.runs))
    gaps = [_seconds(a.end, b.start) for a, b in pairwise(jobs)]
    return Goodput(
        segments=len(jobs), runs=len(runs), span_node_s=span, allocated_node_s=allocated,
        train_s=train, redone_s=redone, startup_s=startup,
        save_s=sum(r.save_s * j.nodes for j, r in runs),
        load_s=sum(r.load_s * j.nodes for j, r in runs),
        queue_s=queue, gap_s=sum(gaps),
        gap_median_s=statistics.median(gaps) if gaps else None, hang_s=hang,
        iterations_trained=len(last_seen), iterations_redone=len(order) - len(last_seen),
        goodput=train / span if span > 0 else None,
        goodput_in_jobs=train / allocated if allocated > 0 else None)


@dataclass(frozen=True)
class Span:
    """One bar of the segments' timeline: what [start, end) was spent on."""

    segment: int  # 1-based, in the order the jobs ran
    kind: str  # one of SPAN_KINDS
    start: datetime
    end: datetime


QUEUE, STARTUP, TRAINING, SAVE, FAILED = "queue wait", "start-up", "training", "save", "failure"
SPAN_KINDS = (QUEUE, STARTUP, TRAINING, SAVE, FAILED)


def timeline(jobs: Sequence[SegmentJob]) -> list[Span]:
    """The bars of the timeline plot: queue wait, start-up, training (with the saves in it
    drawn at the run's end, where the final save is) and runs that failed or were requeued."""
    spans: list[Span] = []
    for number, job in numbered(jobs):
        if job.first_submit is not None:
            spans.append(Span(number, QUEUE, job.first_submit, job.start))
        for before, after in pairwise(job.runs):  # waiting for the requeued run
            if before.end is not None and after.start is not None and before.end < after.start:
                spans.append(Span(number, QUEUE, before.end, after.start))
        for index, run in enumerate(job.runs):
            if run.start is None or run.end is None:
                continue
            interrupted = index < len(job.runs) - 1 or job.failed
            first = min(run.first_step_at or run.end, run.end)
            spans.append(Span(number, STARTUP, run.start, max(first, run.start)))
            save_from = datetime.fromtimestamp(max(first.timestamp(),
                                                   run.end.timestamp() - run.save_s))
            spans.append(Span(number, FAILED if interrupted else TRAINING, first, save_from))
            if run.save_s > 0:
                spans.append(Span(number, SAVE, save_from, run.end))
    return spans
