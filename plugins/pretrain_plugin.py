"""The Airflow plugin: registers the project's extra links with the api-server.

Links are listed here so that the UI can show them for serialized DAGs, whose
operator classes the api-server does not import.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from operators.slurm.links import SlurmJobLink, SlurmLogLink


class PretrainPipelinePlugin(AirflowPlugin):
    name = "pretrain_pipeline"
    operator_extra_links = [SlurmJobLink(), SlurmLogLink()]
