"""The typed messages between the layers of one job's life: what a task submits
(:class:`JobRequest`), where the job runs (:class:`JobLocation`, XCom for the extra links),
what the trigger hands the resumed task (:class:`JobEvent`) and what the task returns
(:class:`JobSummary`, XCom). Each is a frozen dataclass with ``to_json`` / ``from_json``
(operators/slurm/wire.py); the JSON keys are the ones the UI, the extra links, DAGs'
templates and ``segments.jsonl`` read, so they do not change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from operators.slurm.parse import JobRecord
from operators.slurm.watch import LogFinding, WatchSpec
from operators.slurm.wire import ABSENT, JsonMessage

# JobEvent.status
TERMINAL = "terminal"  # the job ended and its state settled
ERROR = "error"  # polling failed past its budget, or Slurm named a state we do not know
WATCHED = "watched"  # a log watcher ended the wait before the job's end (slurm/watch.py)


@dataclass(frozen=True)
class JobRequest(JsonMessage):
    """One job as a task submits it: ``SlurmJobOperator``'s arguments of the same names, and
    what the campaign's renderers (segment, preflight) return."""

    command: str
    job: Mapping[str, Any] = field(default_factory=dict)
    environment: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[str, str] = field(default_factory=dict)
    result_file: str | None = None
    # Log-stream watchers for the job's wait (docs/log-watch.md); not part of its JSON, which
    # is the operator's arguments.
    watchers: tuple[WatchSpec, ...] = ()

    json_omit = frozenset({"watchers"})

    def with_environment(self, extra: Mapping[str, str]) -> JobRequest:
        """This request with ``extra`` exported too (``extra`` wins)."""
        return replace(self, environment={**self.environment, **extra})


@dataclass(frozen=True)
class JobLocation(JsonMessage):
    """Where a submitted job is: pushed to XCom (``XCOM_JOB``) before the task defers."""

    job_id: str
    log_path: str | None
    run_dir: str | None


@dataclass(frozen=True)
class SubmittedJob(JsonMessage):
    """What a task that does not wait (``wait_for_completion=False``) returns."""

    job_id: str
    state: str
    run_dir: str
    log_path: str


@dataclass(frozen=True)
class JobEvent(JsonMessage):
    """The trigger's event (and the worker's own wait's result). ``result``: the job's result
    JSON when the trigger read it (it may be None: an empty file); :data:`ABSENT` when it
    did not, and the task reads it itself."""

    status: str  # TERMINAL, ERROR or WATCHED
    job_id: str
    log_offset: int = 0
    outcome: str | None = None  # an Outcome's value, for TERMINAL and WATCHED
    record: JobRecord | None = None  # for TERMINAL; WATCHED: the last one seen
    message: str | None = None  # for ERROR
    result: Any = ABSENT
    log_tail: str | None = None  # of a failed job's log, when the trigger read it
    findings: tuple[LogFinding, ...] = ()  # the log watchers' (docs/log-watch.md)

    json_omit_empty = frozenset({"findings"})

    @property
    def result_read(self) -> bool:
        return self.result is not ABSENT


@dataclass(frozen=True)
class JobSummary(JsonMessage):
    """A job's end as its task returns it (XCom): small, JSON, no secrets. Also what a failed
    job's task hands its ``on_job_end``."""

    job_id: str
    outcome: str
    record: JobRecord
    run_dir: str | None
    log_path: str | None
    result: Any = None
    findings: tuple[LogFinding, ...] = ()  # the log watchers', as in the JobEvent

    json_omit_empty = frozenset({"findings"})
