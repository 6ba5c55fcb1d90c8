"""``make demo`` (operators/demo.py): one demo per checkout at a time."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from operators.demo import hold_demo_lock


def test_a_second_demo_is_refused_naming_the_first(tmp_path) -> None:
    lock_file = tmp_path / ".demo" / "demo.lock"
    first = hold_demo_lock(lock_file)
    assert lock_file.read_text() == str(os.getpid())
    # Another process, as a second `make demo` from another terminal would be.
    second = subprocess.run(
        [sys.executable, "-c", "import sys; from pathlib import Path; "
         "from operators.demo import hold_demo_lock; hold_demo_lock(Path(sys.argv[1]))",
         str(lock_file)], capture_output=True, text=True)
    assert second.returncode == 1
    assert f"another `make demo` is running in this checkout (pid {os.getpid()}" in second.stderr
    assert "make demo-down" in second.stderr
    first.close()  # the first demo ends: the next one may start, and records itself
    hold_demo_lock(lock_file).close()


def test_the_lock_is_the_processs_not_the_files(tmp_path) -> None:
    """A lock file left by a demo that was killed holds nothing: the lock is the kernel's."""
    lock_file = tmp_path / "demo.lock"
    lock_file.write_text("12345")
    held = hold_demo_lock(lock_file)
    assert lock_file.read_text() == str(os.getpid())
    with pytest.raises(SystemExit, match="another `make demo`"):
        hold_demo_lock(lock_file)  # a second open file description in this process conflicts too
    held.close()


def test_airflow_reads_the_small_machine_settings(tmp_path) -> None:
    """The names are Airflow's own (a misspelt section is ignored silently): asked back from
    Airflow's configuration, they hold the values the demo and the tests set."""
    from operators.local_airflow import (
        EXECUTION_API_RETRIES,
        EXECUTION_API_TIMEOUT_S,
        standalone_settings,
    )

    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(standalone_settings(tmp_path, tmp_path, 18999))
    code = ("from airflow.configuration import conf; "
            "print(conf.getfloat('workers', 'execution_api_timeout'), "
            "conf.getint('workers', 'execution_api_retries'), "
            "conf.getfloat('scheduler', 'scheduler_idle_sleep_time'), "
            "conf.get('core', 'execution_api_server_url'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [str(float(EXECUTION_API_TIMEOUT_S)), EXECUTION_API_RETRIES, "0.2",
                   "http://127.0.0.1:18999/execution/"]


# -- the evaluation curve (issue 19: the demo shows it) ----------------------------------------
def test_the_demo_evaluates_every_checkpoint_in_the_pool_it_creates(tmp_path) -> None:
    """With the evaluation DAG turned on (``health.evaluate_checkpoints``, as demo.yaml has
    it; docs/health.md), the pool ``make demo`` creates through the REST API before it
    triggers is the one every task of that DAG runs in: a fresh clone's demo needs no `airflow
    pools set` (a task in a missing pool never runs)."""
    from operators.campaign.dag.dag_factory import START
    from operators.campaign.dag.eval_dag import build_eval_dag, eval_dag_id
    from operators.campaign.schema.load import load_campaign
    from operators.demo import DEMO, pool_request
    from tests.campaign.util import DEMO as DEMO_YAML
    from tests.campaign.util import dump, edited, raw

    path = tmp_path / "demo.yaml"
    path.write_text(dump(edited(raw(DEMO_YAML), {"health.evaluate_checkpoints": True,
                                                 "health.eval_pool": "pretrain_eval"})))
    on = load_campaign(path)
    assert on.name == DEMO.name
    body = pool_request(on)
    assert set(body) == {"name", "slots", "description", "include_deferred"}  # PoolBody's
    assert body["slots"] >= 1
    dag = build_eval_dag(on, START, auto_register=False)
    assert dag.dag_id == eval_dag_id(DEMO)
    assert {t.pool for t in dag.tasks} == {body["name"]}


# The points of MLflow's REST answer to GET /api/2.0/mlflow/metrics/get-history (its `metrics`
# list: key, value, timestamp, step), as the demo's server gave them on 2026-12-02 for
# eval_bits_per_byte ({"key": "eval_bits_per_byte", "value": 3.911773787411156,
# "timestamp": 1796173833000, "step": 20}, ...), eval_perplexity and eval_tokens_consumed.
def _point(key: str, value: float, step: int, timestamp: int) -> dict:
    return {"key": key, "value": value, "timestamp": timestamp, "step": step}


def test_one_line_per_evaluated_checkpoint_newest_value_per_step() -> None:
    from operators.demo import EVALUATION_CURVE, evaluation_lines

    bpb, ppl, tokens = EVALUATION_CURVE
    histories = {
        # iteration 60: the evaluation DAG's point, then the final evaluate's (reused) and a
        # retry's newer one: the newest is the one shown.
        bpb: [_point(bpb, 2.5, 40, 200), _point(bpb, 3.1, 20, 100), _point(bpb, 2.2, 60, 300),
              _point(bpb, 2.1, 60, 400)],
        ppl: [_point(ppl, 40.0, 20, 100), _point(ppl, 25.0, 40, 200),
              _point(ppl, 18.5, 60, 400)],
        tokens: [_point(tokens, 20480.0, 20, 100), _point(tokens, 40960.0, 40, 200)],
    }
    assert evaluation_lines(histories) == [
        "checkpoint iteration   20 (20,480 tokens): bits per byte 3.100, perplexity 40.00",
        "checkpoint iteration   40 (40,960 tokens): bits per byte 2.500, perplexity 25.00",
        "checkpoint iteration   60 (tokens unknown): bits per byte 2.100, perplexity 18.50",
    ]
    assert evaluation_lines({bpb: [], ppl: [], tokens: []}) == []


def _detached_group(ready: Path) -> int:
    """A process group whose leader is not this test's child (as the servers a demo started
    earlier): no zombie of it stays behind for the group checks to see. SIGINT back to its
    default (a shell's background command starts with it ignored), then ``ready`` is made."""
    sleeper = ("import signal, time, pathlib; signal.signal(signal.SIGINT, signal.SIG_DFL); "
               f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)")
    out = subprocess.run(["sh", "-c", f'setsid {sys.executable} -c "{sleeper}" >/dev/null 2>&1 &'
                          " echo $!"], capture_output=True, text=True, check=True).stdout
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return int(out)


def test_down_stops_the_recorded_servers_and_never_a_stranger_with_their_pid(
        tmp_path, monkeypatch) -> None:
    """``make demo-down`` signals a process group only when the record's start time matches:
    a record left from before a reboot names a PID the kernel may have given another program."""
    import signal

    from jobscripts.common import process_group_alive, process_start_ticks, stop_process_group
    from operators import demo

    monkeypatch.setattr(demo, "STATE", tmp_path)
    ours, stranger = (_detached_group(tmp_path / f"ready-{n}") for n in range(2))
    try:
        (tmp_path / "airflow.pgid").write_text(f"{ours} {process_start_ticks(ours)}\n")
        # The stranger has the recorded PID but started at another time than the record says.
        (tmp_path / "mlflow.pgid").write_text(f"{stranger} {process_start_ticks(stranger) - 1}\n")
        assert demo._recorded_alive()
        assert demo.down() == 0
        assert not process_group_alive(ours)
        assert process_group_alive(stranger)
        assert not (tmp_path / "airflow.pgid").exists() and not (tmp_path / "mlflow.pgid").exists()
        # An older demo's record (a PID alone) is not trusted either.
        (tmp_path / "mlflow.pgid").write_text(f"{stranger}\n")
        assert not demo._recorded_alive() and demo.down() == 0
        assert process_group_alive(stranger)
    finally:
        for pgid in (ours, stranger):
            stop_process_group(pgid, ((signal.SIGKILL, 5),))
