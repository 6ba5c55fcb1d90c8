"""Ingest and tokenization as job arrays plus a merge job each (issue 16 part 4) on the local
cluster, through Airflow (``airflow dags test``: the tasks and their triggers in one process)
and the campaign's own operator (``ArrayJobOperator``, what ``data.ingest`` and
``data.tokenize`` are with ``data.array_tasks`` = 3).

One DAG, one Airflow run: ``good_ingest`` ingests four Parquet files (dedup on) as three array
tasks (files 0 | 1 | 2, 3) and the job after them (global dedup, the JSONL), and its JSONL is
the single job's byte for byte (an in-process run of the same flags); ``good`` then tokenizes
those shards as three array tasks and the merge, and its manifest is the single job's (same
fingerprint as an in-process run of the same shards); ``bad`` has a line that cannot be read
in its second shard: its array task 1 fails, the merge never runs (afterok), and the task
fails naming array task 1 and its shard, with the file and line. Nothing writes a manifest
for ``bad``.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from operators.slurm.jobkey import job_key
from tests.support import cluster
from tests.support.airflow import dags_test
from tests.support.data_stage import cluster_campaign, ok, tokenize_argv

# The setup runs the whole DAG (two arrays, two merges, in-process reference runs): 1323 s
# at load 17-27 here, over the suite's 900 s default.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]
ROOT = Path("/home/pretrain/pp-test-tokenize-array")  # the cluster user's, on this machine
DAG_ID = "pp_tokenize_array"
SHARDS = TASKS = 3
PARQUET_FILES = 4  # ingest: 4 files over 3 tasks, the last task two

DAG_FILE = '''"""Airflow DAG of the tokenize-array test: one ArrayJobOperator per campaign."""

from datetime import datetime
from pathlib import Path

import yaml
from airflow.sdk import DAG

from operators.campaign.dag.stage_operator import ArrayJobOperator
from operators.campaign.render import stages
from operators.campaign.render.layout import Layout
from operators.campaign.schema.load import campaign_from_dict
from operators.slurm.operator import as_data

docs = yaml.safe_load((Path(__file__).parent / "campaigns.yaml").read_text())
with DAG("pp_tokenize_array", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    for name, doc in docs.items():
        campaign = campaign_from_dict(doc)
        layout = Layout.for_campaign(campaign)
        steps = [(name, stages.tokenize(campaign, layout), stages.tokenize_array)]
        if doc["data"]["source"] != "demo":  # a Parquet corpus: ingest it first
            steps.insert(0, (f"{name}_ingest", stages.ingest(campaign, layout),
                             stages.ingest_array))
        tasks = [ArrayJobOperator(task_id=task_id, campaign=campaign, retries=0,
                                  array_job=array(campaign, layout),
                                  command=as_data(merge["command"]), job=as_data(merge["job"]),
                                  environment=as_data(merge["environment"]),
                                  result_file=merge["result_file"], poll_interval=2)
                 for task_id, merge, array in steps]
        if len(tasks) == 2:
            tasks[0] >> tasks[1]
'''


def _campaign(name: str, source: str = "demo") -> dict:
    return cluster_campaign(name, str(ROOT / "campaigns"), {
        "source": source, "split": "95,5,0", "array_tasks": TASKS, "min_doc_chars": 10,
        "tokenizer": {"path": str(ROOT / "tokenizer")}})


@pytest.fixture(scope="module")
def run(dags_test_env, ingested, tokenizer, tmp_path_factory) -> dict:
    from jobscripts.demo_corpus import main as demo_corpus
    from operators.campaign.render.layout import Layout
    from operators.campaign.schema.load import campaign_from_dict

    shutil.rmtree(ROOT, ignore_errors=True)
    ok(demo_corpus, ["--output-dir", str(ROOT / "parquet"), "--target-bytes", "200000",
                     "--shards", str(PARQUET_FILES)], tmp_path_factory.mktemp("demo") / "r.json")
    lines = [line for path in ingested["jsonl_files"]
             for line in Path(path).read_text(encoding="utf-8").splitlines()]
    docs = {"good": _campaign("good", str(ROOT / "parquet")), "bad": _campaign("bad")}
    layouts = {}
    for name, doc in docs.items():
        layout = Layout.for_campaign(campaign_from_dict(doc))
        if name == "bad":  # its JSONL written here, with a fault ingest would never write
            jsonl = Path(layout.jsonl)
            jsonl.mkdir(parents=True)
            for i in range(SHARDS):
                part = lines[i * len(lines) // SHARDS:(i + 1) * len(lines) // SHARDS]
                (jsonl / f"{i:05d}.jsonl").write_text("\n".join(part) + "\n", encoding="utf-8")
        layouts[name] = layout
        Path(layout.tokenizer).parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(tokenizer["tokenizer_dir"], layout.tokenizer)  # data.tokenizer's output
    with open(Path(layouts["bad"].jsonl) / "00001.jsonl", "a", encoding="utf-8") as handle:
        handle.write('{"text": "cut short\n')
    subprocess.run(["chown", "-R", "pretrain:pretrain", str(ROOT)], check=True)

    dags = tmp_path_factory.mktemp("airflow-tokenize-array") / "dags"
    dags.mkdir()
    (dags / "tokenize_array_dag.py").write_text(DAG_FILE)
    (dags / "campaigns.yaml").write_text(
        yaml.safe_dump(docs, sort_keys=False))
    env = {**dags_test_env, "AIRFLOW__CORE__DAGS_FOLDER": str(dags)}
    proc = dags_test(env, DAG_ID, timeout=900)
    out = proc.stdout + proc.stderr
    yield {"proc": proc, "out": out, "layouts": layouts,
           "run_id": re.search(r"creating dag run .* run_id=(\S+)", out).group(1)}
    shutil.rmtree(ROOT, ignore_errors=True)


def _jobs(run: dict, task_id: str) -> list[dict]:
    return cluster.sacct_by_name(job_key(DAG_ID, run["run_id"], task_id, -1, None))


def test_the_ingest_array_and_its_merge_write_the_single_jobs_jsonl(run, tmp_path):
    from jobscripts.ingest import main
    from operators.campaign.render import stages
    from operators.campaign.schema.load import campaign_from_dict

    array, merge = _jobs(run, "good_ingest.array"), _jobs(run, "good_ingest")
    base = array[0]["id"].partition("_")[0]
    assert sorted((j["id"], j["state"]) for j in array) == [
        (f"{base}_{t}", "COMPLETED") for t in range(TASKS)], array
    assert [j["state"] for j in merge] == ["COMPLETED"], merge
    runs = Path(cluster.connection()["extra"]["remote_work_dir"])
    tasks = [json.loads((runs / array[0]["name"] / f"result_{t}.json").read_text())
             for t in range(TASKS)]
    assert [t["shards"] for t in tasks] == [["000_00000.parquet"], ["000_00001.parquet"],
                                             ["000_00002.parquet", "000_00003.parquet"]]
    result = json.loads((runs / merge[0]["name"] / "result.json").read_text())
    assert result["array_tasks"] == TASKS and result["input_files"] == PARQUET_FILES
    # the single job: the flags the campaign renders, into a folder of its own
    layout = run["layouts"]["good"]
    argv = shlex.split(stages.ingest(campaign_from_dict(_campaign("good", str(ROOT / "parquet"))),
                                     layout)["command"])
    argv = argv[argv.index("jobscripts.ingest") + 1:argv.index("--merge-tasks")]
    argv[argv.index("--output-dir") + 1] = str(tmp_path / "single")
    single = ok(main, argv, tmp_path / "single.json")
    assert {k: result[k] for k in ("docs_in", "docs_out", "dropped")} == \
        {k: single[k] for k in ("docs_in", "docs_out", "dropped")}
    ours = sorted(Path(layout.jsonl).glob("*.jsonl"))
    assert [p.name for p in ours] == [Path(p).name for p in single["jsonl_files"]]
    assert [p.read_bytes() for p in ours] == [Path(p).read_bytes()
                                              for p in single["jsonl_files"]]


def test_the_array_and_its_merge_write_the_single_jobs_dataset(run, tokenizer, tmp_path):
    from jobscripts.tokenize_megatron import main

    array, merge = _jobs(run, "good.array"), _jobs(run, "good")  # sacct -X: one row per task
    base = array[0]["id"].partition("_")[0]
    assert sorted((j["id"], j["state"]) for j in array) == [
        (f"{base}_{t}", "COMPLETED") for t in range(TASKS)], array
    assert [j["state"] for j in merge] == ["COMPLETED"], merge
    manifest = json.loads((Path(run["layouts"]["good"].tokens) / "manifest.json").read_text())
    single = ok(main, [*tokenize_argv(run["layouts"]["good"].jsonl, tokenizer["tokenizer_dir"],
                                      tmp_path / "single"), "--merge", "corpus"],
                tmp_path / "single.json")
    assert manifest["fingerprint"] == single["manifest_fingerprint"]


def test_a_failed_array_task_fails_the_task_naming_it_and_its_shards(run):
    assert run["proc"].returncode != 0  # the DAG run failed: its "bad" task did
    tasks = {j["id"].partition("_")[2]: j["state"] for j in _jobs(run, "bad.array")}
    assert tasks == {"0": "COMPLETED", "1": "FAILED", "2": "COMPLETED"}, tasks
    base = _jobs(run, "bad.array")[0]["id"].partition("_")[0]
    errors = [m.group(1) for m in re.finditer(r"SlurmJobFailed: (array job .*)", run["out"])]
    assert errors, run["out"][-4000:]
    error = errors[0]
    assert f"array job {base} of bad ended FAILED" in error, error
    assert "1 of 3 tasks failed: task 1 (shards 00001.jsonl): array task 1 (shards " \
           "00001.jsonl): " in error, error
    jsonl = run["layouts"]["bad"].jsonl
    assert re.search(rf"{re.escape(jsonl)}/00001\.jsonl:\d+: cannot read 'text'", error), error
    assert "the merge did not run" in error
    assert not (Path(run["layouts"]["bad"].tokens) / "manifest.json").exists()
