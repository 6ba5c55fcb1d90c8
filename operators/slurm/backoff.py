"""Jittered exponential back-off, shared by the blocking hook and the async poller."""

from __future__ import annotations

import random
from collections.abc import Iterator


def backoff_delays(attempts: int, base: float = 1.0, cap: float = 20.0) -> Iterator[float]:
    """Full jitter: many workers reconnecting at once spread out instead of stampeding."""
    for attempt in range(attempts):
        yield random.uniform(0, min(cap, base * 2**attempt))  # noqa: S311 - jitter, not crypto
