"""Every tracking write as a small JSON-able op, and how one op is sent.

The tracker sends ops straight away when MLflow is up and writes the same ops to the spool when
it is down, so a replay runs exactly the code a direct send runs. One op is one request at most
(1,000 metrics or 100 params/tags: MLflow's batch limits), so a spool watermark after each op
never re-sends more than one batch, and each op is idempotent on its own:

- metrics carry their timestamps, and MLflow drops exact (name, timestamp, step, value) repeats;
- params are write-once in MLflow: keys it already has are skipped, and a changed value (a
  campaign YAML edited mid-campaign) is kept as a ``pp.param_changed.<key>`` tag instead of
  failing the whole batch;
- tags and artifacts overwrite; child runs are found again by their key; finishing twice is fine.

A child run can be asked for while MLflow is down: the tracker then hands out a reference
``child:<parent id>:<key>``, spools a ``child`` op, and the ops logged against the reference
resolve to the real run id when they are sent.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping

from operators.tracking import artifacts, metrics, runs
from operators.tracking.limits import (
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_TAGS_PER_BATCH,
    MAX_TAG_VAL_LENGTH,
    chunks,
    clip_key,
    clip_value,
)
from operators.tracking.names import PARAM_CHANGED_TAG

log = logging.getLogger(__name__)

CHILD_REF = "child:"


def _op(kind: str, **fields) -> dict:
    return {"id": uuid.uuid4().hex, "op": kind, **fields}


def metric_ops(run: str, rows: Iterable[tuple], timestamp_ms: int) -> list[dict]:
    """rows: (name, value, step); each op holds [name, value, step, timestamp] rows."""
    rows = [[name, float(value), int(step), timestamp_ms] for name, value, step in rows]
    return [_op("metrics", run=run, metrics=batch)
            for batch in chunks(rows, MAX_METRICS_PER_BATCH)]


def _mapping_ops(kind: str, run: str, values: Mapping[str, str]) -> list[dict]:
    items = sorted(values.items())
    return [_op(kind, run=run, **{kind: dict(batch)})
            for batch in chunks(items, MAX_PARAMS_TAGS_PER_BATCH)]


def param_ops(run: str, params: Mapping[str, str]) -> list[dict]:
    return _mapping_ops("params", run, params)


def tag_ops(run: str, tags: Mapping[str, str]) -> list[dict]:
    return _mapping_ops("tags", run, tags)


def artifact_op(run: str, path: str, artifact_path: str | None) -> dict:
    return _op("artifact", run=run, path=path, artifact_path=artifact_path)


def finish_op(run: str, status: str) -> dict:
    return _op("finish", run=run, status=status)


def child_ref(parent: str, key: str) -> str:
    return f"{CHILD_REF}{parent}:{key}"


def child_op(parent: str, name: str, key: str, tags: Mapping[str, str]) -> dict:
    return _op("child", ref=child_ref(parent, key), parent=parent, name=name, key=key,
               tags=dict(tags))


def resolve(client, run: str, refs: dict[str, str]) -> str:
    """A real run id for ``run``, which may be a deferred child reference."""
    if not run.startswith(CHILD_REF):
        return run
    if run not in refs:
        parent, key = run[len(CHILD_REF):].split(":", 1)
        found = runs.find_child(client, parent, key)
        if found is None:
            raise LookupError(f"{run}: its child run was never created")
        refs[run] = found.info.run_id
    return refs[run]


def _send_params(client, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param, RunTag

    existing = client.get_run(run_id).data.params
    new = [Param(k, v) for k, v in params.items() if k not in existing]
    changed = {k: v for k, v in params.items() if k in existing and existing[k] != v}
    if new:
        client.log_batch(run_id, params=new)
    if changed:
        log.warning("run %s: params %s changed since they were first logged; the new values "
                    "are tags %s<key>", run_id, sorted(changed), PARAM_CHANGED_TAG)
        tags = [RunTag(clip_key(PARAM_CHANGED_TAG + k), clip_value(v, MAX_TAG_VAL_LENGTH))
                for k, v in changed.items()]
        client.log_batch(run_id, tags=tags)


def send(client, op: dict, refs: dict[str, str]) -> None:
    """Send one op. ``refs`` caches deferred child references -> run ids."""
    kind = op["op"]
    if kind == "child":
        refs[op["ref"]] = runs.child_run(client, op["parent"], op["name"], op["tags"],
                                         key=op["key"])
        return
    run_id = resolve(client, op["run"], refs)
    if kind == "metrics":
        metrics.log_metrics(client, run_id, metrics.to_metrics(op["metrics"], 0))
    elif kind == "params":
        _send_params(client, run_id, op["params"])
    elif kind == "tags":
        from mlflow.entities import RunTag

        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in op["tags"].items()])
    elif kind == "artifact":
        artifacts.upload(client, run_id, op["path"], op["artifact_path"])
    elif kind == "finish":
        runs.finish_run(client, run_id, op["status"])
    else:
        raise ValueError(f"unknown tracking op {kind!r}")
