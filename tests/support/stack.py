"""The production stack (docker/local_stack.sh) as the tests see it.

``local_stack.sh up`` is idempotent: a fixture calls it as today's fixtures start MLflow, and a
stack already up (from an earlier run, with the same checkout and DAGs folder) is reused. Its
components run as separate processes recorded in the stack's state directory; the tests kill
one by its recorded PID (its whole process group: the trigger runner or task processes with it)
and start it again with ``up``.

    stack = Stack.up(dags)                   # the stack, its Airflow REST client
    stack.airflow.trigger(dag_id, conf)      # tests.support.airflow's client
    stack.s3_client()                        # boto3 on the S3 gateway, with the tracking key
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.support.airflow import Standalone, _utc
from tests.support.cluster import REPO

SCRIPT = REPO / "docker" / "local_stack.sh"
STATE = Path(os.environ.get("PP_STACK_STATE", "/var/lib/pretrain-stack"))
TRIGGERERS = ("triggerer-1", "triggerer-2")
# The line a triggerer logs right after creating its TriggererJob row (Airflow 3.3's
# triggerer_job_runner.py, as the stack's triggerer logs show it).
STARTED = re.compile(r"^(\S+)Z \[info\s*\] Starting the triggerer ", re.M)
WORKERS = ("worker-1", "worker-2")


class StackAirflow(Standalone):
    """The REST client of ``Standalone`` on the stack's api-server; the stack's processes are
    started and stopped by local_stack.sh, not by this object."""

    def start(self, timeout: float = 0) -> StackAirflow:
        return self

    def stop(self) -> None:
        pass


@dataclass
class Stack:
    env: dict[str, str]  # local_stack.sh env: URLs, bucket, tracking key, state paths

    @classmethod
    def up(cls, dags: Path, timeout: float = 600) -> Stack:
        """``local_stack.sh up`` with ``dags`` as its DAGs folder; a stack's servers running
        with other DAGs (or from another checkout) are restarted with these."""
        env = {**os.environ, "PP_STACK_DAGS": str(dags), "PP_STACK_REPLACE": "1"}
        proc = _script("up", env, timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"local_stack.sh up failed:\n{proc.stdout}{proc.stderr}")
        return cls(client_env(env))

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

    def triggerer_of(self, job: dict) -> str:
        """Which triggerer process runs as the TriggererJob ``job`` (a task instance's
        ``triggerer_job``): the one whose log says it started when the job row was made. Both
        run on one host, so the job's hostname does not tell them apart."""
        made = _utc(job["start_date"])
        gaps = {}
        for name in TRIGGERERS:
            starts = STARTED.findall((self.log_dir / f"{name}.log").read_text(errors="replace"))
            if starts:
                gaps[name] = abs((_utc(starts[-1]) - made).total_seconds())
        best = min(gaps, key=gaps.get)
        others = [g for n, g in gaps.items() if n != best]
        if gaps[best] > 0.5 or any(g < gaps[best] + 0.5 for g in others):
            raise RuntimeError(f"cannot tell which triggerer runs job {job['id']}: {gaps}")
        return best

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


def _script(command: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), command], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def client_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``local_stack.sh env``: KEY=VALUE lines."""
    out = subprocess.run(["bash", str(SCRIPT), "env"], env=env, capture_output=True, text=True,
                         check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
