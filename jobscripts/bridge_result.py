"""``segment.json`` for a Megatron Bridge segment, in the reference trainer's shape.

The keys are those jobscripts/reference_trainer.py writes (its module docstring lists them),
so one reader serves both paths. ``end_iteration`` is the last *saved* iteration (the
checkpoint tracker's), never merely the last trained step (``last_step``): a segment that
crashed between saves has not moved the campaign. Bridge adds ``startup_seconds``: job start
(``$PP_JOB_START``, set by the batch script) -> the call of ``pretrain()``, where Bridge's
exit timer starts; the next segment's exit duration subtracts that, and only that. Filled
by Bridge callbacks registered as plain functions, so this module imports nothing from
Bridge or torch.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from jobscripts import checkpoints
from jobscripts.vocabulary import COMPLETED, FAILED, SIGNAL, TIME_LIMIT


def _scalar(value: Any) -> float | None:
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, (tuple, list)) and len(value) == 2:  # (sum, count)
        value = value[0] / value[1] if value[1] else None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


JOB_START_ENV = "PP_JOB_START"  # epoch seconds when the batch script started


def startup_seconds(job_start: str | None, process_started: float) -> float:
    """Seconds from the job's start (``$PP_JOB_START``, epoch seconds) to now; without it,
    from this process's start (``time.monotonic()`` then), which misses the container's."""
    try:
        start = float(job_start) if job_start else None
    except ValueError:
        start = None
    if start is not None and math.isfinite(start) and 0 < start <= time.time():
        return time.time() - start
    return time.monotonic() - process_started


class SegmentRecorder:
    """Bridge callbacks (plain functions on its CallbackManager) that fill ``result``."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.seq_length: int | None = None
        self.save_dir: str | None = None
        self.signal_name: str | None = None
        self._mark = time.monotonic()
        self._start_consumed = 0
        self.result: dict[str, Any] = {
            "start_iteration": None, "end_iteration": None, "train_iters": None,
            "stop_reason": FAILED, "stop_detail": None, "checkpoint": None,
            "resumed_from": None, "fallback_reason": None, "last_train": None,
            "last_validation": None, "save_seconds": 0.0, "load_seconds": None, "saves": 0,
            "consumed_samples": None, "tokens_consumed": 0, "train_seconds": 0.0,
            "elapsed_seconds": 0.0, "startup_seconds": None, "last_step": None,
            "error": None,
            # The reference trainer's newer keys: Megatron's skipped_train_samples from the
            # train state, world_size from torchrun; the iterations skipped, the iterations
            # trained again and the checkpoint lease (the reference trainer's fencing; Bridge's
            # own checkpointing has none) are not known here and stay None.
            "skipped_samples": 0, "skipped_iterations": None, "world_size": None,
            "lease": None, "iterations_redone": None,
        }

    def configure(self, train_iters: int | None, seq_length: int | None,
                  save_dir: str | None) -> None:
        """What the run will do; called from the YAML first, then from the final config."""
        self.seq_length, self.save_dir = seq_length, save_dir
        self.result["train_iters"] = train_iters
        world = os.environ.get("WORLD_SIZE", "")  # torchrun's, in every rank
        self.result["world_size"] = int(world) if world.isdigit() else None
        tracked = checkpoints.read_tracker(save_dir) if save_dir else None
        if tracked is not None:  # what this segment resumes from
            point = {"path": str(checkpoints.checkpoint_dir(save_dir, tracked)),
                     "iteration": tracked}
            self.result.update(resumed_from=point, checkpoint=dict(point),
                               end_iteration=tracked)

    def timer_started(self, job_start: str | None) -> None:
        """Called just before ``pretrain()``, where Bridge starts its exit timer."""
        self.result["startup_seconds"] = startup_seconds(job_start, self.started)

    def _train_state(self, context):
        return context.state.train_state

    def on_train_start(self, context) -> None:
        ts = self._train_state(context)
        self._start_consumed = ts.consumed_train_samples
        self._mark = time.monotonic()
        # ts.step is the iteration the checkpoint loaded (0 from scratch): saved already.
        self.result.update(start_iteration=ts.step, end_iteration=ts.step, last_step=ts.step,
                           consumed_samples=ts.consumed_train_samples)
        if self.result["startup_seconds"] is None:
            self.result["startup_seconds"] = self._mark - self.started

    def on_train_step_end(self, context) -> None:
        ts, now = self._train_state(context), time.monotonic()
        self.result["train_seconds"] += now - self._mark
        self._mark = now
        optimizer = context.optimizer
        lr = optimizer.param_groups[0]["lr"] if getattr(optimizer, "param_groups", None) else None
        loss = _scalar((context.loss_dict or {}).get("lm loss"))
        self.result.update(last_step=ts.step, consumed_samples=ts.consumed_train_samples,
                           skipped_samples=getattr(ts, "skipped_train_samples", 0) or 0)
        self.result["last_train"] = {"iteration": ts.step, "lm_loss": loss,
                                     "learning_rate": _scalar(lr),
                                     "grad_norm": _scalar(context.grad_norm),
                                     "consumed_samples": ts.consumed_train_samples}
        if self.seq_length:
            self.result["tokens_consumed"] = ((ts.consumed_train_samples - self._start_consumed)
                                              * self.seq_length)

    def on_eval_end(self, context) -> None:
        loss = _scalar((context.total_loss_dict or {}).get("lm loss"))
        self._mark = time.monotonic()  # evaluation is neither training nor saving
        self.result["last_validation"] = {
            "iteration": self._train_state(context).step, "val_lm_loss": loss,
            "val_lm_loss_ppl": math.exp(min(20.0, loss)) if loss is not None else None}

    def on_checkpoint_save(self, context) -> None:
        # Fired once the save is on disk: the time since the last step or evaluation ended
        # is the save (Bridge saves right after a step or an evaluation).
        now, step = time.monotonic(), self._train_state(context).step
        self.result["save_seconds"] += now - self._mark
        self._mark = now
        self.result["saves"] += 1
        self.result["end_iteration"] = step
        if self.save_dir:
            self.result["checkpoint"] = {
                "path": str(checkpoints.checkpoint_dir(self.save_dir, step)), "iteration": step}

    def finish(self, exit_code: int | None, error: str | None) -> dict:
        """Decide why the segment stopped (done wins), stamp the elapsed time. The end
        iteration is what the tracker names now: the last save that completed."""
        r = self.result
        tracked = checkpoints.read_tracker(self.save_dir) if self.save_dir else None
        if tracked is not None:
            r["end_iteration"] = tracked
        end, total = r["end_iteration"], r["train_iters"]
        if error is not None:
            reason, detail = FAILED, error
        elif end is not None and total is not None and end >= total:
            reason, detail = COMPLETED, "train_iters reached"
        elif self.signal_name:
            reason, detail = SIGNAL, f"received {self.signal_name}"
        elif exit_code in (None, 0) and end is not None:
            reason, detail = TIME_LIMIT, "exit_duration_in_mins or exit_interval reached"
        else:
            reason, detail = FAILED, f"exited with code {exit_code}"
        r.update(stop_reason=reason, stop_detail=detail, error=error if reason == FAILED
                 and error else r["error"], elapsed_seconds=time.monotonic() - self.started)
        return r
