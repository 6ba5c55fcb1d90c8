"""Pre-queued segments, pure parts (docs/prequeue.md): the campaign setting and its plan row,
which segments a running one queues behind itself, the sbatch dependency as rendered, and
the start gate's decision (jobscripts/segment_gate.py) with the segment.json it leaves.

The gate's inputs are the real trainer's segment.json shape: the records of
tests/tracking/goodput_run/segments.jsonl (recorded on the local cluster).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobscripts import segment_gate
from jobscripts.job_files import SEGMENT_RESULT, TRACKER_FILENAME
from jobscripts.vocabulary import FAILED, PREQUEUE_REFUSED
from operators.campaign.dag import prequeue
from operators.campaign.render.summary import summary
from operators.campaign.schema.load import CampaignConfigError, campaign_from_dict
from operators.slurm.messages import JobRequest
from operators.slurm.operator import build_spec
from operators.slurm.render import render_script
from tests.campaign.util import DEMO, edited, raw

RECORDS = Path(__file__).parents[1] / "tracking" / "goodput_run" / "segments.jsonl"


def _campaign(**changes):
    return campaign_from_dict(edited(raw(DEMO), changes))


def _recorded() -> list[dict]:
    return [json.loads(line) for line in RECORDS.read_text().splitlines()]


def test_depth_defaults_to_one_and_is_shown_in_the_plan() -> None:
    campaign = _campaign()
    assert campaign.segments.prequeue_depth == 1
    assert "| Pre-queued | 1 segment job(s) ahead, afterok" in summary(campaign)
    serial = _campaign(**{"segments.prequeue_depth": 0})
    assert "| Pre-queued | none: each segment submitted after the last |" in summary(serial)


@pytest.mark.parametrize("bad", [-1, 9, "2", 1.5, True])
def test_a_bad_depth_is_an_error_naming_the_field(bad) -> None:
    with pytest.raises(CampaignConfigError, match=r"segments\.prequeue_depth"):
        _campaign(**{"segments.prequeue_depth": bad})


def test_successors_stop_at_the_run_and_at_the_campaign_end() -> None:
    grid = _campaign(**{"training.train_iters": 20, "segments.iters_per_segment": 5})
    # Segment 1 starts at 0 and stops at 5: 2 and 3 start at 5 and 10, both before 20.
    assert prequeue.successors(grid, 1, 0, 20, allowed=4, depth=2) == [2, 3]
    # Segment 3 starts at 10, stops at 15; segment 4 starts at 15; a fifth would start at 20.
    assert prequeue.successors(grid, 3, 10, 20, allowed=8, depth=3) == [4]
    assert prequeue.successors(grid, 2, 5, 20, allowed=2, depth=1) == []  # segments_per_run
    assert prequeue.successors(grid, 1, 0, 20, allowed=4, depth=0) == []
    # Without the grid a segment may end anywhere: queue up to the depth, the gate decides.
    free = _campaign(**{"training.train_iters": 20, "segments.iters_per_segment": None})
    assert prequeue.successors(free, 1, 0, 20, allowed=4, depth=2) == [2, 3]


def test_a_prequeued_job_renders_afterok_its_gate_first_and_its_values_quoted() -> None:
    request = JobRequest("exec \"$PP_PYTHON\" -m jobscripts.reference_trainer --config run.json",
                         {"partition": "debug", "time": "5", "requeue": True})
    hostile = "/scratch/$(touch pwned)/ck'pt"  # campaign data: must stay these characters
    job = prequeue.gated(request, "4711", "/runs/pp-segment_1-abc", hostile, 20)
    spec = build_spec("pp-segment_2-def", "/runs/pp-segment_2-def", job.command, job.job)
    script = render_script(spec)
    assert "#SBATCH --dependency=afterok:4711\n" in script
    assert "#SBATCH --kill-on-invalid-dep=yes\n" in script
    body = script.split("set -euo pipefail\n", 1)[1].splitlines()
    gate, trainer = body[1], body[2]  # after the restart line; set -e: a refusal ends here
    assert gate.startswith('"$PP_PYTHON" -m jobscripts.segment_gate --after-dir '
                           "/runs/pp-segment_1-abc --checkpoints ")
    assert "'/scratch/$(touch pwned)/ck'\"'\"'pt'" in gate
    assert gate.endswith(f"--train-iters 20 --segment-result {SEGMENT_RESULT}")
    assert trainer == request.command
    assert prequeue.dependency("4711") == "afterok:4711"
    # Without pre-queueing nothing changes in the script.
    plain = render_script(build_spec("k", "/r", request.command, request.job))
    assert "--dependency" not in plain and "segment_gate" not in plain


def test_the_gate_lets_a_segment_that_advanced_train() -> None:
    first = _recorded()[0]  # a real segment.json: started at 0, saved at 10
    assert segment_gate.decide(first, first["end_iteration"], 30) is None


@pytest.mark.parametrize(("before", "tracker", "why"), [
    (None, 10, "left no readable segment.json"),
    ({"stop_reason": FAILED, "start_iteration": 0, "error": "boom"}, 5, "stopped 'failed'"),
    ({"stop_reason": PREQUEUE_REFUSED, "start_iteration": 5}, 5, "stopped 'prequeue_refused'"),
    ({"stop_reason": "time_limit", "start_iteration": 10}, 10, "made no progress"),
    ({"stop_reason": "time_limit", "start_iteration": 10}, 5, "made no progress"),
    ({"stop_reason": "time_limit", "start_iteration": None}, None, "made no progress"),
    ({"stop_reason": "completed", "start_iteration": 20}, 30, "campaign is done"),
])
def test_the_gate_refuses_without_progress(before, tracker, why) -> None:
    assert why in segment_gate.decide(before, tracker, 30)


def test_the_gate_leaves_its_refusal_in_segment_json_and_exits_3(tmp_path, monkeypatch) -> None:
    before, checkpoints = tmp_path / "seg1", tmp_path / "ckpt"
    before.mkdir()
    checkpoints.mkdir()
    record = {**_recorded()[0], "start_iteration": 10, "end_iteration": 10}
    (before / SEGMENT_RESULT).write_text(json.dumps(record))
    (checkpoints / TRACKER_FILENAME).write_text("10")
    monkeypatch.chdir(tmp_path)
    argv = ["--after-dir", str(before), "--checkpoints", str(checkpoints), "--train-iters", "30"]
    assert segment_gate.main(argv) == segment_gate.EXIT_REFUSED == 3
    left = json.loads((tmp_path / SEGMENT_RESULT).read_text())
    assert left["stop_reason"] == PREQUEUE_REFUSED
    assert left["start_iteration"] == left["end_iteration"] == 10
    assert "made no progress" in left["stop_detail"]
    (checkpoints / TRACKER_FILENAME).write_text("15")
    (tmp_path / SEGMENT_RESULT).unlink()
    assert segment_gate.main(argv) == 0
    assert not (tmp_path / SEGMENT_RESULT).exists()
