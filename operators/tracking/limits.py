"""MLflow's request limits (mlflow/utils/validation.py, 3.17) and clipping to them. Pure.

Copied rather than imported so that the pure modules stay free of ``import mlflow`` (seconds);
tests/tracking/test_params.py checks they still equal MLflow's.
"""

from __future__ import annotations

import posixpath
import re

MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_ENTITIES_PER_BATCH = 1000  # metrics + params + tags in one log_batch
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
MAX_ENTITY_KEY_LENGTH = 250

_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")  # MLflow accepts only these in names
TRUNCATED = "...[truncated]"


def clip_key(key: str) -> str:
    """A name MLflow accepts: bad characters become ``_``, no empty or ``..`` path parts (MLflow
    rejects names that ``normpath`` would change), at most 250 characters."""
    key = _BAD_KEY_CHARS.sub("_", key)[:MAX_ENTITY_KEY_LENGTH]
    parts = [p if p not in (".", "..") else "_" for p in key.split("/") if p]
    key = "/".join(parts) or "_"
    assert posixpath.normpath(key) == key
    return key


def clip_value(value: str, limit: int) -> str:
    """At most ``limit`` characters, visibly marked when cut (a silently cut value reads as the
    real one)."""
    if len(value) <= limit:
        return value
    return value[: limit - len(TRUNCATED)] + TRUNCATED


def chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]
