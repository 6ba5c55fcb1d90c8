"""Metric records from Megatron-LM / Megatron Bridge training logs and the CPU reference
trainer's (which prints Bridge's formats: jobscripts/megatron_log.py).

Pure and light (standard library only): it runs in the Airflow worker and the triggerer on
log tails. Lines may carry prefixes added by srun (``0: ``), torchrun (``[default0]:``) or a
timestamp, so every pattern is searched, never anchored at the line start. Record kinds and
metric names are jobscripts/vocabulary.py's.

    parse_line(line) -> Record | None        one line, no context
    parse_lines(lines) -> Iterator[Record]   a stream; fills in the iteration that
                                             throughput and timer lines do not print
    metric_points(records) -> [(name, value, step)]   ready for MLflow's log_batch
    step_clock(line) -> datetime | None      the wall clock an iteration line starts with
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from datetime import datetime

from jobscripts import vocabulary as v
from jobscripts.vocabulary import Record

_FIELD_NAMES = {  # the iteration line's labels
    "consumed samples": v.CONSUMED_SAMPLES,
    "elapsed time per iteration (ms)": v.ELAPSED_MS,
    "throughput per GPU (TFLOP/s/GPU)": v.THROUGHPUT_TFLOPS,
    "learning rate": v.LEARNING_RATE,
    "global batch size": v.GLOBAL_BATCH_SIZE,
    "lm loss": v.LM_LOSS,
    "loss scale": v.LOSS_SCALE,
    "grad norm": v.GRAD_NORM,
    "number of skipped iterations": v.SKIPPED_ITERATIONS,
    "number of nan iterations": v.NAN_ITERATIONS,
}
_MEMORY_NAMES = {  # the memory report's labels, by the unit its header names
    # Megatron-LM's report_memory (megatron/training/utils/common_utils.py): MiB.
    "MB": {
        "allocated": v.MEM_ALLOCATED_MB,
        "max allocated": v.MEM_MAX_ALLOCATED_MB,
        "reserved": v.MEM_RESERVED_MB,
        "max reserved": v.MEM_MAX_RESERVED_MB,
    },
    # Megatron Bridge's report_memory with its default MEMORY_KEYS
    # (src/megatron/bridge/training/utils/train_utils.py): byte statistics / 1e9 under
    # "*-gigabytes" labels, two allocator counters as they are ("retires" is Bridge's spelling).
    "GB": {
        "mem-allocated-gigabytes": v.MEM_ALLOCATED_GB,
        "mem-active-gigabytes": v.MEM_ACTIVE_GB,
        "mem-inactive-gigabytes": v.MEM_INACTIVE_GB,
        "mem-reserved-gigabytes": v.MEM_RESERVED_GB,
        "mem-max-allocated-gigabytes": v.MEM_MAX_ALLOCATED_GB,
        "mem-max-active-gigabytes": v.MEM_MAX_ACTIVE_GB,
        "mem-max-inactive-gigabytes": v.MEM_MAX_INACTIVE_GB,
        "mem-max-reserved-gigabytes": v.MEM_MAX_RESERVED_GB,
        "mem-alloc-retires": v.MEM_ALLOC_RETRY_COUNT,
        "mem-allocated-count": v.MEM_ALLOCATION_COUNT,
    },
}
_TIMER_NAMES = {"save-checkpoint": v.SAVE_CHECKPOINT_MS, "load-checkpoint": v.LOAD_CHECKPOINT_MS}

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf"
# Bridge's (and Megatron-LM's) iteration line starts with the wall clock, e.g.
# " [2026-12-01 12:30:49] iteration       21/      30 | ..." (jobscripts/megatron_log.py).
_STEP_CLOCK = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)\]\s+iteration\s+\d+\s*/")
_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)")
_FIELD = re.compile(r"\s*([^|:]+?)\s*:\s*([^|]*?)\s*\|")
_VALIDATION = re.compile(r"validation loss at iteration (\d+)(?: on (\w+) set)?\s*\|(.*)")
_STEP_TIME = re.compile(
    rf"Step Time\s*:\s*({_NUMBER})s\s+GPU utilization\s*:\s*({_NUMBER})\s*MODEL_TFLOP/s/GPU"
)
_MEMORY = re.compile(r"(?:\[Rank (\d+)\]\s*)?\(after (\d+) iterations\) memory \((MB|GB)\)(.*)")
_SAVED = re.compile(r"successfully saved checkpoint from iteration\s+(\d+) to (\S+)")
_LOADED = re.compile(r"successfully loaded checkpoint from (\S+).*? at iteration (\d+)")
_FALLBACK = re.compile(r"checkpoint fallback: (.*?)\s*$")
_TIMER = re.compile(
    rf"\b(save-checkpoint|load-checkpoint)\s*\.*\s*:\s*\(({_NUMBER}),\s*({_NUMBER})\)"
)
_SLURM_CANCEL = re.compile(
    r"\*\*\* (?:JOB|STEP) (\S+) ON (\S+) CANCELLED AT \S+(?: DUE TO ([A-Z ]+?))? \*\*\*"
)
_EXITS = (  # (pattern, reason, group holding the iteration or 0); the first match wins
    (re.compile(r"exiting program after receiving (SIG\w+)"), v.SIGNAL, 0),
    (re.compile(rf"exiting program after ({_NUMBER}) minutes"), v.TIME_LIMIT, 0),
    (re.compile(r"exiting program at iteration (\d+)"), v.EXIT_INTERVAL, 1),
    (re.compile(r"\[after training is done\]"), v.COMPLETED, 0),
    (re.compile(r"training failed at iteration (\d+): (.*)"), v.FAILED, 1),
    (re.compile(r"found NaN in (.*)"), v.EXIT_NAN, 0),
    (re.compile(r"srun: error: \S+: tasks? [\d,-]+: Exited with exit code [1-9]"), v.FAILED, 0),
    (re.compile(r"ChildFailedError"), v.FAILED, 0),
)
_SLURM_REASONS = {
    "TIME LIMIT": v.EXIT_SLURM_TIME_LIMIT,
    "PREEMPTION": v.EXIT_PREEMPTED,
    "NODE FAILURE": v.EXIT_NODE_FAIL,
}


def _derived(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")


def metric_name(label: str) -> str:
    """Megatron's label -> our metric name; labels we do not know (MoE losses, params norm)
    get a derived name rather than being dropped."""
    label = label.strip()
    return _FIELD_NAMES.get(label) or _derived(label)


def memory_metric_name(unit: str, label: str) -> str:
    """A memory report's label -> our metric name, in the report's own unit. A label of a
    custom Bridge ``memory_keys`` is derived: ``*-gigabytes`` -> ``*_gb``; any other is a
    torch allocator counter, kept under its own name."""
    label = label.strip()
    known = _MEMORY_NAMES[unit].get(label)
    if known:
        return known
    if unit == "MB":
        return _derived(label) + "_mb"
    return re.sub(r"(^|_)gigabytes(_|$)", r"\1gb\2", _derived(label))


def _number(text: str) -> float | None:
    match = re.fullmatch(rf"\s*({_NUMBER})\s*", text)
    return float(match.group(1)) if match else None


def _pairs(text: str) -> Iterator[tuple[str, float]]:
    """``label: value |`` pairs; NaN/inf values are dropped (Megatron omits a NaN loss too)."""
    for label, raw in _FIELD.findall(text + ("" if text.rstrip().endswith("|") else "|")):
        value = _number(raw)
        if value is not None and math.isfinite(value):
            yield label, value


def _fields(text: str) -> dict[str, float]:
    return {metric_name(label): value for label, value in _pairs(text)}


def _memory(match: re.Match) -> Record:
    # Values stay in the unit the header names: Bridge's GB are what its report_memory printed
    # (bytes / 1e9), and its counters are counts, not sizes.
    unit = match.group(3)
    metrics = {memory_metric_name(unit, label): value
               for label, value in _pairs(match.group(4).lstrip(" |"))}
    return Record(v.MEMORY, int(match.group(2)), metrics, {"rank": match.group(1) or "0"})


def _validation(match: re.Match) -> Record:
    split = match.group(2) or "validation"
    prefix = "test_" if split == "test" else "val_"
    metrics = {}
    for label, value in _pairs(match.group(3)):
        name, _, measure = label.rpartition(" ")
        if measure in ("value", "PPL"):
            metrics[prefix + metric_name(name) + ("_ppl" if measure == "PPL" else "")] = value
    return Record(v.VALIDATION, int(match.group(1)), metrics, {"split": split})


def _exit(line: str) -> Record | None:
    match = _SLURM_CANCEL.search(line)
    if match:
        reason = _SLURM_REASONS.get(match.group(3) or "", v.EXIT_CANCELLED)
        detail = {"reason": reason, "job": match.group(1), "message": line.strip()}
        return Record(v.EXIT, detail=detail)
    for pattern, reason, group in _EXITS:
        match = pattern.search(line)
        if match:
            iteration = int(match.group(group)) if group else None
            return Record(v.EXIT, iteration, detail={"reason": reason, "message": line.strip()})
    return None


def step_clock(line: str) -> datetime | None:
    """The wall clock (the node's, no zone) an iteration line starts with, or None."""
    match = _STEP_CLOCK.search(line)
    if match is None:
        return None
    try:
        return datetime.fromisoformat(match.group(1))
    except ValueError:
        return None


def parse_line(line: str) -> Record | None:
    """The record one log line carries, or None for lines that carry none."""
    if "|" in line:
        match = _VALIDATION.search(line)
        if match:
            return _validation(match)
        match = _ITERATION.search(line)
        if match:
            metrics = {v.TRAIN_ITERS: float(match.group(2)), **_fields(match.group(3))}
            return Record(v.TRAIN, int(match.group(1)), metrics)
        match = _MEMORY.search(line)
        if match:
            return _memory(match)
    match = _STEP_TIME.search(line)
    if match:
        metrics = {v.STEP_TIME_S: float(match.group(1)),
                   v.MODEL_TFLOPS_PER_GPU: float(match.group(2))}
        return Record(v.THROUGHPUT, None, metrics)
    match = _SAVED.search(line)
    if match:
        return Record(v.CHECKPOINT_SAVE, int(match.group(1)), detail={"path": match.group(2)})
    match = _LOADED.search(line)
    if match:
        return Record(v.CHECKPOINT_LOAD, int(match.group(2)), detail={"path": match.group(1)})
    match = _FALLBACK.search(line)
    if match:
        return Record(v.CHECKPOINT_FALLBACK, detail={"reason": match.group(1)})
    match = _TIMER.search(line)
    if match:  # (min, max) across ranks: the slowest rank is the time the job waited
        return Record(v.TIMER, None, {_TIMER_NAMES[match.group(1)]: float(match.group(3))})
    return _exit(line)


def parse_lines(lines: Iterable[str]) -> Iterator[Record]:
    """Records of a log stream, in order.

    A throughput (``Step Time``) line takes the iteration of the NEXT iteration line: Bridge's
    ``training_log`` prints it first, then the iteration line of the same logging interval. One
    that no iteration line follows (the job died in between) comes out without an iteration.
    Timer lines take the iteration of the last checkpoint saved or loaded.
    """
    waiting: Record | None = None  # a throughput record until its iteration line arrives
    last_checkpoint = None
    for line in lines:
        record = parse_line(line)
        if record is None:
            continue
        if record.kind == v.THROUGHPUT:
            if waiting is not None:  # two in a row: the first one's iteration never printed
                yield waiting
            waiting = record
            continue
        if record.kind == v.TRAIN and waiting is not None:
            waiting.iteration = record.iteration
            yield waiting
            waiting = None
        elif record.kind in (v.CHECKPOINT_SAVE, v.CHECKPOINT_LOAD):
            last_checkpoint = record.iteration
        elif record.kind == v.TIMER:
            record.iteration = last_checkpoint
        yield record
    if waiting is not None:
        yield waiting


def metric_points(records: Iterable[Record]) -> list[tuple[str, float, int]]:
    """(metric name, value, iteration) for every record that has both."""
    return [
        (name, value, record.iteration)
        for record in records
        if record.iteration is not None
        for name, value in record.metrics.items()
    ]
