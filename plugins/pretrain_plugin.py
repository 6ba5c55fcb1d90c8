"""The Airflow plugin: the project's extra links and the MLflow run listener.

Links are listed here so that the api-server can show them for serialized DAGs,
whose operator classes it does not import.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from operators.slurm.links import SlurmJobLink, SlurmLogLink
from operators.tracking.links import MlflowRunLink
from plugins.listener import CampaignRunListener


class PretrainPipelinePlugin(AirflowPlugin):
    name = "pretrain_pipeline"
    operator_extra_links = [SlurmJobLink(), SlurmLogLink(), MlflowRunLink()]
    listeners = [CampaignRunListener()]
