"""operators/tracking/logparse.py on Megatron-LM/Bridge lines and on the reference trainer's
formatter (jobscripts/megatron_log.py), with the prefixes srun/torchrun add. A whole Bridge log
excerpt, and the reference trainer's own log, are in test_bridge_log.py."""

from __future__ import annotations

import pytest

from jobscripts import megatron_log as mlog
from jobscripts import vocabulary as v
from operators.tracking import logparse as lp

# The reference workflow's iteration 10 (lm loss and grad norm as it logged them).
REFERENCE_ITER_10 = (
    " [2025-06-12 14:03:27] iteration       10/     100 | consumed samples:          640 |"
    " elapsed time per iteration (ms): 11402.3 | learning rate: 1.500000E-05 |"
    " global batch size:    64 | lm loss: 1.580069E+01 | loss scale: 1.0 | grad norm: 37.247 |"
    " number of skipped iterations:   0 | number of nan iterations:   0 |"
)
WITH_TFLOPS = (
    " iteration       20/     100 | consumed samples:         1280 | elapsed time per iteration"
    " (ms): 11398.7 | throughput per GPU (TFLOP/s/GPU): 591.7 | learning rate: 3.000000E-05 |"
    " global batch size:    64 | lm loss: 1.123456E+01 | loss scale: 1.0 | grad norm: 12.500 |"
    " params norm: 301.250 | number of skipped iterations:   0 | number of nan iterations:   0 |"
)
NAN_ITERATION = (
    " iteration       21/     100 | consumed samples:         1344 | elapsed time per iteration"
    " (ms): 11390.0 | learning rate: 3.150000E-05 | global batch size:    64 | loss scale: 1.0 |"
    " number of skipped iterations:   1 | number of nan iterations:   1 |"
)
SAVED = "  successfully saved checkpoint from iteration      50 to /ckpt/l8b [ t 1/1, p 1/1 ]"
LOADED = " successfully loaded checkpoint from /ckpt/l8b [ t 1/1, p 1/1 ] at iteration 50"
MEMORY = (
    "[Rank 0] (after 10 iterations) memory (MB) | allocated: 20480.5 | max allocated: 60123.0"
    " | reserved: 65000.0 | max reserved: 65000.0"
)
# Megatron Bridge's report_memory line with its default MEMORY_KEYS (see test_bridge_log.py).
BRIDGE_MEMORY = (
    "[Rank 3] (after 10 iterations) memory (GB) | mem-allocated-gigabytes: 20.48 |"
    " mem-active-gigabytes: 20.48 | mem-inactive-gigabytes: 0.51324 | mem-reserved-gigabytes:"
    " 65.011 | mem-max-allocated-gigabytes: 60.123 | mem-max-active-gigabytes: 60.123 |"
    " mem-max-inactive-gigabytes: 2.1475 | mem-max-reserved-gigabytes: 65.011 |"
    " mem-alloc-retires: 0 | mem-allocated-count: 1234"
)

PREFIXES = ["", "0: ", "[default0]:", "[rank3]: ", "2025-06-12T14:03:27.123456Z 7: "]

CASES = [  # (line, kind, iteration, metrics that must be there, detail that must be there)
    (REFERENCE_ITER_10, v.TRAIN, 10,
     {v.LM_LOSS: 15.80069, v.GRAD_NORM: 37.247, v.TRAIN_ITERS: 100, v.CONSUMED_SAMPLES: 640,
      v.ELAPSED_MS: 11402.3, v.LEARNING_RATE: 1.5e-05, v.GLOBAL_BATCH_SIZE: 64,
      v.LOSS_SCALE: 1.0, v.SKIPPED_ITERATIONS: 0, v.NAN_ITERATIONS: 0}, {}),
    (WITH_TFLOPS, v.TRAIN, 20,
     {v.THROUGHPUT_TFLOPS: 591.7, v.LM_LOSS: 11.23456, "params_norm": 301.25}, {}),
    (" validation loss at iteration 10 | lm loss value: 9.876543E+00 |"
     " lm loss PPL: 1.953721E+04 | ",
     v.VALIDATION, 10, {v.VAL_LM_LOSS: 9.876543, v.VAL_LM_LOSS_PPL: 19537.21},
     {"split": "validation"}),
    (" validation loss at iteration 100 on test set | lm loss value: 2.5E+00 |"
     " lm loss PPL: 1.2E+01 | ",
     v.VALIDATION, 100, {"test_lm_loss": 2.5, "test_lm_loss_ppl": 12.0}, {"split": "test"}),
    ("Step Time : 11.40s GPU utilization: 591.7MODEL_TFLOP/s/GPU", v.THROUGHPUT, None,
     {v.STEP_TIME_S: 11.40, v.MODEL_TFLOPS_PER_GPU: 591.7}, {}),
    (MEMORY, v.MEMORY, 10,
     {v.MEM_ALLOCATED_MB: 20480.5, v.MEM_MAX_ALLOCATED_MB: 60123.0,
      v.MEM_RESERVED_MB: 65000.0, v.MEM_MAX_RESERVED_MB: 65000.0}, {"rank": "0"}),
    (BRIDGE_MEMORY, v.MEMORY, 10,
     {v.MEM_ALLOCATED_GB: 20.48, v.MEM_MAX_ALLOCATED_GB: 60.123, v.MEM_RESERVED_GB: 65.011,
      v.MEM_ALLOC_RETRY_COUNT: 0, v.MEM_ALLOCATION_COUNT: 1234}, {"rank": "3"}),
    (SAVED, v.CHECKPOINT_SAVE, 50, {}, {"path": "/ckpt/l8b"}),
    (LOADED, v.CHECKPOINT_LOAD, 50, {}, {"path": "/ckpt/l8b"}),
    ("    save-checkpoint ................................: (18237.01, 18237.08)", v.TIMER,
     None, {v.SAVE_CHECKPOINT_MS: 18237.08}, {}),
    ("[exiting program after 229.51 minutes] datetime: 2025-06-12 18:00:00 ", v.EXIT, None, {},
     {"reason": v.TIME_LIMIT}),
    ("[exiting program after receiving SIGTERM.] datetime: 2025-06-12 18:00:00 ", v.EXIT, None,
     {}, {"reason": v.SIGNAL}),
    ("[exiting program at iteration 40] datetime: 2025-06-12 18:00:00 ", v.EXIT, 40, {},
     {"reason": v.EXIT_INTERVAL}),
    ("[after training is done] datetime: 2025-06-12 18:00:00 ", v.EXIT, None, {},
     {"reason": v.COMPLETED}),
    ("slurmstepd: error: *** JOB 1234 ON nid001 CANCELLED AT 2025-06-12T18:00:31 DUE TO TIME"
     " LIMIT ***", v.EXIT, None, {}, {"reason": v.EXIT_SLURM_TIME_LIMIT, "job": "1234"}),
    ("slurmstepd: error: *** STEP 1234.0 ON nid001 CANCELLED AT 2025-06-12T18:00:31 ***",
     v.EXIT, None, {}, {"reason": v.EXIT_CANCELLED, "job": "1234.0"}),
    ("slurmstepd: error: *** JOB 99 ON nid002 CANCELLED AT 2025-06-12T18:00:31 DUE TO"
     " PREEMPTION ***", v.EXIT, None, {}, {"reason": v.EXIT_PREEMPTED}),
    ("srun: error: nid001: task 3: Exited with exit code 1", v.EXIT, None, {},
     {"reason": v.FAILED}),
    ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", v.EXIT, None, {},
     {"reason": v.FAILED}),
]


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize(("line", "kind", "iteration", "metrics", "detail"), CASES)
def test_megatron_lines(prefix, line, kind, iteration, metrics, detail):
    record = lp.parse_line(prefix + line)
    assert record is not None and record.kind == kind
    assert record.iteration == iteration
    for name, value in metrics.items():
        assert record.metrics[name] == pytest.approx(value), name
    for key, value in detail.items():
        assert record.detail[key] == value


def test_nan_iteration_has_no_loss_but_counts():
    record = lp.parse_line("0: " + NAN_ITERATION)
    assert v.LM_LOSS not in record.metrics and v.GRAD_NORM not in record.metrics
    assert record.metrics[v.NAN_ITERATIONS] == 1 and record.metrics[v.SKIPPED_ITERATIONS] == 1


@pytest.mark.parametrize("line", [
    "",
    "> building train, validation, and test datasets ...",
    "INFO:megatron.core.num_microbatches_calculator:setting number of microbatches to constant 8",
    "-" * 80,
    "(min, max) time across ranks (ms):",
    "    evaluate .......................................: (1.00, 2.00)",
    "srun: error: nid001: task 0: Exited with exit code 0",
])
def test_lines_without_records(line):
    assert lp.parse_line(line) is None


def test_stream_fills_in_iterations_and_metric_points():
    lines = [  # Bridge's order: the Step Time line comes before the iteration line it measures
        "0: Step Time : 11.40s GPU utilization: 591.7MODEL_TFLOP/s/GPU",
        "0: " + REFERENCE_ITER_10,
        "0: saving checkpoint at iteration      10 to /ckpt in torch_dist format",
        "0:   successfully saved checkpoint from iteration      10 to /ckpt [ t 1/1, p 1/1 ]",
        "0: (min, max) time across ranks (ms):",
        "0:     save-checkpoint ................................: (100.00, 120.50)",
    ]
    records = list(lp.parse_lines(lines))
    assert [r.kind for r in records] == [v.THROUGHPUT, v.TRAIN, v.CHECKPOINT_SAVE, v.TIMER]
    assert [r.iteration for r in records] == [10, 10, 10, 10]
    points = lp.metric_points(records)
    assert (v.LM_LOSS, 15.80069, 10) in points
    assert (v.SAVE_CHECKPOINT_MS, 120.5, 10) in points
    assert (v.STEP_TIME_S, 11.4, 10) in points


def test_throughput_without_its_iteration_line_gets_no_iteration():
    # The job died between the two prints, or two Step Time lines came in a row: neither is
    # given an iteration it did not measure.
    step = "Step Time : 11.40s GPU utilization: 591.7MODEL_TFLOP/s/GPU"
    records = list(lp.parse_lines([step, step.replace("11.40", "11.50"), REFERENCE_ITER_10, step]))
    assert [(r.kind, r.iteration) for r in records] == [
        (v.THROUGHPUT, None), (v.THROUGHPUT, 10), (v.TRAIN, 10), (v.THROUGHPUT, None)]
    assert records[1].metrics[v.STEP_TIME_S] == 11.5


def test_reference_trainer_formats_round_trip():
    """Every line the reference trainer prints parses back to what it printed."""
    train = lp.parse_line("[default0]:" + mlog.iteration_line(
        7, 12, 56, 31.25, 2.5e-3, 8, 4.5, 1.25, 0, 0))
    assert train.iteration == 7 and train.metrics[v.LM_LOSS] == 4.5
    assert train.metrics[v.ELAPSED_MS] == pytest.approx(31.2, abs=0.06)
    nan = lp.parse_line(mlog.iteration_line(8, 12, 64, 30.0, 2.5e-3, 8, None, None, 1, 1))
    assert v.LM_LOSS not in nan.metrics and nan.metrics[v.NAN_ITERATIONS] == 1
    framed = mlog.framed(mlog.validation_line(8, 4.25)).splitlines()
    assert [lp.parse_line(line) is None for line in framed] == [True, False, True]
    assert lp.parse_line(framed[1]).metrics[v.VAL_LM_LOSS] == 4.25
    step = lp.parse_line(mlog.throughput_line(0.031, 0.000123))
    assert step.metrics[v.MODEL_TFLOPS_PER_GPU] == pytest.approx(0.000123)
    assert mlog.gigabytes(1_234_567_890) == 1.2346  # Bridge: bytes / 1e9, 5 significant digits
    memory = lp.parse_line(mlog.memory_line(0, 2, {
        "mem-allocated-gigabytes": mlog.gigabytes(1_234_567_890), "mem-allocated-count": 7}))
    assert (memory.kind, memory.iteration) == (v.MEMORY, 2)
    assert memory.metrics == {v.MEM_ALLOCATED_GB: 1.2346, v.MEM_ALLOCATION_COUNT: 7}
    records = list(lp.parse_lines([
        mlog.saving_line(8, "/ckpt"), mlog.saved_line(8, "/ckpt"),
        *mlog.timer_lines("save-checkpoint", 12.5).splitlines(),
        mlog.fallback_line("tracker names iteration 12 but iter_0000012 does not exist"),
        mlog.loaded_line("/ckpt", 8),
    ]))
    assert [(r.kind, r.iteration) for r in records] == [
        (v.CHECKPOINT_SAVE, 8), (v.TIMER, 8), (v.CHECKPOINT_FALLBACK, None),
        (v.CHECKPOINT_LOAD, 8)]
    assert records[1].metrics[v.SAVE_CHECKPOINT_MS] == 12.5
    exits = {
        mlog.datetime_line(mlog.exit_duration_event(0.5)): v.TIME_LIMIT,
        mlog.datetime_line(mlog.exit_interval_event(4)): v.EXIT_INTERVAL,
        mlog.datetime_line(mlog.exit_signal_event("SIGUSR1")): v.SIGNAL,
        mlog.datetime_line(mlog.COMPLETED_EVENT): v.COMPLETED,
        mlog.failed_line(3, "RuntimeError('boom')"): v.FAILED,
    }
    for line, reason in exits.items():
        assert lp.parse_line(line).detail["reason"] == reason, line


def test_parser_imports_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys; import operators.tracking.logparse; "
            "print(sorted(m for m in ('torch', 'airflow', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
