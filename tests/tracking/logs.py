"""Synthetic Megatron training logs in the reference workflow's format (tests and the bench)."""

from __future__ import annotations

import math

GLOBAL_BATCH = 64
SEQ_LENGTH = 4096


def loss(iteration: int) -> float:
    return 2.0 + 9.0 * math.exp(-iteration / 300.0)


def iteration_line(iteration: int, train_iters: int) -> str:
    return (
        f" [2025-06-12 14:03:27] iteration {iteration:>8}/{train_iters:>8} | consumed samples:"
        f" {iteration * GLOBAL_BATCH:>12} | elapsed time per iteration (ms): 11402.3 |"
        f" learning rate: {1.5e-4 * min(1.0, iteration / 100):.6E} | global batch size:"
        f" {GLOBAL_BATCH:>5} | lm loss: {loss(iteration):.6E} | loss scale: 1.0 |"
        f" grad norm: {1.0 + 10.0 / iteration:.3f} | number of skipped iterations:   0 |"
        " number of nan iterations:   0 |"
    )


def segment_log(first: int, last: int, train_iters: int) -> list[str]:
    """Iterations ``first..last`` and a checkpoint save at the end, as one segment's job log."""
    lines = [iteration_line(i, train_iters) for i in range(first, last + 1)]
    lines.append(f"  successfully saved checkpoint from iteration {last:>7} to /ckpt/demo "
                 "[ t 1/1, p 1/1 ]")
    return lines


# Values a line above yields once parsed: its 9 fields (train_iters dropped) + tokens_consumed.
VALUES_PER_ITERATION = 10
