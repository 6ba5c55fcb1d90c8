"""operators/campaign/logparse.py on Megatron/Bridge lines (DESIGN.md §4) and on the reference
trainer's formatter (jobscripts/megatron_log.py), with the prefixes srun/torchrun add."""

from __future__ import annotations

import pytest

from jobscripts import megatron_log as mlog
from operators.campaign import logparse as lp

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

PREFIXES = ["", "0: ", "[default0]:", "[rank3]: ", "2025-06-12T14:03:27.123456Z 7: "]

CASES = [  # (line, kind, iteration, metrics that must be there, detail that must be there)
    (REFERENCE_ITER_10, lp.TRAIN, 10,
     {lp.LM_LOSS: 15.80069, lp.GRAD_NORM: 37.247, lp.TRAIN_ITERS: 100, lp.CONSUMED_SAMPLES: 640,
      lp.ELAPSED_MS: 11402.3, lp.LEARNING_RATE: 1.5e-05, lp.GLOBAL_BATCH_SIZE: 64,
      lp.LOSS_SCALE: 1.0, lp.SKIPPED_ITERATIONS: 0, lp.NAN_ITERATIONS: 0}, {}),
    (WITH_TFLOPS, lp.TRAIN, 20,
     {lp.THROUGHPUT_TFLOPS: 591.7, lp.LM_LOSS: 11.23456, "params_norm": 301.25}, {}),
    (" validation loss at iteration 10 | lm loss value: 9.876543E+00 |"
     " lm loss PPL: 1.953721E+04 | ",
     lp.VALIDATION, 10, {lp.VAL_LM_LOSS: 9.876543, lp.VAL_LM_LOSS_PPL: 19537.21},
     {"split": "validation"}),
    (" validation loss at iteration 100 on test set | lm loss value: 2.5E+00 |"
     " lm loss PPL: 1.2E+01 | ",
     lp.VALIDATION, 100, {"test_lm_loss": 2.5, "test_lm_loss_ppl": 12.0}, {"split": "test"}),
    ("Step Time : 11.40s GPU utilization: 591.7MODEL_TFLOP/s/GPU", lp.THROUGHPUT, None,
     {lp.STEP_TIME_S: 11.40, lp.MODEL_TFLOPS_PER_GPU: 591.7}, {}),
    (MEMORY, lp.MEMORY, 10,
     {lp.MEM_ALLOCATED_MB: 20480.5, lp.MEM_MAX_ALLOCATED_MB: 60123.0,
      lp.MEM_RESERVED_MB: 65000.0, lp.MEM_MAX_RESERVED_MB: 65000.0}, {"rank": "0"}),
    (SAVED, lp.CHECKPOINT_SAVE, 50, {}, {"path": "/ckpt/l8b"}),
    (LOADED, lp.CHECKPOINT_LOAD, 50, {}, {"path": "/ckpt/l8b"}),
    ("    save-checkpoint ................................: (18237.01, 18237.08)", lp.TIMER,
     None, {lp.SAVE_CHECKPOINT_MS: 18237.08}, {}),
    ("[exiting program after 229.51 minutes] datetime: 2025-06-12 18:00:00 ", lp.EXIT, None, {},
     {"reason": lp.EXIT_TIME_LIMIT}),
    ("[exiting program after receiving SIGTERM.] datetime: 2025-06-12 18:00:00 ", lp.EXIT, None,
     {}, {"reason": lp.EXIT_SIGNAL}),
    ("[exiting program at iteration 40] datetime: 2025-06-12 18:00:00 ", lp.EXIT, 40, {},
     {"reason": lp.EXIT_INTERVAL}),
    ("[after training is done] datetime: 2025-06-12 18:00:00 ", lp.EXIT, None, {},
     {"reason": lp.EXIT_COMPLETED}),
    ("slurmstepd: error: *** JOB 1234 ON nid001 CANCELLED AT 2025-06-12T18:00:31 DUE TO TIME"
     " LIMIT ***", lp.EXIT, None, {}, {"reason": lp.EXIT_SLURM_TIME_LIMIT, "job": "1234"}),
    ("slurmstepd: error: *** STEP 1234.0 ON nid001 CANCELLED AT 2025-06-12T18:00:31 ***",
     lp.EXIT, None, {}, {"reason": lp.EXIT_CANCELLED, "job": "1234.0"}),
    ("slurmstepd: error: *** JOB 99 ON nid002 CANCELLED AT 2025-06-12T18:00:31 DUE TO"
     " PREEMPTION ***", lp.EXIT, None, {}, {"reason": lp.EXIT_PREEMPTED}),
    ("srun: error: nid001: task 3: Exited with exit code 1", lp.EXIT, None, {},
     {"reason": lp.EXIT_FAILED}),
    ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", lp.EXIT, None, {},
     {"reason": lp.EXIT_FAILED}),
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
    assert lp.LM_LOSS not in record.metrics and lp.GRAD_NORM not in record.metrics
    assert record.metrics[lp.NAN_ITERATIONS] == 1 and record.metrics[lp.SKIPPED_ITERATIONS] == 1


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
    lines = [
        "0: " + REFERENCE_ITER_10,
        "0: Step Time : 11.40s GPU utilization: 591.7MODEL_TFLOP/s/GPU",
        "0: saving checkpoint at iteration      10 to /ckpt in torch_dist format",
        "0:   successfully saved checkpoint from iteration      10 to /ckpt [ t 1/1, p 1/1 ]",
        "0: (min, max) time across ranks (ms):",
        "0:     save-checkpoint ................................: (100.00, 120.50)",
    ]
    records = list(lp.parse_lines(lines))
    assert [r.kind for r in records] == [lp.TRAIN, lp.THROUGHPUT, lp.CHECKPOINT_SAVE, lp.TIMER]
    assert [r.iteration for r in records] == [10, 10, 10, 10]
    points = lp.metric_points(records)
    assert (lp.LM_LOSS, 15.80069, 10) in points
    assert (lp.SAVE_CHECKPOINT_MS, 120.5, 10) in points
    assert (lp.STEP_TIME_S, 11.4, 10) in points


def test_reference_trainer_formats_round_trip():
    """Every line the reference trainer prints parses back to what it printed."""
    train = lp.parse_line("[default0]:" + mlog.iteration_line(
        7, 12, 56, 31.25, 2.5e-3, 8, 4.5, 1.25, 0, 0))
    assert train.iteration == 7 and train.metrics[lp.LM_LOSS] == 4.5
    assert train.metrics[lp.ELAPSED_MS] == pytest.approx(31.2, abs=0.06)
    nan = lp.parse_line(mlog.iteration_line(8, 12, 64, 30.0, 2.5e-3, 8, None, None, 1, 1))
    assert lp.LM_LOSS not in nan.metrics and nan.metrics[lp.NAN_ITERATIONS] == 1
    framed = mlog.framed(mlog.validation_line(8, 4.25)).splitlines()
    assert [lp.parse_line(line) is None for line in framed] == [True, False, True]
    assert lp.parse_line(framed[1]).metrics[lp.VAL_LM_LOSS] == 4.25
    step = lp.parse_line(mlog.throughput_line(0.031, 0.000123))
    assert step.metrics[lp.MODEL_TFLOPS_PER_GPU] == pytest.approx(0.000123)
    records = list(lp.parse_lines([
        mlog.saving_line(8, "/ckpt"), mlog.saved_line(8, "/ckpt"),
        *mlog.timer_lines("save-checkpoint", 12.5).splitlines(),
        mlog.fallback_line("tracker names iteration 12 but iter_0000012 does not exist"),
        mlog.loaded_line("/ckpt", 8),
    ]))
    assert [(r.kind, r.iteration) for r in records] == [
        (lp.CHECKPOINT_SAVE, 8), (lp.TIMER, 8), (lp.CHECKPOINT_FALLBACK, None),
        (lp.CHECKPOINT_LOAD, 8)]
    assert records[1].metrics[lp.SAVE_CHECKPOINT_MS] == 12.5
    exits = {
        mlog.datetime_line(mlog.exit_duration_event(0.5)): lp.EXIT_TIME_LIMIT,
        mlog.datetime_line(mlog.exit_interval_event(4)): lp.EXIT_INTERVAL,
        mlog.datetime_line(mlog.exit_signal_event("SIGUSR1")): lp.EXIT_SIGNAL,
        mlog.datetime_line(mlog.COMPLETED_EVENT): lp.EXIT_COMPLETED,
        mlog.failed_line(3, "RuntimeError('boom')"): lp.EXIT_FAILED,
    }
    for line, reason in exits.items():
        assert lp.parse_line(line).detail["reason"] == reason, line


def test_parser_imports_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys; import operators.campaign.logparse; "
            "print(sorted(m for m in ('torch', 'airflow', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
