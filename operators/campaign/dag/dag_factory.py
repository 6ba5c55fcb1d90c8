"""Campaign YAML -> Airflow DAG ``pretrain__<name>``.

    data.check -> [data.demo_corpus] -> data.ingest -> data.raw_gate -> data.tokenizer
      -> data.tokenize -> data.token_gate -> train.segment_1 -> ... -> train.segment_N
      -> finished -> export -> evaluate -> register -> completed

Nothing here touches the cluster or imports anything heavy: the dag-processor
parses this every few seconds. The number of segment tasks is the campaign's
``segments.max_per_run``; the ones after the campaign is done skip.
"""

from __future__ import annotations

import posixpath
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from airflow.sdk import DAG, Asset, Param, TaskGroup, chain, task

from operators.campaign.adapters.code_ship import CampaignJobOperator
from operators.campaign.dag.eval_dag import REUSED_KEY, build_eval_dag
from operators.campaign.dag.health import HealthSegmentOperator, health_decision, uses_health
from operators.campaign.dag.preflight import TASK_ID as PREFLIGHT_TASK
from operators.campaign.dag.preflight import PreflightOperator
from operators.campaign.dag.segment import TrainingSegmentOperator
from operators.campaign.dag.stage_operator import CampaignStageOperator
from operators.campaign.render import stages
from operators.campaign.render.layout import RESULT_FILE, Layout
from operators.campaign.render.summary import summary
from operators.campaign.schema.naming import dag_id
from operators.slurm.operator import SlurmJobOperator, as_data
from operators.tracking.names import conn_dag_tag

if TYPE_CHECKING:
    from operators.campaign.schema.config import Campaign

START = datetime(2026, 1, 1)
TRIGGER_RULE_AFTER_DATA = "none_failed"  # run when the data stage ran or was skipped


def manifest_asset(campaign: Campaign, layout: Layout) -> Asset:
    """The tokenized dataset, as an Asset other campaigns can be scheduled on."""
    host = campaign.cluster.ssh_conn_id.replace("_", "-")
    return Asset(uri=f"file://{host}{layout.manifest}", name=f"{campaign.name}-dataset")


def _retry_args(retry) -> dict:
    return {"retries": retry.retries, "retry_delay": timedelta(seconds=retry.retry_delay),
            "retry_exponential_backoff": retry.exponential_backoff}


def segment_chain(campaign: Campaign, operator: type = TrainingSegmentOperator,
                  **kwargs) -> list[SlurmJobOperator]:
    """The campaign's ``segment_1 >> ... >> segment_N`` (N: ``segments.max_per_run``) with its
    train retries, in the DAG being defined: the train group's body, and the whole of the
    chain-only DAGs that pre-queueing and goodput are measured on. ``operator``: the segments'
    class (a health campaign's announces checkpoints and obeys holds)."""
    segments = [operator(task_id=f"segment_{i}", campaign=campaign, segment=i,
                         **_retry_args(campaign.retries.train), **kwargs)
                for i in range(1, campaign.segments.max_per_run + 1)]
    chain(*segments)
    return segments


def _params(campaign: Campaign) -> dict:
    t, s = campaign.training, campaign.segments
    return {
        "train_iters": Param(t.train_iters, type="integer", minimum=1,
                             description="Iterations the campaign trains to in total."),
        "segments_per_run": Param(s.max_per_run, type="integer", minimum=1,
                                  maximum=s.max_per_run,
                                  description="Segment jobs this run may submit."),
        "skip_data_stage": Param(True, type="boolean",
                                 description="Skip ingest/gates/tokenization when the "
                                             "dataset manifest already exists."),
        "dry_run": Param(False, type="boolean",
                         description="Render and upload configs and scripts only."),
    }


def _check_data_task(campaign: Campaign, layout: Layout):
    @task(task_id="check")
    def check(params=None, ti=None) -> dict:
        """Skips the data stage when its manifest exists (and the user allows it)."""
        from airflow.sdk.exceptions import AirflowSkipException

        from operators.campaign.adapters.remote import read_text
        from operators.slurm.hook import SlurmHook

        hook = SlurmHook(campaign.cluster.ssh_conn_id)
        exists = read_text(hook, layout.manifest) is not None
        if exists and params["skip_data_stage"]:
            raise AirflowSkipException(f"dataset manifest exists: {layout.manifest}")
        return {"manifest_exists": exists}

    return check()


def _stage_job(campaign: Campaign, task_id: str, kwargs: dict, retry: dict,
               array_job: dict | None = None, **extra) -> SlurmJobOperator:
    """A non-training stage's job; with tracking on it also logs its MLflow child run.

    Its job options, environment and command hold campaign values: data, never templates
    (as_data). A command only known when the task runs is a callable (_token_gate_command).
    """
    command = kwargs["command"]
    kwargs = {**kwargs, "job": as_data(kwargs.get("job") or {}),
              "environment": as_data(kwargs.get("environment") or {}),
              "command": command if callable(command) else as_data(command)}
    if array_job is not None:  # a job array first, then this job (its merge): stage_operator
        from operators.campaign.dag import stage_operator as so

        tracked = campaign.tracking.enabled
        return (so.ArrayStageOperator if tracked else so.ArrayJobOperator)(
            task_id=task_id, campaign=campaign, array_job=array_job,
            **({"stage": task_id} if tracked else {}), **kwargs, **retry, **extra)
    if campaign.tracking.enabled:
        return CampaignStageOperator(task_id=task_id, campaign=campaign, stage=task_id,
                                     **kwargs, **retry, **extra)
    return CampaignJobOperator(task_id=task_id, campaign=campaign, **kwargs, **retry, **extra)


def _data_stage(campaign: Campaign, layout: Layout, retry: dict):
    with TaskGroup("data") as group:
        def job(task_id: str, kwargs: dict, **extra) -> SlurmJobOperator:
            return _stage_job(campaign, task_id, kwargs, retry, **extra)

        steps = [_check_data_task(campaign, layout)]
        if campaign.data.source == "demo":
            steps.append(job("demo_corpus", stages.demo_corpus(campaign, layout)))
        steps.append(job("ingest", stages.ingest(campaign, layout),
                         array_job=stages.ingest_array(campaign, layout)))
        steps.append(job("raw_gate", stages.raw_gate(campaign, layout)))
        steps.append(job("tokenizer", stages.tokenizer(campaign, layout)))
        steps.append(job("tokenize", stages.tokenize(campaign, layout),
                         array_job=stages.tokenize_array(campaign, layout)))
        gate = {**stages.token_gate(campaign, layout, "/ingest-result-when-run"),
                "command": _token_gate_command(campaign, layout)}
        steps.append(job("token_gate", gate, outlets=[manifest_asset(campaign, layout)]))
        chain(*steps)
    return group


def _token_gate_command(campaign: Campaign, layout: Layout):
    """The token gate's command, which names the ingest job's run directory (known once that
    job ran): Airflow calls a callable template field with the task's context, so no Jinja is
    involved and no campaign value can be read as a template (a Jinja template here would
    also render the container environment the command carries)."""
    def command(context, jinja_env=None) -> str:
        run_dir = context["ti"].xcom_pull(task_ids="data.ingest")["run_dir"]
        return stages.token_gate(campaign, layout,
                                 posixpath.join(run_dir, RESULT_FILE))["command"]

    return command


def _finished_task(campaign: Campaign, layout: Layout):
    @task(task_id="finished", trigger_rule=TRIGGER_RULE_AFTER_DATA)
    def finished(params=None) -> int:
        """Lets export/evaluate/register run once the campaign reached train_iters, and once
        only: a scheduled run of a finished campaign does nothing."""
        import json

        from airflow.sdk.exceptions import AirflowSkipException

        from operators.campaign.adapters.remote import read_iteration, read_text
        from operators.slurm.hook import SlurmHook

        hook = SlurmHook(campaign.cluster.ssh_conn_id)
        iteration = read_iteration(hook, layout)
        if iteration < int(params["train_iters"]) or params["dry_run"]:
            raise AirflowSkipException(f"campaign at iteration {iteration}: not finished")
        done = json.loads(read_text(hook, layout.completed) or "{}")
        if done.get("iteration") == iteration:
            raise AirflowSkipException(
                f"campaign done at iteration {iteration}: exported, evaluated and registered "
                f"by DAG run {done.get('run_id')} ({layout.completed})")
        return iteration

    return finished()


def _completed_task(campaign: Campaign, layout: Layout):
    @task(task_id="completed")
    def completed(ti=None) -> dict:
        """Records that the final stages ran for this iteration (read by ``finished``)."""
        import json

        from operators.campaign.adapters.remote import write_file
        from operators.slurm.hook import SlurmHook

        record = {"iteration": ti.xcom_pull(task_ids="finished"), "run_id": ti.run_id}
        write_file(SlurmHook(campaign.cluster.ssh_conn_id), layout.completed,
                   json.dumps(record, sort_keys=True) + "\n")
        return record

    return completed()


def _register_task(campaign: Campaign, layout: Layout):
    @task(task_id="register")
    def register(ti=None) -> dict | None:
        """The exported, evaluated model in MLflow's registry, alias ``candidate``."""
        from operators.campaign.adapters.tracking import register as register_model
        from operators.slurm.hook import SlurmHook

        iteration = ti.xcom_pull(task_ids="finished")
        evaluated = ti.xcom_pull(task_ids="evaluate") or {}
        return register_model(campaign, SlurmHook(campaign.cluster.ssh_conn_id), layout,
                              iteration, evaluated.get("result"),
                              reused=bool(evaluated.get(REUSED_KEY)))

    return register()


def _finish_stage(campaign: Campaign, layout: Layout, retry: dict) -> list:
    evaluate = stages.evaluate(campaign, layout)
    steps = [_finished_task(campaign, layout),
             _stage_job(campaign, "export", stages.export(campaign, layout), retry),
             # health.evaluate_checkpoints: the last checkpoint's evaluation is reused
             _reusing_evaluate(campaign, evaluate, retry)
             if campaign.health.evaluate_checkpoints and campaign.tracking.enabled
             else _stage_job(campaign, "evaluate", evaluate, retry)]
    if campaign.tracking.enabled:
        steps.append(_register_task(campaign, layout))
    steps.append(_completed_task(campaign, layout))
    chain(*steps)
    return steps


def _reusing_evaluate(campaign: Campaign, kwargs: dict, retry: dict) -> SlurmJobOperator:
    from operators.campaign.dag.eval_dag import ReusingEvaluateOperator

    kwargs = {**kwargs, "job": as_data(kwargs["job"]),
              "environment": as_data(kwargs["environment"]), "command": as_data(kwargs["command"])}
    return ReusingEvaluateOperator(task_id="evaluate", campaign=campaign, stage="evaluate",
                                   **kwargs, **retry)


def _tracking_tags(campaign: Campaign) -> list[str]:
    # The scheduler's listener ends the campaign's MLflow run through this connection.
    return [conn_dag_tag(campaign.tracking.mlflow_conn_id)] if campaign.tracking.enabled else []


def build_dag(campaign: Campaign, source: Path | None = None, *, auto_register: bool = True,
              eval_backend: str = "vllm") -> DAG:
    layout = Layout.for_campaign(campaign)
    r = campaign.retries
    doc = summary(campaign) + (f"\n\nDefined in `{source.name}`." if source else "")
    with DAG(
        dag_id=dag_id(campaign), schedule=campaign.schedule, start_date=START, catchup=False,
        max_active_runs=1, params=_params(campaign), doc_md=doc,
        tags=["pretrain", "reference" if campaign.model.reference else "bridge",
              *_tracking_tags(campaign)],
        description=campaign.description or None, auto_register=auto_register,
    ) as dag:
        data = _data_stage(campaign, layout, _retry_args(r.data)) if campaign.data.source \
            else None
        with TaskGroup("train") as train:
            # One place decides "this config will run", before any training job is queued.
            preflight = PreflightOperator(task_id=PREFLIGHT_TASK, campaign=campaign,
                                          trigger_rule=TRIGGER_RULE_AFTER_DATA)
            # health: segments announce checkpoints, watch the loss, obey a hold (health.py)
            segment_operator = HealthSegmentOperator if uses_health(campaign) \
                else TrainingSegmentOperator
            segments = segment_chain(campaign, segment_operator,
                                     trigger_rule=TRIGGER_RULE_AFTER_DATA)
            preflight >> segments[0]
        if data is not None:
            data >> train
        train >> _finish_stage(campaign, layout, _retry_args(r.export))[0]
        if campaign.health.loss_spike is not None:  # a human decides on a held campaign
            train >> health_decision(campaign, dag.dag_id)
    if campaign.health.evaluate_checkpoints:  # its companion, registered the same way
        build_eval_dag(campaign, START, backend=eval_backend, auto_register=auto_register)
    return dag


def build_all(campaign_dir: Path, namespace: dict) -> list[DAG]:
    """One DAG per campaign YAML in ``campaign_dir`` that builds and has no DAG file of its own,
    put in ``namespace`` (a DAG file's globals). A campaign that does not build is skipped here
    and reported by the folder's error DAG file (operators/campaign/dag/folder.py), naming its
    file, field and line.
    """
    from operators.campaign.dag.folder import publish

    return publish(campaign_dir, namespace)
