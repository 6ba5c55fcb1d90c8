"""Data parallelism for the reference trainer: torch.distributed over gloo (CPU), started by
``torchrun`` (one process per node, as the production job starts one per GPU).

Every rank builds the same seeded model, takes its share of each global batch's micro-batches
(rank r the micro-batches r, r + W, r + 2W, ...: Megatron's sampler gives data-parallel rank r
the r-th micro-batch of every W), and the gradients are summed across ranks before clipping
and the step, so the weights stay identical on every rank and the losses are a 1-process run's
within float summation order. Only rank 0 logs, saves and writes segment.json; stopping is
agreed on by all ranks each iteration, so no rank waits in a collective for one that left.

Without torchrun (``WORLD_SIZE`` unset or 1) nothing here touches the network and a run is
bit-for-bit the single-process trainer's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def micro_batches(self, total: int) -> range:
        """Which of a global batch's ``total`` micro-batches this rank trains on."""
        return range(self.rank, total, self.size)


ALONE = World()  # one process, no torch.distributed


def init_world(timeout_minutes: float) -> World:
    """Join torchrun's process group (its env:// variables), or stay alone."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return ALONE
    import torch.distributed as dist

    # A peer that died leaves the others blocked in a collective until this timeout, unless
    # Slurm (--kill-on-bad-exit) or torchrun ends them first; Megatron's default is 10 min.
    dist.init_process_group("gloo", timeout=timedelta(minutes=timeout_minutes))
    return World(dist.get_rank(), dist.get_world_size())


def close_world(world: World) -> None:
    if world.size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def sum_across(world: World, values: list[float]) -> list[float]:
    """Element-wise sums over the ranks (float64, so a token count stays exact)."""
    if world.size == 1:
        return values
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def any_across(world: World, flags: list[bool]) -> list[bool]:
    """Element-wise OR over the ranks: a stop one rank saw is every rank's stop."""
    if world.size == 1:
        return flags
    import torch.distributed as dist

    tensor = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]


def sum_gradients(world: World, parameters) -> None:
    """Sum every parameter's gradient over the ranks, in one flat buffer (one collective)."""
    if world.size == 1:
        return
    import torch.distributed as dist

    grads = [p.grad for p in parameters if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
