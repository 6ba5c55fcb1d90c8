"""Airflow import errors for the campaign YAMLs in ``dags/campaigns/`` without a DAG file of
their own that cannot be used.

No DAGs here: ``pretrain_campaigns.py`` holds the DAGs of those campaigns that build. Airflow
hides every DAG of a file that has an import error, so the broken ones are reported by this
file instead, one line each: ``campaigns/x.yaml:LINE: field: message``. A campaign with its own
DAG file (``campaigns/x.py``, a copy of ``campaigns/demo.py``) is its own import error instead.
See operators/campaign/dag/folder.py.
"""

from pathlib import Path

from operators.campaign.dag.folder import raise_errors

raise_errors(Path(__file__).parent / "campaigns")
