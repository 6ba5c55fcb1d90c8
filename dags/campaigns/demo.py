"""Airflow DAG of the campaign YAML beside this file, of the same name (a copy of this file
gives any campaign x.yaml its DAG file x.py and, when it is broken, its own import error).
See operators/campaign/dag/folder.py."""

from operators.campaign.dag.folder import dag_file

dag_file(__file__, globals())
