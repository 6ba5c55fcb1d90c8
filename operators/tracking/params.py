"""Campaign config -> MLflow params, and a Slurm job's accounting -> tags and metrics. Pure.

Params are the config flattened to dotted keys (``training.lr``, ``data.blend.0.weight``), so
runs compare side by side in MLflow's table. Secrets never become params: keys that name one
(``cluster.environment.HF_TOKEN``) and values that contain a known secret are redacted here,
before anything leaves the process.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from operators.tracking.limits import (
    MAX_PARAM_VAL_LENGTH,
    MAX_TAG_VAL_LENGTH,
    clip_key,
    clip_value,
)

REDACTED = "***"
# Key names that hold credentials in configs and environments (HF_TOKEN, WANDB_API_KEY,
# AWS_SECRET_ACCESS_KEY, db_password, auth_header, ...), as whole words between non-letters, so
# that data.tokenizer or num_tokens stay visible.
_SECRET_KEY = re.compile(
    r"(?:^|[^a-z0-9])(token|auth|authorization|api_?key|access_?key|private_?key|secret\w*|"
    r"passw\w*|credentials?)(?:$|[^a-z0-9])",
    re.IGNORECASE,
)

# Accounting names (on the segment's child run).
SLURM_JOB_ID = "slurm.job_id"
SLURM_STATE = "slurm.state"
SLURM_EXIT_CODE = "slurm.exit_code"
SLURM_NODELIST = "slurm.nodelist"
SLURM_GPUS = "slurm.gpus"
QUEUE_WAIT_S = "slurm_queue_wait_s"
ELAPSED_S = "slurm_elapsed_s"
GPU_HOURS = "slurm_gpu_hours"


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def flatten(config: Any, prefix: str = "") -> dict[str, str]:
    """Nested mappings/lists (or a pydantic model) -> {"a.b.0.c": "text"}. Empty containers stay
    as ``[]``/``{}`` so the key is still visible; lists index with ``.N`` (MLflow refuses ``[``)."""
    if hasattr(config, "model_dump"):
        config = config.model_dump(mode="json")
    flat: dict[str, str] = {}
    items: Iterable[tuple[Any, Any]]
    if isinstance(config, Mapping):
        items = config.items()
    elif isinstance(config, list | tuple):
        items = enumerate(config)
    else:
        return {prefix or "value": _as_text(config)}
    empty = True
    for key, value in items:
        empty = False
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping | list | tuple) or hasattr(value, "model_dump"):
            flat.update(flatten(value, name))
        else:
            flat[name] = _as_text(value)
    if empty and prefix:
        flat[prefix] = "{}" if isinstance(config, Mapping) else "[]"
    return flat


def redact(values: Mapping[str, str], secrets: Iterable[str] = ()) -> dict[str, str]:
    """Values whose key names a secret, or that contain one of ``secrets``, become ``***``."""
    secrets = [s for s in secrets if s]
    return {
        key: REDACTED if _SECRET_KEY.search(key) or any(s in value for s in secrets) else value
        for key, value in values.items()
    }


def clean(values: Mapping[str, Any], limit: int, secrets: Iterable[str] = ()) -> dict[str, str]:
    """Keys MLflow accepts, values cut to ``limit``, secrets redacted."""
    text = {clip_key(str(k)): _as_text(v) for k, v in values.items()}
    return {k: clip_value(v, limit) for k, v in redact(text, secrets).items()}


def config_params(config: Any, secrets: Iterable[str] = ()) -> dict[str, str]:
    """The campaign config as params, ready to send."""
    return clean(flatten(config), MAX_PARAM_VAL_LENGTH, secrets)


def clean_tags(tags: Mapping[str, Any], secrets: Iterable[str] = ()) -> dict[str, str]:
    return clean(tags, MAX_TAG_VAL_LENGTH, secrets)


def accounting(job: Any) -> tuple[dict[str, str], dict[str, float]]:
    """(tags, metrics) for a finished Slurm job (an ``operators.slurm.parse.JobRecord``).

    Identity and outcome are tags, not params: MLflow params are write-once, and a retried
    segment task that re-attaches or resubmits would change them. Durations and GPU-hours are
    metrics, so they chart and sum across segments.
    """
    tags = {SLURM_JOB_ID: str(job.job_id), SLURM_STATE: str(job.state),
            SLURM_NODELIST: job.nodelist or "", SLURM_GPUS: str(job.gpus or 0)}
    if job.exit_code is not None:
        tags[SLURM_EXIT_CODE] = str(job.exit_code)
    metrics: dict[str, float] = {}
    if job.queue_wait_s is not None:
        metrics[QUEUE_WAIT_S] = float(job.queue_wait_s)
    if job.elapsed_s is not None:
        metrics[ELAPSED_S] = float(job.elapsed_s)
        metrics[GPU_HOURS] = (job.gpus or 0) * job.elapsed_s / 3600.0
    return tags, metrics
