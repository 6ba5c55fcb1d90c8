"""CPU reference trainer: a tiny Llama trained from Megatron ``.bin/.idx`` data, one segment.

    python -m jobscripts.reference_trainer --config run.json [--train-iters N]
        [--exit-duration-in-mins M] [--exit-interval N] [--save DIR] [--load DIR]
        [--segment-result PATH]

It is what the tests and the local cluster run in place of Megatron Bridge, and it behaves the
same way at the edges: Megatron-format log lines (jobscripts/megatron_log.py), checkpoints in
``iter_XXXXXXX/`` with the tracker (jobscripts/checkpoints.py), stop at the exit duration or on
SIGTERM/SIGUSR1 after saving. Resume is exact: weights, AdamW state, RNG states and the data
position (consumed samples) are restored and the learning rate is a pure function of the
iteration, so a run cut into segments logs the same losses as an uncut one.

Config keys (JSON object; Megatron's names; defaults and meaning in trainer_config.py):
  data:       data_path, split, data_cache_path, tokenizer_model | (vocab_size, eod_id)
  model:      num_layers, hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups,
              seq_length, rotary_base, norm_epsilon, init_method_std
  training:   train_iters, global_batch_size, micro_batch_size, lr, min_lr, lr_warmup_iters,
              lr_decay_iters, lr_decay_style, weight_decay, adam_beta1, adam_beta2, adam_eps,
              clip_grad, seed, iterations_to_skip
  validation: eval_interval, eval_iters, log_interval
  checkpoint: save, load, save_interval, keep_last, keep_every
  stopping:   exit_duration_in_mins, exit_interval, exit_signal_handler
  runtime:    num_threads, segment_result, distributed_timeout_minutes
An unknown key is an error naming it. ``train_iters`` sizes the dataset (as in Megatron): keep
it fixed across a campaign's segments and cut segments with the exit options.

segment.json (written atomically, also on failure): start_iteration, end_iteration,
train_iters, stop_reason (completed | time_limit | signal | failed), stop_detail, checkpoint
{path, iteration} of the last complete one, resumed_from {path, iteration}, fallback_reason,
last_train {iteration, lm_loss, learning_rate, grad_norm, consumed_samples}, last_validation
{iteration, val_lm_loss, val_lm_loss_ppl}, save_seconds, load_seconds, saves, consumed_samples,
tokens_consumed (this segment), skipped_samples (the run's, Megatron's skipped_train_samples),
skipped_iterations (this segment's, as logged had they trained), world_size,
iterations_redone (trained again after the resume: a failed run had trained them past its
last checkpoint), lease {job_id, restart_count}, train_seconds, elapsed_seconds, error.

Under ``torchrun`` (several nodes) the run is data-parallel (jobscripts/trainer_dist.py): the
same losses as one process within float tolerance; rank 0 alone logs, saves and writes
segment.json. Checkpoint writes are fenced by a lease (jobscripts/checkpoints.py).
``exit_interval`` stops report ``time_limit`` (a planned segment end) with the detail saying so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from jobscripts import checkpoints
from jobscripts import megatron_log as mlog
from jobscripts.job_files import TRAINING_PROGRESS
from jobscripts.results import write_json_atomic
from jobscripts.trainer_config import TrainerConfig, load_config
from jobscripts.trainer_data import build_datasets, get_batch, load_tokenizer
from jobscripts.trainer_dist import (
    ALONE,
    World,
    any_across,
    close_world,
    init_world,
    sum_across,
    sum_gradients,
)
from jobscripts.trainer_faults import InjectedFaults
from jobscripts.trainer_memory import memory_report
from jobscripts.trainer_state import (
    Position,
    build_model,
    load_state,
    lr_at,
    model_flops_per_token,
    write_state,
)
from jobscripts.vocabulary import COMPLETED, FAILED, SIGNAL, TIME_LIMIT

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "tokenizer.model")


class StopRequest:
    """Signal handler that only records the signal: the loop saves and stops at the next
    iteration boundary, never in the middle of a step or a save."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def __call__(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            self._previous[sig] = signal.signal(sig, self)

    def restore(self) -> None:
        # Matters when main() runs in-process (tests): leave the caller's handlers as found.
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def summed_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy summed over the positions the loss mask keeps."""
    logits = model(input_ids=batch["tokens"]).logits
    losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    return (losses * batch["loss_mask"].flatten()).sum()


def train_step(model, optimizer, dataset, consumed: int, config: TrainerConfig,
               world: World = ALONE):
    """One global batch with gradient accumulation (this rank's share of its micro-batches,
    gradients summed over the ranks): (loss, grad norm, stepped); loss and grad norm are
    None when not finite."""
    micro = config.micro_batch_size
    batches = [get_batch(dataset, consumed + k * micro, micro)
               for k in world.micro_batches(config.grad_accumulation)]
    tokens_total = sum(b["loss_mask"].sum() for b in batches)  # token-weighted mean, as Megatron
    if world.size > 1:
        (tokens_total,) = sum_across(world, [float(tokens_total)])
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for batch in batches:
        loss = summed_loss(model, batch) / tokens_total
        loss.backward()
        loss_sum += loss.item()
    if world.size > 1:
        sum_gradients(world, model.parameters())
        (loss_sum,) = sum_across(world, [loss_sum])
    max_norm = config.clip_grad if config.clip_grad > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    finite = math.isfinite(loss_sum) and math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    # A non-finite step is skipped, as Megatron's loss scaler does, and the loss not logged.
    def finite_or_none(value: float) -> float | None:
        return value if math.isfinite(value) else None

    return finite_or_none(loss_sum), finite_or_none(grad_norm), finite


@torch.no_grad()
def evaluate(model, dataset, config: TrainerConfig) -> float:
    model.eval()
    loss_sum, count = 0.0, 0.0
    for k in range(config.eval_iters * config.grad_accumulation):
        batch = get_batch(dataset, k * config.micro_batch_size, config.micro_batch_size)
        loss_sum += summed_loss(model, batch).item()
        count += batch["loss_mask"].sum().item()
    model.train()
    return loss_sum / count


def save(config, model, optimizer, position: Position, result: dict,
         lease: checkpoints.Lease | None = None) -> None:
    iteration, consumed = position.iteration, position.consumed
    path = checkpoints.checkpoint_dir(config.save, iteration)
    mlog.emit(mlog.saving_line(iteration, config.save))  # Megatron names the root, not iter_*
    started = time.perf_counter()

    def write_files(staging: Path) -> None:
        model.save_pretrained(staging)
        write_state(staging, optimizer, position, config)
        if config.tokenizer_model:  # a self-contained checkpoint: vLLM/AutoTokenizer load it
            for name in _TOKENIZER_FILES:
                source = Path(config.tokenizer_model) / name
                if source.is_file():
                    shutil.copy2(source, staging / name)

    metadata = {"iteration": iteration, "consumed_samples": consumed,
                "skipped_samples": position.skipped}
    if lease is not None:  # which job incarnation wrote it, for whoever audits a failover
        metadata.update(job_id=lease.job_id, restart_count=lease.restart_count)
    checkpoints.save_checkpoint(config.save, iteration, write_files, metadata, lease)
    seconds = time.perf_counter() - started
    mlog.emit(mlog.saved_line(iteration, config.save))
    mlog.emit(mlog.timer_lines("save-checkpoint", seconds * 1000))
    result["save_seconds"] += seconds
    result["saves"] += 1
    result["checkpoint"] = {"path": str(path), "iteration": iteration}
    if config.keep_last is not None:
        for gone in checkpoints.apply_retention(config.save, config.keep_last, config.keep_every,
                                                lease):
            mlog.emit(f"checkpoint retention: removed {checkpoints.ITER_DIR_FORMAT.format(gone)}")


def resume(config, model, optimizer, result: dict) -> Position:
    """Load the resume checkpoint if there is one; the position to continue from."""
    point = checkpoints.find_resume_checkpoint(config.load_dir)
    if point is None:
        return Position()
    if point.fallback_reason:
        mlog.emit(mlog.fallback_line(point.fallback_reason))
        result["fallback_reason"] = point.fallback_reason
    mlog.emit(mlog.loading_line(config.load_dir, point.iteration))
    started = time.perf_counter()
    position = load_state(point.path, model, optimizer, config)
    result["load_seconds"] = time.perf_counter() - started
    mlog.emit(mlog.loaded_line(config.load_dir, position.iteration))
    result["resumed_from"] = {"path": str(point.path), "iteration": position.iteration}
    result["checkpoint"] = dict(result["resumed_from"])
    return position


def stop_reason(config, stop: StopRequest, iteration: int, started: float,
                world: World = ALONE, *, before_first_step: bool = False):
    """(reason, detail) when the segment must end after this iteration, else None. Every
    rank calls it at the same points and they agree: one rank's signal or clock stops all."""
    minutes = (time.monotonic() - started) / 60.0
    out_of_time = (config.exit_duration_in_mins is not None
                   and minutes >= config.exit_duration_in_mins)
    signalled, out_of_time = any_across(world, [stop.signal_name is not None, out_of_time])
    if iteration >= config.train_iters:  # done wins: nothing is left for another segment
        return COMPLETED, mlog.COMPLETED_EVENT
    if signalled:  # torchrun forwards the signal to every rank; name it as this rank got it
        return SIGNAL, mlog.exit_signal_event(stop.signal_name or signal.SIGTERM.name)
    if before_first_step:
        return None
    if out_of_time:
        return TIME_LIMIT, mlog.exit_duration_event(minutes)
    if config.exit_interval and iteration % config.exit_interval == 0:
        return TIME_LIMIT, mlog.exit_interval_event(iteration)
    return None


def _slurm_incarnation() -> tuple[str | None, int]:
    # A requeued job keeps its id; SLURM_RESTART_COUNT tells its incarnations apart.
    return os.environ.get("SLURM_JOB_ID"), int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def _note_progress(config, lease, iteration: int) -> None:
    """The last iteration trained, saved or not (advisory: a resume counts its redone work).
    Checks the lease first: an orphan stops at its first iteration after losing it."""
    lease.check()
    write_json_atomic(Path(config.save) / TRAINING_PROGRESS,
                      {"iteration": iteration, "job_id": lease.job_id,
                       "restart_count": lease.restart_count})


def _redone_iterations(config, resumed_at: int, result: dict) -> None:
    try:
        earlier = json.loads((Path(config.save) / TRAINING_PROGRESS).read_text())
        reached = int(earlier["iteration"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return
    redone = max(0, reached - resumed_at)
    result["iterations_redone"] = redone
    if redone:
        mlog.emit(f"resuming at iteration {resumed_at}: iterations {resumed_at + 1}-{reached} "
                  f"(trained by job {earlier.get('job_id')}, restart "
                  f"{earlier.get('restart_count')}, after its last checkpoint) are trained "
                  f"again: {redone} iteration(s) redone")


def train(config: TrainerConfig, result: dict, stop: StopRequest, started: float,
          world: World = ALONE, held: dict | None = None) -> None:
    """The segment; fills ``result`` as it goes so a failure still reports what was done.
    ``held`` gets the checkpoint lease rank 0 takes (main checks it before segment.json)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a progress bar per save floods the job log
    torch.set_num_threads(config.num_threads)
    torch.use_deterministic_algorithms(True)
    tokenizer = load_tokenizer(config)
    train_data, valid_data = build_datasets(config, tokenizer)
    model, optimizer = build_model(config, tokenizer.vocab_size, tokenizer.eod)
    lease = None
    if world.main:
        checkpoints.remove_stale_temp(config.save)
        # From here on, older writers of this checkpoint root (orphans) are fenced.
        lease = checkpoints.take_lease(config.save, *_slurm_incarnation())
        if held is not None:
            held["lease"] = lease
        result["lease"] = {"job_id": lease.job_id, "restart_count": lease.restart_count}
    faults = InjectedFaults.from_save_dir(config.save)  # test-only; none in production
    position = resume(config, model, optimizer, result)
    if world.main:
        _redone_iterations(config, position.iteration, result)
    iteration, consumed = position.iteration, position.consumed
    result.update(start_iteration=iteration, end_iteration=iteration, consumed_samples=consumed,
                  skipped_samples=position.skipped)
    start_consumed = consumed
    to_skip = set(config.iterations_to_skip)
    flops_per_iteration = model_flops_per_token(config, tokenizer.vocab_size) * (
        config.global_batch_size * config.seq_length)
    window = {"seconds": 0.0, "steps": 0, "loss": 0.0, "losses": 0, "skipped": 0, "nan": 0}
    # A signal during start-up, or a finished run, stops before any step.
    decision = stop_reason(config, stop, iteration, started, world, before_first_step=True)
    saved_at = loaded_iteration = iteration
    report_memory_flag = True  # Bridge's: the first logging steps report memory
    while decision is None:
        if iteration in to_skip:
            # Megatron's "completely skip iteration": the batch is consumed, nothing trains,
            # and the step logs, evaluates, saves and checks exits nothing (`continue`).
            iteration += 1
            consumed += config.global_batch_size
            position.skipped += config.global_batch_size
            result["skipped_iterations"].append(iteration)
            result.update(end_iteration=iteration, consumed_samples=consumed,
                          skipped_samples=position.skipped)
            if iteration >= config.train_iters:
                decision = stop_reason(config, stop, iteration, started, world)
            continue
        step_started = time.perf_counter()
        position.iteration = iteration
        lr = lr_at(position.trained_steps(config.global_batch_size) + 1, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, grad_norm, ok = train_step(model, optimizer, train_data, consumed, config, world)
        loss = faults.reported_loss(consumed, config.global_batch_size, loss)
        step_seconds = time.perf_counter() - step_started
        iteration += 1
        consumed += config.global_batch_size
        result.update(end_iteration=iteration, consumed_samples=consumed,
                      tokens_consumed=(consumed - start_consumed) * config.seq_length)
        result["train_seconds"] += step_seconds
        window["seconds"] += step_seconds
        window["steps"] += 1
        window["skipped"] += 0 if ok else 1
        window["nan"] += 1 if loss is None else 0
        if loss is not None:
            window["loss"] += loss
            window["losses"] += 1
        result["last_train"] = {"iteration": iteration, "lm_loss": loss, "learning_rate": lr,
                                "grad_norm": grad_norm, "consumed_samples": consumed}
        if iteration % config.log_interval == 0:
            steps = max(1, window["steps"])  # Megatron averages over the steps it trained
            mean_loss = window["loss"] / window["losses"] if window["losses"] else None
            step_time = window["seconds"] / steps
            # Bridge's training_log order: throughput, the iteration line, the memory report.
            mlog.emit(mlog.throughput_line(step_time, flops_per_iteration / step_time / 1e12))
            mlog.emit(mlog.iteration_line(
                iteration, config.train_iters, consumed, window["seconds"] * 1000 / steps, lr,
                config.global_batch_size, mean_loss, grad_norm, window["skipped"], window["nan"],
                skipped_samples=position.skipped))
            if report_memory_flag:
                mlog.emit(mlog.memory_line(0, iteration, memory_report()))
                # As Bridge: once past the iteration after the resume, optimizer state included.
                report_memory_flag = iteration <= loaded_iteration + 1
            window = dict.fromkeys(window, 0)
        if world.main:
            _note_progress(config, lease, iteration)
        if world.main and config.eval_interval and iteration % config.eval_interval == 0:
            val_loss = evaluate(model, valid_data, config)
            mlog.emit(mlog.framed(mlog.validation_line(iteration, val_loss)))
            result["last_validation"] = {"iteration": iteration, "val_lm_loss": val_loss,
                                         "val_lm_loss_ppl": math.exp(min(20, val_loss))}
        position.iteration, position.consumed = iteration, consumed
        if config.save_interval and iteration % config.save_interval == 0:
            if world.main:  # the weights are the same on every rank: saved once
                save(config, model, optimizer, position, result, lease)
            saved_at = iteration
        faults.after_iteration(iteration, lambda: stop.signal_name is not None)
        decision = stop_reason(config, stop, iteration, started, world)
    reason, detail = decision
    position.iteration, position.consumed = iteration, consumed
    if saved_at != iteration and world.main:
        save(config, model, optimizer, position, result, lease)
    result.update(stop_reason=reason, stop_detail=detail)
    mlog.emit(mlog.datetime_line(detail))


def new_result(config: TrainerConfig | None) -> dict:
    return {
        "start_iteration": None, "end_iteration": None,
        "train_iters": config.train_iters if config else None,
        "stop_reason": FAILED, "stop_detail": None, "checkpoint": None, "resumed_from": None,
        "fallback_reason": None, "last_train": None, "last_validation": None,
        "save_seconds": 0.0, "load_seconds": 0.0, "saves": 0, "consumed_samples": None,
        "skipped_samples": 0, "skipped_iterations": [], "world_size": 1, "lease": None,
        "iterations_redone": 0,
        "tokens_consumed": 0, "train_seconds": 0.0, "elapsed_seconds": 0.0, "error": None,
    }


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m jobscripts.reference_trainer",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="run config JSON (keys: module doc)")
    parser.add_argument("--train-iters", type=int)
    parser.add_argument("--exit-duration-in-mins", type=float)
    parser.add_argument("--exit-interval", type=int)
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--segment-result", help="where segment.json goes")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k != "config"}
    try:
        config = load_config(args.config, overrides)
    except (OSError, ValueError, TypeError) as exc:
        print(f"reference_trainer: bad config {args.config}: {exc}", file=sys.stderr, flush=True)
        return 2
    result = new_result(config)
    # Process-wide torch settings, put back afterwards for callers that run main() in-process.
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    stop = StopRequest()
    if config.exit_signal_handler:
        stop.install()
    code, fenced, world, held = 0, False, ALONE, {}
    with contextlib.ExitStack() as quiet:
        try:
            world = init_world(config.distributed_timeout_minutes)
            result["world_size"] = world.size
            if not world.main:  # one log: rank 0's (errors still reach stderr)
                quiet.enter_context(contextlib.redirect_stdout(open(os.devnull, "w")))  # noqa: SIM115
            train(config, result, stop, started, world, held)
        except Exception as exc:
            traceback.print_exc()
            fenced = isinstance(exc, checkpoints.FencedError)
            mlog.emit(mlog.failed_line(result["end_iteration"] or 0, repr(exc)))
            result.update(stop_reason=FAILED, error=f"{type(exc).__name__}: {exc}")
            code = 1
        finally:
            stop.restore()
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(deterministic)
            result["elapsed_seconds"] = time.monotonic() - started
            close_world(world)
            if "lease" in held and not fenced:
                try:  # an orphan that failed some other way (its peers gone) is fenced too
                    held["lease"].check()
                except checkpoints.FencedError as exc:
                    print(f"reference_trainer: {exc}", file=sys.stderr, flush=True)
                    fenced = True
            # segment.json is rank 0's; a fenced orphan's would overwrite the live job's.
            if world.main and not fenced:
                write_json_atomic(config.segment_result, result)
    return code


if __name__ == "__main__":
    sys.exit(main())
