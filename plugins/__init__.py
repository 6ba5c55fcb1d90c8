"""Airflow plugin of pretrain-pipeline (registered through the ``airflow.plugins`` entry point)."""
