"""logparse records -> points: names, tokens_consumed, one value per (name, step), batching."""

from __future__ import annotations

from jobscripts import vocabulary as v
from operators.tracking import logparse as lp
from operators.tracking import metrics, ops
from tests.tracking.logs import GLOBAL_BATCH, SEQ_LENGTH, VALUES_PER_ITERATION, segment_log


def test_points_use_logparse_names_and_add_tokens():
    records = list(lp.parse_lines(segment_log(1, 3, 100)))
    points = metrics.points(records, SEQ_LENGTH)
    names = {name for name, _, _ in points}
    assert v.LM_LOSS in names and v.LEARNING_RATE in names and v.GRAD_NORM in names
    assert v.TRAIN_ITERS not in names  # a constant: it is the config param
    assert len(points) == 3 * VALUES_PER_ITERATION
    tokens = {step: value for name, value, step in points if name == v.TOKENS_CONSUMED}
    assert tokens == {i: float(i * GLOBAL_BATCH * SEQ_LENGTH) for i in (1, 2, 3)}


def test_tokens_without_consumed_samples_use_iteration_times_batch():
    record = v.Record(v.TRAIN, 10, {v.LM_LOSS: 2.0})
    assert metrics.tokens_consumed(record, 1024, global_batch_size=32) == 10 * 32 * 1024
    assert metrics.tokens_consumed(record, 1024) is None


def test_repeated_steps_keep_one_value():
    records = [
        v.Record(v.TRAIN, 5, {v.LM_LOSS: 3.0}),
        v.Record(v.TRAIN, 5, {v.LM_LOSS: 2.5}),  # redone after a requeue: this one counts
        v.Record(v.MEMORY, 5, {v.MEM_MAX_ALLOCATED_MB: 900.0}, {"rank": "0"}),
        v.Record(v.MEMORY, 5, {v.MEM_MAX_ALLOCATED_MB: 1200.0}, {"rank": "1"}),
        v.Record(v.MEMORY, 5, {v.MEM_MAX_ALLOCATED_MB: 1000.0}, {"rank": "2"}),
        v.Record(v.THROUGHPUT, None, {v.STEP_TIME_S: 1.0}),  # no iteration: dropped
    ]
    assert metrics.points(records, 8) == [(v.LM_LOSS, 2.5, 5),
                                          (v.MEM_MAX_ALLOCATED_MB, 1200.0, 5)]


def test_metric_ops_respect_batch_limit():
    rows = [("m", float(i), i) for i in range(2500)]
    batches = ops.metric_ops("run", rows, 123)
    assert [len(op["metrics"]) for op in batches] == [1000, 1000, 500]
    assert batches[0]["metrics"][7] == ["m", 7.0, 7, 123]
    assert len({op["id"] for op in batches}) == 3
    tags = ops.tag_ops("run", {f"k{i}": "v" for i in range(250)})
    assert [len(op["tags"]) for op in tags] == [100, 100, 50]
