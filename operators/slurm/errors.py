"""Errors of the Slurm layer, each saying what the user can do about it."""

from __future__ import annotations


class SlurmError(Exception):
    """Base class."""


class ClusterUnreachable(SlurmError):
    """SSH could not reach the cluster within the retry budget: retry the task later."""


class ClusterAuthError(SlurmError):
    """SSH refused us: authentication or host-key verification failed. Retrying won't help."""


def program(command: str) -> str:
    """The program a command line runs, for messages: ``sacct`` of ``VAR=x sacct ...``."""
    words = command.split("&&")[-1].split()
    return next((w for w in words if "=" not in w), command[:20])


class SlurmCommandError(SlurmError):
    """A Slurm command ran and failed (non-zero exit). The connection is fine: not a
    reason to reconnect."""

    def __init__(self, command: str, returncode: int, stderr: str) -> None:
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(f"{program(command)} exited {returncode}: {stderr.strip()[:500]}")


class SlurmJobFailed(SlurmError):
    """A job ended in a state other than COMPLETED."""
