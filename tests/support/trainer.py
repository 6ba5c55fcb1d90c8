"""The reference trainer run in this process, and the losses its log holds (for tests/trainer,
tests/pipeline and tests/export_eval)."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

from jobscripts import vocabulary
from operators.tracking import logparse


@dataclass
class Run:
    rc: int
    log: str
    segment: dict
    save: Path

    def records(self) -> list[vocabulary.Record]:
        return list(logparse.parse_lines(self.log.splitlines()))


def run_trainer(directory: Path, config: dict, *flags: str) -> Run:
    """One segment in this process (imports are paid once per session); stdout is the log."""
    from jobscripts.reference_trainer import main

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "run.json").write_text(json.dumps(config))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["--config", str(directory / "run.json"), *flags])
    segment = json.loads(Path(config["segment_result"]).read_text())
    return Run(rc, out.getvalue(), segment, Path(config["save"]))


def losses(log: str, allow_repeats: bool = False) -> dict[int, float]:
    """Per-iteration lm loss (a NaN iteration logs none); an iteration logged twice fails the
    test that asks."""
    found: dict[int, float] = {}
    for record in logparse.parse_lines(log.splitlines()):
        if record.kind == vocabulary.TRAIN and vocabulary.LM_LOSS in record.metrics:
            repeated = record.iteration in found and not allow_repeats
            assert not repeated, f"iteration {record.iteration} trained twice"
            found[record.iteration] = record.metrics[vocabulary.LM_LOSS]
    return found
