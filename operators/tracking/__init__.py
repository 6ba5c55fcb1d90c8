"""MLflow tracking for campaigns: one parent run per campaign, a child run per stage/segment,
metrics in batches, artifacts to the server's S3 store, and a spool for when MLflow is down.

Modules, one job each (the first five import neither mlflow nor boto3 at the top, so a DAG file
may import them; the rest are for task code only):

- ``settings``: the Airflow connection -> tracking URI, experiment, S3 endpoint and credentials;
- ``limits``: MLflow's batch and length limits, and key/value clipping (pure);
- ``params``: campaign config -> flattened, redacted params; Slurm accounting (pure);
- ``metrics``: logparse records -> (name, value, step) points, plus ``tokens_consumed`` (pure);
- ``availability``: "is MLflow/S3 down?" for an exception, and a fast health probe;
- ``s3``: a boto3 client built from the connection's credentials (no process env);
- ``client``: ``make_client(settings)``, an MlflowClient whose artifact calls use ``s3``;
- ``runs``: the campaign parent run, idempotent child runs, finishing runs;
- ``artifacts``: where each kind of file goes in a run; checkpoints are recorded, never uploaded;
- ``ops``: every tracking write as a JSON-able op, and how one op is sent (batched);
- ``spool``: ops that could not be sent, on disk, replayed in order exactly once;
- ``tracker``: the facade task code uses: try to send, spool when MLflow is down, flush first;
- ``registry``: registering an exported model version with its lineage.
"""
