"""Log lines in Megatron Bridge's / Megatron-LM's exact formats, so one parser
(operators/tracking/logparse.py) serves the reference trainer and Megatron Bridge alike.

The training-log lines are Bridge's ``training_log`` (src/megatron/bridge/training/utils/
train_utils.py), in its order: the ``Step Time`` line, then the iteration line it measures, then,
on the first logging steps only, the memory report. Checkpoint and timer lines follow
Megatron-LM's ``checkpointing.py``/``timers.py``. Keep the formats byte-for-byte. Every function
returns the text; ``emit`` prints and flushes (Slurm buffers otherwise).
"""

from __future__ import annotations

import math
import sys
import time
from datetime import datetime


def emit(text: str) -> None:
    print(text, flush=True)
    sys.stderr.flush()


def iteration_line(
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms: float,
    learning_rate: float,
    global_batch_size: int,
    lm_loss: float | None,
    grad_norm: float | None,
    skipped: int,
    nan: int,
    loss_scale: float = 1.0,
    skipped_samples: int = 0,
) -> str:
    # Bridge starts the line with the wall-clock time (Megatron-LM adds microseconds).
    text = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
    text += f" iteration {iteration:8d}/{train_iters:8d} |"
    text += f" consumed samples: {consumed_samples:12d} |"
    if skipped_samples > 0:  # Megatron-LM's field for --iterations-to-skip, only once nonzero
        text += f" skipped samples: {skipped_samples:12d} |"
    text += f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
    text += f" learning rate: {learning_rate:.6E} |"
    text += f" global batch size: {global_batch_size:5d} |"
    if lm_loss is not None:  # Megatron leaves the loss out when it is NaN
        text += f" lm loss: {lm_loss:.6E} |"
    text += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        text += f" grad norm: {grad_norm:.3f} |"
    text += f" number of skipped iterations: {skipped:3d} |"
    text += f" number of nan iterations: {nan:3d} |"
    return text


def validation_line(iteration: int, lm_loss: float) -> str:
    ppl = math.exp(min(20, lm_loss))
    text = f" validation loss at iteration {iteration} | "
    text += f"lm loss value: {lm_loss:.6E} | "
    text += f"lm loss PPL: {ppl:.6E} | "
    return text


def framed(text: str) -> str:
    # Megatron prints validation results between dashed rules of the line's length.
    rule = "-" * (len(text) + 1)
    return f"{rule}\n{text}\n{rule}"


def throughput_line(step_seconds: float, model_tflops: float) -> str:
    # Bridge's, printed BEFORE the iteration line of the same logging interval. On CPU the "GPU"
    # is the process, and a tiny model needs more decimals than Bridge's .1f to show anything:
    # the value's precision is the one difference, the shape is Bridge's.
    return f"Step Time : {step_seconds:.2f}s GPU utilization: {model_tflops:.6f}MODEL_TFLOP/s/GPU"


def gigabytes(n_bytes: float) -> float:
    """Bridge's ``report_memory`` conversion: bytes / 1e9, rounded to 5 significant digits."""
    value = n_bytes / 1.0e9
    if value != 0:
        value = round(value, -int(math.floor(math.log10(abs(value)))) + 4)
    return value


def memory_line(rank: int, iteration: int, report: dict[str, float | int]) -> str:
    # Bridge's memory report: "*-gigabytes" values in GB, allocator counters as plain counts,
    # each printed as Python prints it (no format spec).
    text = f"(after {iteration} iterations) memory (GB)"
    for metric, value in report.items():
        text += f" | {metric}: {value}"
    return f"[Rank {rank}] {text}"


def timer_lines(name: str, milliseconds: float) -> str:
    padded = (name + " ").ljust(48, ".")
    times = f"({milliseconds:.2f}, {milliseconds:.2f})"
    return f"(min, max) time across ranks (ms):\n    {padded}: {times}"


def saving_line(iteration: int, path: str) -> str:
    return f"saving checkpoint at iteration {iteration:7d} to {path} in torch format"


def saved_line(iteration: int, path: str) -> str:
    ranks = "[ t 1/1, p 1/1 ]"  # tensor/pipeline rank: one process here
    return f"  successfully saved checkpoint from iteration {iteration:7d} to {path} {ranks}"


def loading_line(path: str, iteration: int) -> str:
    return f"loading checkpoint from {path} at iteration {iteration}"


def loaded_line(path: str, iteration: int) -> str:
    return f"  successfully loaded checkpoint from {path} [ t 1/1, p 1/1 ] at iteration {iteration}"


def fallback_line(reason: str) -> str:
    return f"WARNING: checkpoint fallback: {reason}"


def datetime_line(event: str) -> str:
    # Megatron's print_datetime: "[event] datetime: YYYY-mm-dd HH:MM:SS "
    return "[{}] datetime: {} ".format(event, time.strftime("%Y-%m-%d %H:%M:%S"))


def exit_duration_event(minutes: float) -> str:
    return f"exiting program after {minutes} minutes"


def exit_interval_event(iteration: int) -> str:
    return f"exiting program at iteration {iteration}"


def exit_signal_event(signal_name: str) -> str:
    return f"exiting program after receiving {signal_name}."


COMPLETED_EVENT = "after training is done"


def failed_line(iteration: int, error: str) -> str:
    return f"training failed at iteration {iteration}: {error}"
