"""Errors of the Slurm layer, each saying what the user can do about it."""

from __future__ import annotations


class SlurmError(Exception):
    """Base class."""


class ClusterUnreachable(SlurmError):
    """SSH could not reach the cluster within the retry budget: retry the task later."""


class ClusterAuthError(SlurmError):
    """SSH refused us: authentication or host-key verification failed. Retrying won't help."""


class SlurmCommandError(SlurmError):
    """A Slurm command ran and failed (non-zero exit)."""

    def __init__(self, command: str, returncode: int, stderr: str) -> None:
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(f"{command.split()[0]} exited {returncode}: {stderr.strip()[:500]}")


class SlurmJobFailed(SlurmError):
    """A job ended in a state other than COMPLETED."""
