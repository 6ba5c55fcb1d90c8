"""logparse records -> metric points (name, value, step), plus ``tokens_consumed``; points ->
MLflow ``Metric`` entities sent with ``log_batch``, 1,000 per call, never one call per value
(docs/tracking.md: ~128 values/s one by one, ~9,100/s in batches).

Records and metric names are jobscripts/vocabulary.py's (the one definition, which the log
parser uses too); this adds only ``tokens_consumed``, the x-axis people compare pre-training
runs on. mlflow is imported inside the two functions that need it.
"""

from __future__ import annotations

from collections.abc import Iterable

from jobscripts import vocabulary as v
from jobscripts.vocabulary import TOKENS_CONSUMED, Record
from operators.tracking.limits import MAX_METRICS_PER_BATCH, chunks

# The same number on every iteration line: it is the config param training.train_iters.
_CONSTANT = {v.TRAIN_ITERS}

Point = tuple[str, float, int]  # (name, value, step = iteration)


def tokens_consumed(record: Record, seq_length: int,
                    global_batch_size: int | None = None) -> float | None:
    """Tokens seen up to this iteration: consumed samples x sequence length when the line says
    how many samples (right under batch-size ramp-up too), else iteration x global batch x seq
    length."""
    samples = record.metrics.get(v.CONSUMED_SAMPLES)
    if samples is None:
        batch = record.metrics.get(v.GLOBAL_BATCH_SIZE, global_batch_size)
        if batch is None or record.iteration is None:
            return None
        samples = record.iteration * batch
    return float(samples) * seq_length


def points(records: Iterable[Record], seq_length: int,
           global_batch_size: int | None = None) -> list[Point]:
    """One value per (name, step), in first-seen order.

    The same (name, step) can appear twice: a requeued job appends to its log and redoes the
    iterations after its last checkpoint (the later value is the one the model kept), and every
    rank prints its own memory line (the largest is the one that runs out first).
    """
    found: dict[tuple[str, int], float] = {}
    for record in records:
        if record.iteration is None:
            continue
        step = record.iteration
        for name, value in record.metrics.items():
            if name in _CONSTANT:
                continue
            if record.kind == v.MEMORY and (name, step) in found:
                value = max(value, found[(name, step)])
            found[(name, step)] = value
        if record.kind == v.TRAIN:
            tokens = tokens_consumed(record, seq_length, global_batch_size)
            if tokens is not None:
                found[(TOKENS_CONSUMED, step)] = tokens
    return [(name, value, step) for (name, step), value in found.items()]


def to_metrics(rows: Iterable[Point | tuple[str, float, int, int]], timestamp_ms: int) -> list:
    """``Metric`` entities; a row may carry its own timestamp as a fourth item.

    Give a fixed ``timestamp_ms`` for a segment (its job's start, say): MLflow keys a metric by
    (name, timestamp, step, value) and drops exact repeats, so a log parsed and sent twice (a
    retried task, a replayed spool) adds nothing the second time.
    """
    from mlflow.entities import Metric

    return [Metric(row[0], float(row[1]), int(row[3]) if len(row) > 3 else timestamp_ms,
                   int(row[2])) for row in rows]


def log_metrics(client, run_id: str, metrics: list) -> int:
    """Send ``Metric`` entities in batches of 1,000; returns the number of calls made."""
    batches = chunks(metrics, MAX_METRICS_PER_BATCH)
    for batch in batches:
        client.log_batch(run_id, metrics=batch)
    return len(batches)
