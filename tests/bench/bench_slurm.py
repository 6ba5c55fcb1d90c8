"""Benchmark: polling cost and detection delay of 20 deferred Slurm jobs (issue 2 §5).

Under a real ``airflow standalone``: SSH connections opened by the triggerer
(sampled from the kernel's socket table), ``sacct``/``squeue`` calls (counted by
wrappers put in front of the real commands for the run), and, per job, the
delay from sacct's ``End`` to the task's ``end_date``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from operators.local_airflow import SCHEDULER_IDLE_SLEEP_S
from tests.support import cluster
from tests.support.airflow import Standalone, airflow_env

DAG_ID = "bench_slurm_polling"
WRAPPED = ("sacct", "squeue")
CALL_LOG = Path("/tmp/pp-bench-slurm-calls.log")


def install_wrappers() -> None:
    """Count status calls: sshd's PATH puts /usr/local/bin before /usr/bin."""
    CALL_LOG.write_text("")
    CALL_LOG.chmod(0o666)
    for name in WRAPPED:
        wrapper = Path("/usr/local/bin") / name
        # SSH_CONNECTION names the client's port: calls are told apart by connection.
        wrapper.write_text(f'#!/bin/sh\necho "{name} $(date +%s.%N) $SSH_CONNECTION"'
                           f' >> {CALL_LOG}\nexec /usr/bin/{name} "$@"\n')
        wrapper.chmod(0o755)


def remove_wrappers() -> None:
    for name in WRAPPED:
        (Path("/usr/local/bin") / name).unlink(missing_ok=True)


class ConnectionSampler(threading.Thread):
    """Distinct TCP connections from the triggerer's processes to the cluster's sshd."""

    def __init__(self, af: Standalone, port: int) -> None:
        super().__init__(daemon=True)
        self.af, self.port, self.seen, self.stop = af, port, set(), threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            pids = subprocess.run(["pgrep", "-f", "airflow triggerer"], capture_output=True,
                                  text=True).stdout.split()
            out = subprocess.run(["ss", "-tnpH", "dst", f"127.0.0.1:{self.port}"],
                                 capture_output=True, text=True).stdout
            for line in out.splitlines():
                if any(f"pid={p}," in line for p in pids):
                    self.seen.add(line.split()[3])  # the local address:port of the connection
            time.sleep(0.2)


def utc(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def main() -> dict:
    cluster.check_up()
    poll = float(os.environ.get("PP_BENCH_POLL_S", "5"))
    jobs = int(os.environ.get("PP_BENCH_JOBS", "20"))
    home = Path(tempfile.mkdtemp(prefix="pp-bench-af-"))
    env = airflow_env(home, Path(__file__).parent / "dags", port=18095,
                      extra={"PP_BENCH_POLL_S": str(poll), "PP_BENCH_JOBS": str(jobs)},
                      scheduler_idle_sleep_s=SCHEDULER_IDLE_SLEEP_S)
    af = Standalone(env, home / "standalone.log").start()
    sampler = ConnectionSampler(af, cluster.connection()["port"])
    install_wrappers()
    try:
        sampler.start()
        t0 = time.time()
        run_id = af.trigger(DAG_ID)
        af.wait_run(DAG_ID, run_id, timeout=600)
        elapsed_min = (time.time() - t0) / 60
        calls = [line.split() for line in CALL_LOG.read_text().splitlines()]
        trigger_ports = {addr.rsplit(":", 1)[1] for addr in sampler.seen}
        # Status polling is the triggerer's; workers' lookups at submission are counted apart.
        polling = [c for c in calls if len(c) >= 4 and c[3] in trigger_ports]
        delays = []
        for i in range(jobs):
            task = f"job_{i:02d}"
            ti = af.task_instance(DAG_ID, run_id, task)
            job_id = af.xcom(DAG_ID, run_id, task)["job_id"]
            end = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "End", "-j", job_id],
                                 capture_output=True, text=True, check=True).stdout.strip()
            job_end = datetime.fromisoformat(end).astimezone(UTC)
            delays.append((utc(ti["end_date"]) - job_end).total_seconds())
    finally:
        sampler.stop.set()
        remove_wrappers()
        af.stop()
    delays.sort()
    return {
        "bench": "slurm_polling", "jobs": jobs, "ssh_connections": len(sampler.seen),
        "sacct_calls_per_min": round(len(polling) / elapsed_min, 1),
        "submit_side_calls": len(calls) - len(polling),
        "detect_p50_s": round(statistics.median(delays), 2),
        "detect_p95_s": round(delays[min(len(delays) - 1, int(0.95 * len(delays)))], 2),
        "poll_interval_s": poll,
        "scheduler_idle_sleep_s": float(env["AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME"]),
    }


if __name__ == "__main__":
    print(json.dumps(main()))
