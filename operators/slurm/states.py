"""What each Slurm state means. The one place that says so (docs/slurm-states.md)."""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    """The meaning of a job state for the code that waits on it."""

    ACTIVE = "active"  # keep waiting
    SUCCESS = "success"
    RETRYABLE = "retryable"  # the cluster failed, not the job: retry elsewhere
    TIME_LIMIT = "time_limit"  # the job ran out of wall time
    FAILURE = "failure"
    UNKNOWN = "unknown"  # the query failed: never read as a failure

    @property
    def terminal(self) -> bool:
        return self not in (Outcome.ACTIVE, Outcome.UNKNOWN)


# Ended but not yet gone: KillWait (after a cancel, before SIGKILL) or the epilog still runs.
COMPLETING = "COMPLETING"
ACTIVE_STATES = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", COMPLETING, "REQUEUED", "REQUEUE_FED",
     "REQUEUE_HOLD", "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED",
     "RESV_DEL_HOLD", "SPECIAL_EXIT", "POWER_UP_NODE", "UPDATE_DB"}
)
SUCCESS_STATES = frozenset({"COMPLETED"})
RETRYABLE_STATES = frozenset({"PREEMPTED", "NODE_FAIL", "BOOT_FAIL"})
TIME_LIMIT_STATES = frozenset({"TIMEOUT"})
FAILURE_STATES = frozenset({"FAILED", "OUT_OF_MEMORY", "CANCELLED", "DEADLINE", "REVOKED"})

# squeue prints short codes with %t; we ask for %T but accept both.
SHORT_CODES = {
    "PD": "PENDING", "CF": "CONFIGURING", "R": "RUNNING", "CG": "COMPLETING",
    "RQ": "REQUEUED", "RF": "REQUEUE_FED", "RH": "REQUEUE_HOLD", "RS": "RESIZING",
    "S": "SUSPENDED", "SI": "SIGNALING", "SO": "STAGE_OUT", "ST": "STOPPED",
    "SE": "SPECIAL_EXIT", "RD": "RESV_DEL_HOLD", "CD": "COMPLETED", "F": "FAILED",
    "OOM": "OUT_OF_MEMORY",
    "CA": "CANCELLED", "DL": "DEADLINE", "PR": "PREEMPTED", "NF": "NODE_FAIL",
    "BF": "BOOT_FAIL", "TO": "TIMEOUT", "RV": "REVOKED",
}

_BY_STATE = {
    **dict.fromkeys(ACTIVE_STATES, Outcome.ACTIVE),
    **dict.fromkeys(SUCCESS_STATES, Outcome.SUCCESS),
    **dict.fromkeys(RETRYABLE_STATES, Outcome.RETRYABLE),
    **dict.fromkeys(TIME_LIMIT_STATES, Outcome.TIME_LIMIT),
    **dict.fromkeys(FAILURE_STATES, Outcome.FAILURE),
}


class UnknownSlurmState(ValueError):
    """Slurm printed a state we have no meaning for: stop rather than poll forever."""


def normalize_state(raw: str) -> tuple[str, str]:
    """``"CANCELLED by 1000"`` -> ``("CANCELLED", "by 1000")``; short codes expanded."""
    text = raw.strip()
    base, _, detail = text.partition(" ")
    base = base.rstrip("+")  # sacct marks truncated values with '+'
    return SHORT_CODES.get(base, base), detail.strip()


def classify(raw_state: str) -> Outcome:
    """The meaning of a Slurm state string as ``sacct``/``squeue`` print it."""
    base, _ = normalize_state(raw_state)
    try:
        return _BY_STATE[base]
    except KeyError:
        raise UnknownSlurmState(f"unknown Slurm state {raw_state!r}") from None


# sacct learns of a job's end a few seconds after squeue; only sacct has the exit
# code and times. A terminal state seen only in squeue waits this long for sacct.
SACCT_GRACE_S = 30.0
# A retryable end (NODE_FAIL, PREEMPTED) may be followed by Slurm requeueing the job
# under the same id; it is held this long so that a requeue is seen as one.
REQUEUE_GRACE_S = 10.0


class SettleGate:
    """Holds back a terminal state that may not be the last word, for a while.

    Only ``squeue`` has reported it (sacct will say more), or it is retryable and
    Slurm may requeue the job.
    """

    def __init__(self, grace_s: float = SACCT_GRACE_S,
                 requeue_grace_s: float = REQUEUE_GRACE_S) -> None:
        self.grace_s = grace_s
        self.requeue_grace_s = requeue_grace_s
        self._since: float | None = None

    def final(self, outcome: Outcome, source: str, now: float) -> bool:
        if not outcome.terminal:
            self._since = None
            return False
        if source == "squeue":
            grace = self.grace_s
        elif outcome is Outcome.RETRYABLE:
            grace = self.requeue_grace_s
        else:
            return True
        self._since = self._since if self._since is not None else now
        return now - self._since >= grace
