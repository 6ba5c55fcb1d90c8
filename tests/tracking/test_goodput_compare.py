"""``pretrain-pipeline compare``'s goodput breakdown, segment timeline and resume marks, from the
goodput a campaign's run carries, against the session's real MLflow server.

The campaign is the one recorded in tests/tracking/goodput_run/ (see test_goodput.py): its
job logs' metrics go to the run as track_segment sends them, its goodput as register does
(operators/campaign/adapters/goodput_log.py).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from operators import cli, compare
from operators.campaign.adapters.goodput_log import log_goodput
from operators.slurm.parse import read_sacct
from operators.tracking import goodput, logparse
from operators.tracking.tracker import Tracker

RUN = Path(__file__).parent / "goodput_run"
SEQ_LENGTH, GLOBAL_BATCH = 256, 8  # tests/campaigns/tracked/ci_tracked.yaml


def _recorded():
    rows = read_sacct((RUN / "sacct.txt").read_text()).records
    for line in (RUN / "segments.jsonl").read_text().splitlines():
        entry = json.loads(line)
        log = (RUN / Path(entry["log_path"]).name).read_text().splitlines()
        yield goodput.segment_job(rows[entry["slurm"]["job_id"]], log, 1,
                                  entry.get("load_seconds")), log


@pytest.fixture
def logged(client, experiment, tmp_path):
    tracker = Tracker(client, tmp_path / "spool")
    run_id = tracker.campaign_run(experiment, "ci_tracked", None)
    jobs = []
    for job, log in _recorded():
        tracker.log_metrics(run_id, list(logparse.parse_lines(log)), seq_length=SEQ_LENGTH,
                            global_batch_size=GLOBAL_BATCH)
        jobs.append(job)
    figures = log_goodput(tracker, run_id, jobs, 30)
    return client, experiment, jobs, figures


def test_compare_reads_goodput_timeline_and_resumes(logged, tmp_path, capsys) -> None:
    from PIL import Image

    client, experiment, jobs, figures = logged
    [campaign] = compare.load_campaigns(client, experiment)
    assert campaign.goodput == pytest.approx(figures.components())
    spans = goodput.timeline(jobs)
    assert [(s, k) for s, k, *_ in campaign.timeline] == [(s.segment, s.kind) for s in spans]
    assert campaign.timeline[0][3] - campaign.timeline[0][2] == pytest.approx(
        (spans[0].end - spans[0].start).total_seconds())
    # segments 2 and 3 resumed from iterations 10 and 20: tokens = iteration x 8 x 256
    assert campaign.resumed_tokens == [10 * 8 * 256, 20 * 8 * 256]

    # The loss plot marks them; the timeline has a bar per span.
    train_axis = compare.plot([campaign]).axes[0]
    marks = [c for c in train_axis.collections if c.get_linestyle()]
    assert sorted(seg[0][0] for seg in marks[0].get_segments()) == [20480, 40960]
    timeline_axis = compare.plot_timeline([campaign]).axes[0]
    assert len(timeline_axis.collections) == len(spans)
    assert "goodput" in timeline_axis.get_title()

    png = tmp_path / "out" / "compare.png"
    assert cli.main(["compare", experiment, "--tracking-uri", client.tracking_uri,
                     "--output", str(png), "--dpi", "60"]) == 0
    rows = list(csv.DictReader((png.parent / "compare_goodput.csv").read_text().splitlines()))
    assert rows[0]["run"] == "ci_tracked"
    assert float(rows[0]["goodput"]) == pytest.approx(figures.goodput)
    assert float(rows[0]["allocated_node_s"]) == 90
    image = np.asarray(Image.open(png.parent / "compare_timeline.png").convert("RGB")).astype(int)
    green = np.array((0x2C, 0xA0, 0x2C))  # training bars
    assert (np.abs(image - green).sum(axis=-1) < 30).sum() > 20
    out = capsys.readouterr().out
    assert "| run | segments |" in out and "compare_timeline.png" in out


def test_campaigns_without_goodput_get_no_breakdown(tmp_path) -> None:
    plain = compare.Campaign("old", "r1", "FINISHED")
    assert compare.write_goodput([plain], tmp_path / "compare.png") == ""
    assert not (tmp_path / "compare_goodput.csv").exists()
    assert compare.read_timeline({}) == []
