"""Bench: the demo campaign on the production stack (docker/local_stack.sh: PostgreSQL, Celery
with two workers, two triggerers, MLflow on SeaweedFS) and on ``airflow standalone``, in one
run, through ``operators.demo`` (what ``make demo`` and ``make demo STACK=production`` run).

    {"bench": "deployment", "campaign_s": X, "standalone_campaign_s": X,
     "ssh_connections_per_triggerer": N, "task_start_latency_p50_s": X, ...}

campaign_s is the DAG run's start to end (the Airflow REST API); task start latency is a task
try's queued to running (``queued_when`` to ``start_date`` of each try, from the API's task
instance tries); ssh_connections_per_triggerer is the most TCP connections to the cluster's sshd
that one triggerer's process group held at once, sampled every second through the campaign.
The standalone's servers are stopped afterwards (``operators.demo down``); the stack is stopped
only when this bench started it.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from datetime import datetime

from tests.support import cluster
from tests.support.stack import SCRIPT, TRIGGERERS, Stack, client_env

REPO = SCRIPT.parents[1]
DAG_ID = "pretrain__demo"
STANDALONE_URL = "http://127.0.0.1:8080"


def _get(url: str):
    with urllib.request.urlopen(url, timeout=30) as resp:  # noqa: S310 - loopback only
        return json.loads(resp.read())


def _utc(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _run_id(output: str) -> str:
    for line in output.splitlines():
        if f"triggered {DAG_ID} run " in line:
            return line.split(f"triggered {DAG_ID} run ", 1)[1].split(";", 1)[0]
    raise RuntimeError(f"no DAG run in the demo's output:\n{output[-3000:]}")


def _measure(base: str, run_id: str) -> tuple[float, list[float]]:
    """The run's seconds (start to end) and every task try's queued-to-running seconds."""
    run = _get(f"{base}/api/v2/dags/{DAG_ID}/dagRuns/{run_id}")
    if run["state"] != "success":
        raise RuntimeError(f"the demo run {run_id} ended {run['state']}")
    seconds = (_utc(run["end_date"]) - _utc(run["start_date"])).total_seconds()
    tis = _get(f"{base}/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances")["task_instances"]
    latencies = []
    for ti in tis:
        tries = _get(f"{base}/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/"
                     f"{ti['task_id']}/tries")["task_instances"]
        for t in tries:
            if t.get("queued_when") and t.get("start_date"):
                latencies.append((_utc(t["start_date"]) - _utc(t["queued_when"])).total_seconds())
    return seconds, [x for x in latencies if x >= 0]


def _demo(*args: str, sample=None) -> str:
    proc = subprocess.Popen([sys.executable, "-m", "operators.demo", "up", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while proc.poll() is None:
        if sample:
            sample()
        time.sleep(1)
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise RuntimeError(f"operators.demo up {' '.join(args)} failed:\n{out[-3000:]}")
    return out


def production() -> dict:
    started_here = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True).returncode
    env = {**os.environ, "PP_STACK_DAGS": str(REPO / "dags"), "PP_STACK_REPLACE": "1"}
    subprocess.run(["bash", str(SCRIPT), "up"], env=env, check=True, capture_output=True)
    stack = Stack(client_env(env))
    port = int(cluster.connection()["port"])
    most = dict.fromkeys(TRIGGERERS, 0)

    def sample() -> None:
        for t in TRIGGERERS:
            with contextlib.suppress(OSError, subprocess.CalledProcessError):
                most[t] = max(most[t], stack.connections_to(port, t))

    try:
        out = _demo("production", sample=sample)
        seconds, latencies = _measure(stack.env["PP_STACK_AIRFLOW_URL"], _run_id(out))
    finally:
        if started_here:
            subprocess.run(["bash", str(SCRIPT), "down"], capture_output=True)
    return {"campaign_s": round(seconds, 1), "ssh_connections_per_triggerer": max(most.values()),
            "ssh_connections_by_triggerer": most,
            "task_start_latency_p50_s": round(statistics.median(latencies), 3),
            "task_tries": len(latencies)}


def standalone() -> dict:
    try:
        out = _demo()
        seconds, latencies = _measure(STANDALONE_URL, _run_id(out))
    finally:
        subprocess.run([sys.executable, "-m", "operators.demo", "down"], cwd=REPO,
                       capture_output=True)
    return {"standalone_campaign_s": round(seconds, 1),
            "standalone_task_start_latency_p50_s": round(statistics.median(latencies), 3)}


def main() -> int:
    result = {"bench": "deployment", **production(), **standalone()}
    keys = ["bench", "campaign_s", "standalone_campaign_s", "ssh_connections_per_triggerer",
            "task_start_latency_p50_s"]
    print(json.dumps({k: result[k] for k in keys} | result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
