"""Megatron's ``iterations_to_skip`` in the reference trainer: a skipped step consumes its
global batch without training on it, logs nothing, and does not advance the lr schedule
(Megatron-LM's megatron/training/training.py ``train``: ``if iteration in
args.iterations_to_skip: dummy_train_step(...); iteration += 1; consumed_train_samples +=
batch_size; skipped_train_samples += batch_size; continue``; its training_log then prints
`` skipped samples: {:12d} |`` after the consumed samples once the count is nonzero)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from jobscripts import vocabulary
from jobscripts.job_files import REFERENCE_FAULTS
from jobscripts.trainer_config import from_dict
from tests.support.trainer import losses, run_trainer


def _train_lines(log: str) -> dict[int, str]:
    return {int(line.split("iteration")[1].split("/")[0]): line
            for line in log.splitlines() if "consumed samples:" in line}


def test_skipped_batches_are_consumed_not_trained_and_resume_keeps_them(
        tmp_path, config_for, uncut):
    # The global batches of iterations 5 and 6 (samples 32-47) are "bad data": a loss spike
    # the trainer reports x8 (jobscripts/trainer_faults.py). Skipping [4, 5] (the steps taken
    # with 4 and 5 iterations done) must never train on them.
    spike = {"loss_spike": {"from_sample": 32, "samples": 16, "factor": 8.0}}
    runs = {}
    for name, flags in (("whole", ()), ("split", ("--exit-interval", "8"))):
        root = tmp_path / name
        config = config_for(root, save_interval=4, iterations_to_skip=[4, 5])
        Path(config["save"]).mkdir(parents=True)
        (Path(config["save"]) / REFERENCE_FAULTS).write_text(json.dumps(spike))
        runs[name] = [run_trainer(root, config, *flags)]
        if flags:
            runs[name].append(run_trainer(root, config))
        assert [r.rc for r in runs[name]] == [0] * len(runs[name]), runs[name][-1].log

    whole = runs["whole"][0]
    seen, reference = losses(whole.log), losses(uncut.log)
    assert sorted(seen) == [1, 2, 3, 4, 7, 8, 9, 10, 11, 12]
    for iteration in (1, 2, 3, 4):
        assert math.isclose(seen[iteration], reference[iteration], rel_tol=1e-6)
    assert max(seen.values()) <= reference[1] * 1.05, "a skipped (spiking) batch was trained"
    # The schedule does not advance on a skipped step: iteration 7 is the 5th trained one.
    rates = {r.iteration: r.metrics[vocabulary.LEARNING_RATE] for r in whole.records()
             if r.kind == vocabulary.TRAIN}
    uncut_rates = {r.iteration: r.metrics[vocabulary.LEARNING_RATE] for r in uncut.records()
                   if r.kind == vocabulary.TRAIN}
    assert rates[7] == uncut_rates[5] and rates[12] == uncut_rates[10]
    lines = _train_lines(whole.log)
    assert "skipped samples" not in lines[4]
    assert "consumed samples:           96 | skipped samples:           16 |" in lines[12]
    assert whole.segment["skipped_samples"] == 16
    assert whole.segment["skipped_iterations"] == [5, 6]
    assert whole.segment["consumed_samples"] == 96 and whole.segment["end_iteration"] == 12

    first, second = runs["split"]
    assert (first.segment["end_iteration"], second.segment["start_iteration"]) == (8, 8)
    assert second.segment["skipped_samples"] == 16 and second.segment["skipped_iterations"] == []
    split = losses(first.log + second.log)
    assert split == pytest.approx(seen, rel=1e-6)


@pytest.mark.pure
def test_negative_iteration_to_skip_is_an_error_naming_the_field(tmp_path):
    raw = {"data_path": ["x"], "save": str(tmp_path), "vocab_size": 8, "eod_id": 0}
    assert from_dict({**raw, "iterations_to_skip": [3, 4]}).iterations_to_skip == [3, 4]
    with pytest.raises(ValueError, match="iterations_to_skip"):
        from_dict({**raw, "iterations_to_skip": [-1]})
    with pytest.raises(ValueError, match="iterations_to_skip"):
        from_dict({**raw, "iterations_to_skip": "4"})
