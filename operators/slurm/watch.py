"""Log-stream watchers: code that reads a running job's log as the trigger streams it and may
stop the job or end the wait (docs/log-watch.md). Pure: no I/O, no Airflow, the clock is given.

A watcher is named in a task's :class:`WatchSpec` (its class's dotted path and its parameters,
plain JSON), which travels in the trigger's serialised kwargs, so a trigger re-created after a
triggerer restart gets the same watchers back (and, through :meth:`LogWatcher.state`, whatever
they choose to carry). The trigger and the worker's own wait (``deferrable=False``) both run
them through one :class:`LogWatch`: they hand it the job's new log lines, then
:meth:`LogWatch.tick` with the clock and whether the job runs, and carry out the
:class:`StopStep` it answers (SIGTERM first, ``scancel`` after the grace period).

This layer sees log *lines*; a watcher that wants Megatron's records subclasses
``operators.tracking.logwatch.MegatronLogWatcher``, which parses them.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from operators.slurm.wire import JsonMessage


class WatchSpecError(ValueError):
    """A watcher spec that names no :class:`LogWatcher`, or parameters it refuses."""


@dataclass(frozen=True)
class WatchSpec(JsonMessage):
    """One watcher as a task names it: ``kind`` is the dotted path of a :class:`LogWatcher`
    subclass in an installed package (the triggerer cannot import DAG files), ``params`` its
    JSON parameters, ``state`` what it carries over a re-creation (see :meth:`LogWatcher.state`).
    """

    kind: str
    params: Mapping[str, Any] = field(default_factory=dict)
    state: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LogFinding(JsonMessage):
    """What a watcher found. ``reason`` becomes the task's error when the job is stopped;
    ``code`` is stable for programs ("hang", "loss_spike"); ``at`` is the wall-clock time
    (epoch seconds) of the tick that found it; ``detail``: numbers for reports (a hang's
    ``waited_s``, ``timeout_s``, ``last_progress_at``).

    ``stop_job``: SIGTERM the job now, ``scancel`` it ``grace_s`` later if it still runs; the
    trigger then waits for the job's end as usual and the task fails with ``reason``
    (retryable unless ``retryable`` is False). ``end_wait``: end the trigger at once with a
    ``watched`` event (the job may go on running unless ``stop_job``)."""

    watcher: str  # the WatchSpec.kind that found it
    code: str
    reason: str
    at: float
    iteration: int | None = None
    stop_job: bool = False
    end_wait: bool = False
    retryable: bool = True
    grace_s: float = 60.0
    detail: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Tick:
    """One round as watchers see it: the wall clock (epoch seconds, so that times survive a
    triggerer restart) and whether Slurm says the job is RUNNING (a pending or requeued job is
    not expected to log)."""

    now: float
    running: bool


class LogWatcher:
    """Base of a log-stream watcher (the extension point). Subclasses override
    :meth:`lines` and/or :meth:`tick`; both may return findings. Keep them pure and quick:
    they run in the triggerer's event loop."""

    def __init__(self, params: Mapping[str, Any], state: Mapping[str, Any]) -> None:
        self.params = dict(params)

    def lines(self, lines: Sequence[str], tick: Tick) -> Iterable[LogFinding]:
        """The job's new whole log lines, in order, read at ``tick``."""
        return ()

    def tick(self, tick: Tick) -> Iterable[LogFinding]:
        """Called every round after :meth:`lines` (also when the log had nothing new)."""
        return ()

    def finding(self, code: str, reason: str, tick: Tick, **fields: Any) -> LogFinding:
        """A :class:`LogFinding` of this watcher at ``tick``."""
        return LogFinding(watcher=kind_of(type(self)), code=code, reason=reason, at=tick.now,
                          **fields)

    def state(self) -> Mapping[str, Any]:
        """JSON state to carry into a re-created trigger; none by default (the trigger
        re-reads the log from the offset it was deferred with)."""
        return {}


def kind_of(cls: type[LogWatcher]) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def load(spec: WatchSpec) -> LogWatcher:
    """The watcher ``spec`` names. Raises :class:`WatchSpecError` naming the kind."""
    module_name, _, name = spec.kind.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise WatchSpecError(f"log watcher {spec.kind!r}: cannot import it: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, LogWatcher)):
        raise WatchSpecError(f"log watcher {spec.kind!r} is not a LogWatcher subclass")
    try:
        return cls(spec.params, spec.state)
    except (KeyError, TypeError, ValueError) as exc:
        raise WatchSpecError(f"log watcher {spec.kind!r}: bad parameters: {exc}") from exc


class StopStep(enum.Enum):
    SIGNAL = "signal"  # scancel --signal=TERM --full: the job may save and exit
    CANCEL = "cancel"  # scancel: the grace period is over


@dataclass
class LogWatch:
    """The watchers of one job, the findings so far, and where stopping the job stands."""

    specs: tuple[WatchSpec, ...] = ()
    findings: list[LogFinding] = field(default_factory=list)
    signalled_at: float | None = None  # when SIGTERM was sent
    cancelled: bool = False

    def __post_init__(self) -> None:
        self._watchers = [(spec.kind, load(spec)) for spec in self.specs]
        self._lines: list[str] = []

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> LogWatch:
        data = data or {}
        return cls(tuple(WatchSpec.from_json(s) for s in data.get("specs", ())),
                   [LogFinding.from_json(f) for f in data.get("findings", ())],
                   data.get("signalled_at"), bool(data.get("cancelled", False)))

    def to_json(self) -> dict[str, Any]:
        specs = [WatchSpec(kind, spec.params, watcher.state()).to_json()
                 for spec, (kind, watcher) in zip(self.specs, self._watchers, strict=True)]
        return {"specs": specs, "findings": [f.to_json() for f in self.findings],
                "signalled_at": self.signalled_at, "cancelled": self.cancelled}

    def __bool__(self) -> bool:
        return bool(self._watchers)

    def feed(self, lines: Iterable[str]) -> None:
        """New whole lines of the job's log; the watchers get them at the next tick."""
        self._lines.extend(lines)

    @property
    def stopping(self) -> LogFinding | None:
        """The first finding that asked to stop the job."""
        return next((f for f in self.findings if f.stop_job), None)

    @property
    def ends_wait(self) -> bool:
        return any(f.end_wait for f in self.findings)

    def tick(self, tick: Tick) -> list[StopStep]:
        """Run the watchers on the lines fed since the last tick; what to do to the job now.
        A step the caller could not carry out is asked for again at the next tick unless the
        caller called :meth:`done`."""
        lines, self._lines = self._lines, []
        for _kind, watcher in self._watchers:
            found = list(watcher.lines(lines, tick)) if lines else []
            found += list(watcher.tick(tick))
            self.findings += found
        stop = self.stopping
        if stop is None or self.cancelled:
            return []
        if self.signalled_at is None:
            return [StopStep.SIGNAL]
        if tick.now - self.signalled_at >= stop.grace_s:
            return [StopStep.CANCEL]
        return []

    def done(self, step: StopStep, now: float) -> None:
        if step is StopStep.SIGNAL:
            self.signalled_at = now
        else:
            self.cancelled = True


def failure_reason(findings: Iterable[LogFinding]) -> str | None:
    """The task's error for a job the watchers stopped or ended the wait on, or None."""
    reasons = [f.reason for f in findings if f.stop_job or f.end_wait]
    return "; ".join(reasons) if reasons else None
