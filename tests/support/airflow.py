"""A real Airflow for the tests: its environment, ``dags test``, and ``standalone``.

``airflow dags test`` runs triggers inline and so hides trigger-loading
problems; ``airflow standalone`` runs the real scheduler, dag-processor,
triggerer and api-server, which is what users run. Both are used.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jobscripts.common import stop_process_group
from operators.local_airflow import standalone_settings
from tests.support.cluster import REPO, connection_env, wait_for

VENV_BIN = Path(sys.executable).parent
AIRFLOW = str(VENV_BIN / "airflow")
TERMINAL_RUN_STATES = {"success", "failed"}
# A task instance in one of these stays there until someone clears it: a wait for another
# state can stop at once (and say what happened) instead of waiting out its time-out.
TERMINAL_TASK_STATES = {"success", "failed", "skipped", "upstream_failed", "removed"}
LOG_TAIL_CHARS = 3000


REQUEST_TIMEOUT_S = 60
REQUEST_ATTEMPTS = 3
# Each Airflow of the tests serves its task and trigger logs on ports of its own, derived from
# its api-server port: the lanes of `make test` run two of them at once (the stack's own are in
# docker/local_stack.sh).
LOG_PORT_OFFSET = 10000
# The session ``standalone`` fixture's api-server port, and the variable that moves it: each
# lane of `make test` that runs modules using that fixture gives it its own (tests/lanes.py).
SESSION_PORT_ENV = "PP_TEST_AIRFLOW_PORT"
SESSION_PORT = 18080
# `make test` runs three or four Airflows at once on 2 cores, so what each burns while idle is
# the suite's time. Measured with the fault story alone (2026-12-03, per-process CPU sampled
# every second): its scheduler polling every 0.2 s (the demo's setting) took 0.25 of a core,
# at Airflow's default 1 s 0.10; its dag-processor re-parsing every file every 5 s took 0.11,
# every 30 s (Airflow's default) 0.035. A test that changes what a DAG file reads (a campaign
# YAML) touches the file: a file modified since its last parse is parsed again at once.
SUITE_SCHEDULER_IDLE_SLEEP_S = "1"
SUITE_MIN_FILE_PROCESS_INTERVAL_S = "30"


def airflow_env(home: Path, dags_folder: Path, port: int = 18080,
                extra: dict[str, str] | None = None,
                scheduler_idle_sleep_s: str = SUITE_SCHEDULER_IDLE_SLEEP_S) -> dict[str, str]:
    """A test Airflow's environment: the demo's settings (operators/local_airflow.py) but for
    the two that cost CPU; the benches that measure latency pass the demo's idle sleep."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(connection_env())
    env.update(standalone_settings(home, dags_folder, port,
                                   scheduler_idle_sleep_s=scheduler_idle_sleep_s))
    env.update({
        "AIRFLOW__CORE__PARALLELISM": "8",  # LocalExecutor forks this many workers
        "AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG": "32",  # deferred tasks hold no worker
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(port + LOG_PORT_OFFSET),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(port + LOG_PORT_OFFSET + 1),
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",  # a new DAG file is seen within 5 s
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": SUITE_MIN_FILE_PROCESS_INTERVAL_S,
        # Airflow's default. At 60 the fault story's `register` was failed in a CI-like run:
        # every component of its Airflow logged nothing for ~80 s ("Heartbeat recovered after
        # 85.84 seconds"), then the scheduler failed the running task for its missed heartbeat.
        # No test here needs a killed worker found sooner (the stack's story sets its own).
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "300",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        # standalone starts its components as `airflow ...` from PATH.
        "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
    })
    env.update(extra or {})
    return env


def _log_line(item: Any) -> str:
    """A structured log record as text, with its exception's message when it has one."""
    if not isinstance(item, dict):
        return str(item)
    line = str(item.get("event", ""))
    for exc in item.get("error_detail") or []:
        line += f"\n{exc.get('exc_type')}: {exc.get('exc_value')}"
    return line


def _utc(stamp: str) -> datetime:
    when = datetime.fromisoformat(stamp)
    return when if when.tzinfo else when.replace(tzinfo=UTC)



def dags_test(env: dict[str, str], dag_id: str, conf: dict | None = None,
              timeout: float = 600) -> subprocess.CompletedProcess:
    """``airflow dags test``: every task in this process, triggers run inline."""
    argv = [AIRFLOW, "dags", "test", dag_id]
    if conf:
        argv += ["--conf", json.dumps(conf)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def migrate(env: dict[str, str]) -> None:
    subprocess.run([AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True,
                   cwd=REPO)


class Standalone:
    """``airflow standalone`` in its own process group, with a small REST client."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.env = env
        self.base = env["AIRFLOW__API__BASE_URL"]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._restarted: list[subprocess.Popen] = []

    def start(self, timeout: float = 420) -> Standalone:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([AIRFLOW, "standalone"], env=self.env, cwd=REPO,
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()  # its components may outlive it
                raise RuntimeError(f"airflow standalone exited; see {self.log_path}")
            try:
                health = self.request("GET", "/api/v2/monitor/health")
                if all(health.get(c, {}).get("status") == "healthy"
                       for c in ("metadatabase", "scheduler", "triggerer")):
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        # Not left running: its api-server would hold the port for the next start.
        self.stop()
        raise TimeoutError(f"airflow standalone not healthy in {timeout}s; see {self.log_path}")

    def stop(self, *, crash: bool = False) -> None:
        """SIGINT to the group (standalone's clean stop), then SIGTERM, then SIGKILL; with
        ``crash``, SIGKILL at once (every component gone within a second, as when the machine
        running Airflow dies).

        The whole group, not only the leader: executor workers outlive a leader that
        exits on SIGINT.
        """
        if self.proc is None:
            return
        steps = ((signal.SIGKILL, 5),) if crash else (
            (signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 5))
        for proc in (self.proc, *self._restarted):
            stop_process_group(proc.pid, steps)
            proc.wait(5)
        self._log.close()

    def kill_component(self, name: str, sig: int = signal.SIGKILL) -> list[int]:
        """Kill the processes of one component (e.g. ``triggerer``) in our group."""
        out = subprocess.run(["pgrep", "-g", str(self.proc.pid), "-f", f"airflow {name}"],
                             capture_output=True, text=True).stdout
        pids = [int(p) for p in out.split()]
        for pid in pids:
            os.kill(pid, sig)
        return pids

    def restart_components(self, *names: str, timeout: float = 180) -> None:
        """Kill ``names`` with SIGKILL (a crash: no clean shutdown) and start them again.

        ``standalone`` does not restart a component that died, so the test does; ``stop()``
        ends the restarted ones too.
        """
        killed_at = datetime.now(UTC)
        for name in names:
            if not self.kill_component(name):
                raise RuntimeError(f"no '{name}' process in standalone's group")
        for name in names:  # a group of their own: a process cannot join another session's
            self._restarted.append(subprocess.Popen(
                [AIRFLOW, name], env=self.env, cwd=REPO, stdout=self._log,
                stderr=subprocess.STDOUT, start_new_session=True))

        def beating() -> bool:
            health = self.request("GET", "/api/v2/monitor/health")
            beats = [(health.get(n) or {}).get(f"latest_{n}_heartbeat") for n in names]
            return all(b and _utc(b) > killed_at for b in beats)
        wait_for(beating, timeout, f"restarted {names} to heartbeat")

    # -- REST --------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None) -> Any:
        """One REST call. A GET that times out, loses its connection or gets a 5xx is asked
        again (it changes nothing): on a loaded 2-core machine, with another lane's Airflow
        beside this one, the api-server sometimes answers in more than a minute."""
        data = json.dumps(body).encode() if body is not None else None
        attempts = REQUEST_ATTEMPTS if method == "GET" else 1
        for attempt in range(1, attempts + 1):
            req = urllib.request.Request(self.base + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:  # noqa: S310
                    payload = resp.read()
                return json.loads(payload) if payload else None
            except urllib.error.HTTPError as exc:
                # The server answered: the caller decides, except a 5xx to a GET (SQLite's
                # "database is locked" under load), which is asked again like a timeout.
                if exc.code < 500 or attempt == attempts:
                    raise
                time.sleep(2)
            except (TimeoutError, ConnectionError, urllib.error.URLError):
                if attempt == attempts:
                    raise
                time.sleep(2)
        raise AssertionError("unreachable")

    def wait_dag(self, dag_id: str, timeout: float = 120) -> None:
        def parsed():
            try:
                return self.request("GET", f"/api/v2/dags/{dag_id}")
            except urllib.error.HTTPError:
                return None
        wait_for(parsed, timeout, f"DAG {dag_id} to be parsed")

    def trigger(self, dag_id: str, conf: dict | None = None, run_id: str | None = None) -> str:
        self.wait_dag(dag_id)
        body: dict[str, Any] = {"logical_date": None, "conf": conf or {}}
        if run_id:
            body["dag_run_id"] = run_id
        return self.request("POST", f"/api/v2/dags/{dag_id}/dagRuns", body)["dag_run_id"]

    def run_state(self, dag_id: str, run_id: str) -> str:
        return self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")["state"]

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 300) -> str:
        try:
            return wait_for(
                lambda: (s := self.run_state(dag_id, run_id)) in TERMINAL_RUN_STATES and s,
                timeout, f"run {run_id} of {dag_id}")
        except TimeoutError as timed_out:
            raise TimeoutError(f"{timed_out}\n{self.run_report(dag_id, run_id)}") from None

    def task_instance(self, dag_id: str, run_id: str, task_id: str) -> dict:
        return self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/"
                            f"{task_id}")

    def wait_task_state(self, dag_id: str, run_id: str, task_id: str, states: set[str],
                        timeout: float = 120) -> str:
        """Wait for the task to reach one of ``states``; fail at once, with the run's report,
        when it ends in another."""
        def reached():
            state = self.task_instance(dag_id, run_id, task_id)["state"]
            if state in states:
                return state
            if state in TERMINAL_TASK_STATES:
                raise AssertionError(f"{task_id} ended {state}, not {sorted(states)}:\n"
                                     f"{self.run_report(dag_id, run_id)}")
            return None
        try:
            return wait_for(reached, timeout, f"{task_id} to reach {states}")
        except TimeoutError as timed_out:
            raise TimeoutError(f"{timed_out}\n{self.run_report(dag_id, run_id)}") from None

    def run_report(self, dag_id: str, run_id: str) -> str:
        """The run's state, each task's state and try, and the last lines of every failed
        task's log: what a failed wait must show, since CI keeps nothing else of a story."""
        try:
            run = self.run_state(dag_id, run_id)
            body = self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/"
                                "taskInstances?limit=200")
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            return f"run {run_id}: no report ({exc})"
        tasks = body.get("task_instances", [])
        lines = [f"run {run_id}: {run}"]
        lines += [f"  {ti['task_id']}: {ti['state']} (try {ti['try_number']})"
                  for ti in sorted(tasks, key=lambda ti: ti.get("start_date") or "~")]
        for ti in tasks:
            if ti["state"] in {"failed", "up_for_retry"}:
                try:
                    log = self.last_log(dag_id, run_id, ti["task_id"])
                except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                    log = f"(no log: {exc})"
                lines.append(f"--- {ti['task_id']}'s log, last {LOG_TAIL_CHARS} characters:")
                lines.append(log[-LOG_TAIL_CHARS:])
        return "\n".join(lines)

    def set_task_state(self, dag_id: str, run_id: str, task_id: str, state: str) -> Any:
        return self.request("PATCH", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/"
                            f"{task_id}", {"new_state": state})

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        return self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/"
                            f"{task_id}/xcomEntries/{key}?deserialize=true")["value"]

    def last_log(self, dag_id: str, run_id: str, task_id: str) -> str:
        """The log of the task's last try."""
        ti = self.task_instance(dag_id, run_id, task_id)
        return self.task_log(dag_id, run_id, task_id, try_number=max(1, ti["try_number"]))

    def task_tries(self, dag_id: str, run_id: str, task_id: str) -> list[int]:
        """The try numbers Airflow keeps for the task (its history and the current try): not
        every number up to the current one, since a try the scheduler failed before any worker
        ran it has no record and no log."""
        body = self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/"
                            f"{task_id}/tries")
        return sorted({ti["try_number"] for ti in body["task_instances"]})

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1) -> str:
        """The task's log as text: one line per structured record's event."""
        body = self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/"
                            f"{task_id}/logs/{try_number}?full_content=true")
        content = body.get("content", [])
        if isinstance(content, str):
            return content
        return "\n".join(_log_line(item) for item in content)

