"""The settings of an all-in-one Airflow (``airflow standalone``) on one small machine: the
demo's (operators/demo.py) and the test suite's (tests/support/airflow.py) share them.

Three of them are about load, not features. On 2 cores with a campaign's jobs, an MLflow server
and the scheduler beside it, the api-server can take longer than Airflow's default 5 s to
answer a task's execution-API call; after its retries the supervisor kills the task (a demo's
first task died so at load 22, its log ending at "Pre Execute"). When Airflow is restarted,
the scheduler may start a task before the api-server listens again: Airflow's 5 retries back
off for ~15 s in all, and at load ~12 a restarted standalone refused connections for longer,
so one segment's two tries both died at "Pre Execute" on "Connection refused" (the
Airflow-down story, 2026-12-03); 10 retries back off for several minutes. And an idle scheduler that
checks for fired triggers every 0.2 s instead of every 1 s removes most of the delay between a
Slurm job's end and its task's resumption (make bench: README).
"""

from __future__ import annotations

from pathlib import Path

SCHEDULER_IDLE_SLEEP_S = "0.2"
EXECUTION_API_TIMEOUT_S = "30"
EXECUTION_API_RETRIES = "10"


def standalone_settings(home: Path, dags_folder: Path, port: int, *,
                        scheduler_idle_sleep_s: str = SCHEDULER_IDLE_SLEEP_S) -> dict[str, str]:
    """Airflow's settings (as ``AIRFLOW__*`` variables) for a standalone on ``port``.

    ``scheduler_idle_sleep_s``: the test suite, which runs several Airflows on 2 cores at
    once, trades the demo's low latency for CPU (tests/support/airflow.py)."""
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": scheduler_idle_sleep_s,
        "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": EXECUTION_API_TIMEOUT_S,
        "AIRFLOW__WORKERS__EXECUTION_API_RETRIES": EXECUTION_API_RETRIES,
    }
