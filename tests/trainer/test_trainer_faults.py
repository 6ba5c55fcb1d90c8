"""The reference trainer's test-only faults (jobscripts/trainer_faults.py): what the hang
watchdog and the loss-spike guard are tested against must misbehave exactly as documented."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobscripts import checkpoints, vocabulary
from jobscripts.job_files import REFERENCE_FAULTS
from jobscripts.trainer_faults import InjectedFaults
from tests.support.trainer import losses, run_trainer

REPO = Path(__file__).resolve().parents[2]


def write_faults(save: Path, spec: dict) -> Path:
    save.mkdir(parents=True, exist_ok=True)
    path = save / REFERENCE_FAULTS
    path.write_text(json.dumps(spec))
    return path


def test_spike_and_nan_follow_the_data_not_the_iteration(tmp_path, config_for, uncut):
    # Global batch 8: iteration 6 trains samples 40-47, iteration 9 samples 64-71.
    config = config_for(tmp_path)
    write_faults(Path(config["save"]), {"loss_spike": {"from_sample": 44, "samples": 2,
                                                       "factor": 8.0},
                                        "nan": {"from_sample": 64, "samples": 1}})
    run = run_trainer(tmp_path, config)
    assert run.rc == 0, run.log
    seen, whole = losses(run.log), losses(uncut.log)
    assert 9 not in seen  # a NaN loss is counted, not logged
    for iteration, loss in whole.items():
        expected = loss * 8.0 if iteration == 6 else loss
        if iteration != 9:
            assert math.isclose(seen[iteration], expected, rel_tol=1e-6), iteration
    nan_counts = [r.metrics.get(vocabulary.NAN_ITERATIONS) for r in run.records()
                  if r.kind == vocabulary.TRAIN and r.iteration == 9]
    assert nan_counts == [1]


def test_hang_fires_once_and_a_signal_ends_it_after_a_save(tmp_path, config_for):
    config = config_for(tmp_path, train_iters=12, save_interval=100)
    faults = write_faults(Path(config["save"]), {"hang": {"at_iteration": 3},
                                                 "nan": {"from_sample": 1000, "samples": 1}})
    (tmp_path / "run.json").write_text(json.dumps(config))
    log_path = tmp_path / "trainer.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "jobscripts.reference_trainer",
                                 "--config", str(tmp_path / "run.json")],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "TEST FAULT: hanging after iteration 3" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        time.sleep(1.5)  # hung: no iteration after 3 is trained meanwhile
        assert sorted(losses(log_path.read_text())) == [1, 2, 3]
        assert proc.poll() is None
        # Fires once: the file no longer asks for the hang (the other fault is kept).
        assert json.loads(faults.read_text()) == {"nan": {"from_sample": 1000, "samples": 1}}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    segment = json.loads(Path(config["segment_result"]).read_text())
    assert (segment["stop_reason"], segment["end_iteration"]) == ("signal", 3)
    assert checkpoints.read_tracker(config["save"]) == 3
    # The retry trains on from the checkpoint: the hang is gone.
    again = run_trainer(tmp_path, config)
    assert (again.rc, again.segment["start_iteration"], again.segment["end_iteration"]) == (
        0, 3, 12)


@pytest.mark.parametrize(("spec", "message"), [
    ({"hang": {"at_iteration": 1}, "crash": {}}, "unknown fault(s) ['crash']"),
    ({"loss_spike": {"samples": 2}}, "loss_spike"),
    (["hang"], "must hold a JSON object"),
])
def test_a_bad_faults_file_names_itself_and_the_fault(tmp_path, spec, message):
    path = write_faults(tmp_path, spec)
    with pytest.raises(ValueError, match=str(path).replace(".", r"\.") if "JSON" in message
                       else None) as caught:
        InjectedFaults.from_save_dir(tmp_path)
    assert message in str(caught.value) and REFERENCE_FAULTS in str(caught.value)


def test_no_faults_file_injects_nothing(tmp_path):
    faults = InjectedFaults.from_save_dir(tmp_path)
    assert faults.reported_loss(0, 8, 2.5) == 2.5
    faults.after_iteration(1, lambda: False)  # returns at once
