"""The MLflow names this project writes: run tags, the values of ``pp.kind``, and the DAG tag that
names a campaign's MLflow connection. The one definition; everything else imports from here.

Imports nothing, so the scheduler's listener (plugins/listener.py) can use it without mlflow.
See docs/tracking.md.
"""

from __future__ import annotations

from collections.abc import Iterable

# --- Run tags ---
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: nests the child under the parent in the UI
CAMPAIGN_TAG = "pp.campaign"  # on every run of a campaign: how the listener finds the parent
KIND_TAG = "pp.kind"  # one of the kinds below
CHILD_KEY_TAG = "pp.child_key"  # a child's deterministic key: a retry continues the same child
STAGE_TAG = "pp.stage"  # data stage task, export, evaluate ... ("train" for segments)
SEGMENT_TAG = "pp.segment"  # a segment child's task id
UPLOADED_TAG = "pp.artifacts_complete"  # set last on an export's run: its upload finished
PARAM_CHANGED_TAG = "pp.param_changed."  # + key: a param the campaign changed mid-campaign

# --- pp.kind values ---
CAMPAIGN_KIND = "campaign"
STAGE_KIND = "stage"
SEGMENT_KIND = "segment"
EXPORT_KIND = "export"

TRAIN_STAGE = "train"  # pp.stage of every training segment's child run

# --- Goodput metrics on the campaign's run (operators/tracking/goodput.py) ---
GOODPUT = "goodput"  # training-step time / the campaign's node time, step = its iteration
GOODPUT_PREFIX = "goodput_"  # + a Goodput field: each component (train_s, queue_s ...)
# The segments' timeline, one span per step (0, 1, ...): which segment, what kind (an index
# into goodput.SPAN_KINDS), and its start and end (Unix seconds).
TIMELINE_SEGMENT = "timeline_segment"
TIMELINE_KIND = "timeline_kind"
TIMELINE_START = "timeline_start_ts"
TIMELINE_END = "timeline_end_ts"
RESUMED_FROM = "segment_resumed_from"  # step = segment number: the iteration it loaded


def goodput_metric(field: str) -> str:
    """The metric name of a ``Goodput`` field."""
    return field if field.startswith(GOODPUT) else GOODPUT_PREFIX + field


# --- The DAG side ---
# A campaign DAG carries this tag + its tracking.mlflow_conn_id when tracking is on, so the
# scheduler's listener ends the parent run through the campaign's own connection.
CONN_DAG_TAG = "mlflow_conn:"
DAG_TAG_MAX = 100  # Airflow's TAG_MAX_LEN (airflow.sdk.definitions.dag)


def conn_dag_tag(conn_id: str) -> str:
    tag = f"{CONN_DAG_TAG}{conn_id}"
    if len(tag) > DAG_TAG_MAX:
        raise ValueError(f"tracking.mlflow_conn_id: {len(conn_id)} characters; at most "
                         f"{DAG_TAG_MAX - len(CONN_DAG_TAG)} fit in the DAG tag that names it")
    return tag


def conn_id_from_dag_tags(tags: Iterable[str]) -> str | None:
    """The MLflow connection a campaign DAG's tags name; None for an untracked DAG."""
    for tag in tags:
        if tag.startswith(CONN_DAG_TAG) and len(tag) > len(CONN_DAG_TAG):
            return tag[len(CONN_DAG_TAG):]
    return None
