"""The vocabulary of what a training job reports: the kinds of record its log carries, the name
of every metric that reaches MLflow, and why a segment stopped.

The one definition of these names. The log parser (operators/tracking/logparse.py), tracking
(operators/tracking/), the trainers that write ``segment.json`` (jobscripts/reference_trainer.py,
jobscripts/bridge_result.py) and the comparison report all import them from here. It lives in
``jobscripts`` because that package is installed both beside Airflow and in the job venv, and it
imports nothing, so every one of them may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# --- What one log line is (Record.kind) ---
TRAIN = "train"
VALIDATION = "validation"
THROUGHPUT = "throughput"
MEMORY = "memory"
CHECKPOINT_SAVE = "checkpoint_save"
CHECKPOINT_LOAD = "checkpoint_load"
CHECKPOINT_FALLBACK = "checkpoint_fallback"
TIMER = "timer"
EXIT = "exit"
RECORD_KINDS = (TRAIN, VALIDATION, THROUGHPUT, MEMORY, CHECKPOINT_SAVE, CHECKPOINT_LOAD,
                CHECKPOINT_FALLBACK, TIMER, EXIT)


@dataclass
class Record:
    """One parsed log line: its kind, the iteration it belongs to, its metrics (named below)."""

    kind: str
    iteration: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    detail: dict[str, str] = field(default_factory=dict)  # path, reason, rank, split, ...


# --- Metric names (MLflow keys) ---
# The iteration line's fields.
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
# The validation line's.
VAL_LM_LOSS = "val_lm_loss"
VAL_LM_LOSS_PPL = "val_lm_loss_ppl"
# Bridge's "Step Time : ...s GPU utilization: ...MODEL_TFLOP/s/GPU" line.
STEP_TIME_S = "step_time_s"
MODEL_TFLOPS_PER_GPU = "model_tflops_per_gpu"
# Megatron-LM's memory report, "memory (MB) | allocated: ... | max allocated: ...": MiB.
MEM_ALLOCATED_MB = "mem_allocated_mb"
MEM_MAX_ALLOCATED_MB = "mem_max_allocated_mb"
MEM_RESERVED_MB = "mem_reserved_mb"
MEM_MAX_RESERVED_MB = "mem_max_reserved_mb"
# Megatron Bridge's memory report, "memory (GB) | mem-allocated-gigabytes: ...": torch's CUDA
# allocator statistics, bytes / 1e9, and two of its counters, kept as counts.
MEM_ALLOCATED_GB = "mem_allocated_gb"
MEM_ACTIVE_GB = "mem_active_gb"
MEM_INACTIVE_GB = "mem_inactive_gb"
MEM_RESERVED_GB = "mem_reserved_gb"
MEM_MAX_ALLOCATED_GB = "mem_max_allocated_gb"
MEM_MAX_ACTIVE_GB = "mem_max_active_gb"
MEM_MAX_INACTIVE_GB = "mem_max_inactive_gb"
MEM_MAX_RESERVED_GB = "mem_max_reserved_gb"
MEM_ALLOC_RETRY_COUNT = "mem_alloc_retry_count"  # cudaMalloc failures that flushed the cache
MEM_ALLOCATION_COUNT = "mem_allocation_count"  # live allocations
# Timers, "(min, max) time across ranks (ms)": the slowest rank.
SAVE_CHECKPOINT_MS = "save_checkpoint_ms"
LOAD_CHECKPOINT_MS = "load_checkpoint_ms"
# Added by tracking, not printed: the x-axis pre-training runs are compared on.
TOKENS_CONSUMED = "tokens_consumed"
# eval.json key (jobscripts/evaluate.py) -> metric name on the campaign's run.
EVAL_METRICS = {
    "perplexity": "eval_perplexity",
    "bits_per_byte": "eval_bits_per_byte",
    "nll_per_token": "eval_nll_per_token",
    "tokens_evaluated": "eval_tokens",
}

# --- Why a segment stopped: segment.json's stop_reason, and an exit record's detail["reason"] ---
COMPLETED = "completed"  # train_iters reached
TIME_LIMIT = "time_limit"  # a planned end: exit duration, exit interval
SIGNAL = "signal"  # SIGTERM/SIGUSR1 (Slurm's --signal), saved and stopped
FAILED = "failed"
# A pre-queued segment job that did not train: its gate found the segment before it had not
# advanced the checkpoint (jobscripts/segment_gate.py, docs/prequeue.md).
PREQUEUE_REFUSED = "prequeue_refused"
STOP_REASONS = (COMPLETED, TIME_LIMIT, SIGNAL, FAILED, PREQUEUE_REFUSED)
# Only the log tells these apart (segment.json says time_limit or failed).
EXIT_INTERVAL = "exit_interval"
EXIT_NAN = "nan"
EXIT_SLURM_TIME_LIMIT = "slurm_time_limit"
EXIT_PREEMPTED = "preempted"
EXIT_NODE_FAIL = "node_fail"
EXIT_CANCELLED = "cancelled"
