"""Segment planning, pure: how many segment tasks a DAG run gets, where each one stops, how
long it may train, and whether it moved.

A campaign outlives any Slurm job, so training runs as a chain of segments that each resume
from the last checkpoint. ``train_iters`` stays fixed for the whole campaign (it sizes the
dataset and the learning-rate schedule); a segment ends by time (``exit_duration_in_mins``,
with ``--signal`` as a backup) or, when ``segments.iters_per_segment`` is set, at the next
multiple of it (``exit_interval``: Megatron and the reference trainer both stop when
``iteration % exit_interval == 0``, so targets lie on that grid).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from operators.campaign.schema.config import Campaign


class SegmentNoProgress(RuntimeError):
    """A segment ended without advancing the checkpoint: retrying it blindly would loop."""


@dataclass(frozen=True)
class SegmentTarget:
    index: int  # 1-based within this DAG run
    start_iteration: int | None  # where it resumes, if known before the earlier ones ran
    target_iteration: int  # where it stops at the latest (train_iters, or the next multiple)


@dataclass(frozen=True)
class Plan:
    train_iters: int
    start_iteration: int
    segments: tuple[SegmentTarget, ...]

    @property
    def done(self) -> bool:
        return self.start_iteration >= self.train_iters


def next_target(campaign: Campaign, iteration: int | None) -> int:
    """The iteration a segment starting at ``iteration`` stops at, at the latest."""
    iteration, total = iteration or 0, campaign.training.train_iters
    per = campaign.segments.iters_per_segment
    if per is None or iteration >= total:
        return total
    return min(total, (iteration // per + 1) * per)


def plan_segments(campaign: Campaign, iteration: int | None = 0) -> Plan:
    """The segment tasks of one DAG run, given the checkpoint iteration it starts from.

    With ``iters_per_segment``, one task per grid step left (at most ``max_per_run``).
    Without it how far a segment gets depends on its speed, so every task aims at
    ``train_iters``, there are ``max_per_run`` of them, and the ones after the campaign is
    done skip. None when the campaign is already done.
    """
    start, total = iteration or 0, campaign.training.train_iters
    cap, per = campaign.segments.max_per_run, campaign.segments.iters_per_segment
    segments: list[SegmentTarget] = []
    if start < total and per is None:
        segments = [SegmentTarget(i, start if i == 1 else None, total) for i in range(1, cap + 1)]
    position = start
    while per is not None and position < total and len(segments) < cap:
        target = next_target(campaign, position)
        segments.append(SegmentTarget(len(segments) + 1, position, target))
        position = target
    return Plan(train_iters=total, start_iteration=start, segments=tuple(segments))


@dataclass(frozen=True)
class SegmentEnd:
    """Where a segment's job left the campaign: ``iteration`` is what its progress counts to,
    ``note`` why, when its ``segment.json`` and the checkpoint tracker disagree."""

    iteration: int
    note: str | None = None


def segment_end(reported: object, tracker: int) -> SegmentEnd:
    """The last iteration a segment's job saved, from its ``segment.json``'s ``end_iteration``
    (``reported``) and the checkpoint tracker read after the job ended.

    The lower of the two. The tracker ahead of the job's own figure: the next, pre-queued
    segment's job has trained and saved since (Airflow read it late); this segment's progress
    ends at its own figure. The tracker behind: the figure is stale or wrong (no save of this
    job's survived): the tracker is what a resume starts from."""
    if not isinstance(reported, int) or isinstance(reported, bool):
        return SegmentEnd(tracker)
    if tracker > reported:
        return SegmentEnd(reported, f"the checkpoint tracker is at {tracker}, past this job's "
                          f"last save {reported}: a later segment's job has saved since; "
                          f"counting {reported}")
    if tracker < reported:
        return SegmentEnd(tracker, f"segment.json says iteration {reported}, the checkpoint "
                          f"tracker {tracker}: counting the tracker's")
    return SegmentEnd(tracker)


def check_progress(before: int | None, after: int | None) -> int:
    """Iterations a segment advanced; raises :class:`SegmentNoProgress` if none."""
    before, after = before or 0, after or 0
    if after < before:
        raise SegmentNoProgress(f"segment went backwards: iteration {before} -> {after} "
                                "(checkpoint lost or a different checkpoint directory?)")
    if after == before:
        raise SegmentNoProgress(f"segment made no progress (iteration stayed at {before})")
    return after - before


def save_seconds_estimate(results: Iterable[Mapping], default_s: float) -> float:
    """Seconds one save takes: the slowest per-save time measured by earlier segments'
    ``segment.json`` (save_seconds / saves), else ``default_s``. The slowest, because a
    save cut by the time limit loses the whole segment."""
    measured = [r["save_seconds"] / r["saves"] for r in results
                if r.get("saves") and r.get("save_seconds") is not None]
    return max(measured, default=default_s)


def startup_minutes_estimate(results: Iterable[Mapping], default_min: float) -> float:
    """Minutes from job start to the trainer's exit timer: the slowest ``startup_seconds``
    earlier segments measured, else ``default_min``. Only that part: Bridge's timer starts
    inside ``pretrain()``, so model set-up and checkpoint loading already count against
    ``exit_duration_in_mins`` and must not be subtracted a second time."""
    measured = [r["startup_seconds"] / 60.0 for r in results
                if isinstance(r.get("startup_seconds"), (int, float))
                and not isinstance(r.get("startup_seconds"), bool)
                and math.isfinite(r["startup_seconds"]) and r["startup_seconds"] >= 0]
    return max(measured, default=default_min)


def exit_duration_minutes(time_limit_min: float, startup_estimate_min: float,
                          measured_save_s: float, margin_min: float) -> int:
    """``train.exit_duration_in_mins`` for a segment: whole minutes of training that leave
    room, inside the job's time limit, for start-up before the training timer starts, one
    final save, and a margin (the timer is checked once per iteration, so one iteration can
    overrun it). Megatron takes an int; rounding down errs on the side of saving."""
    for name, value in (("time_limit_min", time_limit_min),
                        ("startup_estimate_min", startup_estimate_min),
                        ("measured_save_s", measured_save_s), ("margin_min", margin_min)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0 (got {value!r})")
    minutes = math.floor(time_limit_min - startup_estimate_min - measured_save_s / 60.0
                         - margin_min)
    if minutes < 1:
        raise ValueError(
            f"a {time_limit_min} min segment leaves no training time after start-up "
            f"{startup_estimate_min} min + save {measured_save_s:.0f} s + margin {margin_min} min")
    return minutes


def signal_lead_seconds(margin_min: float) -> int:
    """``--signal=TERM@N``: half the margin before the limit. The planned exit has saved by
    then; the signal is only a backup, and Slurm may send it up to 60 s early."""
    return max(60, int(margin_min * 60) // 2)


def segment_job_options(campaign: Campaign, *, batch_shell: bool) -> dict:
    """sbatch options every training segment has, whoever trains it.

    ``--signal`` as the backup stop (``B:`` when the trainer is the batch shell itself).
    ``--requeue``: a segment resumes from its last checkpoint, so Slurm may restart it
    under the same job id after a node failure, a preemption or ``scontrol requeue``.
    """
    lead = signal_lead_seconds(campaign.segments.margin_min)
    return {"signal": f"{'B:' if batch_shell else ''}TERM@{lead}", "requeue": True}


def segment_exit_minutes(campaign: Campaign, earlier_results: Iterable[Mapping] = ()) -> int:
    """:func:`exit_duration_minutes` with the start-up and save times earlier segments
    measured, else the campaign's estimates."""
    s, results = campaign.segments, list(earlier_results)
    return exit_duration_minutes(campaign.cluster.time_limit_minutes,
                                 startup_minutes_estimate(results, s.startup_estimate_min),
                                 save_seconds_estimate(results, s.save_estimate_s),
                                 s.margin_min)


# --- Checkpoint interval: Young/Daly ------------------------------------------------------
# With no failure seen yet, the mean time between failures the interval assumes (of the whole
# allocation): a day, the order published for large GPU jobs (Llama 3: 419 interruptions in
# 54 days on 16k GPUs, about one per 3 h there; a few nodes fail far less often).
DEFAULT_MTBF_S = 24 * 3600.0
# How a segment stopped that counts as a failure (segment.json's stop_reason): anything but
# a planned end (train_iters reached, the exit duration or interval, Slurm's warning signal).
_PLANNED_STOPS = ("completed", "time_limit", "signal")


@dataclass(frozen=True)
class CheckpointInterval:
    """``checkpoint.save_interval`` as the plan shows it and ``auto`` sets it."""

    iterations: int  # what the trainer gets
    young_daly_s: float  # sqrt(2 x mtbf_s x save_s)
    mtbf_s: float
    failures: int  # seen in the segment records
    save_s: float
    step_s: float | None  # measured seconds per iteration; None before the first segment
    bound: int  # the segment length in iterations (or train_iters)
    auto: bool  # whether ``iterations`` is the Young/Daly one

    def describe(self) -> str:
        mtbf = (f"MTBF {self.mtbf_s / 3600:.3g} h from {self.failures} failure(s) seen"
                if self.failures else f"MTBF {self.mtbf_s / 3600:.3g} h (none seen: default)")
        text = (f"Young/Daly sqrt(2 x {mtbf} x save {self.save_s:.3g} s) = "
                f"{self.young_daly_s / 60:.3g} min")
        if self.step_s:
            text += f" = {self.young_daly_s / self.step_s:.0f} iters at {self.step_s:.3g} s/iter"
        else:
            text += " (step time unknown until a segment ran)"
        return text + f", bounded by the segment's {self.bound} iters"


def young_daly_seconds(mtbf_s: float, save_s: float) -> float:
    """The checkpoint interval that loses least expected time (Young 1974, Daly 2006's first
    order): sqrt(2 x MTBF x save time)."""
    if not (math.isfinite(mtbf_s) and math.isfinite(save_s)) or mtbf_s <= 0 or save_s < 0:
        raise ValueError(f"MTBF {mtbf_s!r} s and save time {save_s!r} s must be finite, > 0 "
                         "and >= 0")
    return math.sqrt(2.0 * mtbf_s * save_s)


def _failed(result: Mapping) -> bool:
    detail = str((result.get("slurm") or {}).get("state_detail") or "")
    return result.get("stop_reason") not in _PLANNED_STOPS or "requeued" in detail


def failure_rate(results: Iterable[Mapping], default_mtbf_s: float = DEFAULT_MTBF_S,
                 ) -> tuple[float, int]:
    """(MTBF seconds, failures) from the segment records: their wall time (sacct) over the
    failures among them; the default while none failed, or the time seen if longer."""
    results = list(results)
    seen = sum(float((r.get("slurm") or {}).get("elapsed_s") or 0) for r in results)
    failures = sum(_failed(r) for r in results)
    if failures == 0:
        return max(default_mtbf_s, seen), 0
    return max(seen, 1.0) / failures, failures


def step_seconds(results: Iterable[Mapping]) -> float | None:
    """Seconds per iteration the segments measured (segment.json's train_seconds over the
    iterations each advanced), None before any."""
    seconds = iterations = 0.0
    for r in results:
        trained = (r.get("end_iteration") or 0) - (r.get("start_iteration") or 0)
        if trained > 0 and isinstance(r.get("train_seconds"), (int, float)):
            seconds, iterations = seconds + r["train_seconds"], iterations + trained
    return seconds / iterations if iterations and seconds > 0 else None


def checkpoint_interval(campaign: Campaign, results: Iterable[Mapping] = ()) -> CheckpointInterval:
    """``checkpoint.save_interval``: the configured number, or for ``auto`` the Young/Daly
    interval in iterations at the measured step time, bounded by the segment length
    (``iters_per_segment``, else what fits the exit duration, else ``train_iters``). Before a
    segment measured its step time, ``auto`` saves at the bound."""
    results = list(results)
    s, total = campaign.segments, campaign.training.train_iters
    save_s = save_seconds_estimate(results, s.save_estimate_s)
    mtbf_s, failures = failure_rate(results)
    optimum = young_daly_seconds(mtbf_s, save_s)
    step = step_seconds(results)
    bound = min(total, s.iters_per_segment or total)
    if step and s.iters_per_segment is None:
        bound = min(bound, max(1, int(segment_exit_minutes(campaign, results) * 60 / step)))
    configured = campaign.checkpoint.save_interval
    auto = configured == "auto"
    if auto:
        iterations = bound if step is None else max(1, min(bound, round(optimum / step)))
    else:
        iterations = int(configured)
    return CheckpointInterval(iterations, optimum, mtbf_s, failures, save_s, step, bound, auto)
