"""Run Slurm jobs from Airflow over SSH.

Modules, one job each:

- ``spec``: the job spec and the validation of every value that reaches a script;
- ``render``: job spec -> sbatch script text (pure);
- ``states``: what each Slurm state means (the only place that says so);
- ``parse``: ``sbatch``/``sacct``/``squeue`` output -> records (pure);
- ``commands``: the remote command lines (pure, quoted);
- ``jobkey``: the deterministic key that makes submission idempotent;
- ``hook``: blocking SSH/SFTP transport for the worker side;
- ``poller``: one shared async SSH connection and one ``sacct`` per cluster per interval;
- ``trigger``, ``operator``, ``sensor``, ``links``: the Airflow pieces.
"""
