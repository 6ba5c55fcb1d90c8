"""A tracked campaign under a real ``airflow standalone``, with faults injected as it runs.

One campaign (tests/campaigns/tracked/ci_tracked.yaml: data stage, three segments of ten
iterations, export, evaluation, registration) goes through three DAG runs, each triggered as
users do, while the cluster and the services misbehave:

run A  REST trigger with params (segments_per_run=2, skip_data_stage=false):
       - segment 1: the scheduler and the triggerer are SIGKILLed while the task is deferred
         on a running job, then started again;
       - segment 2: MLflow is unreachable from the moment it starts until it has ended.
run B  REST trigger with the defaults, after the checkpoint tracker was made to name a
       checkpoint that does not exist: the third segment falls back to the last complete one,
       and is requeued by ``scontrol requeue`` mid-run; then export, evaluation, registration.
run C  the campaign, now done, gets a schedule: the scheduler's run must do nothing.

Then MLflow, S3 (moto's server), Slurm accounting, the job logs, Airflow's task logs and
XComs are checked: nothing lost, nothing run twice, no secret anywhere; the gates passed, every
tokenized document decodes back to its text, the cut and faulted run trained exactly what an
uncut run trains, and the exported model was verified and evaluated on the cluster.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from jobscripts import vocabulary
from operators.tracking import logparse
from tests.support import cluster
from tests.support.airflow import Standalone, airflow_env
from tests.support.mlflow_server import S3_SECRET, TcpProxy
from tests.support.trainer import losses, run_trainer

# The story runs three DAG runs end to end in the module's fixture: ~12 min on 2 idle cores,
# 23 min at load 4-12 (1378 s); its waits and time-out are sized for CI's load (about 3x).
pytestmark = [pytest.mark.cluster, pytest.mark.airflow, pytest.mark.timeout(4200)]

NAME = "ci_tracked"
DAG_ID = f"pretrain__{NAME}"
YAML = Path(__file__).parents[1] / "campaigns" / "tracked" / f"{NAME}.yaml"
CAMPAIGN = Path("/home/pretrain/pp-test-campaigns") / NAME
RUNS = Path("/home/pretrain/pp-runs")
TRAIN_ITERS = 30
ITERATION = re.compile(r"iteration\s+(\d+)/")
DAG_FILE = '''"""Airflow DAG of the fault-injection campaign (test_campaign_faults.py)."""
from pathlib import Path

from operators.campaign.dag.dag_factory import build_all

build_all(Path(__file__).parent / "campaigns", globals())
'''


@dataclass
class Story:
    """What happened, for the tests to check."""

    af: Standalone
    runs: dict[str, str] = field(default_factory=dict)  # "A"/"B"/"C" -> DAG run id
    states: dict[str, str] = field(default_factory=dict)
    killed_during: dict = field(default_factory=dict)  # the job the scheduler lost sight of
    outage: dict = field(default_factory=dict)
    requeued: dict = field(default_factory=dict)


def _iterations(log_path: str) -> list[int]:
    path = Path(log_path)
    text = path.read_text(errors="replace") if path.exists() else ""
    return [int(i) for i in ITERATION.findall(text)]


def _running_segment(af: Standalone, run_id: str, task_id: str, past: int) -> dict:
    """The task's Slurm job once it has trained an iteration past ``past``.

    Two waits, so that a time-out says which part was slow: the task reaching its job (after
    the data stage, for a first segment: ~10 jobs, slow at CI's load) and the job training."""
    def submitted():
        try:
            return af.xcom(DAG_ID, run_id, task_id, key="slurm_job")
        except urllib.error.HTTPError:
            pass
        # Not yet: a run that already failed (a data-stage task, say) never will.
        if af.run_state(DAG_ID, run_id) == "failed":
            raise AssertionError(f"{task_id} never submitted a job:\n"
                                 f"{af.run_report(DAG_ID, run_id)}")
        return None
    try:
        job = cluster.wait_for(submitted, 1800, f"{task_id} of {run_id} to submit its job")
    except TimeoutError as timed_out:
        raise TimeoutError(f"{timed_out}\n{af.run_report(DAG_ID, run_id)}") from None

    def trained():
        its = _iterations(job["log_path"])
        return job if its and max(its) > past else None
    try:
        return cluster.wait_for(trained, 900, f"{task_id} of {run_id} to train past {past}", 0.5)
    except TimeoutError as timed_out:
        state = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "State,Reason,Start,NodeList",
                                "-j", str(job["job_id"])], capture_output=True, text=True).stdout
        log = Path(job["log_path"])
        tail = log.read_text(errors="replace")[-1500:] if log.exists() else "(no log yet)"
        raise TimeoutError(f"{timed_out}: job {job['job_id']} {state.strip()!r}; "
                           f"log tail:\n{tail}") from None


def _set_schedule(dags: Path, schedule: str) -> None:
    path = dags / "campaigns" / YAML.name
    path.write_text(path.read_text().replace("schedule: null", f'schedule: "{schedule}"'))
    (dags / "campaigns_tracked.py").touch()  # re-parse now, not at the next interval


def _scheduled_run(af: Standalone) -> str | None:
    body = af.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns?run_type=scheduled")
    runs = body.get("dag_runs", [])
    return runs[0]["dag_run_id"] if runs else None


def _run_story(af: Standalone, proxy: TcpProxy, dags: Path) -> Story:
    story = Story(af)
    # -- run A -------------------------------------------------------------------------
    run_a = story.runs["A"] = af.trigger(DAG_ID, {"segments_per_run": 2,
                                                  "skip_data_stage": False})
    job = _running_segment(af, run_a, "train.segment_1", 0)
    af.wait_task_state(DAG_ID, run_a, "train.segment_1", {"deferred"})
    af.restart_components("scheduler", "triggerer")
    story.killed_during = job

    af.wait_task_state(DAG_ID, run_a, "train.segment_1", {"success"}, timeout=1500)
    proxy.stop()  # MLflow unreachable for the whole of segment 2, its tracking included
    try:
        af.wait_task_state(DAG_ID, run_a, "train.segment_2", {"success", "failed"}, timeout=1500)
    finally:
        proxy.start()
    story.outage = af.xcom(DAG_ID, run_a, "train.segment_2", key="slurm_job")
    story.states["A"] = af.wait_run(DAG_ID, run_a, timeout=1200)

    # -- between the runs: the tracker names a checkpoint that does not exist -------------
    cluster.remote(f"printf 25 > {CAMPAIGN}/checkpoints/latest_checkpointed_iteration.txt")

    # -- run B -------------------------------------------------------------------------
    run_b = story.runs["B"] = af.trigger(DAG_ID)
    job = _running_segment(af, run_b, "train.segment_1", 20)
    subprocess.run(["scontrol", "requeue", job["job_id"]], check=True)
    story.requeued = job
    story.states["B"] = af.wait_run(DAG_ID, run_b, timeout=2400)

    # -- run C: the scheduler's own run of the finished campaign ------------------------
    _set_schedule(dags, "@monthly")
    run_c = story.runs["C"] = cluster.wait_for(lambda: _scheduled_run(af), 180,
                                               "a scheduled run")
    story.states["C"] = af.wait_run(DAG_ID, run_c, timeout=900)
    return story


@pytest.fixture(scope="module")
def story(servers, local_cluster, tmp_path_factory):
    _, mlflow = servers
    proxy = TcpProxy(mlflow.port).start()
    home = tmp_path_factory.mktemp("airflow-faults")
    dags = home / "dags"
    (dags / "campaigns").mkdir(parents=True)
    shutil.copy(YAML, dags / "campaigns" / YAML.name)
    (dags / "campaigns_tracked.py").write_text(DAG_FILE)
    env = airflow_env(home, dags, port=18085, extra={
        "AIRFLOW_CONN_MLFLOW_DEFAULT": mlflow.airflow_conn_json(port=proxy.port)})
    # MLflow and S3 credentials reach Airflow only through the connection.
    env = {k: v for k, v in env.items() if not k.startswith(("AWS_", "MLFLOW_"))}
    cluster.remote(f"rm -rf {CAMPAIGN}")
    af = Standalone(env, home / "standalone.log").start()
    try:
        yield _run_story(af, proxy, dags)
    finally:
        af.stop()
        proxy.stop()


# -- helpers over what the story left behind ---------------------------------------------
def _task_instances(af: Standalone, run_id: str) -> list[dict]:
    body = af.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances")
    return body["task_instances"]


def _segment_jobs(story: Story) -> list[dict]:
    jobs = []
    for run_id in story.runs.values():
        for ti in _task_instances(story.af, run_id):
            # train.segment_N only: train.preflight runs in the same group and submits a job too
            if ti["task_id"].startswith("train.segment_") and ti["state"] == "success":
                jobs.append(story.af.xcom(DAG_ID, run_id, ti["task_id"], key="slurm_job"))
    return sorted(jobs, key=lambda job: int(job["job_id"]))


@pytest.fixture(scope="module")
def tracking(servers):
    from tests.support.mlflow_server import experiment_runs

    _, mlflow = servers
    client, runs = experiment_runs(mlflow.connection(), NAME)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return client, parents, children


# -- the tests ------------------------------------------------------------------------------
def test_every_run_succeeds(story) -> None:
    assert story.states == {"A": "success", "B": "success", "C": "success"}, \
        Path(story.af.log_path).read_text()[-5000:]


def test_killed_scheduler_and_triggerer_reattach_to_the_same_job(story) -> None:
    job_id = story.killed_during["job_id"]
    ti = story.af.task_instance(DAG_ID, story.runs["A"], "train.segment_1")
    assert ti["try_number"] == 1 and ti["state"] == "success"
    name = cluster.sacct_job(job_id)["name"]
    assert [r["id"] for r in cluster.sacct_by_name(name)] == [job_id]  # one job for the key
    assert cluster.sacct_job(job_id)["state"] == "COMPLETED"


def test_requeued_segment_continues_under_the_same_job(story) -> None:
    job_id = story.requeued["job_id"]
    name = cluster.sacct_job(job_id)["name"]
    rows = cluster.sacct_by_name(name)
    assert {r["id"] for r in rows} == {job_id}
    assert [r["state"] for r in rows] == ["REQUEUED", "COMPLETED"]
    log = Path(story.requeued["log_path"]).read_text()
    assert f"job {job_id} restart 0" in log and f"job {job_id} restart 1" in log  # appended
    its = _iterations(story.requeued["log_path"])
    assert its == list(range(21, TRAIN_ITERS + 1))  # resumed where the requeue cut it


def test_missing_checkpoint_falls_back_and_says_so(story, tracking) -> None:
    log = Path(story.requeued["log_path"]).read_text()
    fallbacks = [r for r in logparse.parse_lines(log.splitlines())
                 if r.kind == vocabulary.CHECKPOINT_FALLBACK]
    assert fallbacks and "25" in fallbacks[0].detail["reason"], log[:3000]
    _, _, children = tracking
    run = [c for c in children if c.data.tags.get("slurm.job_id") == story.requeued["job_id"]]
    assert len(run) == 1 and "25" in run[0].data.tags["checkpoint_fallback"]


def _segment_logs(story: Story) -> str:
    return "\n".join(Path(job["log_path"]).read_text() for job in _segment_jobs(story))


def test_nothing_trained_twice_and_nothing_lost(story) -> None:
    jobs = _segment_jobs(story)
    assert len(jobs) == 3
    trained = [i for job in jobs for i in _iterations(job["log_path"])]
    assert trained == list(range(1, TRAIN_ITERS + 1))
    train = losses(_segment_logs(story))  # asserts that no iteration appears twice
    first, last = sum(train[i] for i in (1, 2, 3)) / 3, sum(train[i] for i in (28, 29, 30)) / 3
    assert last < first - 0.5  # nats/token; about 0.9 in the runs seen here
    for job in jobs:  # one Slurm job per segment key: nothing submitted twice
        name = cluster.sacct_job(job["job_id"])["name"]
        assert {r["id"] for r in cluster.sacct_by_name(name)} == {job["job_id"]}
    history = [json.loads(line) for line in (CAMPAIGN / "segments.jsonl").read_text()
               .splitlines()]
    assert [h["end_iteration"] for h in history] == [10, 20, 30]


def test_split_run_matches_uncut_run(story, tmp_path) -> None:
    """Cut at 10 and 20, requeued at 22 and resumed through a checkpoint fallback, the
    campaign trained exactly what one uncut run of the same config trains."""
    first = _segment_jobs(story)[0]
    config = json.loads((Path(first["run_dir"]) / "run.json").read_text())
    config.update(save=str(tmp_path / "ckpt"), data_cache_path=str(tmp_path / "cache"),
                  segment_result=str(tmp_path / "segment.json"), exit_interval=None,
                  exit_duration_in_mins=None)
    uncut = losses(run_trainer(tmp_path, config).log)
    split = losses(_segment_logs(story))
    assert sorted(uncut) == sorted(split) == list(range(1, TRAIN_ITERS + 1))
    for iteration, loss in split.items():
        assert math.isclose(loss, uncut[iteration], rel_tol=1e-6), iteration


def _newest_run_dir(task_id: str) -> Path:
    """This campaign's latest job directory for ``task_id`` (other DAGs share task ids)."""
    mine = [p for p in RUNS.glob(f"pp-{task_id}-*") if str(CAMPAIGN) in
            (p / "job.sbatch").read_text()]
    return max(mine, key=lambda p: p.stat().st_mtime)


def test_gates_passed_and_manifest_pinned(story) -> None:
    data = CAMPAIGN / "data"
    manifest = json.loads((data / "manifest.json").read_text())
    assert json.loads((CAMPAIGN / "pinned_manifest.json").read_text()) == manifest
    assert manifest["total"]["documents"] > 100 and manifest["total"]["tokens"] > 100_000
    for stage in ("raw_gate", "token_gate"):
        result = json.loads((_newest_run_dir(f"data.{stage}") / "result.json").read_text())
        assert result["ok"] is True, stage
    assert any((data / "raw_gate").rglob("*.html"))  # GX Data Docs


def test_every_document_decodes_back_to_its_text(story) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import Tokenizer

    data = CAMPAIGN / "data"
    tokenizer = Tokenizer.from_file(str(data / "tokenizer" / "tokenizer.json"))
    texts = [json.loads(line)["text"] for shard in sorted((data / "ingest" / "jsonl").rglob(
        "*.jsonl*")) for line in _lines(shard)]
    dataset = IndexedDataset(str(data / "corpus_text_document"))
    assert len(dataset) == len(texts)
    eod = json.loads((data / "manifest.json").read_text())["settings"]["eod_id"]
    for i, text in enumerate(texts):
        ids = dataset[i].tolist()
        assert ids[-1] == eod, i
        assert tokenizer.decode(ids[:-1], skip_special_tokens=False) == text, i


def _lines(path: Path) -> list[str]:
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [line for line in handle if line.strip()]


def test_export_and_evaluation_ran_on_the_cluster(story) -> None:
    export = CAMPAIGN / "export" / "hf"
    assert (export / "config.json").exists() and (export / "tokenizer.json").exists()
    result = json.loads((_newest_run_dir("export") / "result.json").read_text())
    assert result["ok"] and result["iteration"] == TRAIN_ITERS
    assert result["verification"]["max_abs_logit_diff"] <= result["verification"]["atol"]
    evaluation = json.loads((_newest_run_dir("evaluate") / "result.json").read_text())
    assert evaluation["ok"] and math.isfinite(evaluation["perplexity"])
    # Better than a uniform guess over the 1,024-token vocabulary after 30 iterations.
    assert evaluation["perplexity"] < 1024 and evaluation["bits_per_byte"] > 0
    assert {s["temperature"] for s in evaluation["samples"]} == {0.0, 0.8}


def test_scheduled_run_of_the_finished_campaign_does_nothing(story) -> None:
    tis = _task_instances(story.af, story.runs["C"])
    ran = {ti["task_id"]: ti["state"] for ti in tis if ti["state"] != "skipped"}
    assert ran == {}, ran  # no job, no export, no registration
    done = json.loads((CAMPAIGN / "completed.json").read_text())
    assert done == {"iteration": TRAIN_ITERS, "run_id": story.runs["B"]}


def test_one_parent_run_continued_by_every_dag_run(story, tracking) -> None:
    client, parents, children = tracking
    assert len(parents) == 1
    parent = parents[0]
    assert (CAMPAIGN / "mlflow_run_id").read_text().strip() == parent.info.run_id
    # Ended by the scheduler's listener, on a thread of its own, once the DAG run ended.
    cluster.wait_for(lambda: client.get_run(parent.info.run_id).info.status == "FINISHED",
                     180, "the listener to end the campaign's MLflow run", 2)
    assert parent.data.params["training.train_iters"] == str(TRAIN_ITERS)
    segments = [c for c in children if c.data.tags.get("pp.stage") == "train"]
    assert len(segments) == 3
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent.info.run_id}


def test_metrics_continuous_across_segments_and_the_outage(story, tracking) -> None:
    client, parents, children = tracking
    history = client.get_metric_history(parents[0].info.run_id, vocabulary.LM_LOSS)
    steps = sorted(m.step for m in history)
    assert steps == list(range(1, TRAIN_ITERS + 1))  # segment 2's arrived after the outage
    tokens = client.get_metric_history(parents[0].info.run_id, "tokens_consumed")
    assert max(m.value for m in tokens) == TRAIN_ITERS * 8 * 256
    outage_job = story.outage["job_id"]
    during = [c for c in children if c.data.tags.get("pp.stage") == "train"
              and c.data.tags.get("slurm.job_id") == outage_job]
    assert len(during) == 1, "segment 2's child run never reached MLflow"


def test_artifacts_in_s3_and_no_checkpoint_uploaded(story, tracking, s3_server) -> None:
    client, parents, children = tracking
    keys = []
    for run in [*parents, *children]:
        bucket, prefix = run.info.artifact_uri[len("s3://"):].split("/", 1)
        listing = s3_server.client().list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
        keys += [item["Key"] for item in listing.get("Contents", [])]
    names = {k.rsplit("/", 1)[-1] for k in keys}
    assert {"job.sbatch", "run.json", "manifest.json"} <= names
    assert any(re.fullmatch(r"slurm-\d+\.out", n) for n in names)  # job logs
    assert not [k for k in keys if "iter_" in k or k.endswith((".pt", ".distcp"))]


def test_goodput_on_the_campaign_run(story, tracking) -> None:
    """register logs the campaign's goodput (operators/tracking/goodput.py) from its segment
    records and job logs: three segment jobs, one of them run twice (the requeue)."""
    from operators.tracking import goodput, names

    client, parents, _ = tracking
    run_id = parents[0].info.run_id
    metrics = client.get_run(run_id).data.metrics
    value = {f: metrics.get(names.goodput_metric(f))
             for f in goodput.Goodput.__dataclass_fields__}
    assert value["segments"] == 3 and value["runs"] == 4
    assert value["iterations_trained"] == TRAIN_ITERS and value["iterations_redone"] == 0
    jobs = _segment_jobs(story)
    last_runs = sum(int(cluster.sacct_field(job["job_id"], "ElapsedRaw")) for job in jobs)
    assert value["allocated_node_s"] >= last_runs  # + the requeued job's first run
    assert 0 < value["train_s"] < value["allocated_node_s"]
    # the campaign's node time: what the jobs held plus the gaps between them (and the
    # requeued job's wait for its restart)
    assert value["span_node_s"] >= value["allocated_node_s"] + value["gap_s"]
    assert value["goodput"] == pytest.approx(value["train_s"] / value["span_node_s"])
    assert value["goodput_in_jobs"] == pytest.approx(value["train_s"]
                                                     / value["allocated_node_s"])
    assert value["startup_s"] > 0 and value["save_s"] > 0 and value["gap_s"] > 0
    assert value["hang_s"] == 0
    kinds = client.get_metric_history(run_id, names.TIMELINE_KIND)
    assert goodput.SPAN_KINDS.index(goodput.FAILED) in {m.value for m in kinds}  # the requeue
    resumed = {m.step: m.value for m in client.get_metric_history(run_id, names.RESUMED_FROM)}
    assert resumed == {2: 10, 3: 20}  # segment 3 fell back from the missing 25 to 20


def test_model_registered_as_candidate(story, tracking) -> None:
    client, _, _ = tracking
    version = client.get_model_version_by_alias(f"pretrain-{NAME}", "candidate")
    assert version.tags["campaign"] == NAME
    assert version.tags["checkpoint_iteration"] == str(TRAIN_ITERS)


def _haystacks(story: Story, tracking, s3_server) -> dict[str, str]:
    """Every text a secret could leak into, by where it came from."""
    af = story.af
    texts = {"standalone.log": Path(af.log_path).read_text(errors="replace")}
    for run_id in story.runs.values():
        for ti in _task_instances(af, run_id):
            where = f"{run_id}/{ti['task_id']}"
            for attempt in range(1, (ti["try_number"] or 0) + 1):
                texts[f"task log {where}#{attempt}"] = af.task_log(DAG_ID, run_id, ti["task_id"],
                                                                  attempt)
            entries = af.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/"
                                 f"taskInstances/{ti['task_id']}/xcomEntries")
            for entry in entries.get("xcom_entries", []):
                value = af.xcom(DAG_ID, run_id, ti["task_id"], entry["key"])
                texts[f"xcom {where}/{entry['key']}"] = json.dumps(value)
                if entry["key"] == "slurm_job":
                    for path in Path(value["run_dir"]).iterdir():
                        if path.is_file() and path.stat().st_size < 1 << 20:
                            texts[f"run dir {path}"] = path.read_text(errors="replace")
    _, parents, children = tracking
    for run in [*parents, *children]:
        texts[f"mlflow {run.info.run_id}"] = json.dumps(
            {"params": run.data.params, "tags": run.data.tags})
        bucket, prefix = run.info.artifact_uri[len("s3://"):].split("/", 1)
        s3 = s3_server.client()
        for item in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", []):
            if item["Size"] < 1 << 20:
                body = s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
                texts[f"s3 {item['Key']}"] = body.decode("utf-8", "replace")
    return texts


def test_no_secret_in_scripts_logs_xcom_or_mlflow(story, tracking, s3_server) -> None:
    key_file = Path(cluster.connection()["extra"]["key_file"])
    key_lines = [line for line in key_file.read_text().splitlines()
                 if line and not line.startswith("-----")]
    secrets = {"S3 secret key": S3_SECRET, **{f"SSH key line {i}": line
                                              for i, line in enumerate(key_lines)}}
    texts = _haystacks(story, tracking, s3_server)
    assert len(texts) > 50  # the scan saw the run: logs, XComs, scripts, MLflow, S3
    leaks = [(what, where) for where, text in texts.items()
             for what, secret in secrets.items() if secret in text]
    assert leaks == []
