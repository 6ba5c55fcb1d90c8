"""The Slurm layer under ``airflow dags test`` (tasks and triggers in one process)."""

from __future__ import annotations

import pytest

from tests.support import cluster
from tests.support.airflow import dags_test

pytestmark = pytest.mark.cluster


def test_success_runs_a_real_job_and_streams_its_log(dags_test_env) -> None:
    proc = dags_test(dags_test_env, "slurm_success")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "hello from" in out and "line two" in out  # streamed from the job log
    assert 'result: {"answer": 42}' in out  # the result JSON came back


def test_nonzero_exit_fails_with_state_exit_code_and_log_tail(dags_test_env) -> None:
    proc = dags_test(dags_test_env, "slurm_fail")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "ended FAILED" in out and "exit code 3" in out and "classified failure" in out
    assert "the reason: disk on fire" in out  # the log tail is in the error


def test_blocking_mode_polls_in_the_worker(dags_test_env) -> None:
    proc = dags_test(dags_test_env, "slurm_success_in_worker")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "hello from the worker" in out


def test_hostile_values_never_execute(dags_test_env) -> None:
    markers = [f"/tmp/pp-pwned-{w}" for w in ("env", "param", "file")]
    for m in markers:
        cluster.remote(f"rm -f {m}")
    proc = dags_test(dags_test_env, "slurm_hostile")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert cluster.remote("ls /tmp/pp-pwned-* 2>/dev/null || true").strip() == ""
    out = cluster.remote("cat ~/pp-runs/pp-quoted-*/out.txt")
    assert out.startswith("$(touch /tmp/pp-pwned-env); `touch /tmp/pp-pwned-env`\n;x|")
    assert "$(touch /tmp/pp-pwned-param)|$(touch /tmp/pp-pwned-file)" in out
