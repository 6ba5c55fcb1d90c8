"""Waits for a Slurm job in the triggerer and streams its log into the task log.

The trigger only waits: status comes from the shared :class:`ClusterPoller`
(one ``sacct`` per cluster per interval for every watched job), the log is
read by byte offset over the poller's SFTP channel. It must live in this
installed package: the triggerer cannot load trigger classes from DAG files.
"""

from __future__ import annotations

import asyncio
import json
import posixpath
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from operators.slurm.jobids import parse_job_id
from operators.slurm.messages import ERROR, TERMINAL, WATCHED, JobEvent
from operators.slurm.parse import job_view
from operators.slurm.poller import ClusterPoller
from operators.slurm.states import Outcome, SettleGate, UnknownSlurmState, classify
from operators.slurm.stream_mark import StreamMark, mark_path, new_token, read_mark, write_mark
from operators.slurm.watch import LogWatch, StopStep, Tick

# Job-log bytes forwarded per round: enough for chatty jobs, bounded for the triggerer.
LOG_CHUNK = 256 * 1024
# A result JSON up to this size travels in the event, so that the resumed task needs no
# SSH connection of its own; a bigger one is read by the task.
RESULT_IN_EVENT_MAX = 64 * 1024
LOG_TAIL_BYTES = 4000  # of a failed job's log, for the task's error
# Seconds between the last streamed line and the trigger's event. The triggerer's supervisor
# reads a trigger's log lines and its "finished" message from two sockets; finished first,
# it closes the trigger's log file and writes the late lines into the triggerer's own log
# (airflow/jobs/triggerer_job_runner.py, logger_cache.pop on TriggerStateChanges). The stack
# story met it in CI: the job's last lines missing from the task's trigger log.
FINAL_LOG_GRACE_S = 2.0
# Seconds a trigger runs at least before any event. The worker that deferred reports its exit
# ("success") to the scheduler on its own; if that report comes after the resumed try was
# queued, Airflow 3.3 takes it for the resumed try's end and fails it ("finished with state
# success, but the task instance's state attribute is queued": apache/airflow#72716; 3.3
# tolerates it only while the task is still `scheduled`). The report took 1.3 s on idle cores;
# CI, loaded, met the race twice in a run on 2-second jobs (fault story, 2026-12-05). A job
# found ended on a later poll waits nothing more; the cost falls on jobs over in seconds.
DEFER_EXIT_GRACE_S = 10.0
WATCH_LOG_MARK = "log watch finding:"  # then the LogFinding's JSON, on one task-log line


def event_delay(now: float, started_at: float | None, last_line_at: float | None) -> float:
    """Seconds to wait before a trigger event may go out (monotonic clock; see
    FINAL_LOG_GRACE_S and DEFER_EXIT_GRACE_S)."""
    waits = [0.0]
    if started_at is not None:
        waits.append(DEFER_EXIT_GRACE_S - (now - started_at))
    if last_line_at is not None:
        waits.append(FINAL_LOG_GRACE_S - (now - last_line_at))
    return max(waits)


class SlurmJobTrigger(BaseTrigger):
    """Fires once the job reaches a terminal state, or polling fails past its budget.

    Success is not ended here with a ``TaskSuccessEvent``: Airflow 3.3 stores
    XComs pushed that way JSON-encoded twice, so downstream ``xcom_pull`` would
    get a string. The worker resumes and returns the summary instead.
    """

    def __init__(self, ssh_conn_id: str, job_id: str, log_path: str | None = None,
                 log_offset: int = 0, poll_interval: float = 5.0,
                 unknown_budget_s: float = 600.0, result_path: str | None = None,
                 job_name: str | None = None, log_pattern: str | None = None,
                 log_offsets: dict[str, int] | None = None,
                 watch: dict[str, Any] | None = None, stream_token: str | None = None) -> None:
        super().__init__()
        self.ssh_conn_id = ssh_conn_id
        self.job_id = job_id
        self.log_path = log_path
        self.log_offset = log_offset
        # An array job's log path with ``%a`` still in it (one log per task), and how far each
        # task's log has been forwarded (task id -> byte offset). Both travel in the
        # serialised kwargs, so a trigger re-created after a triggerer restart goes on where
        # it was. Without a pattern, ``log_path`` and ``log_offset`` are the one log.
        self.log_pattern = log_pattern
        self.log_offsets = {str(k): int(v) for k, v in (log_offsets or {}).items()}
        self._drained: set[str] = set()  # tasks that ended and whose log was read to its end
        self._last_line_at: float | None = None  # monotonic: when a line was last streamed
        self._started_at: float | None = None  # monotonic: when run() began
        self.poll_interval = poll_interval
        self.unknown_budget_s = unknown_budget_s
        self.result_path = result_path
        # The job's key: a job Slurm gave the same id after a controller reset is not ours.
        self.job_name = job_name
        # Log-stream watchers (slurm/watch.py, docs/log-watch.md), their state and findings:
        # in the kwargs too. They read the one log of a job that is not an array.
        self.watch = LogWatch.from_json(watch)
        # This deferral's log stream (slurm/stream_mark.py): a trigger rebuilt from these kwargs
        # by the triggerer that takes it over has the same token, and goes on from the offsets
        # the dead one left beside the job, not from the deferral's.
        self.stream_token = stream_token or new_token()
        self._mark_failed = False  # said once in the task log, not every round

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "ssh_conn_id": self.ssh_conn_id, "job_id": self.job_id,
            "log_path": self.log_path, "log_offset": self.log_offset,
            "poll_interval": self.poll_interval, "unknown_budget_s": self.unknown_budget_s,
            "result_path": self.result_path, "job_name": self.job_name,
            "log_pattern": self.log_pattern, "log_offsets": dict(self.log_offsets),
            "watch": self.watch.to_json() if self.watch else None,
            "stream_token": self.stream_token,
        })

    @property
    def _mark_path(self) -> str | None:
        log = self.log_pattern or self.log_path
        return mark_path(log, self.job_id) if log else None

    async def _resume_stream(self, poller: ClusterPoller) -> None:
        """Go on from the offsets an earlier trigger of this stream left (a takeover)."""
        if self._mark_path is None:
            return
        try:
            mark = await read_mark(poller, self._mark_path)
        except Exception as exc:  # noqa: BLE001 - streaming from the kwargs' offsets is safe
            self.log.warning("job %s: log stream mark %s not read, streaming from byte %d: %s",
                             self.job_id, self._mark_path, self.log_offset, exc)
            return
        resumed = mark and mark.resume(self.stream_token, self.log_offset, self.log_offsets)
        if not resumed:
            return
        if resumed.log_offset > self.log_offset or resumed.log_offsets != self.log_offsets:
            self.log.info("job %s: log stream resumed at byte %d (from %d), as an earlier "
                          "triggerer left it", self.job_id, resumed.log_offset, self.log_offset)
        self.log_offset, self.log_offsets = resumed.log_offset, dict(resumed.log_offsets)
        if resumed.watch is not None:
            self.watch = LogWatch.from_json(resumed.watch)

    async def _save_stream(self, poller: ClusterPoller) -> None:
        """Write this stream's offsets beside the job, on the poller's SFTP channel."""
        mark = StreamMark(self.stream_token, self.log_offset, dict(self.log_offsets),
                          self.watch.to_json() if self.watch else None)
        try:
            await write_mark(poller, self._mark_path, mark)
            self._mark_failed = False
        except Exception as exc:  # noqa: BLE001 - a takeover would repeat lines, no more
            if not self._mark_failed:
                self.log.warning("job %s: log stream mark %s not written (a takeover would "
                                 "stream some lines again): %s", self.job_id, self._mark_path,
                                 exc)
            self._mark_failed = True

    async def _outputs(self, poller: ClusterPoller, outcome: Outcome) -> dict[str, Any]:
        """:class:`JobEvent`'s ``result`` and, unless the job succeeded, its ``log_tail`` (for
        the task's error), read on the poller's connection.

        Best effort: what cannot be read here is left out, and the task reads it itself.
        """
        found: dict[str, Any] = {}
        try:
            if self.result_path:
                data = await poller.read_bytes(self.result_path, 0, RESULT_IN_EVENT_MAX + 1)
                if len(data) <= RESULT_IN_EVENT_MAX:
                    found["result"] = json.loads(data) if data.strip() else None
            if self.log_path and outcome is not Outcome.SUCCESS:
                found["log_tail"] = await poller.log_tail(self.log_path, LOG_TAIL_BYTES)
        except Exception as exc:  # noqa: BLE001 - the task falls back to reading them
            self.log.info("job %s outputs left to the task: %s", self.job_id, exc)
        return found

    async def _stream_log(self, poller: ClusterPoller) -> None:
        """Forward the new whole lines of the job's log, or of each array task's log (each
        line prefixed with its task's id), read by byte offset on the poller's connection;
        then, if lines went to the task log, where the stream got to, beside the job."""
        before = (self.log_offset, dict(self.log_offsets))
        await self._stream_logs(poller)
        if self._mark_path and (self.log_offset, self.log_offsets) != before:
            await self._save_stream(poller)

    async def _stream_logs(self, poller: ClusterPoller) -> None:
        if self.log_pattern is None:
            if self.log_path:
                self.log_offset, _ = await self._forward(poller, self.log_path,
                                                         self.log_offset, self.job_id)
            return
        ended = self._array_tasks(poller.snapshot.records)
        for task in sorted({*self.log_offsets, *ended} - self._drained, key=int):
            before = self.log_offsets.get(task, 0)
            after, read = await self._forward(poller, self.log_pattern.replace("%a", task),
                                              before, f"{self.job_id}_{task}")
            self.log_offsets[task] = after
            if ended.get(task) and read and after == before:
                # Slurm says the task ended and its log has nothing new: read to its end.
                self._drained.add(task)

    def _array_tasks(self, records: dict) -> dict[str, bool]:
        """This array's started tasks in ``records`` (id -> whether Slurm says it ended).
        A pending range row (``123_[2-4]``) stands for tasks that have no log yet."""
        tasks = {}
        for key, record in records.items():
            parsed = parse_job_id(key)
            if parsed is None or parsed.base != self.job_id or parsed.task is None:
                continue
            try:
                outcome = classify(record.state)
            except UnknownSlurmState:
                outcome = Outcome.ACTIVE
            if record.state != "PENDING":
                tasks[str(parsed.task)] = outcome.terminal and record.source == "sacct"
        return tasks

    async def _forward(self, poller: ClusterPoller, path: str, offset: int,
                       label: str) -> tuple[int, bool]:
        """Log the whole lines of ``path`` after ``offset`` as ``[slurm <label>] line``; the
        offset after them, and whether the read worked. A partial last line waits for the
        next round."""
        try:
            while True:
                data = await poller.read_bytes(path, offset, LOG_CHUNK)
                cut = data.rfind(b"\n") + 1 if len(data) < LOG_CHUNK else len(data)
                if cut == 0:
                    return offset, True
                lines = data[:cut].decode("utf-8", "replace").splitlines()
                for line in lines:
                    self.log.info("[slurm %s] %s", label, line)
                if lines:
                    self._last_line_at = time.monotonic()
                if self.log_pattern is None:
                    self.watch.feed(lines)
                offset += cut
                if len(data) < LOG_CHUNK:
                    return offset, True
        except Exception as exc:  # noqa: BLE001 - a log hiccup must not fail the task
            self.log.warning("could not read job log %s: %s", path, exc)
            return offset, False

    def _note_degraded(self, poller: ClusterPoller, error: str | None, was: bool) -> bool:
        """Say in the task log when the job starts and stops being followed through squeue
        alone (sacct failing), with the SSH connections the poller has opened so far."""
        if bool(error) != was:
            what = (f"followed through squeue, sacct failing: {' '.join(error.split())}"
                    if error else "sacct answers again")
            self.log.warning("Slurm job %s: %s (SSH connections opened by this triggerer's "
                             "poller: %d)", self.job_id, what, poller.stats.connections_opened)
        return bool(error)

    def _event(self, status: str, **fields: Any) -> TriggerEvent:
        """A :class:`JobEvent`, as the JSON Airflow stores (the task reads it back typed)."""
        return TriggerEvent(JobEvent(status=status, job_id=self.job_id,
                                     log_offset=self.log_offset,
                                     findings=tuple(self.watch.findings), **fields).to_json())

    async def _run_watchers(self, poller: ClusterPoller, running: bool) -> None:
        """The log watchers' round; stop the job as they ask, on the poller's connection."""
        before = len(self.watch.findings)
        steps = self.watch.tick(Tick(time.time(), running))
        for finding in self.watch.findings[before:]:
            # One line per finding, for people and for the goodput bench (docs/log-watch.md).
            self.log.warning("%s %s", WATCH_LOG_MARK, json.dumps(finding.to_json()))
        run_dir = posixpath.dirname(self.log_path) if self.log_path else None
        for step in steps:
            try:
                if step is StopStep.SIGNAL:
                    await poller.signal(self.job_id, "TERM", stopped_in=run_dir)
                else:
                    await poller.cancel(self.job_id)
            except Exception as exc:  # noqa: BLE001 - asked again at the next round
                self.log.warning("could not %s Slurm job %s: %s", step.value, self.job_id, exc)
                continue
            self.watch.done(step, time.time())
            self.log.warning("Slurm job %s: %s (log watch: %s)", self.job_id,
                             "SIGTERM sent" if step is StopStep.SIGNAL else "cancelled",
                             self.watch.stopping.reason)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        poller = ClusterPoller.get(self.ssh_conn_id, self.poll_interval)
        poller.watch(self.job_id, self.job_name)
        seq, unknown_since, last_state, degraded = 0, None, None, False
        self._started_at = time.monotonic()
        gate = SettleGate()
        try:
            await self._resume_stream(poller)
            while True:
                snap = await poller.wait(seq)
                seq = snap.seq
                await self._stream_log(poller)
                record = job_view(snap.records, self.job_id)
                if record is None:
                    unknown_since = unknown_since or time.monotonic()
                    waited = time.monotonic() - unknown_since
                    if waited > self.unknown_budget_s:
                        await self._hold_the_event()
                        yield self._event(ERROR, message=(
                            f"job {self.job_id} state unknown for {waited:.0f}s: "
                            f"{snap.error or 'not found by sacct or squeue'}"))
                        return
                    continue
                unknown_since = None
                degraded = self._note_degraded(poller, snap.error, degraded)
                try:
                    outcome = classify(record.state)
                except UnknownSlurmState as exc:
                    await self._hold_the_event()
                    yield self._event(ERROR, message=str(exc))
                    return
                seen = f"{record.state} {record.state_detail}".rstrip()
                if seen != last_state:  # e.g. "PENDING requeued after NODE_FAIL"
                    self.log.info("Slurm job %s is %s", self.job_id, seen)
                    last_state = seen
                if self.watch and not outcome.terminal:
                    await self._run_watchers(poller, record.state == "RUNNING")
                    if self.watch.ends_wait:
                        await self._hold_the_event()
                        yield self._event(WATCHED, outcome=outcome.value, record=record)
                        return
                if gate.final(outcome, record.source, time.monotonic()):
                    await asyncio.sleep(0)  # let the log's last write land before the drain
                    await self._stream_log(poller)
                    await self._hold_the_event()
                    yield self._event(TERMINAL, outcome=outcome.value, record=record,
                                      **await self._outputs(poller, outcome))
                    return
        finally:
            poller.unwatch(self.job_id)

    async def _hold_the_event(self) -> None:
        """Wait until the event is safe to send: FINAL_LOG_GRACE_S after the last streamed
        line (Airflow files it in the task's trigger log before it learns the trigger
        finished) and DEFER_EXIT_GRACE_S after the trigger began (the deferring worker's exit
        report has reached the scheduler before the resumed try is queued)."""
        left = event_delay(time.monotonic(), self._started_at, self._last_line_at)
        if left > 0:
            await asyncio.sleep(left)

    async def on_kill(self) -> None:
        """The user cleared or failed the deferred task: cancel its job."""
        poller = ClusterPoller.get(self.ssh_conn_id, self.poll_interval)
        self.log.info("task killed while deferred: cancelling Slurm job %s", self.job_id)
        run_dir = posixpath.dirname(self.log_path) if self.log_path else None
        # The cancel runs in the poller's task, shielded: the triggerer cancels on_kill itself
        # at its next sync, and that must not take the scancel with it (cancel_for_kill).
        await asyncio.shield(poller.cancel_for_kill(self.job_id, killed_in=run_dir))


