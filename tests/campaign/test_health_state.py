"""The health state on the real cluster, over the real SSH hook: a hold and a rollback
(operators/campaign/adapters/health_state.py), on checkpoint folders the reference trainer's
layout names (iter_XXXXXXX + latest_checkpointed_iteration.txt)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from jobscripts import checkpoints
from operators.campaign.adapters import health_state
from operators.campaign.render.layout import Layout
from operators.campaign.schema.load import load_campaign
from operators.slurm.hook import SlurmHook
from tests.support import cluster

pytestmark = pytest.mark.cluster
HEALTH = Path(__file__).parents[1] / "campaigns" / "health" / "health_eval.yaml"


@pytest.fixture
def site(local_cluster):
    campaign = load_campaign(HEALTH).model_copy(update={"name": "health_state_test"})
    layout = Layout.for_campaign(campaign)
    root = Path(layout.campaign_dir)
    shutil.rmtree(root, ignore_errors=True)
    for i in (2, 4, 6):
        folder = checkpoints.checkpoint_dir(layout.checkpoints, i)
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"weights of %d" % i)
    Path(layout.tracker).write_text("6")
    subprocess.run(["chown", "-R", "pretrain:pretrain", str(root)], check=True)
    mp = pytest.MonkeyPatch()
    for name, value in cluster.connection_env().items():
        mp.setenv(name, value)
    yield SlurmHook(campaign.cluster.ssh_conn_id), layout
    mp.undo()
    shutil.rmtree(root, ignore_errors=True)


def test_rollback_moves_the_tracker_back_and_keeps_later_checkpoints_aside(site) -> None:
    hook, layout = site
    assert health_state.complete_checkpoints(hook, layout) == [2, 4, 6]
    skip = health_state.rollback(hook, layout, 2, batches=3)
    assert Path(layout.tracker).read_text() == "2"
    assert checkpoints.read_tracker(layout.checkpoints) == 2
    assert health_state.complete_checkpoints(hook, layout) == [2]
    aside = Path(skip["set_aside_dir"])
    assert sorted(p.name for p in aside.iterdir()) == [
        "iter_0000004", "iter_0000006", health_state.SET_ASIDE_RECORD]
    assert (aside / "iter_0000006" / "model.safetensors").read_bytes() == b"weights of 6"
    assert health_state.read_skip(hook, layout) == skip
    assert health_state.skip_list(skip, bridge=False) == [2, 3, 4]
    with pytest.raises(ValueError, match=r"no checkpoint at iteration 4 .* \[2\]"):
        health_state.rollback(hook, layout, 4, batches=1)


def test_a_hold_is_kept_with_its_decision_once_cleared(site) -> None:
    hook, layout = site
    assert health_state.read_hold(hook, layout) is None
    hold = {"code": "loss_spike", "iteration": 5, "reason": "loss spike at iteration 5"}
    health_state.write_hold(hook, layout, hold)
    assert health_state.read_hold(hook, layout) == hold
    health_state.clear_hold(hook, layout, {"action": "continue", "by": "tester"})
    assert health_state.read_hold(hook, layout) is None
    kept = json.loads((Path(health_state.health_dir(layout)) / "hold.5.json").read_text())
    assert kept["decision"] == {"action": "continue", "by": "tester"}


def test_set_aside_checkpoints_are_removed_once_the_campaign_passed_the_spike(site) -> None:
    """Rolled back to 2 after a spike at 5: checkpoints 4 and 6 are set aside until the
    campaign saves one past 6 (the spike and every checkpoint set aside); a second rollback
    to 2 gets a folder of its own, and each is removed when its own spike is passed."""
    hook, layout = site
    first = health_state.rollback(hook, layout, 2, batches=2, spike_iteration=5)
    assert first["kept_until"] == 6
    record = json.loads((Path(first["set_aside_dir"]) / health_state.SET_ASIDE_RECORD)
                        .read_text())
    assert record == {"rolled_back_to": 2, "spike_iteration": 5, "checkpoints": [4, 6],
                      "until": 6}
    # the resumed campaign saves 4 and 6 again: not past the spike's branch yet
    for i in (4, 6):
        checkpoints.checkpoint_dir(layout.checkpoints, i).mkdir()
    subprocess.run(["chown", "-R", "pretrain:pretrain", layout.checkpoints], check=True)
    assert health_state.remove_passed(hook, layout, 6, run_id="r", segment=2) == []
    assert sorted(p.name for p in Path(first["set_aside_dir"]).iterdir()) == [
        "iter_0000004", "iter_0000006", health_state.SET_ASIDE_RECORD]
    # a second spike, at 3 this time, rolled back to 2 again: its own folder
    second = health_state.rollback(hook, layout, 2, batches=1, spike_iteration=3)
    assert second["set_aside_dir"] == first["set_aside_dir"] + ".2"
    assert second["kept_until"] == 6
    assert sorted(p.name for p in Path(second["set_aside_dir"]).iterdir()) == [
        "iter_0000004", "iter_0000006", health_state.SET_ASIDE_RECORD]
    gone = health_state.remove_passed(hook, layout, 8, run_id="r2", segment=3)
    assert [g["set_aside_dir"] for g in gone] == [first["set_aside_dir"],
                                                  second["set_aside_dir"]]
    assert not Path(first["set_aside_dir"]).exists()
    assert not Path(second["set_aside_dir"]).exists()
    assert health_state.complete_checkpoints(hook, layout) == [2]  # the live ones untouched
    removed = [json.loads(line) for line in (Path(health_state.health_dir(layout))
                                             / health_state.REMOVED_LOG).read_text().splitlines()]
    assert [(r["checkpoints"], r["removed_at_iteration"], r["run_id"], r["segment"])
            for r in removed] == [([4, 6], 8, "r2", 3), ([4, 6], 8, "r2", 3)]
    assert health_state.remove_passed(hook, layout, 10) == []  # nothing left to remove


RECORDED = Path(__file__).parents[1] / "tracking" / "goodput_run"  # a real 3-segment campaign


def test_a_segments_loss_baseline_comes_from_the_logs_before_it(site) -> None:
    """The losses a segment's spike watcher starts from, read over SSH from the recorded
    campaign's job logs (iterations 1-10, 11-20, 21-30) where segments.jsonl points."""
    from tests.support.trainer import losses

    hook, layout = site
    logs = Path(layout.campaign_dir) / "logs"
    logs.mkdir()
    lines = []
    for line in (RECORDED / "segments.jsonl").read_text().splitlines():
        record = json.loads(line)
        name = Path(record["log_path"]).name
        shutil.copy(RECORDED / name, logs / name)
        lines.append(json.dumps({**record, "log_path": str(logs / name)}))
    Path(layout.segments_log).write_text("\n".join(lines) + "\n")
    Path(layout.tracker).write_text("30")
    subprocess.run(["chown", "-R", "pretrain:pretrain", layout.campaign_dir], check=True)
    logged = {}
    for name in ("slurm-246.out", "slurm-247.out", "slurm-249.out"):
        logged.update(losses((RECORDED / name).read_text()))

    def baseline(window, up_to=None):
        found = health_state.loss_baseline(hook, layout, window, up_to)
        assert dict(found) == pytest.approx({it: logged[it] for it, _ in found})
        return [it for it, _ in found]

    assert baseline(3) == [28, 29, 30]  # where the tracker stands
    # Rolled back to 20: the segment that trained 21-30 is no baseline.
    assert baseline(3, up_to=20) == [18, 19, 20]
    assert baseline(4, up_to=11) == [8, 9, 10, 11]  # across two segments' logs
    assert baseline(3, up_to=0) == []
