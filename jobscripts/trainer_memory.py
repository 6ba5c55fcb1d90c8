"""The reference trainer's memory report: what Megatron Bridge's ``report_memory`` reads from
``torch.cuda.memory_stats()``, measured for a CPU process.

The keys are Bridge's default ``MEMORY_KEYS`` names (src/megatron/bridge/training/utils/
train_utils.py), byte statistics renamed ``*-gigabytes`` and converted as Bridge converts them.
Bridge leaves out a key torch does not report, and so does this: a CPU process has no caching
allocator, hence no active/inactive/reserved bytes and no allocation retries.
"""

from __future__ import annotations

import gc

import torch

from jobscripts.megatron_log import gigabytes


def _resident_bytes() -> tuple[int, int]:
    """(current, peak) resident memory. One read of /proc/self/status: there the kernel gives
    VmHWM as at least VmRSS, which getrusage's lazily updated ru_maxrss is not."""
    with open("/proc/self/status") as status:
        kib = {key: int(rest.split()[0]) for key, _, rest in
               (line.partition(":") for line in status) if key in ("VmRSS", "VmHWM")}
    return kib["VmRSS"] * 1024, kib["VmHWM"] * 1024


def _live_storages() -> int:
    # The allocations torch holds right now: one per distinct tensor storage (views share one).
    # type(), not isinstance(): isinstance asks some lazy module proxies for __class__, which warns.
    pointers = {obj.untyped_storage().data_ptr() for obj in gc.get_objects()
                if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu"}
    return len(pointers - {0})


def memory_report() -> dict[str, float | int]:
    """Current and peak resident memory stand for allocated bytes (GB), live storages for
    ``allocation.all.current`` (a count); in Bridge's key order."""
    current, peak = _resident_bytes()
    return {
        "mem-allocated-gigabytes": gigabytes(current),
        "mem-max-allocated-gigabytes": gigabytes(peak),
        "mem-allocated-count": _live_storages(),
    }
