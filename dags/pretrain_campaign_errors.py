"""Airflow import errors for the campaign YAMLs in ``dags/campaigns/`` that cannot be used.

No DAGs here: ``pretrain_campaigns.py`` holds the DAGs of the campaigns that build. Airflow
hides every DAG of a file that has an import error, so the broken campaigns are reported by
this file instead, one line each: ``campaigns/x.yaml:LINE: field: message``.
See operators/campaign/dag/folder.py.
"""

from pathlib import Path

from operators.campaign.dag.folder import raise_errors

raise_errors(Path(__file__).parent / "campaigns")
