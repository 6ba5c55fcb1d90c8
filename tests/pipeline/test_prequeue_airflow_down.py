"""Pre-queued segments carry the campaign while Airflow is down (issue 15 §1, docs/prequeue.md).

A tracked reference campaign of four segments (tests/support/reference_campaign.py), pre-queued
one ahead (``segments.prequeue_depth: 1``), under a real ``airflow standalone`` of this module's
own (port 18530; the session's ``standalone`` is never stopped). The story:

1. Segment 1's task submits its job, queues segment 2's job behind it (``afterok``, under
   segment 2's own job key) and defers. Then **every Airflow component is stopped**
   (``Standalone.stop()``: scheduler, triggerer, dag-processor, api-server, executor workers),
   checked by no process of that Airflow home being left and its port refusing.
2. With Airflow down, segment 1 ends and segment 2's job starts and finishes by itself
   (sacct): nothing of Airflow runs, the cluster alone goes on. Nothing queues segment 3 (depth
   1: only a segment task queues, and none runs).
3. Airflow is started again on the same home and SQLite database: the DAG catches up. Segment
   1's trigger sees its job ended, segment 2's task re-attaches to its job by key (no second
   submission), segment 3's submits and queues segment 4, which re-attaches in turn.

Segment 1 is held at the end of its segment by the reference trainer's test-only hang fault
(honouring signals, jobscripts/trainer_faults.py) until Airflow is down, then the test sends it
SIGTERM as Slurm's ``--signal`` would: it saves and exits 0 (stop_reason ``signal``). So the
hand-over from segment 1 to segment 2 happens with Airflow down however long Airflow takes to
stop at this machine's load (a tiny segment trains its iterations in about a second).

Checked: the run succeeds; every segment task succeeds on its own job, the one sacct holds
under its key (exactly one job per key); segment 1's job ended and segment 2's started and
ended while no Airflow process was alive; every iteration was trained exactly once (the job
logs, the segment records); MLflow has the whole loss curve, each step once, with the losses
the job logs show.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest

from jobscripts import vocabulary
from operators.campaign.dag import prequeue
from operators.campaign.dag.segment import XCOM_ATTACHED
from operators.slurm.jobkey import job_key
from operators.slurm.operator import XCOM_JOB
from tests.support import cluster
from tests.support.airflow import Standalone, airflow_env
from tests.support.reference_campaign import (
    campaign_doc,
    dag_id,
    prepare_data,
    segment_records,
    trained_iterations,
    write_dags,
)
from tests.support.trainer import losses

# The whole story runs in the module's fixture: two Airflow starts (a first one migrates a
# fresh SQLite database: minutes at load 10+), four segment jobs, one stop. Waits are failure
# detectors sized for CI's 2 loaded cores, not targets.
pytestmark = [pytest.mark.cluster, pytest.mark.airflow, pytest.mark.timeout(2400)]

NAME = "prequeue_airflow_down"
DAG_ID = dag_id(NAME)
ROOT = Path("/home/pretrain/pp-test-prequeue-airflow-down")  # the cluster user's
PORT = 18530  # this story's own Airflow (its log servers: +10000, +10001)
SEGMENTS, ITERS = 4, 4
TRAIN_ITERS = SEGMENTS * ITERS
HANG_AT = ITERS  # segment 1 holds after its last iteration (saved) until signalled
HANG_LINE = f"TEST FAULT: hanging after iteration {HANG_AT}"


def _doc() -> dict:
    doc = campaign_doc(NAME, ROOT, str(ROOT / "tokenizer"), "/set-by-the-fixture",
                       segments=SEGMENTS, iters=ITERS, depth=1, retries=1,
                       hang_timeout_min=60)
    # Start-up took over 2 min at load ~20 here: time limits and a start-up estimate that
    # leave each segment its iterations (test_prequeue.py's); the hang watchdog's timeout is
    # far beyond the test: only the test ends segment 1's hold. One retry: Airflow's stale
    # executor event (apache/airflow#72716) can fail a resumed try; a retry re-attaches.
    doc["cluster"]["time_limit"] = "15"
    doc["segments"]["startup_estimate_min"] = 4
    doc["tracking"] = {"enabled": True, "mlflow_conn_id": "mlflow_default", "experiment": NAME}
    return doc


def _keys(run_id: str) -> dict[int, str]:
    return {i: job_key(DAG_ID, run_id, f"segment_{i}", -1, i) for i in range(1, SEGMENTS + 1)}


def _xcom(af: Standalone, run_id: str, task_id: str, key: str):
    """The task's XCom ``key``, None while it has not pushed it."""
    try:
        return af.xcom(DAG_ID, run_id, task_id, key=key)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def _squeue_state(key: str) -> str:
    return subprocess.run(["squeue", "-h", f"--name={key}", "-o", "%T"], capture_output=True,
                          text=True, check=True).stdout.strip()


def _ended(job_id: str, timeout: float, what: str) -> dict:
    def done():
        row = cluster.sacct_job(job_id)
        return row if row["state"] not in ("", "PENDING", "RUNNING", "COMPLETING") else None
    return cluster.wait_for(done, timeout, what, interval=2)


def _sacct_time(job_id: str, field_name: str) -> datetime:
    """A job's sacct Start/End (this machine's local time, as datetime.now())."""
    return datetime.fromisoformat(cluster.sacct_field(job_id, field_name))


def _airflow_pids(home: Path) -> list[int]:
    """Processes of the Airflow whose home is ``home``: every one this module's Airflow
    started carries its AIRFLOW_HOME, whatever process group it moved to."""
    mark = f"AIRFLOW_HOME={home}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:  # gone meanwhile, or a kernel thread
            continue
        if mark in environ.split(b"\0"):
            found.append(int(proc.name))
    return found


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5):  # noqa: S310 - loopback only
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _segment_1_hands_over(af: Standalone, run_id: str) -> tuple[dict, dict] | None:
    """(segment 1's job, the job it pre-queued) once segment 1's task is deferred on its
    running job and segment 2's job waits behind it in Slurm's queue; else None. By id from
    the task's XComs: ``sacct --starttime`` leaves out a dependency-pending job."""
    if af.task_instance(DAG_ID, run_id, "segment_1")["state"] != "deferred":
        return None
    where = _xcom(af, run_id, "segment_1", XCOM_JOB)
    queued = _xcom(af, run_id, "segment_1", prequeue.XCOM_PREQUEUED)
    if not (where and queued):
        return None
    if cluster.sacct_job(where["job_id"])["state"] != "RUNNING" \
            or _squeue_state(queued[0]["key"]) != "PENDING":
        return None
    return where, queued[0]


@dataclass
class Story:
    """What happened, for the tests to check (also written to ROOT/story.json)."""

    af: Standalone
    home: Path
    run_id: str = ""
    keys: dict[int, str] = field(default_factory=dict)
    jobs: dict[int, str] = field(default_factory=dict)  # segment -> its task's job (XCom)
    logs: dict[int, str] = field(default_factory=dict)  # segment -> that job's log
    prequeued_by_1: list = field(default_factory=list)
    down_at: datetime | None = None  # every Airflow process gone
    up_at: datetime | None = None  # Airflow being started again
    stop_s: float = 0.0
    left_after_stop: list[int] = field(default_factory=list)
    port_answered_after_stop: bool = True
    seen_while_down: dict = field(default_factory=dict)
    state: str = ""
    seconds: dict[str, float] = field(default_factory=dict)

    def facts(self) -> dict:
        return {"run_id": self.run_id, "keys": self.keys, "jobs": self.jobs, "logs": self.logs,
                "prequeued_by_1": self.prequeued_by_1, "down_at": str(self.down_at),
                "up_at": str(self.up_at), "stop_s": self.stop_s,
                "left_after_stop": self.left_after_stop,
                "port_answered_after_stop": self.port_answered_after_stop,
                "seen_while_down": self.seen_while_down, "state": self.state,
                "seconds": self.seconds, "home": str(self.home)}


def _run_story(story: Story) -> None:
    af, t0 = story.af, time.monotonic()

    def mark(what: str) -> None:
        story.seconds[what] = round(time.monotonic() - t0, 1)

    af.start(900)
    mark("airflow_up")
    af.wait_dag(DAG_ID, timeout=600)
    story.run_id = af.trigger(DAG_ID)
    story.keys = _keys(story.run_id)
    first, second = cluster.wait_for(lambda: _segment_1_hands_over(af, story.run_id), 1200,
                                     "segment 1 deferred on its running job, segment 2 "
                                     "pre-queued behind it", interval=3)
    story.jobs[1], story.jobs[2] = first["job_id"], second["job_id"]
    story.prequeued_by_1 = _xcom(af, story.run_id, "segment_1", prequeue.XCOM_PREQUEUED)
    mark("segment_1_deferred")

    # -- every Airflow component stopped ---------------------------------------------------
    started = time.monotonic()
    af.stop()
    story.stop_s = round(time.monotonic() - started, 1)
    story.left_after_stop = _airflow_pids(story.home)
    story.port_answered_after_stop = _answers(f"http://127.0.0.1:{PORT}/api/v2/monitor/health")
    story.down_at = datetime.now().replace(microsecond=0)
    mark("airflow_down")
    assert not story.left_after_stop and not story.port_answered_after_stop, story.facts()
    state = cluster.sacct_job(first["job_id"])["state"]
    assert state == "RUNNING", f"segment 1's job is {state} once Airflow is down: {story.facts()}"

    # -- with Airflow down: segment 1 ends, segment 2 runs and ends by itself ----------------
    def holding() -> bool:
        log = cluster.read_local_bytes(first["log_path"]).decode(errors="replace")
        if HANG_LINE in log:
            return True
        row = cluster.sacct_job(first["job_id"])
        assert row["state"] == "RUNNING", f"segment 1's job ended before its hold: {row}, " \
            f"log tail:\n{log[-2000:]}"
        return False
    cluster.wait_for(holding, 900, f"segment 1's job {first['job_id']} to train its "
                     f"{ITERS} iterations", interval=2)
    story.seen_while_down["segment_2_before_signal"] = _squeue_state(second["key"])
    # What Slurm's --signal=TERM@lead does at a segment's end: the trainer saves and exits 0.
    subprocess.run(["scancel", "--full", "--signal=TERM", first["job_id"]], check=True)
    story.seen_while_down["segment_1"] = _ended(first["job_id"], 300, "segment 1's job to end")
    story.seen_while_down["segment_2"] = _ended(second["job_id"], 1200,
                                                "segment 2's pre-queued job to end by itself")
    mark("segment_2_ended")
    story.seen_while_down["segment_3_sacct"] = cluster.sacct_by_name(story.keys[3])
    story.seen_while_down["segment_3_squeue"] = _squeue_state(story.keys[3])
    story.seen_while_down["airflow_pids"] = _airflow_pids(story.home)

    # -- Airflow again: the DAG catches up --------------------------------------------------
    story.up_at = datetime.now().replace(microsecond=0)
    af.start(900)
    mark("airflow_up_again")
    story.state = af.wait_run(DAG_ID, story.run_id, timeout=1800)
    mark("run_ended")
    for segment in story.keys:
        where = _xcom(af, story.run_id, f"segment_{segment}", XCOM_JOB) or {}
        story.jobs[segment], story.logs[segment] = where.get("job_id"), where.get("log_path")


@pytest.fixture(scope="module")
def story(servers, local_cluster, tmp_path_factory):
    from jobscripts.job_files import REFERENCE_FAULTS
    from operators.campaign.render.layout import Layout
    from operators.campaign.schema.load import campaign_from_dict

    _, mlflow = servers
    shutil.rmtree(ROOT, ignore_errors=True)
    ROOT.mkdir(parents=True)
    tokenizer, prefix = prepare_data(ROOT)
    doc = _doc()
    doc["data"] = {**doc["data"], "prefixes": [prefix], "tokenizer": {"path": tokenizer}}
    # The hold: the reference trainer's test-only fault file in the campaign's checkpoint
    # directory; it fires once (the entry is removed before the hold), so segment 2 trains on.
    checkpoints = Path(Layout.for_campaign(campaign_from_dict(doc)).checkpoints)
    checkpoints.mkdir(parents=True)
    (checkpoints / REFERENCE_FAULTS).write_text(json.dumps(
        {"hang": {"at_iteration": HANG_AT, "signals": True}}))
    subprocess.run(["chown", "-R", "pretrain:pretrain", str(ROOT)], check=True)

    home = tmp_path_factory.mktemp("airflow-prequeue-down")
    dags = write_dags(home / "dags", [doc])
    # A worker's call to the execution API timed out (5 s default) at load ~20 here.
    env = airflow_env(home, dags, port=PORT, extra={
        "AIRFLOW_CONN_MLFLOW_DEFAULT": mlflow.airflow_conn_json(),
        "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "30"})
    # MLflow and S3 credentials reach Airflow only through the connection.
    env = {k: v for k, v in env.items() if not k.startswith(("AWS_", "MLFLOW_"))}
    story = Story(Standalone(env, home / "standalone.log"), home)
    try:
        _run_story(story)
        yield story
    finally:
        story.af.stop()
        (ROOT / "story.json").write_text(json.dumps(story.facts(), indent=1, default=str))


@pytest.fixture(scope="module")
def tracking(servers):
    from tests.support.mlflow_server import experiment_runs

    _, mlflow = servers
    client, runs = experiment_runs(mlflow.connection(), NAME)
    return client, runs


def _log(story: Story, segment: int) -> str:
    return Path(story.logs[segment]).read_text(errors="replace")


# -- the tests -------------------------------------------------------------------------------
def test_the_cluster_carried_segment_2_while_airflow_was_down(story) -> None:
    """Segment 1's job ended, and segment 2's started and ended, while no process of that
    Airflow was alive; nothing queued segment 3 meanwhile (depth 1)."""
    down = story.seen_while_down
    assert down["segment_1"]["state"] == "COMPLETED", down
    assert down["segment_2"]["state"] == "COMPLETED", down
    assert down["segment_2_before_signal"] == "PENDING", down
    assert down["airflow_pids"] == [], down
    one, two = down["segment_1"]["id"], down["segment_2"]["id"]
    assert story.down_at <= _sacct_time(one, "End") <= _sacct_time(two, "Start"), story.facts()
    assert _sacct_time(two, "End") <= story.up_at, story.facts()
    assert down["segment_3_sacct"] == [] and down["segment_3_squeue"] == "", down


def test_the_dag_caught_up_each_task_on_its_own_job(story) -> None:
    """Every segment task succeeded on the one job sacct has under its key: segment 2's and
    segment 4's re-attached to the job queued for them, none submitted a second one."""
    af, run_id = story.af, story.run_id
    assert story.state == "success", Path(af.log_path).read_text()[-5000:]
    assert story.prequeued_by_1 == [{"segment": 2, "key": story.keys[2],
                                     "job_id": story.jobs[2], "after_job": story.jobs[1],
                                     "by_segment": 1}]
    for segment, key in story.keys.items():
        task = f"segment_{segment}"
        assert af.task_instance(DAG_ID, run_id, task)["state"] == "success", task
        rows = cluster.sacct_by_name(key)
        assert [r["id"] for r in rows] == [story.jobs[segment]], (task, rows)  # one per key
        assert rows[0]["state"] == "COMPLETED", (task, rows)
        assert af.xcom(DAG_ID, run_id, task, key=XCOM_JOB)["job_id"] == story.jobs[segment]
    queued_by_3 = af.xcom(DAG_ID, run_id, "segment_3", key=prequeue.XCOM_PREQUEUED)
    assert [(p["segment"], p["job_id"], p["after_job"]) for p in queued_by_3] == [
        (4, story.jobs[4], story.jobs[3])]  # the chain pre-queues again after the catch-up
    for segment in (2, 4):  # re-attached by key, every try
        task = f"segment_{segment}"
        # str(): the REST API's deserialize turns the pushed "341" into a number
        assert str(af.xcom(DAG_ID, run_id, task, key=XCOM_ATTACHED)) == story.jobs[segment]
        tries = af.task_instance(DAG_ID, run_id, task)["try_number"]
        logs = [af.task_log(DAG_ID, run_id, task, try_number=t) for t in range(1, tries + 1)]
        assert all("submitted Slurm job" not in log for log in logs), task
        assert f"re-attaching to Slurm job {story.jobs[segment]}" in logs[-1], task
        assert f"re-attached to Slurm job {story.jobs[segment]}" in logs[-1], task


def test_every_iteration_trained_exactly_once(story) -> None:
    """The job logs together train 1..train_iters once each, and the segment records (one
    per segment task) chain without a gap or an overlap; segment 1 stopped at its hold."""
    trained = [i for segment in sorted(story.jobs)
               for i in trained_iterations(_log(story, segment))]
    assert sorted(trained) == list(range(1, TRAIN_ITERS + 1)), trained
    records = segment_records(ROOT, NAME)
    assert sorted(r["slurm"]["job_id"] for r in records) == sorted(story.jobs.values())
    spans = [(r["task_id"], r["start_iteration"], r["end_iteration"]) for r in
             sorted(records, key=lambda r: r["start_iteration"])]
    assert [s[0] for s in spans] == [f"segment_{i}" for i in range(1, SEGMENTS + 1)], spans
    assert spans[0][1:] == (0, HANG_AT) and spans[-1][2] == TRAIN_ITERS, spans
    # no gap, no overlap
    assert all(a[2] == b[1] for a, b in zip(spans, spans[1:], strict=False)), spans
    by_task = {r["task_id"]: r for r in records}
    assert by_task["segment_1"]["stop_reason"] == vocabulary.SIGNAL, by_task["segment_1"]
    assert all(r.get("iterations_redone", 0) == 0 for r in records), records


def test_mlflow_has_the_whole_loss_curve(story, tracking) -> None:
    """The campaign's MLflow run has lm_loss at every step once, with the job logs' values;
    each segment's child run has its own segment's steps."""
    client, runs = tracking
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1, [r.info.run_id for r in runs]
    logged: dict[int, float] = {}
    for segment in sorted(story.jobs):
        found = losses(_log(story, segment))
        assert not set(found) & set(logged), (segment, sorted(found))
        logged.update(found)
    history = client.get_metric_history(parents[0].info.run_id, vocabulary.LM_LOSS)
    steps = sorted(m.step for m in history)
    assert steps == list(range(1, TRAIN_ITERS + 1)), steps  # each step once
    assert {m.step: m.value for m in history} == pytest.approx(logged, rel=1e-6)
    train = [r for r in runs if r.data.tags.get("pp.stage") == "train"]
    assert len(train) == SEGMENTS, [r.data.tags for r in runs]
    for run in train:
        job = run.data.tags.get("slurm.job_id")
        segment = next(s for s, j in story.jobs.items() if j == job)
        got = sorted(m.step for m in client.get_metric_history(run.info.run_id,
                                                                 vocabulary.LM_LOSS))
        assert got == sorted(losses(_log(story, segment))), (segment, got)
