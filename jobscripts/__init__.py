"""Entry points that run on the cluster as Slurm jobs.

Nothing here imports Airflow: these modules run on compute nodes, inside the
cluster's Python environment or a container. Each entry point is run as
``python -m jobscripts.<name> ...`` and writes a small JSON result that the
Airflow side reads back over SFTP.
"""
