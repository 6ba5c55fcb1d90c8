"""TEST-ONLY fault injection for the CPU reference trainer: a hang, a loss spike, NaN steps.

Tests of the hang watchdog and of the loss-spike guard need a job that misbehaves on cue, on
the real cluster, under the real triggerer. A test writes ``.reference-faults.json`` into the
campaign's checkpoint directory (the ``save`` path, which every segment of the campaign
shares); the reference trainer reads it at start. Megatron Bridge never reads it: nothing on
the production path imports this module, and the file is never rendered by the DAGs.

    {"hang": {"at_iteration": 5, "signals": true},
     "loss_spike": {"from_sample": 64, "samples": 16, "factor": 8.0},
     "nan": {"from_sample": 96, "samples": 8}}

- ``hang`` fires once: after iteration ``at_iteration`` is done (logged, saved when due) the
  trainer stops making progress and sleeps. The entry is removed from the file before the
  sleep, so the retry that resumes from the checkpoint trains on. ``signals: true`` (default)
  lets SIGTERM/SIGUSR1 end the hang as at any iteration boundary (save, then stop); ``false``
  ignores them, like a rank stuck in a collective, so only SIGKILL ends it.
- ``loss_spike`` and ``nan`` are tied to the data, not to the iteration, like a bad batch:
  every global batch whose samples overlap ``[from_sample, from_sample + samples)`` reports
  its loss times ``factor`` (or NaN, counted as Megatron counts a NaN iteration). A run that
  skips those batches never sees the fault again. Only the reported loss changes: the weights
  are trained as without the fault, so a rolled-back run's losses are comparable.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from jobscripts.job_files import REFERENCE_FAULTS
from jobscripts.results import write_json_atomic


@dataclass(frozen=True)
class SampleRange:
    start: int
    count: int
    factor: float = 1.0

    def overlaps(self, first: int, count: int) -> bool:
        return first < self.start + self.count and self.start < first + count


def _sample_range(entry: object, name: str, *, factor: bool) -> SampleRange | None:
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise ValueError(f"{REFERENCE_FAULTS}: {name} must be an object")
    try:
        return SampleRange(int(entry["from_sample"]), int(entry["samples"]),
                           float(entry.get("factor", 1.0)) if factor else 1.0)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{REFERENCE_FAULTS}: {name}: {exc!r}") from exc


class InjectedFaults:
    """The faults one trainer process injects, read from ``<save>/.reference-faults.json``."""

    def __init__(self, path: Path | None, spec: dict) -> None:
        self.path = path
        self.spec = spec
        hang = spec.get("hang")
        self.hang_at = int(hang["at_iteration"]) if isinstance(hang, dict) else None
        self.hang_signals = bool(hang.get("signals", True)) if isinstance(hang, dict) else True
        self.spike = _sample_range(spec.get("loss_spike"), "loss_spike", factor=True)
        self.nan = _sample_range(spec.get("nan"), "nan", factor=False)

    @classmethod
    def none(cls) -> InjectedFaults:
        return cls(None, {})

    @classmethod
    def from_save_dir(cls, save: str | os.PathLike[str] | None) -> InjectedFaults:
        if not save:
            return cls.none()
        path = Path(save) / REFERENCE_FAULTS
        try:
            spec = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return cls.none()
        if not isinstance(spec, dict):
            raise ValueError(f"{path}: must hold a JSON object")
        unknown = set(spec) - {"hang", "loss_spike", "nan"}
        if unknown:
            raise ValueError(f"{path}: unknown fault(s) {sorted(unknown)}")
        return cls(path, spec)

    def reported_loss(self, first_sample: int, samples: int, loss: float | None) -> float | None:
        """The loss the trainer logs for the global batch of ``samples`` from ``first_sample``."""
        if loss is None:
            return None
        if self.nan is not None and self.nan.overlaps(first_sample, samples):
            return None
        if self.spike is not None and self.spike.overlaps(first_sample, samples):
            return loss * self.spike.factor
        return loss

    def after_iteration(self, iteration: int, interrupted) -> None:
        """Hang here when the test asked for it at ``iteration``; ``interrupted()`` says
        whether a stop signal arrived (honoured only when the hang ``signals``)."""
        if self.hang_at is None or iteration != self.hang_at:
            return
        self._forget("hang")  # fires once: the resumed retry must train on
        print(f"reference_trainer: TEST FAULT: hanging after iteration {iteration}", flush=True)
        while not (self.hang_signals and interrupted()):
            time.sleep(0.2)

    def _forget(self, name: str) -> None:
        self.spec = {k: v for k, v in self.spec.items() if k != name}
        self.hang_at = None if name == "hang" else self.hang_at
        if self.path is not None:
            write_json_atomic(self.path, self.spec)
