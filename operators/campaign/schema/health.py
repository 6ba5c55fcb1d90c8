"""The campaign's ``health`` section: checkpoints evaluated as they land, loss spikes watched.

    health:
      evaluate_checkpoints: true     # pretrain__<name>__eval scores every segment's checkpoint
      eval_pool: pretrain_eval       # that DAG's Airflow pool (default: Airflow's default pool)
      loss_spike:                    # absent: no watcher
        factor: 3.0                  # flag a loss above factor x the running median ...
        window: 20                   # ... of the last N logged losses (needs N before judging)
        nan_steps: true              # flag NaN losses and skipped iterations too
        stop_running: false          # also cancel the running segment (default: stop before
                                     # the next one)
        decision_timeout_min: 60     # the human's form times out after this ...
        default_action: stop         # ... and this is taken: continue or stop

See docs/health.md.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from operators.campaign.schema.fields import PosInt, SlurmName

CONTINUE, STOP = "continue", "stop"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LossSpike(_Section):
    factor: Annotated[float, Field(gt=1, allow_inf_nan=False)] = 3.0
    window: Annotated[int, Field(ge=2, le=10_000, strict=True)] = 20
    nan_steps: bool = True
    stop_running: bool = False
    decision_timeout_min: PosInt = 60
    default_action: Literal["continue", "stop"] = STOP


class Health(_Section):
    evaluate_checkpoints: bool = False
    eval_pool: SlurmName | None = None  # an Airflow pool name (same narrow alphabet)
    loss_spike: LossSpike | None = None
