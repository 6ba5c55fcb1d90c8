"""Fixtures for the reference-trainer tests: one tiny dataset and one uncut run per session."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.trainer import Run, losses, run_trainer
from tests.trainer.synthetic_data import base_config, write_dataset


@pytest.fixture(scope="session")
def data_prefix(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data") / "synthetic_text_document")


# How long the signalled trainer may take to reach its iteration: ~20 s of imports on a quiet
# machine, but in a lane of `make test` at load ~9 it had not logged iteration 2 after 180 s
# (2026-12-03), beside the in-process runs of the same module.
SIGTERM_JOB_TIMEOUT_S = 600  # and the test waits 180 s more: under the 900 s test time-out


@dataclass
class Job:
    proc: subprocess.Popen
    config: dict
    log: Path
    # Set when the trainer never reached the iteration and was killed: the test says so.
    gave_up: str = ""


def _sigterm_once_trained(job: Job, iteration: int,
                          timeout: float = SIGTERM_JOB_TIMEOUT_S) -> None:
    # Slurm's --signal=TERM arrives at an arbitrary moment; here: soon after `iteration`.
    deadline = time.monotonic() + timeout
    while job.proc.poll() is None and time.monotonic() < deadline:
        if iteration in losses(job.log.read_text(), allow_repeats=True):
            job.proc.send_signal(signal.SIGTERM)
            return
        time.sleep(0.05)
    if job.proc.poll() is None:
        job.gave_up = f"killed: no iteration {iteration} logged within {timeout:.0f} s"
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
