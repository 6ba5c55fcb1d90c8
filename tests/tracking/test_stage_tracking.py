"""Non-training stages in MLflow: real Slurm jobs under ``airflow dags test``, a real MLflow
server, artifacts in a real (moto) S3 server.

tests/dags/stage_tracking.py runs a raw gate on a corpus of duplicates (the gate fails) and an
evaluate stage. Each must leave a child run of the campaign's run with its job, result and
reports; the evaluation's figures land on the campaign's run too.
"""

from __future__ import annotations

import json
import shlex
import uuid
from pathlib import Path

import pytest

from operators.tracking import params, runs
from tests.dags.stage_tracking import CAMPAIGN, LAYOUT, MLFLOW_CONN, ROOT
from tests.support import cluster
from tests.support.airflow import dags_test

pytestmark = pytest.mark.cluster
EVAL_STEP = 30  # the checkpoint iteration the test gives the campaign


def _corpus(texts: list[str]) -> str:
    return "".join(json.dumps({"id": f"doc-{i}", "text": t}) + "\n" for i, t in enumerate(texts))


def _prepare_cluster() -> None:
    texts = ["The very same sentence, repeated until the duplicate check has to fail it."] * 12
    cluster.remote(" && ".join([
        f"rm -rf {ROOT}", f"mkdir -p {LAYOUT.jsonl} {LAYOUT.checkpoints}",
        f"printf '%s' {shlex.quote(_corpus(texts))} > {LAYOUT.jsonl}/00000.jsonl",
        f"printf {EVAL_STEP} > {LAYOUT.tracker}"]))


@pytest.fixture(scope="module")
def tracked(dags_test_env, mlflow_server, tmp_path_factory):
    """Runs the DAG once; returns the MLflow client and the DAG's output."""
    from operators.tracking.client import make_client
    from operators.tracking.settings import tracking_settings

    _prepare_cluster()
    conn = mlflow_server.connection(experiment=f"stages-{uuid.uuid4().hex[:8]}")
    conn_json = json.dumps({"conn_type": conn.conn_type, "host": conn.host, "port": conn.port,
                            "schema": conn.schema, "login": conn.login,
                            "password": conn.password, "extra": json.loads(conn.extra)})
    spool = tmp_path_factory.mktemp("stage-spool")
    env = {**dags_test_env, f"AIRFLOW_CONN_{MLFLOW_CONN.upper()}": conn_json,
           "PP_TRACKING_SPOOL": str(spool)}
    proc = dags_test(env, "stage_tracking", timeout=300)
    assert not list(spool.rglob("rejected.jsonl")), "MLflow refused tracking ops"
    assert not list(spool.rglob("ops.jsonl")), "tracking ops still wait in the spool"
    return make_client(tracking_settings(conn)), proc.stdout + proc.stderr


def _parent() -> str:
    return (Path(ROOT) / CAMPAIGN.name / "mlflow_run_id").read_text().strip()


def _child(client, task_id: str):
    parent = _parent()
    experiment = client.get_run(parent).info.experiment_id
    found = client.search_runs([experiment], f"tags.`{runs.PARENT_TAG}` = '{parent}'")
    return next(r for r in found if r.info.run_name.startswith(f"{task_id} ("))


def _s3_files(s3_server, run) -> dict[str, bytes]:
    """The run's artifacts as the S3 server holds them: path -> content."""
    bucket, prefix = run.info.artifact_uri[len("s3://"):].split("/", 1)
    s3 = s3_server.client()
    listing = s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    return {item["Key"][len(prefix) + 1:]: s3.get_object(Bucket=bucket, Key=item["Key"])
            ["Body"].read() for item in listing}


def _job_files(files: dict[str, bytes]) -> None:
    assert b"#SBATCH" in files["jobscripts/job.sbatch"]
    logs = [name for name in files if name.startswith("logs/slurm-")]
    assert len(logs) == 1 and files[logs[0]], sorted(files)


def test_failed_gate_logs_its_report_and_data_docs(tracked, s3_server) -> None:
    client, out = tracked
    run = _child(client, "raw_gate")
    assert run.info.status == "FAILED", out[-4000:]
    tags = run.data.tags
    assert tags["pp.stage"] == "raw_gate" and tags[runs.KIND_TAG] == "stage"
    assert tags[runs.CAMPAIGN_TAG] == CAMPAIGN.name
    assert tags[params.SLURM_STATE] == "FAILED" and params.ELAPSED_S in run.data.metrics
    files = _s3_files(s3_server, run)
    _job_files(files)
    report = json.loads(files["reports/raw_gate.json"])
    assert report["ok"] is False and "duplicate_rate" in report["error"]
    assert [e["name"] for e in report["expectations"] if not e["success"]] == ["duplicate_rate"]
    assert b"<html" in files["reports/data_docs/index.html"].lower()
    assert [n for n in files if n.startswith("reports/data_docs/validations/")
            and n.endswith(".html")]
    assert not [n for n in files if n.endswith((".otf", ".png", ".gif"))]  # pages, not assets


def test_evaluation_child_and_figures_on_the_campaign_run(tracked, s3_server) -> None:
    client, out = tracked
    run = _child(client, "evaluate")
    assert run.info.status == "FINISHED", out[-4000:]
    assert run.data.tags["pp.stage"] == "evaluate"
    assert run.data.tags[params.SLURM_STATE] == "COMPLETED"
    files = _s3_files(s3_server, run)
    _job_files(files)
    assert json.loads(files["eval/evaluate.json"])["perplexity"] == 12.5
    for run_id in (_parent(), run.info.run_id):
        history = {m: [(p.step, p.value) for p in client.get_metric_history(run_id, m)]
                   for m in ("eval_perplexity", "eval_bits_per_byte", "eval_tokens")}
        assert history == {"eval_perplexity": [(EVAL_STEP, 12.5)],
                           "eval_bits_per_byte": [(EVAL_STEP, 1.25)],
                           "eval_tokens": [(EVAL_STEP, 4096.0)]}
