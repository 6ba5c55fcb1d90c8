"""Blocking SSH/SFTP transport to a Slurm login node, for the worker side.

Built on the Airflow SSH provider's ``SSHHook`` (paramiko), so the connection's
host, user, key and pinned ``host_key`` mean what they mean everywhere else in
Airflow. Host-key checking stays on: an unknown or changed key is refused.

One SSH connection per cluster per process is kept and reused; transport
errors reconnect within a bounded budget with jittered back-off. ``sbatch``
itself is never retried here: whether a lost ``sbatch`` reached Slurm is
something only a key lookup can tell, and that is the operator's decision.
"""

from __future__ import annotations

import json
import logging
import posixpath
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import paramiko

from operators.slurm import commands, query
from operators.slurm.backoff import backoff_delays
from operators.slurm.errors import (
    ClusterAuthError,
    ClusterUnreachable,
    SlurmCommandError,
    program,
)
from operators.slurm.parse import (
    JobRecord,
    SlurmParseError,
    job_view,
    newest_job,
    parse_sbatch,
    read_sacct,
    read_squeue,
)
from operators.slurm.render import render_script
from operators.slurm.spec import JobSpec

log = logging.getLogger(__name__)
SCRIPT_NAME = "job.sbatch"
DEFAULT_WORK_DIR = "pp-runs"
_TRANSPORT_ERRORS = (paramiko.SSHException, OSError, EOFError, socket.timeout)


@dataclass(frozen=True)
class ClusterSettings:
    """The connection extras this project reads, besides the SSH provider's own."""

    conn_id: str
    host: str
    user: str
    key_file: str | None
    remote_work_dir: str  # per-job run directories are created under it
    remote_python: str  # the Python that runs ``python -m jobscripts.*`` on the cluster
    log_url_template: str | None  # e.g. an Open OnDemand file URL with {path}

    @classmethod
    def from_connection(cls, conn: Any) -> ClusterSettings:
        extra = conn.extra_dejson or {}
        return cls(
            conn_id=conn.conn_id, host=conn.host or "", user=conn.login or "",
            key_file=extra.get("key_file"),
            remote_work_dir=extra.get("remote_work_dir") or DEFAULT_WORK_DIR,
            remote_python=extra.get("remote_python") or "python3",
            log_url_template=extra.get("log_url_template"),
        )


class SlurmHook:
    """Slurm commands over one reused SSH connection."""

    _clients: dict[str, paramiko.SSHClient] = {}
    _lock = threading.Lock()

    def __init__(self, ssh_conn_id: str, command_timeout: float = 60.0,
                 max_attempts: int = 5) -> None:
        from airflow.providers.ssh.hooks.ssh import SSHHook

        self.ssh_conn_id = ssh_conn_id
        self.command_timeout = command_timeout
        self.max_attempts = max_attempts
        # Our own retry loop below handles transport errors; let the provider try once.
        self._ssh = SSHHook(ssh_conn_id=ssh_conn_id, conn_retry_attempts=1,
                            keepalive_interval=15, conn_timeout=15)
        self.settings = ClusterSettings.from_connection(self._ssh.get_connection(ssh_conn_id))

    # -- transport -------------------------------------------------------------
    def _connect(self) -> paramiko.SSHClient:
        with self._lock:
            client = self._clients.get(self.ssh_conn_id)
            transport = client.get_transport() if client else None
            if client and transport and transport.is_active():
                return client
            try:
                client = self._ssh.get_conn()
            except paramiko.AuthenticationException as exc:
                raise ClusterAuthError(
                    f"SSH authentication failed for {self._who()}: {exc}") from exc
            except paramiko.BadHostKeyException as exc:
                raise ClusterAuthError(
                    f"SSH host key of {self.settings.host} changed; refusing ({self._who()})"
                ) from exc
            except paramiko.SSHException as exc:
                if "known_hosts" in str(exc) or "host key" in str(exc).lower():
                    raise ClusterAuthError(
                        f"SSH host key of {self.settings.host} is unknown; pin it in the "
                        f"connection's host_key extra ({self._who()}): {exc}") from exc
                raise
            self._clients[self.ssh_conn_id] = client
            return client

    def _who(self) -> str:
        s = self.settings
        return (f"connection {s.conn_id!r} (host {s.host}:{self._ssh.port}, user {s.user}, "
                f"key {s.key_file or '<none>'})")

    def _drop(self) -> None:
        with self._lock:
            client = self._clients.pop(self.ssh_conn_id, None)
        self._ssh.client = None
        if client is not None:
            client.close()

    def _with_retries(self, what: str, fn):
        last: Exception | None = None
        for delay in backoff_delays(self.max_attempts):
            try:
                return fn(self._connect())
            except ClusterAuthError:
                raise
            except _TRANSPORT_ERRORS as exc:
                last = exc
                self._drop()
                time.sleep(delay)
        raise ClusterUnreachable(
            f"{what}: cluster unreachable after {self.max_attempts} attempts via "
            f"{self._who()}: {last}") from last

    def _exec(self, client: paramiko.SSHClient, command: str) -> tuple[int, str, str]:
        _, stdout, stderr = client.exec_command(command, timeout=self.command_timeout)
        out = stdout.read().decode("utf-8", "replace")
        err = stderr.read().decode("utf-8", "replace")
        return stdout.channel.recv_exit_status(), out, err

    def run(self, command: str, *, retry: bool = True) -> tuple[int, str, str]:
        """Run one command line; transport errors are retried only when ``retry``."""
        if retry:
            return self._with_retries(program(command), lambda c: self._exec(c, command))
        try:
            return self._exec(self._connect(), command)
        except _TRANSPORT_ERRORS as exc:
            self._drop()
            raise ClusterUnreachable(f"{program(command)} via {self._who()}: {exc}") from exc

    def check(self, command: str) -> str:
        rc, out, err = self.run(command)
        if rc != 0:
            raise SlurmCommandError(command, rc, err)
        return out

    # -- files -----------------------------------------------------------------
    def run_dir(self, key: str) -> str:
        return posixpath.join(self.settings.remote_work_dir, key)

    def upload(self, run_dir: str, files: Mapping[str, str | bytes]) -> None:
        """Write ``files`` (name -> content) into ``run_dir``, each atomically."""
        self.check(commands.mkdir_p(run_dir))

        def put(client: paramiko.SSHClient) -> None:
            with client.open_sftp() as sftp:
                for name, content in files.items():
                    if "/" in name or name.startswith("."):
                        raise ValueError(f"upload file name {name!r} must be a plain file name")
                    data = content.encode() if isinstance(content, str) else content
                    target = posixpath.join(run_dir, name)
                    tmp = posixpath.join(run_dir, f".{name}.part")
                    with sftp.open(tmp, "wb") as handle:
                        handle.write(data)
                    sftp.posix_rename(tmp, target)

        self._with_retries("upload", put)

    def read_bytes(self, path: str, offset: int = 0, limit: int = 1 << 20) -> bytes:
        """Up to ``limit`` bytes of ``path`` from ``offset``; b"" when it does not exist."""
        def get(client: paramiko.SSHClient) -> bytes:
            with client.open_sftp() as sftp:
                try:
                    with sftp.open(path, "rb") as handle:
                        handle.seek(offset)
                        return handle.read(limit)
                except FileNotFoundError:
                    return b""
        return self._with_retries("read", get)

    def read_json(self, path: str) -> Any | None:
        data = self.read_bytes(path, 0, 16 << 20)
        return json.loads(data) if data else None

    def log_tail(self, path: str, max_bytes: int = 4000) -> str:
        def size(client: paramiko.SSHClient) -> int:
            with client.open_sftp() as sftp:
                try:
                    return sftp.stat(path).st_size or 0
                except FileNotFoundError:
                    return 0
        total = self._with_retries("stat", size)
        data = self.read_bytes(path, max(0, total - max_bytes), max_bytes)
        return data.decode("utf-8", "replace")

    def list_files(self, path: str) -> list[tuple[str, int, float]]:
        """Regular files under ``path``, recursively: (relative path, size, mtime), sorted;
        [] when ``path`` does not exist. Symlinks are not followed (no loops, nothing outside)."""
        import stat

        def walk(client: paramiko.SSHClient) -> list[tuple[str, int, float]]:
            found, todo = [], [""]
            with client.open_sftp() as sftp:
                while todo:
                    rel = todo.pop()
                    try:
                        entries = sftp.listdir_attr(posixpath.join(path, rel))
                    except FileNotFoundError:
                        continue
                    for entry in entries:
                        name = posixpath.join(rel, entry.filename)
                        if stat.S_ISDIR(entry.st_mode or 0):
                            todo.append(name)
                        elif stat.S_ISREG(entry.st_mode or 0):
                            found.append((name, entry.st_size or 0, entry.st_mtime or 0))
            return sorted(found)
        return self._with_retries("list", walk)

    def killed_jobs(self, run_dir: str) -> set[str]:
        """Jobs of ``run_dir`` cancelled because their task was killed."""
        data = self.read_bytes(posixpath.join(run_dir, commands.KILLED_JOBS))
        return set(data.decode().split())

    # -- Slurm -----------------------------------------------------------------
    def submit(self, spec: JobSpec, run_dir: str,
               files: Mapping[str, str | bytes] | None = None) -> str:
        """Upload the rendered script and ``files`` into ``run_dir``; ``sbatch`` once.

        A wrapped sbatch that exited 0 without a job id we can read did queue the job:
        it is looked up by its key (``spec.name``) before anything fails.
        """
        script = render_script(spec)
        self.upload(run_dir, {**(files or {}), SCRIPT_NAME: script})
        rc, out, err = self.run(commands.sbatch(run_dir, SCRIPT_NAME), retry=False)
        if rc != 0:
            raise SlurmCommandError("sbatch", rc, err)
        try:
            return parse_sbatch(out)
        except SlurmParseError:
            found = self.find_by_key(spec.name)
            if found is None:
                raise
            log.warning("sbatch exited 0 but printed no job id we can read (%r); job %s "
                        "has key %s", out.strip()[:200], found.job_id, spec.name)
            return found.job_id

    def find_by_key(self, key: str) -> JobRecord | None:
        """The newest job named ``key`` (an array or het job as a whole): ``squeue``
        first (fresh), then ``sacct``. Rows of other names are not ours, whatever
        their id (Slurm reuses ids after a controller reset)."""
        live = self._rows(commands.squeue_name(key), read_squeue)
        found = newest_job(live, key)
        if found is not None:
            return found
        return newest_job(self._rows(commands.sacct_name(key), read_sacct), key)

    def _rows(self, command: str, reader) -> dict[str, JobRecord]:
        rows = reader(self.check(command))
        _log_skipped(program(command), rows.skipped)
        return rows.records

    def describe(self, job_id: str, name: str | None = None) -> JobRecord | None:
        """The job's state, as :func:`operators.slurm.query.status` reads it; with ``name``
        (its key), rows of that id under another name are not taken for it."""
        found = query.run_blocking(query.status([job_id], {job_id: name}),
                                   lambda line: query.Result(*self.run(line)))
        _log_skipped("sacct/squeue", found.skipped)
        if found.degraded:
            log.warning("job %s followed through squeue: %s", job_id, found.degraded)
        return job_view(found.records, job_id)

    def node_count(self, partition: str | None = None) -> int:
        """Nodes in ``partition`` (all partitions when None), as ``sinfo`` counts them."""
        return commands.sinfo_node_count(self.check(commands.sinfo_nodes(partition)))

    def cancel(self, job_id: str, killed_in: str | None = None) -> None:
        """Cancel ``job_id``; a job that already ended is not an error. ``killed_in``: the
        job's run dir, when its task was killed (see ``commands.KILLED_JOBS``)."""
        rc, _, err = self.run(commands.scancel(job_id, killed_in))
        commands.check_cancel(job_id, rc, err)


def _log_skipped(what: str, lines: tuple[str, ...]) -> None:
    """Lines on a Slurm command's stdout that are not its rows: a banner, a MOTD."""
    for line in lines[:5]:
        log.info("skipped a line of %s output that is not a Slurm row: %r", what, line[:200])
