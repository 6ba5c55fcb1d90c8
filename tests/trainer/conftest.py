"""Fixtures for the reference-trainer tests: one tiny dataset and one uncut run per session."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from operators.campaign import logparse
from tests.trainer.synthetic_data import base_config, write_dataset


@dataclass
class Run:
    rc: int
    log: str
    segment: dict
    save: Path

    def records(self) -> list[logparse.Record]:
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
    """Per-iteration lm loss; an iteration logged twice fails the test that asks."""
    found: dict[int, float] = {}
    for record in logparse.parse_lines(log.splitlines()):
        if record.kind == logparse.TRAIN:
            repeated = record.iteration in found and not allow_repeats
            assert not repeated, f"iteration {record.iteration} trained twice"
            found[record.iteration] = record.metrics[logparse.LM_LOSS]
    return found


@pytest.fixture(scope="session")
def data_prefix(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data") / "synthetic_text_document")


@dataclass
class Job:
    proc: subprocess.Popen
    config: dict
    log: Path


def _sigterm_once_trained(job: Job, iteration: int, timeout: float = 180) -> None:
    # Slurm's --signal=TERM arrives at an arbitrary moment; here: soon after `iteration`.
    deadline = time.monotonic() + timeout
    while job.proc.poll() is None and time.monotonic() < deadline:
        if iteration in losses(job.log.read_text(), allow_repeats=True):
            job.proc.send_signal(signal.SIGTERM)
            return
        time.sleep(0.02)
    job.proc.kill()


@pytest.fixture(scope="session")
def sigterm_job(tmp_path_factory, data_prefix) -> Job:
    """A trainer subprocess that gets SIGTERM after iteration 2 of 2000. Started before the
    in-process runs so that its ~20 s of imports overlap theirs on the second core."""
    root = tmp_path_factory.mktemp("sigterm")
    config = base_config(data_prefix, root / "ckpt", train_iters=2000)
    (root / "run.json").write_text(json.dumps(config))
    repo = Path(__file__).resolve().parents[2]
    with open(root / "trainer.log", "w") as log:
        command = [sys.executable, "-m", "jobscripts.reference_trainer",
                   "--config", str(root / "run.json")]
        proc = subprocess.Popen(command, cwd=repo, stdout=log, stderr=subprocess.STDOUT)
    job = Job(proc, config, root / "trainer.log")
    threading.Thread(target=_sigterm_once_trained, args=(job, 2), daemon=True).start()
    yield job
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def uncut(tmp_path_factory, data_prefix, sigterm_job) -> Run:
    """12 iterations in one segment, checkpoints at 4, 8, 12: what split runs must match.
    (Asks for sigterm_job only to start it first.)"""
    root = tmp_path_factory.mktemp("uncut")
    run = run_trainer(root, base_config(data_prefix, root / "ckpt", save_interval=4))
    assert run.rc == 0, run.log
    return run


@pytest.fixture
def config_for(data_prefix):
    def make(root: Path, **overrides) -> dict:
        return base_config(data_prefix, root / "ckpt", **overrides)

    return make
