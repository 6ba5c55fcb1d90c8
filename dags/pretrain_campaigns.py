"""Airflow DAGs: one per campaign YAML in ``dags/campaigns/``.

See operators/campaign/dag_factory.py. (Airflow's safe-mode discovery only reads files that
mention both "airflow" and "dag", which this docstring does.)
"""

from pathlib import Path

from operators.campaign.dag_factory import build_all

build_all(Path(__file__).parent / "campaigns", globals())
