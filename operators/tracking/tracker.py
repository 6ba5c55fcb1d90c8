"""The facade task code uses: tracking that never blocks or fails training.

Every call first replays the spool (so a recovered server gets the backlog before anything
newer), then sends; when MLflow is down it writes the ops to the spool instead and returns.
Data calls never raise for MLflow: errors other than an outage are logged and the op set aside
in the spool's ``rejected.jsonl`` (a tracking bug must not fail a segment that trained fine).
Run creation raises on errors other than an outage (bad names, permissions: found on the first
run). ``None`` as a run id (MLflow was down when the campaign's first run should have been
created) makes every call a logged no-op.

MLflow's own client retries a dead server for minutes; a ``/health`` probe (3 s timeout) before
each call makes a known outage cost nothing (availability.py).

    tracker = Tracker(make_client(settings), spool_dir)
    parent = tracker.campaign_run("exp", "demo", stored_run_id)   # None when down
    seg = tracker.child_run(parent, "segment-2", key=f"{dag_run}:{task}:2")
    tracker.log_metrics(seg, records, seq_length=4096, timestamp_ms=job_start_ms)
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from operators.tracking import metrics, ops, params, runs
from operators.tracking.artifacts import checkpoint_tags, is_checkpoint
from operators.tracking.availability import is_unavailable, reachable
from operators.tracking.spool import Spool, flush

log = logging.getLogger(__name__)


class Tracker:
    def __init__(self, client, spool_dir: str | os.PathLike) -> None:
        self.client = client
        self.spool = Spool(spool_dir)
        settings = getattr(client, "settings", None)
        self._secrets = settings.secrets() if settings is not None else ()
        self._refs: dict[str, str] = {}  # deferred child references -> run ids

    # -- plumbing --------------------------------------------------------------------------
    def _up(self) -> bool:
        return reachable(self.client.tracking_uri)

    def flush(self) -> int:
        """Send what the spool holds, if the server answers. Returns the number of ops sent."""
        if not self.spool.ops_path.exists() or not self._up():
            return 0
        return flush(self.spool, self.client, self._refs)

    def _spool(self, batch: list[dict]) -> None:
        try:
            self.spool.append(batch)
        except OSError:  # disk full, artifact gone: lose the tracking data, not the training
            log.exception("could not spool %d tracking ops to %s; they are lost", len(batch),
                          self.spool.dir)

    def _submit(self, batch: list[dict]) -> None:
        """Send ``batch`` in order, or spool what could not be sent because MLflow is down."""
        if not batch:
            return
        if not self._up():
            self._spool(batch)
            return
        self.flush()
        if self.spool.ops_path.exists():  # the replay stopped at an outage: keep the order
            self._spool(batch)
            return
        for i, op in enumerate(batch):
            try:
                ops.send(self.client, op, self._refs)
            except Exception as exc:
                if is_unavailable(exc):
                    log.warning("MLflow unavailable; spooling %d ops in %s: %s",
                                len(batch) - i, self.spool.dir, exc)
                    self._spool(batch[i:])
                    return
                log.exception("MLflow refused tracking op %s; set aside in %s", op["id"],
                              self.spool.rejected_path)
                self.spool.reject(op, exc)

    @staticmethod
    def _skip(run_id: str | None, what: str) -> bool:
        if run_id is None:
            log.warning("no MLflow run (it was down when the run was due): %s not tracked", what)
        return run_id is None

    # -- runs ------------------------------------------------------------------------------
    def campaign_run(self, experiment: str, campaign_name: str, stored_run_id: str | None,
                     tags: Mapping[str, Any] | None = None,
                     artifact_location: str | None = None, *,
                     reopen: bool = True) -> str | None:
        """``runs.ensure_campaign_run`` (artifact location: the connection's by default); the
        stored id unchanged when MLflow is down (None if there was none: nothing is tracked for
        this DAG run then)."""
        settings = getattr(self.client, "settings", None)
        if artifact_location is None and settings is not None:
            artifact_location = settings.artifact_location
        kwargs = {"tags": params.clean_tags(tags or {}, self._secrets),
                  "artifact_location": artifact_location, "reopen": reopen}
        if not self._up():
            log.warning("MLflow down: campaign %s continues without re-opening its run",
                        campaign_name)
            return stored_run_id
        self.flush()
        try:
            return runs.ensure_campaign_run(self.client, experiment, campaign_name,
                                            stored_run_id, **kwargs)
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            log.warning("MLflow down: campaign %s not re-opened: %s", campaign_name, exc)
            return stored_run_id

    def child_run(self, parent_id: str | None, name: str, tags: Mapping[str, Any] | None = None,
                  *, key: str | None = None) -> str | None:
        """``runs.child_run``, or a deferred reference to it when MLflow is down: use it like a
        run id; the ops logged against it go to the real run once it exists."""
        if self._skip(parent_id, f"child run {name}"):
            return None
        key = key or name
        tags = params.clean_tags(tags or {}, self._secrets)
        if self._up():
            self.flush()
            if not self.spool.ops_path.exists():
                try:
                    return runs.child_run(self.client, parent_id, name, tags, key=key)
                except Exception as exc:
                    if not is_unavailable(exc):
                        raise
        self._spool([ops.child_op(parent_id, name, key, tags)])
        return ops.child_ref(parent_id, key)

    def resolve(self, run_id: str | None) -> str | None:
        """The real id behind a deferred child reference (for links), or None while its run
        does not exist yet; real ids are returned as they are."""
        if run_id is None or not run_id.startswith(ops.CHILD_REF):
            return run_id
        if run_id not in self._refs and self._up():
            self.flush()
            try:
                ops.resolve(self.client, run_id, self._refs)
            except Exception as exc:
                log.warning("run %s not resolved yet: %s", run_id, exc)
        return self._refs.get(run_id)

    def finish(self, run_id: str | None, status: str = "FINISHED") -> None:
        if not self._skip(run_id, "finish"):
            self._submit([ops.finish_op(run_id, status)])

    # -- data ------------------------------------------------------------------------------
    def log_metrics(self, run_id: str | None, records: Iterable, *, seq_length: int,
                    global_batch_size: int | None = None,
                    timestamp_ms: int | None = None) -> int:
        """logparse records -> metrics (+ tokens_consumed), batched. Give the segment job's
        start as ``timestamp_ms`` to make re-sending the same log a no-op. Returns the number
        of values."""
        if self._skip(run_id, "metrics"):
            return 0
        rows = metrics.points(records, seq_length, global_batch_size)
        stamp = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        self._submit(ops.metric_ops(run_id, rows, stamp))
        return len(rows)

    def log_values(self, run_id: str | None, values: Mapping[str, float], step: int,
                   timestamp_ms: int | None = None) -> None:
        """A few named values at one step (accounting, evaluation)."""
        if not self._skip(run_id, "metrics"):
            stamp = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
            rows = [(name, value, step) for name, value in values.items()]
            self._submit(ops.metric_ops(run_id, rows, stamp))

    def log_params(self, run_id: str | None, config: Any) -> None:
        """A (nested) config or flat mapping as dotted, clipped, redacted params."""
        if not self._skip(run_id, "params"):
            self._submit(ops.param_ops(run_id, params.config_params(config, self._secrets)))

    def set_tags(self, run_id: str | None, tags: Mapping[str, Any]) -> None:
        if not self._skip(run_id, "tags"):
            self._submit(ops.tag_ops(run_id, params.clean_tags(tags, self._secrets)))

    def log_accounting(self, run_id: str | None, job: Any, step: int = 0) -> None:
        """A Slurm job's accounting (``JobRecord``) on its segment's child run."""
        tags, values = params.accounting(job)
        self.set_tags(run_id, tags)
        self.log_values(run_id, values, step)

    def record_checkpoint(self, run_id: str | None, uri: str,
                          iteration: int | None = None) -> None:
        self.set_tags(run_id, checkpoint_tags(uri, iteration))

    def log_artifact(self, run_id: str | None, local_path: str | os.PathLike,
                     artifact_path: str | None = None) -> None:
        """A file or directory; checkpoints are refused (record their URI instead)."""
        if self._skip(run_id, f"artifact {local_path}"):
            return
        if is_checkpoint(local_path):
            raise ValueError(f"{local_path} is (in) a checkpoint: use record_checkpoint()")
        if not os.path.exists(local_path):
            log.error("artifact %s does not exist; not tracked", local_path)
            return
        self._submit([ops.artifact_op(run_id, os.fspath(local_path), artifact_path)])
