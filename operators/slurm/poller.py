"""One SSH connection and one ``sacct`` per cluster per interval, for all triggers.

Every Slurm trigger in a triggerer process registers its job here. A single
task per cluster polls ``sacct`` for all registered jobs at once (``squeue`` for
the few seconds before ``sacct`` knows a new job), so the number of status
calls per minute does not grow with the number of jobs, and the cluster sees
one SSH connection per triggerer instead of one per job: login nodes ban
accounts for less. Log tails are read over SFTP on the same connection.

When sacct fails (slurmdbd down) the round follows the jobs through squeue
alone (see :mod:`operators.slurm.query`). A round that got no status at all
marks every watched job UNKNOWN for that round, never FAILED. Only a broken
transport closes the connection (re-opened with jittered back-off, up to a
minute, since login nodes ban reconnect storms); a Slurm command that ran and
failed keeps it, and the next round comes one interval later, so the end of an
accounting outage is seen within about two intervals.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from operators.slurm import commands, query
from operators.slurm.backoff import backoff_delays
from operators.slurm.errors import SlurmCommandError
from operators.slurm.parse import JobRecord

log = logging.getLogger(__name__)

# How long a killed task's cancel is retried (slurmctld busy, the SSH connection dropped)
# before the poller gives up and logs it: longer than an outage a user would wait out, short
# enough that a job nobody could cancel is reported while someone still looks.
KILL_CANCEL_RETRY_S = 300.0


@dataclass
class Snapshot:
    """The result of one polling round, shared by every watcher."""

    seq: int = 0
    records: dict[str, JobRecord] = field(default_factory=dict)
    # Why the round knows less than it should: its query failed (records empty), or sacct
    # failed and the records are squeue's alone.
    error: str | None = None
    at: float = 0.0


@dataclass
class PollerStats:
    connections_opened: int = 0
    status_calls: int = 0
    failed_rounds: int = 0  # no status at all (both commands failed, or the transport)
    degraded_rounds: int = 0  # sacct failed, squeue answered


class ClusterPoller:
    """Polls one cluster for every job watched in this event loop."""

    _pollers: dict[tuple[str, int], ClusterPoller] = {}

    def __init__(self, conn_id: str, interval: float) -> None:
        self.conn_id = conn_id
        self.interval = interval
        self.snapshot = Snapshot()
        self.stats = PollerStats()
        self._watch: dict[str, int] = {}  # job id -> number of watchers
        self._names: dict[str, str | None] = {}  # job id -> its name (key), where known
        self._changed = asyncio.Condition()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._conn = None
        self._sftp = None
        self._conn_lock = asyncio.Lock()
        self._kills: dict[str, asyncio.Task] = {}  # job id -> its cancel_for_kill task

    @classmethod
    def get(cls, conn_id: str, interval: float) -> ClusterPoller:
        """The poller for ``conn_id`` in the running loop; the fastest interval wins."""
        key = (conn_id, id(asyncio.get_running_loop()))
        poller = cls._pollers.get(key)
        if poller is None:
            poller = cls._pollers[key] = cls(conn_id, interval)
        poller.interval = min(poller.interval, interval)
        return poller

    # -- watchers --------------------------------------------------------------
    def watch(self, job_id: str, name: str | None = None) -> None:
        self._watch[job_id] = self._watch.get(job_id, 0) + 1
        if name is not None or job_id not in self._names:
            self._names[job_id] = name
        self._wake.set()  # a new job gets its first status without waiting a round
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def unwatch(self, job_id: str) -> None:
        left = self._watch.get(job_id, 0) - 1
        if left <= 0:
            self._watch.pop(job_id, None)
            self._names.pop(job_id, None)
        else:
            self._watch[job_id] = left

    async def wait(self, after_seq: int) -> Snapshot:
        """The first snapshot newer than ``after_seq``."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.snapshot.seq > after_seq)
            return self.snapshot

    # -- connection ------------------------------------------------------------
    async def connection(self):
        async with self._conn_lock:
            if self._conn is None or self._conn.is_closed():
                from airflow.providers.ssh.hooks.ssh import SSHHookAsync

                self._sftp = None
                self._conn = await SSHHookAsync(ssh_conn_id=self.conn_id,
                                                keepalive_interval=15).get_conn()
                self.stats.connections_opened += 1
                log.info("SSH connection %d to cluster %s opened", self.stats.connections_opened,
                         self.conn_id)
            return self._conn

    async def sftp(self):
        conn = await self.connection()
        if self._sftp is None:
            self._sftp = await conn.start_sftp_client()
        return self._sftp

    async def _drop(self) -> None:
        conn, self._conn, self._sftp = self._conn, None, None
        if conn is not None:
            conn.close()

    async def run(self, command: str, timeout: float = 60.0) -> tuple[int, str, str]:
        conn = await self.connection()
        result = await conn.run(command, check=False, timeout=timeout)
        return result.exit_status or 0, str(result.stdout or ""), str(result.stderr or "")

    async def read_bytes(self, path: str, offset: int = 0, limit: int = 1 << 20) -> bytes:
        """Up to ``limit`` bytes of ``path`` from ``offset``; b"" when it does not exist."""
        import asyncssh

        sftp = await self.sftp()
        try:
            async with sftp.open(path, "rb") as handle:
                await handle.seek(offset)
                return await handle.read(limit)
        except asyncssh.SFTPNoSuchFile:
            return b""

    async def log_tail(self, path: str, max_bytes: int = 4000) -> str:
        """The last ``max_bytes`` of ``path`` as text ("" when it does not exist)."""
        import asyncssh

        sftp = await self.sftp()
        try:
            size = (await sftp.stat(path)).size or 0
        except asyncssh.SFTPNoSuchFile:
            return ""
        data = await self.read_bytes(path, max(0, size - max_bytes), max_bytes)
        return data.decode("utf-8", "replace")

    async def cancel(self, job_id: str, killed_in: str | None = None) -> None:
        rc, _, err = await self.run(commands.scancel(job_id, killed_in))
        commands.check_cancel(job_id, rc, err)

    def cancel_for_kill(self, job_id: str, killed_in: str | None = None) -> asyncio.Task:
        """Cancel the job of a killed task in a task of the poller's own, retried until
        ``scancel`` answers or :data:`KILL_CANCEL_RETRY_S` runs out.

        Not in the caller's task because Airflow's triggerer (3.3) cancels a trigger again at
        each sync (about every second) until it finishes, and the second cancel lands inside
        ``on_kill``: on a loaded machine it interrupted the SSH round trip before ``scancel``
        was sent, and the job ran on with nobody left to cancel it. The caller may wait for
        the task (shielded); the poller holds a reference so that it runs to its end."""
        task = self._kills.get(job_id)
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(
                self._cancel_until_answered(job_id, killed_in))
            self._kills[job_id] = task
            task.add_done_callback(lambda done: self._kills.pop(job_id, None)
                                   if self._kills.get(job_id) is done else None)
        return task

    async def _cancel_until_answered(self, job_id: str, killed_in: str | None) -> None:
        deadline = time.monotonic() + KILL_CANCEL_RETRY_S
        delays = backoff_delays(1000, base=self.interval, cap=30)
        while True:
            try:
                await self.cancel(job_id, killed_in)
                log.info("Slurm job %s cancelled: its task was killed", job_id)
                return
            except Exception as exc:  # noqa: BLE001 - retried; only the deadline gives up
                if time.monotonic() >= deadline:
                    # Logged, not raised: nobody may be left to retrieve the exception.
                    log.error("Slurm job %s of a killed task could not be cancelled in %.0f s, "
                              "it may still run: %s", job_id, KILL_CANCEL_RETRY_S, exc)
                    return
                log.warning("cancelling Slurm job %s of a killed task failed, retrying: %s",
                            job_id, exc)
                if not isinstance(exc, SlurmCommandError):
                    await self._drop()  # the transport broke: the next try opens a new one
                await asyncio.sleep(next(delays))

    async def signal(self, job_id: str, signal: str, stopped_in: str | None = None) -> None:
        """Send ``signal`` to the job (batch shell and steps), on this connection: a log
        watcher stopping a job needs no SSH connection of its own."""
        rc, _, err = await self.run(commands.scancel_signal(job_id, signal, stopped_in))
        commands.check_cancel(job_id, rc, err)

    # -- polling ---------------------------------------------------------------
    async def _query(self, job_ids: list[str]) -> query.Status:
        """One round of :func:`operators.slurm.query.status` on this connection."""
        round_ = query.status(job_ids, {j: self._names.get(j) for j in job_ids})
        found = None
        try:
            line = next(round_)
            while True:
                line = round_.send(query.Result(*await self.run(line)))
        except StopIteration as done:
            found = done.value
        finally:
            self.stats.status_calls += found.calls if found else 1
        for skipped in found.skipped[:5]:
            log.info("skipped a line of sacct/squeue output that is not a Slurm row: %r",
                     skipped[:200])
        return found

    async def _publish(self, records: dict[str, JobRecord], error: str | None) -> None:
        async with self._changed:
            self.snapshot = Snapshot(self.snapshot.seq + 1, records, error, time.monotonic())
            self._changed.notify_all()

    async def _loop(self) -> None:
        delays = None
        idle_rounds = 0
        while True:
            started = time.monotonic()
            self._wake.clear()  # a job registered from now on gets the next round early
            job_ids = sorted(self._watch)
            if not job_ids:
                idle_rounds += 1
                if idle_rounds * self.interval > 60:
                    await self._drop()  # nobody to watch for a minute: free the login node
                    return
            else:
                idle_rounds = 0
                try:
                    found = await self._query(job_ids)
                    delays = None
                    if found.degraded:
                        self.stats.degraded_rounds += 1
                    if found.degraded and not self.snapshot.error:  # once per outage
                        log.warning("cluster %s: following jobs through squeue: %s",
                                    self.conn_id, found.degraded)
                    await self._publish(found.records, found.degraded)
                except SlurmCommandError as exc:
                    # Slurm answered, with an error: the connection is fine, keep it, and
                    # ask again next interval (not later: recovery must be seen soon).
                    self.stats.failed_rounds += 1
                    log.warning("polling cluster %s failed: %s", self.conn_id, exc)
                    await self._publish({}, f"{type(exc).__name__}: {exc}")
                except Exception as exc:  # noqa: BLE001 - any failure is UNKNOWN, never FAILED
                    self.stats.failed_rounds += 1
                    log.warning("polling cluster %s failed, reconnecting: %s", self.conn_id, exc)
                    await self._drop()
                    await self._publish({}, f"{type(exc).__name__}: {exc}")
                    delays = delays or backoff_delays(1000, base=self.interval, cap=60)
                    await asyncio.sleep(next(delays))
                    continue
            # Rounds start every interval, however long the query took: a job's end is
            # seen at most one interval (plus the query) after it happens.
            remaining = self.interval - (time.monotonic() - started)
            if remaining <= 0:
                continue
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=remaining)
                # Woken by a new job: let the other triggers starting now join the round.
                await asyncio.sleep(0.5)
            except TimeoutError:
                pass
