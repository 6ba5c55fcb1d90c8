"""The base of log watchers that read Megatron's records (docs/log-watch.md).

``operators/slurm/watch.py`` hands watchers the job's log lines; this subclass parses them with
:mod:`operators.tracking.logparse` (Megatron Bridge's and the reference trainer's formats) and
hands its subclasses the records. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jobscripts.vocabulary import Record
from operators.slurm.watch import LogFinding, LogWatcher, Tick
from operators.tracking import logparse


class MegatronLogWatcher(LogWatcher):
    """Override :meth:`records` (and :meth:`tick`, which runs every round)."""

    def lines(self, lines: Sequence[str], tick: Tick) -> Iterable[LogFinding]:
        return self.records(list(logparse.parse_lines(lines)), tick)

    def records(self, records: Sequence[Record], tick: Tick) -> Iterable[LogFinding]:
        """The records of the lines read at ``tick``, in log order."""
        return ()
