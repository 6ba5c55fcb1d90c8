"""Metric records from Megatron-LM / Megatron Bridge training logs and the CPU reference
trainer's (which prints the same formats; DESIGN.md §4).

Pure and light (standard library only): it runs in the Airflow worker and the triggerer on
log tails. Lines may carry prefixes added by srun (``0: ``), torchrun (``[default0]:``) or a
timestamp, so every pattern is searched, never anchored at the line start.

    parse_line(line) -> Record | None        one line, no context
    parse_lines(lines) -> Iterator[Record]   a stream; fills in the iteration that
                                             throughput and timer lines do not print
    metric_points(records) -> [(name, value, step)]   ready for MLflow's log_batch
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

# Record kinds
TRAIN = "train"
VALIDATION = "validation"
THROUGHPUT = "throughput"
MEMORY = "memory"
CHECKPOINT_SAVE = "checkpoint_save"
CHECKPOINT_LOAD = "checkpoint_load"
CHECKPOINT_FALLBACK = "checkpoint_fallback"
TIMER = "timer"
EXIT = "exit"

# Metric names: the one definition of every name that reaches MLflow.
TRAIN_ITERS = "train_iters"
CONSUMED_SAMPLES = "consumed_samples"
ELAPSED_MS = "elapsed_time_per_iteration_ms"
THROUGHPUT_TFLOPS = "throughput_tflops_per_gpu"
LEARNING_RATE = "learning_rate"
GLOBAL_BATCH_SIZE = "global_batch_size"
LM_LOSS = "lm_loss"
LOSS_SCALE = "loss_scale"
GRAD_NORM = "grad_norm"
SKIPPED_ITERATIONS = "skipped_iterations"
NAN_ITERATIONS = "nan_iterations"
VAL_LM_LOSS = "val_lm_loss"
VAL_LM_LOSS_PPL = "val_lm_loss_ppl"
STEP_TIME_S = "step_time_s"
MODEL_TFLOPS_PER_GPU = "model_tflops_per_gpu"
MEM_ALLOCATED_MB = "mem_allocated_mb"
MEM_MAX_ALLOCATED_MB = "mem_max_allocated_mb"
MEM_RESERVED_MB = "mem_reserved_mb"
MEM_MAX_RESERVED_MB = "mem_max_reserved_mb"
SAVE_CHECKPOINT_MS = "save_checkpoint_ms"
LOAD_CHECKPOINT_MS = "load_checkpoint_ms"

# Exit reasons (Record.detail["reason"]); the first four match segment.json's stop_reason.
EXIT_COMPLETED = "completed"
EXIT_TIME_LIMIT = "time_limit"
EXIT_SIGNAL = "signal"
EXIT_FAILED = "failed"
EXIT_INTERVAL = "exit_interval"
EXIT_NAN = "nan"
EXIT_SLURM_TIME_LIMIT = "slurm_time_limit"
EXIT_PREEMPTED = "preempted"
EXIT_NODE_FAIL = "node_fail"
EXIT_CANCELLED = "cancelled"

_FIELD_NAMES = {
    "consumed samples": CONSUMED_SAMPLES,
    "elapsed time per iteration (ms)": ELAPSED_MS,
    "throughput per GPU (TFLOP/s/GPU)": THROUGHPUT_TFLOPS,
    "learning rate": LEARNING_RATE,
    "global batch size": GLOBAL_BATCH_SIZE,
    "lm loss": LM_LOSS,
    "loss scale": LOSS_SCALE,
    "grad norm": GRAD_NORM,
    "number of skipped iterations": SKIPPED_ITERATIONS,
    "number of nan iterations": NAN_ITERATIONS,
    "allocated": MEM_ALLOCATED_MB,
    "max allocated": MEM_MAX_ALLOCATED_MB,
    "reserved": MEM_RESERVED_MB,
    "max reserved": MEM_MAX_RESERVED_MB,
}
_TIMER_NAMES = {"save-checkpoint": SAVE_CHECKPOINT_MS, "load-checkpoint": LOAD_CHECKPOINT_MS}

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf"
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
    (re.compile(r"exiting program after receiving (SIG\w+)"), EXIT_SIGNAL, 0),
    (re.compile(rf"exiting program after ({_NUMBER}) minutes"), EXIT_TIME_LIMIT, 0),
    (re.compile(r"exiting program at iteration (\d+)"), EXIT_INTERVAL, 1),
    (re.compile(r"\[after training is done\]"), EXIT_COMPLETED, 0),
    (re.compile(r"training failed at iteration (\d+): (.*)"), EXIT_FAILED, 1),
    (re.compile(r"found NaN in (.*)"), EXIT_NAN, 0),
    (re.compile(r"srun: error: \S+: tasks? [\d,-]+: Exited with exit code [1-9]"), EXIT_FAILED, 0),
    (re.compile(r"ChildFailedError"), EXIT_FAILED, 0),
)
_SLURM_REASONS = {
    "TIME LIMIT": EXIT_SLURM_TIME_LIMIT,
    "PREEMPTION": EXIT_PREEMPTED,
    "NODE FAILURE": EXIT_NODE_FAIL,
}


@dataclass
class Record:
    kind: str
    iteration: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    detail: dict[str, str] = field(default_factory=dict)  # path, reason, rank, split, ...


def metric_name(label: str) -> str:
    """Megatron's label -> our metric name; labels we do not know (MoE losses, params norm)
    get a derived name rather than being dropped."""
    label = label.strip()
    if label in _FIELD_NAMES:
        return _FIELD_NAMES[label]
    return re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")


def _number(text: str) -> float | None:
    match = re.fullmatch(rf"\s*({_NUMBER})\s*", text)
    return float(match.group(1)) if match else None


def _fields(text: str) -> dict[str, float]:
    """``key: value |`` pairs; NaN/inf values are dropped (Megatron omits a NaN loss too)."""
    found = {}
    for label, raw in _FIELD.findall(text + ("" if text.rstrip().endswith("|") else "|")):
        value = _number(raw)
        if value is not None and math.isfinite(value):
            found[metric_name(label)] = value
    return found


def _validation(match: re.Match) -> Record:
    split = match.group(2) or "validation"
    prefix = "test_" if split == "test" else "val_"
    metrics = {}
    for label, raw in _FIELD.findall(match.group(3)):
        value = _number(raw)
        name, _, measure = label.rpartition(" ")
        if value is None or not math.isfinite(value) or measure not in ("value", "PPL"):
            continue
        metrics[prefix + metric_name(name) + ("_ppl" if measure == "PPL" else "")] = value
    return Record(VALIDATION, int(match.group(1)), metrics, {"split": split})


def _exit(line: str) -> Record | None:
    match = _SLURM_CANCEL.search(line)
    if match:
        reason = _SLURM_REASONS.get(match.group(3) or "", EXIT_CANCELLED)
        detail = {"reason": reason, "job": match.group(1), "message": line.strip()}
        return Record(EXIT, detail=detail)
    for pattern, reason, group in _EXITS:
        match = pattern.search(line)
        if match:
            iteration = int(match.group(group)) if group else None
            return Record(EXIT, iteration, detail={"reason": reason, "message": line.strip()})
    return None


def parse_line(line: str) -> Record | None:
    """The record one log line carries, or None for lines that carry none."""
    if "|" in line:
        match = _VALIDATION.search(line)
        if match:
            return _validation(match)
        match = _ITERATION.search(line)
        if match:
            metrics = {TRAIN_ITERS: float(match.group(2)), **_fields(match.group(3))}
            return Record(TRAIN, int(match.group(1)), metrics)
    match = _STEP_TIME.search(line)
    if match:
        metrics = {STEP_TIME_S: float(match.group(1)), MODEL_TFLOPS_PER_GPU: float(match.group(2))}
        return Record(THROUGHPUT, None, metrics)
    match = _MEMORY.search(line)
    if match:
        scale = 1024.0 if match.group(3) == "GB" else 1.0
        metrics = {k: v * scale for k, v in _fields(match.group(4).lstrip(" |")).items()}
        return Record(MEMORY, int(match.group(2)), metrics, {"rank": match.group(1) or "0"})
    match = _SAVED.search(line)
    if match:
        return Record(CHECKPOINT_SAVE, int(match.group(1)), detail={"path": match.group(2)})
    match = _LOADED.search(line)
    if match:
        return Record(CHECKPOINT_LOAD, int(match.group(2)), detail={"path": match.group(1)})
    match = _FALLBACK.search(line)
    if match:
        return Record(CHECKPOINT_FALLBACK, detail={"reason": match.group(1)})
    match = _TIMER.search(line)
    if match:  # (min, max) across ranks: the slowest rank is the time the job waited
        return Record(TIMER, None, {_TIMER_NAMES[match.group(1)]: float(match.group(3))})
    return _exit(line)


def parse_lines(lines: Iterable[str]) -> Iterator[Record]:
    """Records of a log stream, in order. Throughput lines take the iteration of the last
    iteration line; timer lines that of the last checkpoint saved or loaded."""
    last_iteration = last_checkpoint = None
    for line in lines:
        record = parse_line(line)
        if record is None:
            continue
        if record.kind == TRAIN:
            last_iteration = record.iteration
        elif record.kind in (CHECKPOINT_SAVE, CHECKPOINT_LOAD):
            last_checkpoint = record.iteration
        elif record.kind == THROUGHPUT:
            record.iteration = last_iteration
        elif record.kind == TIMER:
            record.iteration = last_checkpoint
        yield record


def metric_points(records: Iterable[Record]) -> list[tuple[str, float, int]]:
    """(metric name, value, iteration) for every record that has both."""
    return [
        (name, value, record.iteration)
        for record in records
        if record.iteration is not None
        for name, value in record.metrics.items()
    ]
