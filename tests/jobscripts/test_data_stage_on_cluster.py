"""The data stage's refusals, through Airflow and real Slurm jobs on the local cluster.

Two small campaigns in their own DAG folder (the session's migrated Airflow home):

* ``ds_bad_corpus``, under ``airflow dags test``, reads a bad corpus from S3 (moto's server;
  the job finds keys and endpoint through boto3's default chain on the cluster, never on its
  command line): ``data.ingest`` runs as a Slurm job, ``data.raw_gate`` runs as one and
  fails, and the task's error lists each failed expectation with its observed value and
  lines. Nothing after the gate is submitted. (The faults only JSONL can have, malformed
  lines and bytes that are not UTF-8, are the gate job's own: test_ingest_and_raw_gate.py.)
* ``ds_blend_missing`` blends a prefix that exists with one that does not: its first
  training segment task (``airflow tasks test``) fails before any sbatch, naming the
  missing prefix.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from operators.slurm.jobkey import job_key
from tests.support import cluster
from tests.support.airflow import AIRFLOW, dags_test
from tests.support.data_stage import cluster_campaign, parquet_bytes
from tests.support.mlflow_server import S3_KEY_ID, S3_SECRET

pytestmark = pytest.mark.cluster
ROOT = Path("/home/pretrain/pp-test-data-stage")  # the cluster user's, on this machine
BUCKET = "pp-bad-corpus"
BAD_DAG, BLEND_DAG = "pretrain__ds_bad_corpus", "pretrain__ds_blend_missing"
# The Parquet corpus ingest reads: what a scraped shard can hold.
BAD_ROWS = [
    ("The river runs north through the valley town.", "doc-1"),
    (None, "doc-2"),  # null text: dropped by ingest, counted as empty
    ("", "doc-3"),  # empty: the same
    (b"caf\xe9 au lait, na\xefve \xff\xfe".decode("utf-8", "replace"), "doc-4"),  # mojibake
    ("Same words twice, word for word.", "doc-5"),
    ("Same words twice, word for word.", "doc-6"),  # duplicate text (dedup off)
    ("A second document that reuses an id.", "doc-1"),  # duplicate id
    ("control \x00\x01\x02 characters in the text", "doc-8"),
    ("A perfectly ordinary closing paragraph.", "doc-9"),
]


def _campaign(name: str, data: dict, environment: dict | None = None) -> dict:
    return cluster_campaign(
        name, str(ROOT / "campaigns"), {"split": "95,5,0", "min_doc_chars": 10,
                                         "max_doc_chars": 100_000,
                                         "tokenizer": {"train": {"vocab_size": 1024}}, **data},
        time_limit="5", environment=environment, max_segments=2)


def _as_cluster_user(path: Path) -> None:
    subprocess.run(["chown", "-R", "pretrain:pretrain", str(path)], check=True)


@pytest.fixture(scope="module")
def airflow(dags_test_env, moto_s3, tmp_path_factory) -> dict[str, str]:
    """The cluster side (corpus on S3, the user's AWS config, one real prefix) and an
    Airflow home whose DAG folder holds the two campaigns."""
    shutil.rmtree(ROOT, ignore_errors=True)
    ROOT.mkdir(parents=True)
    # boto3's default chain on the cluster: a config file of the cluster user's, named by a
    # path in the campaign's environment. The keys never reach the job script.
    (ROOT / "aws_config").write_text(
        f"[default]\nregion = us-east-1\naws_access_key_id = {S3_KEY_ID}\n"
        f"aws_secret_access_key = {S3_SECRET}\n")
    (ROOT / "aws_config").chmod(0o600)
    for name in ("present_text_document.bin", "present_text_document.idx"):
        (ROOT / name).write_bytes(b"\x00" * 64)
    _as_cluster_user(ROOT)
    client = moto_s3.client()
    client.create_bucket(Bucket=BUCKET)
    client.put_object(Bucket=BUCKET, Key="raw/000_00000.parquet", Body=parquet_bytes(BAD_ROWS))

    home = tmp_path_factory.mktemp("airflow-data-stage")
    dags = home / "dags"
    (dags / "campaigns").mkdir(parents=True)
    # The docstring matters: Airflow's safe mode parses only files that mention "airflow" and "dag".
    (dags / "data_stage_campaigns.py").write_text(
        '"""Airflow DAGs of the data-stage test campaigns."""\n\nfrom pathlib import Path\n\n'
        "from operators.campaign.dag.dag_factory import build_all\n\n"
        'build_all(Path(__file__).parent / "campaigns", globals())\n')
    campaigns = {
        "ds_bad_corpus": _campaign(
            "ds_bad_corpus", {"source": f"s3://{BUCKET}/raw/", "dedup": False,
                              "gate": {"sample_size": 200, "max_duplicate_rate": 0.05}},
            {"AWS_CONFIG_FILE": str(ROOT / "aws_config"), "AWS_ENDPOINT_URL": moto_s3.url}),
        "ds_blend_missing": _campaign(
            "ds_blend_missing", {"blend": [
                {"weight": 30, "prefix": str(ROOT / "present_text_document")},
                {"weight": 70, "prefix": str(ROOT / "absent_text_document")}],
                "tokenizer": {"path": str(ROOT / "tokenizer")}}),
    }
    for name, doc in campaigns.items():
        (dags / "campaigns" / f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    # The session's migrated Airflow home (one SQLite DB is enough), with this DAG folder.
    yield {**dags_test_env, "AIRFLOW__CORE__DAGS_FOLDER": str(dags)}
    shutil.rmtree(ROOT, ignore_errors=True)


def _run_id(out: str) -> str:
    return re.search(r"creating dag run .* run_id=(\S+)", out).group(1)


def _task_error(out: str, exc_type: str, marker: str) -> str:
    """The message of the ``exc_type`` a task failed with (``dags test`` prints the tasks'
    logs), the one that mentions ``marker``: up to the next log record."""
    pattern = rf"^\S*{exc_type}: (.*?)(?=^\d{{4}}-\d\d-\d\dT|\Z)"
    found = [m.group(1) for m in re.finditer(pattern, out, re.S | re.M) if marker in m.group(1)]
    assert found, f"no {exc_type} mentioning {marker} in:\n{out[-4000:]}"
    return found[0]


def _submitted(dag_id: str, run_id: str, task_id: str, segment: int | None = None) -> list:
    return cluster.sacct_by_name(job_key(dag_id, run_id, task_id, -1, segment))


def test_bad_corpus_from_s3_stops_at_the_raw_gate(airflow):
    proc = dags_test(airflow, BAD_DAG, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    run_id = _run_id(out)
    # ingest ran as a Slurm job, fetched the shard from S3 and dropped the null and empty texts
    (ingest_job,) = _submitted(BAD_DAG, run_id, "data.ingest")
    assert ingest_job["state"] == "COMPLETED"
    runs = Path(cluster.connection()["extra"]["remote_work_dir"])
    ingest = json.loads((runs / ingest_job["name"] / "result.json").read_text())
    assert ingest["downloaded"]["fetched"] == 1 and ingest["docs_in"] == len(BAD_ROWS)
    assert ingest["dropped"]["empty"] == 2 and ingest["docs_out"] == len(BAD_ROWS) - 2
    assert S3_SECRET not in (runs / ingest_job["name"] / "job.sbatch").read_text()
    # the gate ran as a Slurm job and failed; its task's error says why, with lines
    (gate_job,) = _submitted(BAD_DAG, run_id, "data.raw_gate")
    assert gate_job["state"] == "FAILED"
    error = _task_error(out, "SlurmJobFailed", gate_job["name"])
    assert "raw_gate FAILED: raw gate failed 4 of 8 checks" in error, error
    assert ("id_unique: observed 2 of 7 rows fail, expected ids unique "
            "(e.g. 00000.jsonl:1, 00000.jsonl:5)") in error
    assert re.search(r"duplicate_rate: observed 0\.142\d*, expected duplicate rate <= 0\.05", error)
    assert re.search(r"replacement_share: observed 0\.0\d+, expected mean U\+FFFD share", error)
    assert re.search(r"nonprintable_share: observed 0\.0\d+, expected mean non-printable", error)
    # nothing after the gate was submitted
    assert not _submitted(BAD_DAG, run_id, "data.tokenizer")
    assert not _submitted(BAD_DAG, run_id, "train.segment_1", 1)


def test_blend_prefix_missing_on_the_cluster_fails_before_any_sbatch(airflow):
    # The first segment task alone (``tasks test``): the DAG around it adds only waiting.
    proc = subprocess.run([AIRFLOW, "tasks", "test", BLEND_DAG, "train.segment_1"], env=airflow,
                          capture_output=True, text=True, timeout=300, cwd=cluster.REPO)
    out = proc.stdout + proc.stderr
    error = _task_error(out, "AirflowFailException", "training data missing")
    missing = ROOT / "absent_text_document"
    assert f"data.blend[1].prefix {missing}: no {missing}.bin or {missing}.idx" in error, error
    assert "nothing submitted" in error and "present_text_document" not in error
    run_id = _run_id(out)
    assert not _submitted(BLEND_DAG, run_id, "train.segment_1", 1)
    runs = Path(cluster.connection()["extra"]["remote_work_dir"])
    assert not (runs / job_key(BLEND_DAG, run_id, "train.segment_1", -1, 1)).exists()
