"""The CPU reference trainer: exact resume, clean stops, checkpoints, segment.json."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
from pathlib import Path

import pytest

from jobscripts import checkpoints, vocabulary
from tests.support.trainer import losses, run_trainer


def assert_same_losses(split: dict[int, float], whole: dict[int, float]) -> None:
    for iteration, loss in split.items():
        assert math.isclose(loss, whole[iteration], rel_tol=1e-6), iteration


def test_loss_falls_and_log_parses(uncut):
    records = uncut.records()
    by_kind = {kind: [r for r in records if r.kind == kind] for kind in {r.kind for r in records}}
    train = losses(uncut.log)
    assert sorted(train) == list(range(1, 13))
    assert train[12] < 0.9 * train[1]
    assert [r.iteration for r in by_kind[vocabulary.VALIDATION]] == [4, 8, 12]
    assert [r.iteration for r in by_kind[vocabulary.CHECKPOINT_SAVE]] == [4, 8, 12]
    assert [r.iteration for r in by_kind[vocabulary.TIMER]] == [4, 8, 12]
    assert [r.iteration for r in by_kind[vocabulary.THROUGHPUT]] == list(range(1, 13))
    assert by_kind[vocabulary.EXIT][-1].detail["reason"] == vocabulary.COMPLETED
    last = by_kind[vocabulary.TRAIN][-1].metrics
    assert last[vocabulary.CONSUMED_SAMPLES] == 96 and last[vocabulary.GLOBAL_BATCH_SIZE] == 8
    assert last[vocabulary.SKIPPED_ITERATIONS] == 0 and last[vocabulary.NAN_ITERATIONS] == 0


def test_segment_json_of_a_whole_run(uncut):
    segment = uncut.segment
    assert (segment["start_iteration"], segment["end_iteration"]) == (0, 12)
    assert segment["stop_reason"] == "completed" and segment["error"] is None
    assert segment["checkpoint"]["iteration"] == 12
    assert segment["last_train"]["iteration"] == 12
    assert segment["last_validation"]["iteration"] == 12
    assert segment["tokens_consumed"] == 12 * 8 * 32
    assert segment["saves"] == 3 and segment["save_seconds"] > 0
    assert segment["resumed_from"] is None and segment["fallback_reason"] is None


def test_checkpoint_loads_in_transformers(uncut):
    import torch
    from transformers import LlamaForCausalLM

    path = checkpoints.checkpoint_dir(uncut.save, 12)
    assert checkpoints.check_complete(path) is None
    assert (uncut.save / checkpoints.TRACKER_FILENAME).read_text() == "12"
    model = LlamaForCausalLM.from_pretrained(path)
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 256) and torch.isfinite(logits).all()


def test_three_segments_match_the_uncut_run(tmp_path, config_for, uncut):
    # Saves every 2 iterations with retention (keep 2, plus every 8th) across segments.
    config = config_for(tmp_path, save_interval=2, keep_last=2, keep_every=8)
    runs = [run_trainer(tmp_path, config, "--exit-interval", "4") for _ in range(3)]
    assert [r.rc for r in runs] == [0, 0, 0]
    spans = [(r.segment["start_iteration"], r.segment["end_iteration"]) for r in runs]
    assert spans == [(0, 4), (4, 8), (8, 12)]
    assert [r.segment["stop_reason"] for r in runs] == ["time_limit", "time_limit", "completed"]
    assert runs[1].segment["resumed_from"]["iteration"] == 4
    whole = losses("".join(r.log for r in runs))  # fails on an iteration trained twice
    assert sorted(whole) == list(range(1, 13))
    assert_same_losses(whole, losses(uncut.log))
    assert checkpoints.list_checkpoints(tmp_path / "ckpt") == [8, 10, 12]


def test_sigterm_saves_and_resume_is_exact_across_processes(tmp_path, config_for, sigterm_job):
    from tests.trainer.conftest import SIGTERM_JOB_TIMEOUT_S

    rc = sigterm_job.proc.wait(timeout=SIGTERM_JOB_TIMEOUT_S + 180)
    assert rc == 0, (sigterm_job.gave_up, sigterm_job.log.read_text()[-3000:])
    first_log = sigterm_job.log.read_text()
    config = sigterm_job.config
    segment = json.loads(Path(config["segment_result"]).read_text())
    stopped = segment["end_iteration"]
    assert segment["stop_reason"] == "signal" and 2 <= stopped < 2000, first_log
    assert segment["checkpoint"]["iteration"] == stopped
    assert checkpoints.find_resume_checkpoint(config["save"]).iteration == stopped
    assert "exiting program after receiving SIGTERM." in first_log

    # The next segment, in another process, resumes where the signal stopped the first.
    target = str(stopped + 2)
    second = run_trainer(Path(config["save"]).parent, config, "--exit-interval", target)
    assert (second.segment["start_iteration"], second.segment["end_iteration"]) == (
        stopped, stopped + 2)
    split = losses(first_log + second.log)  # fails on an iteration trained twice
    assert sorted(split) == list(range(1, stopped + 3))
    whole = run_trainer(tmp_path, config_for(tmp_path, train_iters=2000), "--exit-interval", target)
    assert_same_losses(split, losses(whole.log))


def test_exit_duration_stops_with_time_limit(tmp_path, config_for):
    run = run_trainer(tmp_path, config_for(tmp_path), "--exit-duration-in-mins", "0")
    assert run.rc == 0
    assert run.segment["stop_reason"] == "time_limit"
    assert run.segment["end_iteration"] == run.segment["checkpoint"]["iteration"] == 1
    exits = [r for r in run.records() if r.kind == vocabulary.EXIT]
    assert exits[-1].detail["reason"] == vocabulary.TIME_LIMIT


def test_sigusr1_before_the_first_step_stops_without_training(tmp_path, config_for):
    # The handler only sets a flag; a flag raised during start-up stops before any step.
    from jobscripts import reference_trainer

    original = reference_trainer.StopRequest.install

    def install_and_signal(self):
        original(self)
        os.kill(os.getpid(), signal.SIGUSR1)

    reference_trainer.StopRequest.install = install_and_signal
    try:
        run = run_trainer(tmp_path, config_for(tmp_path))
    finally:
        reference_trainer.StopRequest.install = original
    assert run.rc == 0 and run.segment["stop_reason"] == "signal"
    assert run.segment["end_iteration"] == 0 and run.segment["checkpoint"] is None
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_corrupt_latest_checkpoint_falls_back(tmp_path, config_for, uncut):
    shutil.copytree(uncut.save, tmp_path / "ckpt")
    weights = checkpoints.checkpoint_dir(tmp_path / "ckpt", 12) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated by a dying node
    run = run_trainer(tmp_path, config_for(tmp_path))
    assert run.rc == 0
    reason = run.segment["fallback_reason"]
    assert "iter_0000012/model.safetensors" in reason and "falling back to iteration 8" in reason
    assert run.segment["resumed_from"]["iteration"] == 8
    fallbacks = [r for r in run.records() if r.kind == vocabulary.CHECKPOINT_FALLBACK]
    assert fallbacks and fallbacks[0].detail["reason"] == reason
    assert_same_losses(losses(run.log), losses(uncut.log))
    assert sorted(losses(run.log)) == [9, 10, 11, 12]
    assert checkpoints.check_complete(weights.parent) is None  # re-saved whole


def test_unknown_config_key_is_an_error_naming_it(tmp_path, config_for, capsys):
    from jobscripts.reference_trainer import main

    config = config_for(tmp_path, trian_iters=5)
    (tmp_path / "run.json").write_text(json.dumps(config))
    assert main(["--config", str(tmp_path / "run.json")]) == 2
    assert "trian_iters" in capsys.readouterr().err


def test_failure_writes_segment_json(tmp_path, config_for):
    config = config_for(tmp_path, data_path=[str(tmp_path / "missing_text_document")])
    run = run_trainer(tmp_path, config)
    assert run.rc == 1
    assert run.segment["stop_reason"] == "failed"
    assert "missing_text_document.bin" in run.segment["error"]


@pytest.mark.parametrize("blend", [["1", "{p}"], ["30", "{p}", "70", "{p}"]])
def test_weighted_blend_trains(tmp_path, config_for, data_prefix, blend):
    paths = [item.format(p=data_prefix) for item in blend]
    run = run_trainer(tmp_path, config_for(tmp_path, data_path=paths), "--train-iters", "2")
    assert run.rc == 0 and run.segment["end_iteration"] == 2


def test_tokenizer_directory_sets_vocab_and_travels_with_the_checkpoint(tmp_path, config_for):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(256)}  # id 0 is the synthetic data's EOD
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")), eos_token="t0")
    fast.save_pretrained(tmp_path / "tokenizer")
    config = config_for(tmp_path, tokenizer_model=str(tmp_path / "tokenizer"), vocab_size=None,
                        eod_id=None)
    run = run_trainer(tmp_path, config, "--train-iters", "2")
    assert run.rc == 0, run.log
    saved = checkpoints.checkpoint_dir(tmp_path / "ckpt", 2)
    assert AutoTokenizer.from_pretrained(saved).eos_token_id == 0
    model = LlamaForCausalLM.from_pretrained(saved)
    assert model.config.vocab_size == 256 and model.config.eos_token_id == 0
