"""``checkpoint.save_interval: auto``: Young/Daly from the measured save time and the failures
seen (render/plan.py), bounded by the segment length, and shown in the plan.

The segment records are those of tests/tracking/goodput_run/segments.jsonl (recorded on the
local cluster from tests/pipeline/test_campaign_faults.py's campaign), so the fields read are
the ones the segment operator really writes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from operators.campaign.render.plan import (
    DEFAULT_MTBF_S,
    checkpoint_interval,
    failure_rate,
    step_seconds,
    young_daly_seconds,
)
from operators.campaign.render.summary import summary
from operators.campaign.schema.load import CampaignConfigError, campaign_from_dict
from tests.campaign.util import DEMO, edited, raw

RECORDS = Path(__file__).parents[1] / "tracking" / "goodput_run" / "segments.jsonl"


def _history() -> list[dict]:
    return [json.loads(line) for line in RECORDS.read_text().splitlines()]


def _campaign(**changes):
    return campaign_from_dict(edited(raw(DEMO), {"checkpoint.save_interval": "auto", **changes}))


def test_young_daly_formula() -> None:
    assert young_daly_seconds(24 * 3600, 60) == pytest.approx(math.sqrt(2 * 86400 * 60))
    assert young_daly_seconds(3600, 0) == 0
    with pytest.raises(ValueError, match="MTBF"):
        young_daly_seconds(0, 10)


def test_recorded_segments_give_step_time_and_no_failure() -> None:
    history = _history()
    # train_seconds 3.414 + 2.116 + 1.440 over 10 + 10 + 8 iterations
    assert step_seconds(history) == pytest.approx((3.4140 + 2.1163 + 1.4396) / 28, rel=1e-3)
    assert failure_rate(history) == (DEFAULT_MTBF_S, 0)  # all three stopped as planned


def test_a_failed_segment_sets_the_mtbf() -> None:
    history = _history()
    history[1] = {**history[1], "stop_reason": "failed"}
    mtbf, failures = failure_rate(history)
    assert failures == 1 and mtbf == 26 + 23 + 20  # sacct's elapsed_s of the three jobs


def test_auto_before_any_segment_saves_at_the_segment_bound() -> None:
    interval = checkpoint_interval(_campaign())
    assert interval.auto and interval.step_s is None
    assert interval.iterations == interval.bound == 20  # the demo's iters_per_segment


def test_auto_with_history_is_young_daly_in_iterations_bounded_by_the_segment() -> None:
    history = _history()
    for i in (0, 1):  # two failures in 69 s of jobs: saving often pays
        history[i] = {**history[i], "stop_reason": "failed"}
    interval = checkpoint_interval(_campaign(), history)
    save = max(r["save_seconds"] / r["saves"] for r in history)
    assert interval.save_s == pytest.approx(save) and interval.mtbf_s == 69 / 2
    expected = math.sqrt(2 * 69 / 2 * save) / step_seconds(history)
    assert interval.iterations == max(1, round(expected)) < 20
    # no failure: a day's MTBF puts the optimum far past the segment, which bounds it
    assert checkpoint_interval(_campaign(), _history()).iterations == 20


def test_a_number_stays_the_number() -> None:
    campaign = campaign_from_dict(raw(DEMO))
    interval = checkpoint_interval(campaign, _history())
    assert not interval.auto and interval.iterations == 5


def test_plan_shows_the_interval() -> None:
    text = summary(_campaign())
    assert "| Checkpoints | every 20 iters (auto)" in text
    assert "| Checkpoint interval | Young/Daly sqrt(2 x MTBF 24 h" in text
    assert "bounded by the segment's 20 iters" in text


def test_anything_else_is_refused_by_field() -> None:
    with pytest.raises(CampaignConfigError, match="checkpoint.save_interval") as refused:
        campaign_from_dict(edited(raw(DEMO), {"checkpoint.save_interval": "often"}))
    # The value as given, quoted (a template placeholder printed literally once).
    assert "(got 'often')" in str(refused.value)
