"""Model registry against a real MLflow server: lineage tags, alias, idempotent re-registration."""

from __future__ import annotations

import pytest

from operators.tracking.registry import CANDIDATE_ALIAS, Lineage, register_model

EVALUATION = {"ok": True, "perplexity": 12.5, "bits_per_byte": 0.91, "nll_per_token": 2.526,
              "tokens_evaluated": 629}


@pytest.fixture
def campaign_run(mlflow_client, request):
    experiment = mlflow_client.create_experiment(f"registry-{request.node.name}")
    return mlflow_client.create_run(experiment, run_name="campaign").info.run_id


def test_register_tags_alias_metrics_and_artifacts(mlflow_client, campaign_run, exported):
    export_dir, export_result = exported
    lineage = Lineage("camp-a", export_result["iteration"], "manifest-sha", "config-sha")
    first = register_model(mlflow_client, "camp-a-model", campaign_run, export_dir, lineage,
                           EVALUATION)
    assert first.created and first.version == "1"

    version = mlflow_client.get_model_version_by_alias("camp-a-model", CANDIDATE_ALIAS)
    assert version.version == first.version and version.run_id == first.run_id
    assert {k: version.tags[k] for k in ("campaign", "checkpoint_iteration",
                                         "dataset_manifest_hash", "config_hash")} == {
        "campaign": "camp-a", "checkpoint_iteration": str(export_result["iteration"]),
        "dataset_manifest_hash": "manifest-sha", "config_hash": "config-sha"}
    assert float(version.tags["eval.eval_bits_per_byte"]) == pytest.approx(0.91)
    assert float(version.tags["eval.eval_perplexity"]) == pytest.approx(12.5)

    # The files are the export's, under the campaign's child run.
    export_run = mlflow_client.get_run(first.run_id)
    assert export_run.data.tags["mlflow.parentRunId"] == campaign_run
    listed = dict(mlflow_client.artifact_files(first.run_id))
    assert {f"model/{name}": size for name, size in export_result["files"].items()} == listed

    # Evaluation metrics on the campaign's run, at the checkpoint's iteration.
    history = mlflow_client.get_metric_history(campaign_run, "eval_bits_per_byte")
    assert [(m.step, m.value) for m in history] == [(export_result["iteration"], 0.91)]

    # Again (an Airflow retry): the same version, nothing logged twice.
    again = register_model(mlflow_client, "camp-a-model", campaign_run, export_dir, lineage,
                           EVALUATION)
    assert (again.version, again.created) == (first.version, False)
    assert len(mlflow_client.search_model_versions("name = 'camp-a-model'")) == 1
    assert len(mlflow_client.get_metric_history(campaign_run, "eval_bits_per_byte")) == 1


def test_a_later_iteration_becomes_the_candidate(mlflow_client, campaign_run, exported):
    export_dir, _ = exported
    old = register_model(mlflow_client, "camp-b-model", campaign_run, export_dir,
                         Lineage("camp-b", 10), EVALUATION)
    new = register_model(mlflow_client, "camp-b-model", campaign_run, export_dir,
                         Lineage("camp-b", 20), {**EVALUATION, "bits_per_byte": 0.8})
    assert (old.version, new.version) == ("1", "2")
    assert mlflow_client.get_model_version_by_alias("camp-b-model", "candidate").version == "2"
    history = mlflow_client.get_metric_history(campaign_run, "eval_bits_per_byte")
    assert sorted((m.step, m.value) for m in history) == [(10, 0.91), (20, 0.8)]
    # Re-registering the older iteration returns it and moves the alias back to it.
    assert register_model(mlflow_client, "camp-b-model", campaign_run, export_dir,
                          Lineage("camp-b", 10)).version == "1"
    assert mlflow_client.get_model_version_by_alias("camp-b-model", "candidate").version == "1"


def test_a_half_done_upload_is_redone(mlflow_client, campaign_run, exported):
    """A crash after the export run was created but before the upload was marked complete."""
    from operators.tracking.registry import UPLOADED_TAG, export_run

    export_dir, _ = exported
    lineage = Lineage("camp-c", 7)
    crashed = export_run(mlflow_client, campaign_run, lineage)
    assert mlflow_client.get_run(crashed).data.tags.get(UPLOADED_TAG) is None
    done = register_model(mlflow_client, "camp-c-model", campaign_run, export_dir, lineage)
    assert done.run_id == crashed  # found again, not a second child run
    assert mlflow_client.get_run(done.run_id).data.tags[UPLOADED_TAG] == "true"
    assert mlflow_client.artifact_files(done.run_id)


def test_figures_the_evaluate_task_logged_are_not_logged_again(mlflow_client, campaign_run,
                                                               exported):
    """The evaluate task already put its figures on the campaign's run at this iteration:
    registration adds no second point there, but the export run gets all of them."""
    export_dir, _ = exported
    mlflow_client.log_metric(campaign_run, "eval_bits_per_byte", 0.91, step=30)
    done = register_model(mlflow_client, "camp-d-model", campaign_run, export_dir,
                          Lineage("camp-d", 30), EVALUATION)
    history = mlflow_client.get_metric_history(campaign_run, "eval_bits_per_byte")
    assert [(m.step, m.value) for m in history] == [(30, 0.91)]
    assert [m.step for m in mlflow_client.get_metric_history(campaign_run, "eval_perplexity")
            ] == [30]
    assert mlflow_client.get_run(done.run_id).data.metrics["eval_bits_per_byte"] == 0.91


def test_a_reused_evaluations_figures_are_left_to_the_evaluation_dag(mlflow_client, campaign_run,
                                                                     exported):
    """The final evaluate reused the evaluation DAG's result, whose own task logs it on the
    campaign's run (with its job's timestamp) and may not have yet: registration puts nothing
    there (before, its point and that task's made two at one step), the export run gets all."""
    export_dir, _ = exported
    done = register_model(mlflow_client, "camp-e-model", campaign_run, export_dir,
                          Lineage("camp-e", 30), EVALUATION, campaign_figures=False)
    assert mlflow_client.get_metric_history(campaign_run, "eval_bits_per_byte") == []
    assert mlflow_client.get_run(done.run_id).data.metrics["eval_bits_per_byte"] == 0.91
