"""Campaign values are data, never templates (issue 14, point 1): a campaign's environment
holding Jinja reaches the job literally, under Airflow's own rendering and a real task run,
and no connection password or Variable is written into the job script."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from tests.dags.campaign_literal import HOSTILE_ENVIRONMENT, ROOT
from tests.support import cluster
from tests.support.airflow import AIRFLOW, REPO

DAG_ID = "pretrain__literal_env"
CONN_PASSWORD = "s3cr3t-conn-pw"  # noqa: S105 - a test value the job must never see
VARIABLE = "s3cr3t-variable"


def _dag():
    from tests.dags.campaign_literal import dag

    return dag


def test_airflow_rendering_leaves_campaign_values_alone() -> None:
    dag = _dag()
    for task_id in ("data.demo_corpus", "data.ingest", "export", "evaluate"):
        task = dag.get_task(task_id)
        # Airflow's own renderer, as the task runner calls it; {{ 7*7 }} needs no context.
        task.render_template_fields({"params": {}})
        assert task.environment == HOSTILE_ENVIRONMENT, task_id
        assert task.job["partition"] == "debug" and "{{" not in task.command


def test_the_token_gate_names_the_ingest_run_without_jinja() -> None:
    task = _dag().get_task("data.token_gate")
    task.render_template_fields({"ti": _Ti(), "params": {}})
    assert "--ingest-result /runs/ingest-1/result.json" in task.command
    assert task.environment == HOSTILE_ENVIRONMENT


def test_a_container_environment_in_a_data_stage_image_stays_literal() -> None:
    """The token gate's command carries the container's environment when the data stage runs
    in an image: with a Jinja template in that command, it used to render too."""
    from operators.campaign.dag.dag_factory import build_dag
    from operators.campaign.schema.load import campaign_from_dict
    from tests.campaign.util import LLAMA_8B, edited, raw

    campaign = campaign_from_dict(edited(raw(LLAMA_8B), {
        "stages.data.image": "/scratch/pretrain/containers/data.sif",
        "cluster.container.environment": {"HF_HOME": "/hf_home", "X_T": "{{ 7*7 }}"}}))
    for task_id in ("data.ingest", "data.token_gate"):
        task = build_dag(campaign, auto_register=False).get_task(task_id)
        task.render_template_fields({"ti": _Ti(), "params": {}})
        assert "export X_T=" in task.command and "{{ 7*7 }}" in task.command, task_id


class _Ti:
    """What the token gate's own template reads: the ingest task's XCom."""

    def xcom_pull(self, task_ids: str) -> dict:
        return {"run_dir": "/runs/ingest-1"} if task_ids == "data.ingest" else {}


def test_parse_time_check_still_runs_on_jinja_values() -> None:
    from operators.slurm.operator import SlurmJobOperator, as_data
    from operators.slurm.spec import JobSpecError

    with pytest.raises(JobSpecError, match="partition"):
        SlurmJobOperator(task_id="t", ssh_conn_id="c", command=as_data("true"),
                         job=as_data({"partition": "{{ x }} bad"}),
                         environment=as_data({"A": "{{ 7*7 }}"}))


SCRIPTS = f"grep -l -s -- '{ROOT}/literal_env' ~/pp-runs/pp-data.demo_corpus-*/job.sbatch"


def _scripts() -> str:
    """Every job script this DAG's demo_corpus task wrote on the cluster."""
    return cluster.remote(f"{SCRIPTS} | xargs -r cat")


@pytest.mark.airflow
def test_a_real_task_run_writes_the_literal_text(dags_test_env) -> None:
    cluster.remote(f"{SCRIPTS} | xargs -r -n1 dirname | xargs -r rm -rf; rm -rf {ROOT}")
    env = {**dags_test_env,
           "AIRFLOW_CONN_PP_LITERAL_CONN": '{"conn_type": "http", "host": "h", '
                                           f'"password": "{CONN_PASSWORD}"}}',
           "AIRFLOW_VAR_PP_LITERAL_VAR": VARIABLE}
    proc = subprocess.run([AIRFLOW, "tasks", "test", DAG_ID, "data.demo_corpus"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ended COMPLETED" in out, out[-4000:]
    script = _scripts()
    for key, value in HOSTILE_ENVIRONMENT.items():
        assert f"export {key}={shlex.quote(value)}\n" in script, (key, script)
    assert CONN_PASSWORD not in script and VARIABLE not in script
    assert "export NCCL_DEBUG=49" not in script and "$(id)" not in script
