"""A loss spike held, decided by a human through Airflow's HITL form, and rolled back, under
the session's real ``airflow standalone`` (scheduler, triggerer: the spike watcher runs in the
trigger on the log stream).

``pretrain__health_spike`` (tests/campaigns/health/health_spike.yaml: 2-iteration segments,
tracked) trains with jobscripts/trainer_faults.py's test-only ``loss_spike`` on the samples
of iteration 4. Run A: segment 2 is flagged (8 x the median of the last 3 losses) and holds
the campaign; segment 3 refuses to train; ``health.decide`` waits for input. The test answers
it through the REST API as the UI does: roll back to checkpoint 2, skip 2 batches. The
decision is carried out (tracker back at 2, checkpoint 4 set aside, not deleted) and run B,
triggered by ``health.resume``, trains on from 2 with iterations 3 and 4 skipped (the spiked
samples consumed, not trained): no spike again, every MLflow step logged once.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from jobscripts.job_files import REFERENCE_FAULTS
from operators.campaign.adapters import health_state
from operators.campaign.render.layout import Layout
from tests.dags.health_campaigns import HEALTH_SPIKE
from tests.support import cluster

pytestmark = [pytest.mark.cluster, pytest.mark.airflow, pytest.mark.timeout(1800)]

DAG_ID = "pretrain__health_spike"
LAYOUT = Layout.for_campaign(HEALTH_SPIKE)
ROOT = Path(HEALTH_SPIKE.cluster.remote_root)
PREFIX = Path(HEALTH_SPIKE.data.prefixes[0])
SPIKE_AT = 4  # global batch 8: iteration 4 trains samples 24-31
DECIDE = "health.decide"


def _lay_out() -> None:
    from tests.export_eval.conftest import write_tokenizer
    from tests.trainer.synthetic_data import write_dataset

    shutil.rmtree(ROOT, ignore_errors=True)
    PREFIX.parent.mkdir(parents=True)
    write_dataset(PREFIX)
    write_tokenizer(Path(LAYOUT.tokenizer))
    Path(LAYOUT.checkpoints).mkdir(parents=True)
    (Path(LAYOUT.checkpoints) / REFERENCE_FAULTS).write_text(json.dumps(
        {"loss_spike": {"from_sample": 8 * (SPIKE_AT - 1), "samples": 8, "factor": 8.0}}))
    subprocess.run(["chown", "-R", "pretrain:pretrain", str(ROOT)], check=True)


def _runs(af) -> list[dict]:
    return af.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns?order_by=run_after")["dag_runs"]


def _deferral_drained(af, ti: dict) -> None:
    """Wait, as a human's minutes would, until the scheduler has taken the worker's exit event
    of the try that paused for input. Answered before that, the resumed try meets Airflow 3.3's
    stale-event race: the late "success" event fails it (apache/airflow#72716, open; seen here
    at load ~15, README "Troubleshooting")."""
    finished = (f"TaskInstance Finished: dag_id={ti['dag_id']}, task_id={ti['task_id']}, "
                f"run_id={ti['dag_run_id']},")
    cluster.wait_for(lambda: any(finished in line and "executor_state=success" in line
                                 for line in Path(af.log_path).read_text(errors="replace")
                                 .splitlines()),
                     300, f"the scheduler to take {ti['task_id']}'s deferral exit")


@pytest.fixture(scope="module")
def story(standalone, mlflow_server):
    from tests.pipeline.test_checkpoint_eval import _admin_setup

    af = standalone
    _lay_out()
    af.wait_dag(DAG_ID)
    _admin_setup(af, mlflow_server)  # the same MLflow connection id as the eval story
    run_a = af.trigger(DAG_ID)
    decide = af.wait_task_state(DAG_ID, run_a, DECIDE,
                                {"awaiting_input", "skipped", "failed", "upstream_failed"},
                                timeout=900)
    if decide != "awaiting_input":  # the segment that should have held it, then the run
        spiked = af.last_log(DAG_ID, run_a, "train.segment_2")[-3000:]
        raise AssertionError(f"{DECIDE} {decide}; train.segment_2's log ends:\n{spiked}\n"
                             f"{af.run_report(DAG_ID, run_a)}")
    # As the UI's "Required actions" page: the forms waiting for an answer, then the answer.
    waiting = af.request("GET", "/api/v2/dags/~/dagRuns/~/hitlDetails"
                                f"?dag_id_pattern={DAG_ID}&response_received=false")
    (form,) = waiting["hitl_details"]
    ti = form["task_instance"]
    _deferral_drained(af, ti)
    answer = af.request(
        "PATCH", f"/api/v2/dags/{ti['dag_id']}/dagRuns/{ti['dag_run_id']}/taskInstances/"
                 f"{ti['task_id']}/{ti['map_index']}/hitlDetails",
        {"chosen_options": ["roll back"], "params_input": {"checkpoint": 2, "skip_batches": 2}})
    state_a = af.wait_run(DAG_ID, run_a, timeout=300)
    answered = af.request("GET", "/api/v2/dags/~/dagRuns/~/hitlDetails"
                                 f"?dag_id_pattern={DAG_ID}&response_received=true")
    run_b = cluster.wait_for(lambda: next((r["dag_run_id"] for r in _runs(af)
                                           if r["dag_run_id"] != run_a), None),
                             120, f"the resumed run (run A {state_a})")
    state_b = af.wait_run(DAG_ID, run_b, timeout=900)
    return {"af": af, "a": run_a, "b": run_b, "form": form, "answer": answer,
            "answered": answered["hitl_details"], "states": (state_a, state_b)}


def test_the_spike_holds_the_campaign_before_its_next_segment(story) -> None:
    af, run_a = story["af"], story["a"]
    states = {t: af.task_instance(DAG_ID, run_a, f"train.segment_{t}")["state"]
              for t in (1, 2, 3)}
    assert states == {1: "success", 2: "success", 3: "failed"}, states
    assert "campaign held" in af.task_log(DAG_ID, run_a, "train.segment_3")
    kept = json.loads((Path(health_state.health_dir(LAYOUT)) / f"hold.{SPIKE_AT}.json")
                      .read_text())
    assert kept["code"] == "loss_spike" and kept["iteration"] == SPIKE_AT
    assert [i for i, _ in kept["losses"]] == [1, 2, 3, 4]


def test_the_form_shows_the_losses_and_checkpoints_and_the_answer_is_taken(story) -> None:
    form = story["form"]
    assert f"loss spike at iteration {SPIKE_AT}" in form["body"]
    assert "| 3 |" in form["body"] and "<- flagged" in form["body"]
    assert "[2, 4]" in form["body"]  # the checkpoints on the cluster
    assert form["options"] == ["continue", "roll back", "stop"]
    assert form["defaults"] == ["stop"]  # health.loss_spike.default_action
    assert form["task_instance"]["task_id"] == DECIDE
    assert form["task_instance"]["dag_run_id"] == story["a"]
    assert form["params"]["checkpoint"]["value"] == 2  # the last one before the spike
    assert form["params"]["skip_batches"]["value"] == 0
    assert story["answer"]["chosen_options"] == ["roll back"]
    # the PATCH's reply (HITLDetailResponse) and the form as the UI lists it afterwards
    assert story["answer"]["params_input"] == {"checkpoint": 2, "skip_batches": 2}
    assert story["answer"]["responded_at"]
    (done,) = story["answered"]
    assert done["response_received"] and done["chosen_options"] == ["roll back"]
    # carried out as answered, and kept with the hold for the record
    kept = json.loads((Path(health_state.health_dir(LAYOUT)) / f"hold.{SPIKE_AT}.json")
                      .read_text())
    decision = kept["decision"]
    assert decision["action"] == "roll back" and decision["run_id"] == story["a"]
    assert decision["params"] == {"checkpoint": 2, "skip_batches": 2}
    assert decision["rollback"]["set_aside"] == [SPIKE_AT]


def test_the_rollback_is_real_and_the_batches_are_skipped(story) -> None:
    af, run_b = story["af"], story["b"]
    assert story["states"][1] == "success", Path(af.log_path).read_text()[-3000:]
    assert not Path(health_state.hold_path(LAYOUT)).exists()
    job = af.xcom(DAG_ID, run_b, "train.segment_1")
    result = job["result"]
    assert result["start_iteration"] == 2 and result["skipped_iterations"] == [3, 4]
    log = Path(job["log_path"]).read_text()
    assert "loss spike" not in af.task_log(DAG_ID, run_b, "train.segment_1")
    assert not re.search(r"iteration\s+4/", log)  # skipped: consumed, not trained nor logged


def test_mlflow_has_every_step_once(story, mlflow_server) -> None:
    from operators.tracking.client import make_client
    from operators.tracking.settings import tracking_settings

    client = make_client(tracking_settings(mlflow_server.connection()))
    parent = Path(LAYOUT.mlflow_run_id).read_text().strip()
    steps = [m.step for m in client.get_metric_history(parent, "lm_loss")]
    assert sorted(steps) == sorted(set(steps)), steps  # no step twice
    assert set(steps) >= {1, 2, 3, 4, 5, 6}



def test_the_set_aside_checkpoint_is_removed_once_the_campaign_passed_the_spike(story) -> None:
    """Checkpoint 4 of the spiked branch was moved aside by the rollback (apply's record)
    and removed by the first segment of run B that saved past it: segment 1 skipped 3 and 4
    (no save), trained 5 and 6 and saved 6 without a finding. (Kept while the campaign is
    not yet past it: tests/campaign/test_health_state.py.)"""
    af, run_b = story["af"], story["b"]
    health = Path(health_state.health_dir(LAYOUT))
    aside = health / health_state.SET_ASIDE / "2"
    kept = json.loads((health / f"hold.{SPIKE_AT}.json").read_text())
    assert kept["decision"]["rollback"]["set_aside_dir"] == str(aside)
    assert not aside.exists()
    (removed,) = [json.loads(line) for line in
                  (health / health_state.REMOVED_LOG).read_text().splitlines()]
    assert removed["set_aside_dir"] == str(aside)
    assert removed["checkpoints"] == [SPIKE_AT] and removed["spike_iteration"] == SPIKE_AT
    assert (removed["run_id"], removed["segment"], removed["removed_at_iteration"]) == (
        run_b, 1, 6)
    assert "set-aside checkpoints [4] of the rollback to 2 removed" in af.task_log(
        DAG_ID, run_b, "train.segment_1")
