"""Against a real MLflow server whose artifacts go to a real (moto) S3 server."""

from __future__ import annotations

import os

import pytest
import requests

from jobscripts import vocabulary
from operators.slurm.parse import JobRecord
from operators.tracking import artifacts, logparse, params, runs
from operators.tracking.tracker import Tracker
from tests.support.mlflow_server import BUCKET, S3_KEY_ID, S3_SECRET
from tests.tracking.logs import GLOBAL_BATCH, SEQ_LENGTH, VALUES_PER_ITERATION, segment_log


@pytest.fixture
def count_requests(monkeypatch):
    """Counts HTTP requests the MLflow client makes, by endpoint path."""
    counts: dict[str, int] = {}
    original = requests.Session.request

    def counting(self, method, url, *args, **kwargs):
        path = url.split("/api/", 1)[-1]
        counts[path] = counts.get(path, 0) + 1
        return original(self, method, url, *args, **kwargs)

    monkeypatch.setattr(requests.Session, "request", counting)
    return counts


def test_parent_run_is_reused_across_dag_runs(client, experiment, settings):
    first = runs.ensure_campaign_run(client, experiment, "demo", None,
                                     artifact_location=settings.artifact_location)
    runs.finish_run(client, first, "FAILED")  # DAG run 1 ends
    again = runs.ensure_campaign_run(client, experiment, "demo", first)  # DAG run 2
    assert again == first
    run = client.get_run(first)
    assert run.info.status == "RUNNING"
    assert run.data.tags[runs.CAMPAIGN_TAG] == "demo"
    assert run.info.artifact_uri.startswith(f"s3://{BUCKET}/mlflow/")
    # A stored id the server does not know (a wiped database) starts a new parent run.
    fresh = runs.ensure_campaign_run(client, experiment, "demo", "0" * 32)
    assert fresh != first


def test_work_beside_the_dag_run_leaves_the_parent_ended(client, experiment):
    """A checkpoint's evaluation that ends after the campaign's DAG run logs to the parent
    without re-opening it: nothing would set it FINISHED again."""
    parent = runs.ensure_campaign_run(client, experiment, "demo", None)
    runs.finish_run(client, parent)  # the DAG run ended (the listener)
    assert runs.ensure_campaign_run(client, experiment, "demo", parent, reopen=False) == parent
    client.log_metric(parent, "eval_bits_per_byte", 3.7, step=60)
    run = client.get_run(parent)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["eval_bits_per_byte"] == 3.7


def test_child_run_is_idempotent_by_key(client, experiment):
    parent = runs.ensure_campaign_run(client, experiment, "demo", None)
    key = "scheduled__2025-01-01:train_segment_1:1"
    child = runs.child_run(client, parent, "segment-1", {"pp.kind": "segment"}, key=key)
    runs.finish_run(client, child, "FAILED")  # the task's first try failed
    assert runs.child_run(client, parent, "segment-1", key=key) == child  # its retry
    assert client.get_run(child).info.status == "RUNNING"
    other = runs.child_run(client, parent, "segment-2", key="scheduled__2025-01-01:t:2")
    assert other != child
    children = client.search_runs([client.get_run(parent).info.experiment_id],
                                  f"tags.`{runs.PARENT_TAG}` = '{parent}'")
    assert sorted(r.info.run_id for r in children) == sorted([child, other])
    assert client.get_run(child).data.tags[runs.CAMPAIGN_TAG] == "demo"


def test_metrics_continuous_across_segments_in_batches(client, experiment, tmp_path,
                                                       count_requests):
    tracker = Tracker(client, tmp_path / "spool")
    parent = tracker.campaign_run(experiment, "demo", None)
    total = 300
    sent = 0
    for first, last, job_start_ms in ((1, 150, 1_700_000_000_000), (151, total, 1_700_100_000_000)):
        records = list(logparse.parse_lines(segment_log(first, last, total)))
        sent += tracker.log_metrics(parent, records, seq_length=SEQ_LENGTH,
                                    timestamp_ms=job_start_ms)
    assert sent == total * VALUES_PER_ITERATION
    batch_calls = count_requests.get("2.0/mlflow/runs/log-batch", 0)
    assert batch_calls == 4  # 2 segments x (1,000 + 500) values: never one call per value
    assert "2.0/mlflow/runs/log-metric" not in count_requests

    # A retried task that parses and sends segment 1's log again adds nothing.
    records = list(logparse.parse_lines(segment_log(1, 150, total)))
    tracker.log_metrics(parent, records, seq_length=SEQ_LENGTH, timestamp_ms=1_700_000_000_000)

    loss = client.get_metric_history(parent, vocabulary.LM_LOSS)
    assert sorted(m.step for m in loss) == list(range(1, total + 1))  # continuous, no repeats
    tokens = {m.step: m.value for m in client.get_metric_history(parent, "tokens_consumed")}
    assert tokens[total] == total * GLOBAL_BATCH * SEQ_LENGTH
    assert not (tmp_path / "spool" / "rejected.jsonl").exists()


def test_artifacts_land_in_s3_and_checkpoints_are_only_recorded(client, experiment, tmp_path,
                                                                s3_server, settings):
    tracker = Tracker(client, tmp_path / "spool")
    parent = tracker.campaign_run(experiment, "demo", None,
                                  artifact_location=settings.artifact_location)
    files = {"config.yaml": "training:\n  lr: 3e-4\n", "train.sbatch": "#!/bin/bash\n",
             "slurm-42.out": "iteration 1/10\n", "gx.html": "<html>ok</html>",
             "manifest.json": "{}"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    tracker.log_artifact(parent, tmp_path / "config.yaml", artifacts.CONFIGS)
    tracker.log_artifact(parent, tmp_path / "train.sbatch", artifacts.JOBSCRIPTS)
    tracker.log_artifact(parent, tmp_path / "slurm-42.out", artifacts.LOGS)
    tracker.log_artifact(parent, tmp_path / "gx.html", artifacts.REPORTS)
    tracker.log_artifact(parent, tmp_path / "manifest.json", artifacts.DATA)
    plots = tmp_path / "plots"
    (plots / "loss").mkdir(parents=True)
    (plots / "loss" / "loss.png").write_bytes(b"\x89PNG")
    tracker.log_artifact(parent, plots, artifacts.PLOTS)
    tracker.record_checkpoint(parent, "/scratch/demo/checkpoints/iter_0000050", 50)

    root = client.get_run(parent).info.artifact_uri
    bucket, prefix = root[len("s3://"):].split("/", 1)
    listing = s3_server.client().list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    keys = {item["Key"][len(prefix) + 1:] for item in listing.get("Contents", [])}
    assert keys == {"configs/config.yaml", "jobscripts/train.sbatch", "logs/slurm-42.out",
                    "reports/gx.html", "data/manifest.json", "plots/loss/loss.png"}
    head = s3_server.client().head_object(Bucket=bucket, Key=f"{prefix}/reports/gx.html")
    assert head["ContentType"] == "text/html"  # the MLflow UI renders it
    assert sorted(p for p, _ in client.artifact_files(parent)) == sorted(keys)
    tags = client.get_run(parent).data.tags
    assert tags[artifacts.CHECKPOINT_URI] == "/scratch/demo/checkpoints/iter_0000050"
    assert tags[artifacts.CHECKPOINT_ITERATION] == "50"
    # The keys came from the connection, through objects: the process environment is untouched.
    assert not [k for k in os.environ if k.startswith(("AWS_", "MLFLOW_S3"))]


def test_config_params_flattened_and_no_secret_anywhere(client, experiment, tmp_path,
                                                        count_requests):
    tracker = Tracker(client, tmp_path / "spool")
    parent = tracker.campaign_run(experiment, "demo", None)
    config = {
        "name": "demo",
        "training": {"lr": 3e-4, "seq_length": 4096, "train_iters": 1000},
        "data": {"blend": [{"prefix": "/d/a", "weight": 0.7}, {"prefix": "/d/b", "weight": 0.3}]},
        "cluster": {"environment": {"HF_TOKEN": "hf_live_token", "NCCL_DEBUG": "INFO",
                                    "S3_CREDS": f"{S3_KEY_ID}:{S3_SECRET}"}},
        "notes": "x" * 7000,
        "many": {f"k{i:03d}": i for i in range(150)},
    }
    tracker.log_params(parent, config)
    assert count_requests["2.0/mlflow/runs/log-batch"] == 2  # 159 params, 100 per request
    tracker.set_tags(parent, {"endpoint_auth": "sekrit", "note": f"key is {S3_SECRET}"})
    child = tracker.child_run(parent, "segment-1", {"slurm.comment": S3_KEY_ID})

    run = client.get_run(parent)
    got = run.data.params
    assert got["training.lr"] == "0.0003" and got["data.blend.1.weight"] == "0.3"
    assert got["cluster.environment.HF_TOKEN"] == params.REDACTED
    assert got["cluster.environment.S3_CREDS"] == params.REDACTED
    assert got["cluster.environment.NCCL_DEBUG"] == "INFO"
    assert len(got["notes"]) == 6000 and len([k for k in got if k.startswith("many.")]) == 150
    everything = [*got.values(), *run.data.tags.values(),
                  *client.get_run(child).data.tags.values()]
    for secret in (S3_KEY_ID, S3_SECRET, "hf_live_token", "sekrit"):
        assert not [v for v in everything if secret in v], secret

    # The YAML edited mid-campaign: the changed value is kept as a tag, nothing fails.
    config["training"]["lr"] = 1e-4
    tracker.log_params(parent, config)
    run = client.get_run(parent)
    assert run.data.params["training.lr"] == "0.0003"
    assert run.data.tags["pp.param_changed.training.lr"] == "0.0001"
    assert not (tmp_path / "spool" / "rejected.jsonl").exists()


def test_slurm_accounting_on_the_segment_child(client, experiment, tmp_path):
    from datetime import datetime

    tracker = Tracker(client, tmp_path / "spool")
    parent = tracker.campaign_run(experiment, "demo", None)
    child = tracker.child_run(parent, "segment-1", key="dr:seg:1")
    job = JobRecord(job_id="77", name="k", state="TIMEOUT", exit_code=0, gpus=4,
                    submit=datetime(2025, 1, 1, 10), start=datetime(2025, 1, 1, 10, 1),
                    elapsed_s=1800, nodelist="node01")
    tracker.log_accounting(child, job, step=1)
    tracker.finish(child, "FINISHED")
    run = client.get_run(child)
    assert run.data.tags[params.SLURM_JOB_ID] == "77"
    assert run.data.tags[params.SLURM_STATE] == "TIMEOUT"
    assert run.data.tags[params.SLURM_NODELIST] == "node01"
    assert run.data.metrics == {params.QUEUE_WAIT_S: 60.0, params.ELAPSED_S: 1800.0,
                                params.GPU_HOURS: 2.0}
    assert run.info.status == "FINISHED"
