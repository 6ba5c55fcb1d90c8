"""Every checkpoint evaluated as it lands, under the session's real ``airflow standalone``.

tests/dags/health_campaigns.py builds ``pretrain__health_eval`` (three 2-iteration segments
of a tiny reference model on the synthetic bigram data, tracked) and its evaluation DAG
``pretrain__health_eval__eval``, scheduled on the campaign's checkpoints asset. One DAG run
of the campaign; each segment's success emits an asset event carrying its checkpoint's
iteration, and the evaluation DAG (its own pool, created here through the REST API as an
admin would) exports and scores each checkpoint on the held-out split (transformers backend).
Then: each of the three checkpoints evaluated once (the ledger, MLflow's parent run at step =
iteration with the tokens consumed), the final evaluate reused the last one, ``compare``
draws bits per byte against tokens.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import urllib.error
from pathlib import Path

import pytest

from operators.campaign.adapters.checkpoint_eval_log import EVAL_TOKENS_CONSUMED
from operators.campaign.dag.eval_dag import EVALUATED, eval_dag_id, read_ledger
from operators.campaign.render.checkpoint_eval import eval_result_path, ledger_path
from operators.campaign.render.layout import Layout
from tests.dags.health_campaigns import HEALTH_EVAL
from tests.support import cluster

pytestmark = [pytest.mark.cluster, pytest.mark.airflow, pytest.mark.timeout(2700)]

DAG_ID = "pretrain__health_eval"
EVAL_DAG = eval_dag_id(HEALTH_EVAL)
LAYOUT = Layout.for_campaign(HEALTH_EVAL)
ROOT = Path(HEALTH_EVAL.cluster.remote_root)
PREFIX = Path(HEALTH_EVAL.data.prefixes[0])
CHECKPOINTS = [2, 4, 6]  # one per segment: iters_per_segment 2, train_iters 6
BPB = "eval_bits_per_byte"


def _lay_out() -> None:
    """The synthetic dataset and its word-level tokenizer (tests/export_eval's), on the
    cluster user's disk; no campaign state left from an earlier run."""
    from tests.export_eval.conftest import write_tokenizer
    from tests.trainer.synthetic_data import write_dataset

    shutil.rmtree(ROOT, ignore_errors=True)
    PREFIX.parent.mkdir(parents=True)
    write_dataset(PREFIX)
    write_tokenizer(Path(LAYOUT.tokenizer))
    subprocess.run(["chown", "-R", "pretrain:pretrain", str(ROOT)], check=True)


def _admin_setup(af, mlflow_server) -> None:
    """The evaluation pool and the campaign's MLflow connection, through the REST API."""
    conn = mlflow_server.connection()
    for path, body in (
            ("/api/v2/pools", {"name": HEALTH_EVAL.health.eval_pool, "slots": 2}),
            ("/api/v2/connections", {
                "connection_id": HEALTH_EVAL.tracking.mlflow_conn_id, "conn_type": "http",
                "host": conn.host, "port": conn.port, "schema": conn.schema,
                "login": conn.login, "password": conn.password, "extra": conn.extra})):
        try:
            af.request("POST", path, body)
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # already there: an earlier module of the session made it
                raise


def _ledger() -> dict[int, str]:
    path = Path(ledger_path(LAYOUT))
    return read_ledger(path.read_text() if path.exists() else None)


def _eval_runs(af) -> list[dict]:
    return af.request("GET", f"/api/v2/dags/{EVAL_DAG}/dagRuns")["dag_runs"]


@pytest.fixture(scope="module")
def story(standalone, mlflow_server):
    af = standalone
    _lay_out()
    af.wait_dag(DAG_ID)
    af.wait_dag(EVAL_DAG)
    _admin_setup(af, mlflow_server)
    run_id = af.trigger(DAG_ID)
    state = af.wait_run(DAG_ID, run_id, timeout=1500)
    if state != "success":  # the first test says why; no evaluation to wait for
        return {"af": af, "run_id": run_id, "state": state}
    cluster.wait_for(lambda: all(_ledger().get(i) == EVALUATED for i in CHECKPOINTS), 900,
                     "every checkpoint evaluated", interval=3)
    cluster.wait_for(lambda: all(r["state"] in ("success", "failed") for r in _eval_runs(af)),
                     300, "the evaluation DAG's runs to end", interval=2)
    return {"af": af, "run_id": run_id, "state": state}


@pytest.fixture(scope="module")
def parent(story, mlflow_server):
    from operators.tracking.client import make_client
    from operators.tracking.settings import tracking_settings

    client = make_client(tracking_settings(mlflow_server.connection()))
    return client, (Path(LAYOUT.mlflow_run_id)).read_text().strip()


def test_campaign_succeeds_and_each_segment_announces_its_checkpoint(story) -> None:
    af = story["af"]
    assert story["state"] == "success", Path(af.log_path).read_text()[-4000:]
    events = af.request("GET", "/api/v2/assets/events?limit=100")["asset_events"]
    ours = [e for e in events if e["uri"].endswith(LAYOUT.checkpoints)]
    assert sorted(e["extra"]["iteration"] for e in ours) == CHECKPOINTS
    # the segments' own timing, for the report (no assertion on time: make bench's job)
    for i in (1, 2, 3):
        ti = af.task_instance(DAG_ID, story["run_id"], f"train.segment_{i}")
        print(f"segment {i}: {ti['duration']:.1f}s ({ti['start_date']} -> {ti['end_date']})")


def test_every_checkpoint_evaluated_once_on_the_heldout_split(story) -> None:
    runs = _eval_runs(story["af"])
    assert runs and all(r["state"] == "success" for r in runs), runs
    assert {i: s for i, s in _ledger().items()} == dict.fromkeys(CHECKPOINTS, EVALUATED)
    lines = Path(ledger_path(LAYOUT)).read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines
            if json.loads(line)["state"] == EVALUATED] == CHECKPOINTS  # once each
    for iteration in CHECKPOINTS:
        result = json.loads(Path(eval_result_path(LAYOUT, iteration)).read_text())
        assert result["ok"] and result["backend"] == "transformers", result
        assert result["heldout"]["split"] == "valid"  # split 90,10,0: never trained on
        assert math.isfinite(result["bits_per_byte"]) and result["bits_per_byte"] > 0
        assert result["samples"] and all(s["completion"] for s in result["samples"])


def test_figures_on_the_campaign_run_at_each_checkpoint_iteration(parent) -> None:
    client, run_id = parent
    history = client.get_metric_history(run_id, BPB)
    assert sorted(m.step for m in history) == CHECKPOINTS  # each once: no duplicate point
    tokens = {m.step: m.value for m in client.get_metric_history(run_id, EVAL_TOKENS_CONSUMED)}
    t = HEALTH_EVAL.training
    assert tokens == {i: float(i * t.global_batch_size * t.seq_length) for i in CHECKPOINTS}
    by_step = {m.step: m.value for m in history}
    for iteration in CHECKPOINTS:
        result = json.loads(Path(eval_result_path(LAYOUT, iteration)).read_text())
        assert by_step[iteration] == pytest.approx(result["bits_per_byte"])


def test_the_campaign_run_stays_finished_after_its_evaluations(parent) -> None:
    """The listener ends it with the DAG run, on a thread of the scheduler (seconds under
    load: CI's rehearsal found it still RUNNING when asked at once); evaluations logged after
    that must not re-open it (the demo's run was left RUNNING that way)."""
    client, run_id = parent
    cluster.wait_for(lambda: client.get_run(run_id).info.status == "FINISHED", 180,
                     "the listener to end the campaign's MLflow run", 2)


def test_final_evaluate_reuses_the_last_checkpoints_evaluation(story) -> None:
    summary = story["af"].xcom(DAG_ID, story["run_id"], "evaluate")
    assert summary["reused"] == eval_result_path(LAYOUT, CHECKPOINTS[-1])
    registered = story["af"].xcom(DAG_ID, story["run_id"], "register")
    assert registered and registered["version"]


def test_compare_draws_bits_per_byte_against_tokens(parent, tmp_path) -> None:
    from operators.compare import BPB_CURVE, load_campaigns

    client, run_id = parent
    (campaign,) = [c for c in load_campaigns(client, HEALTH_EVAL.tracking.experiment)
                   if c.run_id == run_id]
    t = HEALTH_EVAL.training
    assert [x for x, _ in campaign.curves[BPB_CURVE]] == [
        float(i * t.global_batch_size * t.seq_length) for i in CHECKPOINTS]
