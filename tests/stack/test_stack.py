"""The tracked campaign on the production stack (docker/local_stack.sh): PostgreSQL, Redis,
CeleryExecutor with two workers, two triggerers, MLflow on PostgreSQL with its artifacts on
SeaweedFS's S3 gateway, the local Slurm cluster.

One DAG run of tests/stack/campaigns/stack_tracked.yaml (data stage, two segments, export,
evaluation, registration) serves every check. While segment 1 is deferred on its running job,
the triggerer that watches it (the one holding the cluster's SSH connection) is SIGKILLed with
its process group; the other triggerer must take the trigger over, follow the job to its end
and resume the task, with no second job for the segment's key. The killed one is started again
(``local_stack.sh up``) only after the run has ended.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support import cluster
from tests.support.stack import TRIGGERERS, WORKERS, Stack, StackAirflow

# ~6 min on 2 cores with the stack already up; a cold `up` adds ~2 min.
pytestmark = [pytest.mark.cluster, pytest.mark.airflow, pytest.mark.servers,
              pytest.mark.timeout(1800)]

NAME = "stack_tracked"
DAG_ID = f"pretrain__{NAME}"
DAGS = Path(__file__).parent / "dags"
CAMPAIGN = Path("/home/pretrain/pp-test-campaigns") / NAME
TRAIN_ITERS = 12
SEGMENTS = 2
ITERATION = re.compile(r"iteration\s+(\d+)/")


@dataclass
class Story:
    stack: Stack
    af: StackAirflow
    run_id: str = ""
    state: str = ""
    seconds: float = 0.0
    killed: str = ""  # the triggerer SIGKILLed
    killed_job: dict = field(default_factory=dict)  # the job its trigger watched
    ssh_before: dict[str, int] = field(default_factory=dict)  # per triggerer, at the kill
    ssh_after: dict[str, int] = field(default_factory=dict)  # the survivor's, segment 2


def _iterations(log_path: str) -> list[int]:
    path = Path(log_path)
    text = path.read_text(errors="replace") if path.exists() else ""
    return [int(i) for i in ITERATION.findall(text)]


def _running_segment(af: StackAirflow, run_id: str, task_id: str) -> dict:
    """The task's Slurm job once it has trained an iteration."""
    def ready():
        try:
            job = af.xcom(DAG_ID, run_id, task_id, key="slurm_job")
        except urllib.error.HTTPError:
            return None
        return job if _iterations(job["log_path"]) else None
    return cluster.wait_for(ready, 900, f"{task_id} to train", 0.5)


def _ssh(stack: Stack, port: int) -> dict[str, int]:
    return {t: stack.connections_to(port, t) for t in TRIGGERERS}


@pytest.fixture(scope="module")
def stack(local_cluster) -> Stack:
    return Stack.up(DAGS)


@pytest.fixture(scope="module")
def story(stack, local_cluster) -> Story:
    af = stack.airflow
    story = Story(stack, af)
    ssh_port = int(local_cluster["port"])
    cluster.remote(f"rm -rf {CAMPAIGN}")
    started = time.monotonic()
    try:
        story.run_id = af.trigger(DAG_ID, {"skip_data_stage": False})
        story.killed_job = _running_segment(af, story.run_id, "train.segment_1")
        af.wait_task_state(DAG_ID, story.run_id, "train.segment_1", {"deferred"})
        ti = cluster.wait_for(lambda: (t := af.task_instance(DAG_ID, story.run_id,
                                                             "train.segment_1"))
                              .get("triggerer_job") and t, 60, "segment 1's triggerer", 0.5)
        story.killed = stack.triggerer_of(ti["triggerer_job"])
        # Its poller holds the cluster's SSH connection while the trigger runs.
        story.ssh_before = _ssh(stack, ssh_port)
        stack.kill(story.killed)
        survivor = next(t for t in TRIGGERERS if t != story.killed)
        af.wait_task_state(DAG_ID, story.run_id, "train.segment_2", {"deferred"}, timeout=900)
        story.ssh_after = {survivor: stack.connections_to(ssh_port, survivor)}
        story.state = af.wait_run(DAG_ID, story.run_id, timeout=1200)
        story.seconds = time.monotonic() - started
    finally:
        Stack.up(DAGS)  # the killed triggerer back: the stack whole for the next user
    return story


@pytest.fixture(scope="module")
def tracking(story):
    from operators.tracking.client import make_client
    from operators.tracking.settings import tracking_settings

    client = make_client(tracking_settings(story.stack.mlflow_connection()))
    experiment = client.get_experiment_by_name(NAME)
    assert experiment is not None, "no MLflow experiment for the campaign"
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    # The stack's MLflow keeps earlier test runs' campaigns: this one's parent is the run the
    # campaign folder names.
    parent_id = (CAMPAIGN / "mlflow_run_id").read_text().strip()
    parents = [r for r in runs if r.info.run_id == parent_id]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent_id]
    return client, parents, children


def _segment_jobs(story: Story) -> list[dict]:
    return [story.af.xcom(DAG_ID, story.run_id, f"train.segment_{i}", key="slurm_job")
            for i in range(1, SEGMENTS + 1)]


def test_campaign_succeeds_on_the_stack(story) -> None:
    print(f"campaign on the stack: {story.seconds:.0f} s")
    assert story.state == "success", (story.stack.log_dir / "scheduler.log").read_text()[-5000:]


def test_tasks_ran_on_celery_workers(story) -> None:
    body = story.af.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{story.run_id}/"
                            "taskInstances")
    hosts = {ti["task_id"]: ti["hostname"] for ti in body["task_instances"]
             if ti["state"] == "success"}
    assert hosts and all(hosts.values()), hosts
    logs = "".join((story.stack.log_dir / f"{w}.log").read_text(errors="replace")
                   for w in ("worker-1", "worker-2"))
    assert "execute_workload" in logs or "Received task" in logs


def test_killed_triggerers_trigger_taken_over_by_the_other(story) -> None:
    ti = story.af.task_instance(DAG_ID, story.run_id, "train.segment_1")
    # Resumed without a retry: the surviving triggerer fired the trigger the dead one held.
    assert ti["try_number"] == 1 and ti["state"] == "success"
    job_id = story.killed_job["job_id"]
    assert cluster.sacct_job(job_id)["state"] == "COMPLETED"
    name = cluster.sacct_job(job_id)["name"]
    assert [r["id"] for r in cluster.sacct_by_name(name)] == [job_id]  # one job for the key


def test_one_job_per_segment_key_and_every_iteration_once(story) -> None:
    jobs = _segment_jobs(story)
    trained = [i for job in jobs for i in _iterations(job["log_path"])]
    assert trained == list(range(1, TRAIN_ITERS + 1))
    for job in jobs:
        name = cluster.sacct_job(job["job_id"])["name"]
        assert {r["id"] for r in cluster.sacct_by_name(name)} == {job["job_id"]}


def test_one_ssh_connection_per_triggerer(story) -> None:
    print(f"SSH connections per triggerer: at the kill {story.ssh_before}, "
          f"survivor during segment 2 {story.ssh_after}")
    assert story.ssh_before[story.killed] == 1
    assert all(n <= 1 for n in story.ssh_before.values())
    assert list(story.ssh_after.values()) == [1]


def test_mlflow_run_complete(story, tracking) -> None:
    client, parents, children = tracking
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert parent.data.params["training.train_iters"] == str(TRAIN_ITERS)
    assert len([c for c in children if c.data.tags.get("pp.stage") == "train"]) == SEGMENTS
    steps = sorted(m.step for m in client.get_metric_history(parent.info.run_id, "lm_loss"))
    assert steps == list(range(1, TRAIN_ITERS + 1))
    version = client.get_model_version_by_alias(f"pretrain-{NAME}", "candidate")
    assert version.tags["checkpoint_iteration"] == str(TRAIN_ITERS)


def test_artifacts_in_seaweedfs(story, tracking) -> None:
    _, parents, children = tracking
    s3 = story.stack.s3_client()
    keys = []
    for run in [*parents, *children]:
        bucket, prefix = run.info.artifact_uri[len("s3://"):].split("/", 1)
        assert bucket == story.stack.env["PP_STACK_BUCKET"]
        listing = s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
        keys += [item["Key"] for item in listing.get("Contents", [])]
    names = {k.rsplit("/", 1)[-1] for k in keys}
    assert {"job.sbatch", "run.json", "manifest.json"} <= names
    assert any(re.fullmatch(r"slurm-\d+\.out", n) for n in names)


def test_tracking_key_limited_to_its_bucket(story) -> None:
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError) as refused:
        story.stack.s3_client().create_bucket(Bucket="pp-not-the-artifact-bucket")
    assert refused.value.response["Error"]["Code"] == "AccessDenied"


# -- the tracking spool where every worker sees it -------------------------------------------
WORKER_SPOOLS = """
import json, os, sys
from operators.tracking.client import make_client
from operators.tracking.settings import tracking_settings
from operators.tracking.tracker import Tracker
from types import SimpleNamespace
conn = SimpleNamespace(**json.loads(sys.argv[1]))
tracker = Tracker(make_client(tracking_settings(conn)), sys.argv[2])
if sys.argv[3] == "log":
    tracker.log_values(sys.argv[4], {"spooled_by_a": 1.0}, step=1)
print(tracker.flush() if sys.argv[3] == "flush" else tracker.spool.backlog())
"""


def _spool_of(stack: Stack, worker: str) -> str:
    """The PP_TRACKING_SPOOL the worker's processes run with (read from /proc: celery's
    setproctitle overwrites the main process's, so every process of its group is asked)."""
    found = set()
    for pid in stack.group_pids(worker):
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        env = dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)
        found.add(env.get("PP_TRACKING_SPOOL"))
    found.discard(None)
    assert len(found) == 1, f"{worker}'s processes name spools {found}"
    return found.pop()


def _as_worker(stack: Stack, worker: str, conn, *args: str) -> str:
    """WORKER_SPOOLS in a process with ``worker``'s spool setting, as its task would run."""
    env = {**os.environ, "PP_TRACKING_SPOOL": _spool_of(stack, worker)}
    conn_json = json.dumps({k: getattr(conn, k) for k in
                            ("conn_id", "conn_type", "host", "port", "schema", "login",
                             "password", "extra")})
    spool_dir = str(Path(env["PP_TRACKING_SPOOL"]) / "stack_spool_test")
    return subprocess.run([sys.executable, "-c", WORKER_SPOOLS, conn_json, spool_dir, *args],
                          env=env, capture_output=True, text=True, check=True).stdout.strip()


def test_one_spool_for_every_worker(stack) -> None:
    spools = {w: _spool_of(stack, w) for w in WORKERS}
    assert len(set(spools.values())) == 1, spools
    assert Path(spools["worker-1"]).is_dir()


def test_what_worker_a_spooled_worker_b_flushes(stack) -> None:
    """MLflow unreachable from worker A (a closed port) as its task ends: the records wait in
    the spool; a later task on worker B, with MLflow up, sends them."""
    from operators.tracking.client import make_client
    from operators.tracking.settings import tracking_settings
    from tests.support.mlflow_server import free_port

    live = stack.mlflow_connection(experiment="stack_spool_test")
    client = make_client(tracking_settings(live))
    experiment = (client.get_experiment_by_name("stack_spool_test")
                  or client.get_experiment(client.create_experiment("stack_spool_test")))
    run_id = client.create_run(experiment.experiment_id).info.run_id
    down = stack.mlflow_connection()
    down.port = free_port()  # nothing listens there
    assert _as_worker(stack, "worker-1", down, "log", run_id) == "1"  # one op spooled
    assert client.get_metric_history(run_id, "spooled_by_a") == []
    assert _as_worker(stack, "worker-2", live, "flush") == "1"
    assert [m.value for m in client.get_metric_history(run_id, "spooled_by_a")] == [1.0]
