"""Megatron Bridge's training-log shapes, parsed: a Bridge log excerpt, and the reference trainer's
own log, which must print the same lines in the same order.

The excerpt is written from Bridge's source (NVIDIA-NeMo/Megatron-Bridge, tag 26.04-alpha.rc2 and
main alike), src/megatron/bridge/training/utils/train_utils.py:
- ``training_log``: at every ``log_interval``, ``print_rank_0(f"Step Time : {..:.2f}s GPU
  utilization: {..:.1f}MODEL_TFLOP/s/GPU")`` FIRST, then ``print_rank_last`` of the iteration line
  (`` [%Y-%m-%d %H:%M:%S] iteration {:8d}/{:8d} | consumed samples: {:12d} | ...``) for the same
  interval; then, while ``report_memory_flag`` (until the iteration after the resume is past),
  ``report_theoretical_memory`` on rank 0 and, on each data-parallel rank 0,
  ``print("[Rank {}] {}".format(rank, "(after {iteration} iterations) memory (GB)" +
  " | {metric}: {value}"...))``;
- ``report_memory`` with the default ``MEMORY_KEYS``: byte statistics / 1e9 rounded to 5
  significant digits under ``mem-*-gigabytes``, then ``mem-alloc-retires`` (num_alloc_retries)
  and ``mem-allocated-count`` (allocation.all.current): counts, printed as ints.
The ``N: `` prefixes are ``srun --label``'s; 2 nodes x 4 GPUs, TP 2, so ranks 0 and 1 are the
data-parallel rank 0 of their groups and rank 7 is the last rank.
"""

from __future__ import annotations

import re

from jobscripts import vocabulary as v
from operators.tracking import logparse as lp
from operators.tracking import metrics
from tests.support.trainer import run_trainer

_MEMORY_FIELDS = (
    "| mem-allocated-gigabytes: {a} | mem-active-gigabytes: {a} | mem-inactive-gigabytes: 0.51324"
    " | mem-reserved-gigabytes: 65.011 | mem-max-allocated-gigabytes: 60.123"
    " | mem-max-active-gigabytes: 60.123 | mem-max-inactive-gigabytes: 2.1475"
    " | mem-max-reserved-gigabytes: 65.011 | mem-alloc-retires: {r} | mem-allocated-count: {c}"
)
BRIDGE_LOG = [
    "0: Step Time : 11.40s GPU utilization: 591.7MODEL_TFLOP/s/GPU",
    "7:  [2026-04-20 10:15:02] iteration       10/     100 | consumed samples:          640 |"
    " elapsed time per iteration (ms): 11402.3 | learning rate: 1.500000E-05 |"
    " global batch size:    64 | lm loss: 1.580069E+01 | loss scale: 1.0 | grad norm: 37.247 |"
    " number of skipped iterations:   0 | number of nan iterations:   0 |",
    "0: Theoretical memory footprints: weight and optimizer=91553.22 MB, activation=29150.51 MB,"
    " total=120703.73 MB",
    "0: [Rank 0] (after 10 iterations) memory (GB) " + _MEMORY_FIELDS.format(a=20.48, r=0, c=1234),
    "1: [Rank 1] (after 10 iterations) memory (GB) " + _MEMORY_FIELDS.format(a=20.61, r=2, c=1240),
    "0: Step Time : 11.39s GPU utilization: 592.3MODEL_TFLOP/s/GPU",
    "7:  [2026-04-20 10:16:56] iteration       20/     100 | consumed samples:         1280 |"
    " elapsed time per iteration (ms): 11394.1 | learning rate: 3.000000E-05 |"
    " global batch size:    64 | lm loss: 1.123456E+01 | loss scale: 1.0 | grad norm: 12.500 |"
    " number of skipped iterations:   0 | number of nan iterations:   0 |",
]
BRIDGE_MEMORY_NAMES = {
    v.MEM_ALLOCATED_GB, v.MEM_ACTIVE_GB, v.MEM_INACTIVE_GB, v.MEM_RESERVED_GB,
    v.MEM_MAX_ALLOCATED_GB, v.MEM_MAX_ACTIVE_GB, v.MEM_MAX_INACTIVE_GB, v.MEM_MAX_RESERVED_GB,
    v.MEM_ALLOC_RETRY_COUNT, v.MEM_ALLOCATION_COUNT,
}


def _of(records: list[v.Record], kind: str) -> list[v.Record]:
    return [r for r in records if r.kind == kind]


def test_bridge_step_time_belongs_to_the_iteration_line_after_it():
    records = list(lp.parse_lines(BRIDGE_LOG))
    throughput = [(r.iteration, r.metrics[v.STEP_TIME_S], r.metrics[v.MODEL_TFLOPS_PER_GPU])
                  for r in _of(records, v.THROUGHPUT)]
    assert throughput == [(10, 11.40, 591.7), (20, 11.39, 592.3)]
    points = metrics.points(records, seq_length=8192)  # what MLflow gets
    assert (v.MODEL_TFLOPS_PER_GPU, 591.7, 10) in points  # the first one arrives
    assert (v.MODEL_TFLOPS_PER_GPU, 592.3, 20) in points  # and none is shifted
    assert (v.STEP_TIME_S, 11.40, 10) in points


def test_bridge_memory_report_stays_in_gb_and_counts_stay_counts():
    memory = _of(list(lp.parse_lines(BRIDGE_LOG)), v.MEMORY)
    assert [(r.iteration, r.detail["rank"]) for r in memory] == [(10, "0"), (10, "1")]
    assert set(memory[0].metrics) == BRIDGE_MEMORY_NAMES
    assert memory[0].metrics[v.MEM_ALLOCATED_GB] == 20.48  # as printed, not x1024
    assert memory[0].metrics[v.MEM_MAX_RESERVED_GB] == 65.011
    assert memory[0].metrics[v.MEM_ALLOCATION_COUNT] == 1234
    assert memory[1].metrics[v.MEM_ALLOC_RETRY_COUNT] == 2
    # Every rank prints its own line; MLflow gets the largest (the rank that runs out first).
    points = metrics.points(memory, seq_length=8192)
    assert (v.MEM_ALLOCATED_GB, 20.61, 10) in points
    assert (v.MEM_ALLOCATION_COUNT, 1240, 10) in points
    assert (v.MEM_ALLOC_RETRY_COUNT, 2, 10) in points


def test_bridge_memory_labels_of_custom_memory_keys_keep_their_unit():
    line = ("[Rank 0] (after 5 iterations) memory (GB) | mem-foo-gigabytes: 1.5 |"
            " num_ooms: 3")  # memory_keys={"...bytes...": "mem-foo-bytes", "num_ooms": ...}
    assert lp.parse_line(line).metrics == {"mem_foo_gb": 1.5, "num_ooms": 3}
    line = "[Rank 0] (after 5 iterations) memory (MB) | total device memory used: 512.00"
    assert lp.parse_line(line).metrics == {"total_device_memory_used_mb": 512.0}


def test_reference_trainer_prints_bridge_order_and_memory_report(uncut):
    lines = uncut.log.splitlines()
    steps = [i for i, line in enumerate(lines) if line.startswith("Step Time : ")]
    assert len(steps) == 12
    for i in steps:  # the iteration line it measures comes right after it, timestamped
        assert re.match(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +\d+/ +12 \|", lines[i + 1])
    records = uncut.records()
    assert [r.iteration for r in _of(records, v.THROUGHPUT)] == list(range(1, 13))
    # log_interval 1: reported after iterations 1 and 2, as Bridge does after a fresh start.
    memory = _of(records, v.MEMORY)
    assert [(r.iteration, r.detail["rank"]) for r in memory] == [(1, "0"), (2, "0")]
    for record in memory:
        m = record.metrics
        assert set(m) == {v.MEM_ALLOCATED_GB, v.MEM_MAX_ALLOCATED_GB, v.MEM_ALLOCATION_COUNT}
        # The resident memory of a Python process with torch: GB, not GB x 1024.
        assert 0.05 < m[v.MEM_ALLOCATED_GB] <= m[v.MEM_MAX_ALLOCATED_GB] < 64
        assert m[v.MEM_ALLOCATION_COUNT] == int(m[v.MEM_ALLOCATION_COUNT]) > 20  # >= params
    printed = [line for line in lines if " memory (GB) | " in line]
    assert len(printed) == 2 and all(re.search(r"mem-allocated-count: \d+$", p) for p in printed)


def test_resumed_reference_trainer_reports_memory_after_the_resume(tmp_path, config_for):
    config = config_for(tmp_path, save_interval=2, eval_interval=0)
    first = run_trainer(tmp_path, config, "--exit-interval", "2")
    second = run_trainer(tmp_path, config, "--exit-interval", "5")
    assert (first.rc, second.rc) == (0, 0)
    assert [r.iteration for r in _of(second.records(), v.MEMORY)] == [3, 4]
    assert [r.iteration for r in _of(second.records(), v.THROUGHPUT)] == [3, 4, 5]

