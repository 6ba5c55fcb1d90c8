"""The loss-spike watcher: a segment whose logged loss rises above ``factor`` x the running
median of the last ``window`` logged losses, or that logs NaN or skipped iterations, is
flagged (docs/health.md). Pure: it runs in the triggerer on the log stream the trigger already
reads (operators/slurm/watch.py's extension point, through MegatronLogWatcher).

A finding never ends the wait by itself: the job trains on to its end unless the campaign
asks to stop the running segment too (``health.loss_spike.stop_running``: SIGTERM, the
trainer saves, then ``scancel``); either way the segment task then stops the campaign before
its next segment (operators/campaign/dag/health.py). Its ``detail`` carries the losses around
the spike (``loss@<iteration>``) for the form a human decides on.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jobscripts import vocabulary as v
from jobscripts.vocabulary import Record
from operators.slurm.watch import LogFinding, Tick, WatchSpec, kind_of
from operators.tracking.logparse import parse_lines
from operators.tracking.logwatch import MegatronLogWatcher

SPIKE = "loss_spike"  # LogFinding.code: the loss jumped
NAN_STEPS = "nan_steps"  # LogFinding.code: NaN or skipped iterations
CODES = (SPIKE, NAN_STEPS)
LOSS_KEY_PREFIX = "loss@"  # detail keys: the loss at each iteration around the finding
AROUND = 8  # losses kept before the finding, for the decision form


def is_spike(loss: float, recent: Sequence[float], factor: float, window: int) -> float | None:
    """The running median ``loss`` exceeds ``factor`` times, or None (also before ``window``
    losses were seen: a warm-up's first losses are no baseline). Pure."""
    if len(recent) < window:
        return None
    median = statistics.median(recent[-window:])
    return median if loss > factor * median else None


def loss_detail(losses: Sequence[tuple[int, float]]) -> dict[str, float]:
    return {f"{LOSS_KEY_PREFIX}{i}": value for i, value in losses}


def losses_of(detail: Mapping[str, float]) -> list[tuple[int, float]]:
    """The (iteration, loss) pairs a finding's detail carries, in order."""
    return sorted((int(k[len(LOSS_KEY_PREFIX):]), float(val)) for k, val in detail.items()
                  if k.startswith(LOSS_KEY_PREFIX))


def baseline_losses(lines: Iterable[str], up_to: int, count: int) -> list[tuple[int, float]]:
    """The last ``count`` finite (iteration, lm loss) pairs a job log logged at iterations up
    to ``up_to``, in order: the running median a segment's watcher starts from, so that a
    spike in a segment's first ``window`` iterations (right after a resume, where spikes are
    common) is judged against the campaign's losses, not skipped for want of a baseline.
    Iterations past ``up_to`` (trained before a rollback moved the campaign back) are no
    baseline. Pure."""
    seen: dict[int, float] = {}
    for record in parse_lines(lines):
        loss = record.metrics.get(v.LM_LOSS) if record.kind == v.TRAIN else None
        if record.iteration is not None and record.iteration <= up_to and loss is not None \
                and math.isfinite(loss):
            seen[record.iteration] = loss  # a redone iteration: its last logged loss
    return sorted(seen.items())[-count:] if count > 0 else []


class LossSpikeWatch(MegatronLogWatcher):
    """Params: ``factor`` (> 1), ``window`` (>= 2), ``nan_steps`` (flag NaN/skipped
    iterations), ``stop_running`` (stop the job too), ``grace_s`` (SIGTERM -> scancel),
    ``baseline`` (the (iteration, loss) pairs the campaign logged before this segment: see
    :func:`baseline_losses`). Flags once per segment: the first spike or NaN step is the one
    the human decides on."""

    def __init__(self, params: Mapping[str, Any], state: Mapping[str, Any]) -> None:
        super().__init__(params, state)
        self.factor = float(params["factor"])
        self.window = int(params["window"])
        if not (self.factor > 1 and self.window >= 2):
            raise ValueError("factor must be > 1 and window >= 2")
        self.nan_steps = bool(params.get("nan_steps", True))
        self.stop_running = bool(params.get("stop_running", False))
        self.grace_s = float(params.get("grace_s", 60.0))
        # Carried over a triggerer restart: the losses seen and whether it already fired;
        # a new watcher starts from the campaign's baseline.
        self.recent: list[tuple[int, float]] = [
            (int(i), float(x)) for i, x in state.get("recent", params.get("baseline", ()))]
        self.fired = bool(state.get("fired", False))

    @classmethod
    def spec(cls, factor: float, window: int, nan_steps: bool, stop_running: bool,
             grace_s: float, baseline: Sequence[tuple[int, float]] = ()) -> WatchSpec:
        return WatchSpec(kind_of(cls), {"factor": factor, "window": window,
                                        "nan_steps": nan_steps, "stop_running": stop_running,
                                        "grace_s": grace_s,
                                        "baseline": [[i, x] for i, x in baseline]})

    def state(self) -> Mapping[str, Any]:
        return {"recent": [list(p) for p in self.recent], "fired": self.fired}

    def _flag(self, code: str, reason: str, tick: Tick, iteration: int | None,
              extra: Mapping[str, float]) -> LogFinding:
        self.fired = True
        stop = (", stopping the running segment (SIGTERM, then scancel)"
                if self.stop_running else ", the campaign stops before its next segment")
        return self.finding(code, reason + stop, tick, iteration=iteration,
                            stop_job=self.stop_running, retryable=False, grace_s=self.grace_s,
                            detail={**loss_detail(self.recent[-AROUND:]), **extra})

    def records(self, records: Sequence[Record], tick: Tick) -> Iterable[LogFinding]:
        found: list[LogFinding] = []
        for record in records:
            if self.fired or record.kind != v.TRAIN or record.iteration is None:
                continue
            m, it = record.metrics, record.iteration
            bad = {k: m[k] for k in (v.NAN_ITERATIONS, v.SKIPPED_ITERATIONS) if m.get(k)}
            loss = m.get(v.LM_LOSS)
            if self.nan_steps and (bad or (loss is not None and not math.isfinite(loss))):
                what = ", ".join(f"{int(n)} {k.replace('_', ' ')}" for k, n in bad.items()) \
                    or f"lm loss {loss}"
                found.append(self._flag(NAN_STEPS, f"iteration {it} logged {what}", tick, it,
                                        {"iteration": float(it)}))
                continue
            if loss is None or not math.isfinite(loss):
                continue
            median = is_spike(loss, [x for _, x in self.recent], self.factor, self.window)
            self.recent = [*self.recent, (it, loss)][-max(self.window, AROUND):]
            if median is not None:
                found.append(self._flag(
                    SPIKE, f"loss spike at iteration {it}: lm loss {loss:.4g} > {self.factor:g} "
                           f"x the median {median:.4g} of the last {self.window} logged losses",
                    tick, it, {"iteration": float(it), "loss": loss, "median": median,
                               "factor": self.factor}))
        return found
