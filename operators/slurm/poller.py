"""One SSH connection and one ``sacct`` per cluster per interval, for all triggers.

Every Slurm trigger in a triggerer process registers its job here. A single
task per cluster polls ``sacct`` for all registered jobs at once (``squeue`` for
the few seconds before ``sacct`` knows a new job), so the number of status
calls per minute does not grow with the number of jobs, and the cluster sees
one SSH connection per triggerer instead of one per job: login nodes ban
accounts for less. Log tails are read over SFTP on the same connection.

A failed query marks every watched job UNKNOWN for that round, never FAILED;
the connection is re-opened with jittered back-off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from operators.slurm import commands
from operators.slurm.backoff import backoff_delays
from operators.slurm.parse import (
    JobRecord,
    merge_live,
    needs_squeue,
    parse_sacct,
    parse_squeue,
)

log = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """The result of one polling round, shared by every watcher."""

    seq: int = 0
    records: dict[str, JobRecord] = field(default_factory=dict)
    error: str | None = None  # set when the round's query failed
    at: float = 0.0


@dataclass
class PollerStats:
    connections_opened: int = 0
    status_calls: int = 0


class ClusterPoller:
    """Polls one cluster for every job watched in this event loop."""

    _pollers: dict[tuple[str, int], ClusterPoller] = {}

    def __init__(self, conn_id: str, interval: float) -> None:
        self.conn_id = conn_id
        self.interval = interval
        self.snapshot = Snapshot()
        self.stats = PollerStats()
        self._watch: dict[str, int] = {}  # job id -> number of watchers
        self._changed = asyncio.Condition()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._conn = None
        self._sftp = None
        self._conn_lock = asyncio.Lock()

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
    def watch(self, job_id: str) -> None:
        self._watch[job_id] = self._watch.get(job_id, 0) + 1
        self._wake.set()  # a new job gets its first status without waiting a round
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def unwatch(self, job_id: str) -> None:
        left = self._watch.get(job_id, 0) - 1
        if left <= 0:
            self._watch.pop(job_id, None)
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

    async def read_log(self, path: str, offset: int, limit: int = 1 << 20) -> bytes:
        import asyncssh

        sftp = await self.sftp()
        try:
            async with sftp.open(path, "rb") as handle:
                await handle.seek(offset)
                return await handle.read(limit)
        except asyncssh.SFTPNoSuchFile:
            return b""

    async def tail(self, path: str, max_bytes: int) -> bytes:
        """The last ``max_bytes`` of ``path`` (b"" when it does not exist)."""
        import asyncssh

        sftp = await self.sftp()
        try:
            size = (await sftp.stat(path)).size or 0
        except asyncssh.SFTPNoSuchFile:
            return b""
        return await self.read_log(path, max(0, size - max_bytes), max_bytes)

    async def cancel(self, job_id: str, killed_in: str | None = None) -> None:
        rc, _, err = await self.run(commands.scancel(job_id, killed_in))
        if rc != 0 and not any(s in err for s in commands.CANCEL_ALREADY_DONE):
            raise RuntimeError(f"scancel {job_id} exited {rc}: {err.strip()}")

    # -- polling ---------------------------------------------------------------
    async def _query(self, job_ids: list[str]) -> dict[str, JobRecord]:
        self.stats.status_calls += 1
        rc, out, err = await self.run(commands.sacct_jobs(job_ids))
        if rc != 0:
            raise RuntimeError(f"sacct exited {rc}: {err.strip()[:300]}")
        records = parse_sacct(out)
        unsure = [j for j in job_ids if needs_squeue(records, j)]
        if unsure:  # not in sacct yet, or perhaps requeued: squeue knows
            self.stats.status_calls += 1
            rc, out, _ = await self.run(commands.squeue_jobs(unsure))
            if rc == 0:
                records = merge_live(records, parse_squeue(out))
        return records

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
                    records = await self._query(job_ids)
                    delays = None
                    await self._publish(records, None)
                except Exception as exc:  # noqa: BLE001 - any failure is UNKNOWN, never FAILED
                    log.warning("polling cluster %s failed: %s", self.conn_id, exc)
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
