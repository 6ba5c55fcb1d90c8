"""The production stack (docker/local_stack.sh) as the tests see it.

``local_stack.sh up`` is idempotent: a fixture calls it as today's fixtures start MLflow, and a
stack already up (from an earlier run, with the same checkout and DAGs folder) is reused. Its
components run as separate processes recorded in the stack's state directory; the tests kill
one by its recorded PID (its whole process group: the trigger runner or task processes with it)
and start it again with ``up``.

    stack = Stack.up(dags)                   # the stack, its Airflow REST client
    stack.airflow.trigger(dag_id, conf)      # tests.support.airflow's client
    stack.s3_client()                        # boto3 on the S3 gateway, with the tracking key
    stack.stop("redis"); stack.start("redis")  # local_stack.sh stop/up NAME: a service restarted
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from jobscripts.common import process_start_ticks
from tests.lanes import note
from tests.support import cluster
from tests.support.airflow import Standalone
from tests.support.cluster import REPO

SCRIPT = REPO / "docker" / "local_stack.sh"
STATE = Path(os.environ.get("PP_STACK_STATE", "/var/lib/pretrain-stack"))
TRIGGERERS = ("triggerer-1", "triggerer-2")
UP_RETRY_DELAY_S = 20
WORKERS = ("worker-1", "worker-2")


class StackAirflow(Standalone):
    """The REST client of ``Standalone`` on the stack's api-server; the stack's processes are
    started and stopped by local_stack.sh, not by this object."""

    def start(self, timeout: float = 0) -> StackAirflow:
        return self

    def stop(self) -> None:
        pass

    def fail_running(self, dag_id: str) -> list[str]:
        """Mark failed every running or queued run of ``dag_id``: one that a story aborted
        earlier would hold the next (max_active_runs=1)."""
        runs = self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns?state=running&state=queued")
        ids = [r["dag_run_id"] for r in runs["dag_runs"]]
        for run_id in ids:
            self.request("PATCH", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}", {"state": "failed"})
        return ids


@dataclass
class Stack:
    env: dict[str, str]  # local_stack.sh env: URLs, bucket, tracking key, state paths

    @classmethod
    def up(cls, dags: Path, timeout: float = 1200) -> Stack:
        """``local_stack.sh up`` with ``dags`` as its DAGs folder; a stack's servers running
        with other DAGs (or from another checkout) are restarted with these."""
        env = {**os.environ, "PP_STACK_DAGS": str(dags), "PP_STACK_REPLACE": "1"}
        proc = _script("up", env, timeout)
        if proc.returncode != 0:
            # Once more (``up`` starts only what is not running): CI's fresh machines twice
            # failed the first ``up`` in seconds while the other lanes started, for a reason
            # CI's output cut off. The first failure goes into the lane's notes either way.
            first = f"{proc.stdout}{proc.stderr}"
            note(f"local_stack.sh up failed once, retried: {_last_lines(first)}")
            time.sleep(UP_RETRY_DELAY_S)
            proc = _script("up", env, timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"local_stack.sh up failed twice; the first time:\n{first}\n"
                                   f"the second:\n{proc.stdout}{proc.stderr}")
        return cls(client_env(env))

    def stop(self, *components: str, timeout: float = 120) -> None:
        """``local_stack.sh stop``: a clean stop of those components (PostgreSQL: a fast
        shutdown), by their recorded PIDs."""
        self._run("stop", components, timeout)

    def start(self, *components: str, timeout: float = 600) -> None:
        """``local_stack.sh up NAME...``: start those that are not running, nothing else (a
        component a test killed on purpose stays down)."""
        self._run("up", components, timeout)
        self.env = client_env({**os.environ, "PP_STACK_DAGS": self.env["PP_STACK_DAGS"]})

    def _run(self, command: str, components: tuple[str, ...], timeout: float) -> None:
        env = {**os.environ, "PP_STACK_DAGS": self.env["PP_STACK_DAGS"]}
        proc = subprocess.run(["bash", str(SCRIPT), command, *components], env=env,
                              capture_output=True, text=True, timeout=timeout, cwd=REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"local_stack.sh {command} {' '.join(components)} failed:\n"
                               f"{proc.stdout}{proc.stderr}")

    def alive(self, component: str) -> bool:
        """The component's recorded process still runs: its PID with its recorded start time
        (local_stack.sh's own test, so a reused PID is not taken for it)."""
        path = Path(self.env["PP_STACK_PIDS"]) / f"{component}.pid"
        try:
            pid, started = (int(field) for field in path.read_text().split())
        except (OSError, ValueError):
            return False
        return process_start_ticks(pid) == started

    def celery(self):
        """A Celery app on the stack's broker, for remote control of its workers."""
        from celery import Celery

        return Celery(broker=self.env["PP_STACK_BROKER_URL"])

    def celery_name(self, app, worker: str, timeout: float = 300) -> str:
        """The Celery node name of ``worker`` (``stack-worker-1@<host>``), from pings until it
        answers: after the broker's restart a worker reconnects on its own back-off (seconds
        to a minute), and until then no ping reaches it."""
        seen: list[str] = []

        def answered() -> str | None:
            seen[:] = [name for reply in app.control.ping(timeout=10) for name in reply]
            mine = [n for n in seen if n.startswith(f"stack-{worker}@")]
            if len(mine) > 1:
                raise RuntimeError(f"more than one Celery node for {worker} among {seen}")
            return mine[0] if mine else None

        try:
            return cluster.wait_for(answered, timeout, f"Celery node {worker} to answer a ping", 2)
        except TimeoutError as exc:
            raise RuntimeError(f"no Celery node for {worker} among {seen}") from exc

    def workloads(self, worker: str, task_log: str) -> int:
        """How many times ``worker`` started a workload (a task's start or its resume after
        a deferral) whose log is ``task_log`` (``dag_id=.../task_id=x/attempt=1.log``): the
        line Airflow 3.3's Celery worker logs for each, as the stack's worker logs show it."""
        return len(self._workload_lines(worker, task_log))

    def _workload_lines(self, worker: str, task_log: str) -> list[str]:
        """The worker's log lines that start ``task_log``'s workloads, from its log and the one
        before it (``up`` keeps it as ``.log.1`` when it starts a killed worker again)."""
        lines = []
        for name in (f"{worker}.log.1", f"{worker}.log"):
            path = self.log_dir / name
            text = path.read_text(errors="replace") if path.exists() else ""
            lines += [line for line in text.splitlines() if "Executing workload in Celery"
                      in line and f"log_path='{task_log}'" in line]
        return lines

    def last_workload(self, task_log: str) -> str:
        """Which worker started ``task_log``'s latest workload (for a deferred task that
        resumed: its end), by the time each worker logged it."""
        latest = {}
        for worker in WORKERS:
            lines = self._workload_lines(worker, task_log)
            if lines:
                latest[worker] = lines[-1].split()[0]
        if not latest:
            raise RuntimeError(f"no worker ran {task_log}")
        return max(latest, key=latest.get)

    @property
    def airflow(self) -> StackAirflow:
        base = self.env["PP_STACK_AIRFLOW_URL"]
        return StackAirflow({"AIRFLOW__API__BASE_URL": base}, self.log_dir / "api-server.log")

    @property
    def log_dir(self) -> Path:
        return Path(self.env["PP_STACK_LOGS"])

    def pid(self, component: str) -> int:
        """The recorded PID of one component (also its process group)."""
        return int((Path(self.env["PP_STACK_PIDS"]) / f"{component}.pid").read_text().split()[0])

    def kill(self, component: str, sig: int = signal.SIGKILL) -> int:
        """``sig`` to the component's process group: a crash of it and its children."""
        pid = self.pid(component)
        os.killpg(pid, sig)
        return pid

    def triggerer_of(self, ti: dict, timeout: float = 300) -> str:
        """Which triggerer process runs the trigger of the deferred task instance ``ti`` (a
        REST task-instance body). Both triggerers run on one host, so the TriggererJob's
        hostname does not tell them apart, and two started within the same second cannot be
        told apart by their start lines either (a CI run saw 0.43 s). Two signs, the first found:
        the triggerer's process holds the trigger's log file open (``attempt=N.log.trigger.
        <triggerer job>.log``, from its first line until the trigger ends: Airflow 3.3's
        TriggerLoggingFactory), or its own log has lines tagged ``ti_id=... try_number=...``
        (asyncssh's, when the trigger opened the poller's connection: a trigger that joins a
        running poller logs none there)."""
        tag = f"ti_id={ti['id']} try_number={ti['try_number']}"
        trigger_log = re.compile(
            re.escape(f"/dag_id={ti['dag_id']}/run_id={ti['dag_run_id']}/task_id={ti['task_id']}/"
                      f"attempt={ti['try_number']}.log.trigger.") + r"\d+\.log$")

        def holding() -> list[str]:
            names = []
            for name in TRIGGERERS:
                for pid in self.group_pids(name):
                    try:
                        fds = list(Path(f"/proc/{pid}/fd").iterdir())
                        targets = [os.readlink(fd) for fd in fds]
                    except OSError:
                        continue
                    if any(trigger_log.search(t) for t in targets):
                        names.append(name)
                        break
            return names

        def tagged() -> list[str]:
            return [name for name in TRIGGERERS
                    if tag in (self.log_dir / f"{name}.log").read_text(errors="replace")]

        names = cluster.wait_for(lambda: holding() or tagged() or None, timeout,
                                 f"the triggerer of {tag}", 0.5)
        if len(names) != 1:
            raise RuntimeError(f"both triggerers run or logged {tag}: {names}")
        return names[0]

    def group_pids(self, component: str) -> set[int]:
        pgid = self.pid(component)
        out = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout
        return {int(p) for p in out.split()}

    def connections_to(self, port: int, component: str) -> int:
        """Established TCP connections to 127.0.0.1:``port`` held by the component's group."""
        pids = self.group_pids(component)
        out = subprocess.run(["ss", "-Htnp", "state", "established", "dst", f"127.0.0.1:{port}"],
                             capture_output=True, text=True, check=True).stdout
        count = 0
        for line in out.splitlines():
            # users:(("python",pid=123,fd=7)) - one connection per line
            owners = {int(p.split(",")[0]) for p in line.split("pid=")[1:]}
            count += bool(owners & pids)
        return count

    def s3_client(self):
        import boto3

        return boto3.session.Session(
            aws_access_key_id=self.env["PP_STACK_S3_ACCESS_KEY"],
            aws_secret_access_key=self.env["PP_STACK_S3_SECRET_KEY"],
            region_name="us-east-1").client("s3", endpoint_url=self.env["PP_STACK_S3_ENDPOINT"])

    def mlflow_connection(self, experiment: str | None = None):
        """An Airflow-Connection-shaped object for ``tracking_settings``: the one the stack's
        tasks use (tracking key, S3 endpoint), as tests/support/mlflow_server.py builds it."""
        import json
        from types import SimpleNamespace
        from urllib.parse import urlsplit

        url = urlsplit(self.env["PP_STACK_MLFLOW_URL"])
        extra = {"s3_endpoint_url": self.env["PP_STACK_S3_ENDPOINT"]}
        if experiment:
            extra["experiment"] = experiment
        return SimpleNamespace(conn_id="mlflow_stack", conn_type="http", host=url.hostname,
                               port=url.port, schema=url.scheme,
                               login=self.env["PP_STACK_S3_ACCESS_KEY"],
                               password=self.env["PP_STACK_S3_SECRET_KEY"],
                               extra=json.dumps(extra))


def _last_lines(output: str, count: int = 4) -> str:
    return " | ".join([line for line in output.splitlines() if line.strip()][-count:])


def _script(command: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), command], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def client_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``local_stack.sh env``: KEY=VALUE lines."""
    out = subprocess.run(["bash", str(SCRIPT), "env"], env=env, capture_output=True, text=True,
                         check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
