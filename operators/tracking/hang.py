"""The hang watchdog: a running job whose log shows no progress for longer than its hang
timeout is stopped (SIGTERM, then ``scancel``), and its task fails, retryably, with "no
progress for N min at iteration I" (docs/log-watch.md). Pure.

Progress is a new iteration line, or a finished evaluation or checkpoint save (work that
is not a hang, and may take longer than steps). The timeout:

- before the job's first iteration line: the start-up allowance ``startup_s`` (the
  campaign's start-up estimate, measured by earlier segments where they did), or the set
  timeout when that is longer;
- after it: the set timeout (``segments.hang_timeout_min``), or by default
  ``max(FACTOR x median seconds per logged interval, startup_s)``, the interval measured from
  the iteration lines' own "elapsed time per iteration" (not the triggerer's clock, which
  sees lines late and in bursts).

The clock starts when Slurm says the job runs (a queued job is not hung) and again after a
requeue. An iteration's progress counts from its line's own wall clock (Bridge prints one),
held between the previous round and this one: the line was not in the log at the previous
read and is at this one. The triggerer reads every few seconds, so counting from when it saw
the line would find a hang up to one poll interval late; held so, a node clock or time zone
unlike the triggerer's moves it by at most that interval.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jobscripts import vocabulary as v
from jobscripts.vocabulary import Record
from operators.slurm.watch import LogFinding, Tick, WatchSpec, kind_of
from operators.tracking import logparse
from operators.tracking.logwatch import MegatronLogWatcher

CODE = "hang"
FACTOR = 10.0  # x the median step: a step ten times slower than usual is not one
SAMPLES = 50  # the median of the last this many logged intervals
_LIVENESS = (v.VALIDATION, v.CHECKPOINT_SAVE)  # finished work that is not an iteration


@dataclass(frozen=True)
class HangTimeout:
    """A timeout and how it was chosen (for the error and the docs)."""

    seconds: float
    how: str


def hang_timeout(step_s: Sequence[float], startup_s: float, set_s: float | None,
                 first_step_seen: bool, factor: float = FACTOR) -> HangTimeout:
    """The module's rule. ``step_s``: seconds per logged interval seen so far."""
    if not first_step_seen:
        seconds = max(startup_s, set_s or 0.0)
        return HangTimeout(seconds, f"start-up allowance {seconds:.0f} s before the first step")
    if set_s is not None:
        return HangTimeout(set_s, "segments.hang_timeout_min")
    if not step_s:
        return HangTimeout(startup_s, f"auto: start-up estimate {startup_s:.0f} s, no step "
                                      "time measured yet")
    median = statistics.median(step_s)
    seconds = max(factor * median, startup_s)
    return HangTimeout(seconds, f"auto: max({factor:g} x median step interval {median:.2f} s, "
                                f"start-up estimate {startup_s:.0f} s)")


class HangWatch(MegatronLogWatcher):
    """Params: ``startup_s`` (required), ``timeout_s`` (None: auto), ``grace_s`` (SIGTERM ->
    scancel), ``start_iteration`` (the checkpoint the segment resumes from), ``factor``."""

    def __init__(self, params: Mapping[str, Any], state: Mapping[str, Any]) -> None:
        super().__init__(params, state)
        self.startup_s = float(params["startup_s"])
        timeout = params.get("timeout_s")
        self.timeout_s = None if timeout is None else float(timeout)
        self.grace_s = float(params.get("grace_s", 60.0))
        self.factor = float(params.get("factor", FACTOR))
        start = params.get("start_iteration")
        if self.startup_s < 0 or (self.timeout_s is not None and self.timeout_s <= 0):
            raise ValueError("startup_s must be >= 0 and timeout_s > 0")
        self.iteration: int | None = None if start is None else int(start)
        self.first_step_seen = False
        self.step_s: list[float] = []
        self.running_since: float | None = None
        self.progress_at: float | None = None
        self.last_round_at: float | None = None
        self.printed_at: float | None = None  # the last iteration line's clock in this read
        self.fired = False

    @classmethod
    def spec(cls, startup_s: float, timeout_s: float | None, grace_s: float,
             start_iteration: int | None = None) -> WatchSpec:
        return WatchSpec(kind_of(cls), {"startup_s": startup_s, "timeout_s": timeout_s,
                                        "grace_s": grace_s, "start_iteration": start_iteration})

    def timeout(self) -> HangTimeout:
        return hang_timeout(self.step_s, self.startup_s, self.timeout_s, self.first_step_seen,
                            self.factor)

    def lines(self, lines: Sequence[str], tick: Tick) -> Iterable[LogFinding]:
        clocks = [c for c in map(logparse.step_clock, lines) if c is not None]
        # Bridge's clock has whole seconds: the line came at the end of that second at the latest.
        self.printed_at = clocks[-1].timestamp() + 1.0 if clocks else None
        return super().lines(lines, tick)

    def step_seen_at(self, tick: Tick) -> float:
        """When the newest iteration line of this read was printed, as the module says."""
        if self.printed_at is None or self.last_round_at is None:
            return tick.now
        return min(tick.now, max(self.last_round_at, self.printed_at))

    def records(self, records: Sequence[Record], tick: Tick) -> Iterable[LogFinding]:
        for record in records:
            if record.kind == v.CHECKPOINT_LOAD and not self.first_step_seen:
                self.iteration = record.iteration  # where this segment really starts
            elif record.kind == v.TRAIN and record.iteration is not None and (
                    self.iteration is None or record.iteration > self.iteration
                    or not self.first_step_seen):
                elapsed_ms = record.metrics.get(v.ELAPSED_MS)
                if elapsed_ms is not None and self.iteration is not None:
                    steps = max(1, record.iteration - self.iteration)
                    self.step_s = [*self.step_s, elapsed_ms / 1000.0 * steps][-SAMPLES:]
                self.iteration, self.first_step_seen = record.iteration, True
                self.progress_at = self.step_seen_at(tick)
            elif record.kind in _LIVENESS:
                self.progress_at = tick.now
        return ()

    def tick(self, tick: Tick) -> Iterable[LogFinding]:
        self.last_round_at = tick.now
        if not tick.running:
            self.running_since = None  # queued, or requeued: the clock starts again
            return ()
        if self.running_since is None:
            self.running_since = tick.now
        if self.fired:
            return ()
        since = max(self.running_since, self.progress_at or self.running_since)
        waited = tick.now - since
        limit = self.timeout()
        if waited <= limit.seconds:
            return ()
        self.fired = True
        at = "before its first step" if not self.first_step_seen else ""
        reason = (f"no progress for {waited / 60:.1f} min at iteration "
                  f"{self.iteration if self.iteration is not None else '?'}"
                  f"{' ' + at if at else ''} (hang timeout {limit.seconds / 60:.2f} min: "
                  f"{limit.how}); stopped: SIGTERM, then scancel after {self.grace_s:.0f} s")
        return [self.finding(CODE, reason, tick, iteration=self.iteration, stop_job=True,
                             grace_s=self.grace_s,
                             detail={"waited_s": round(waited, 3),
                                     "timeout_s": round(limit.seconds, 3),
                                     "last_progress_at": since})]
