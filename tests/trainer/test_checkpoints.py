"""jobscripts/checkpoints.py: the tracker contract, atomic saves, fallback and retention."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobscripts import checkpoints as ck


def fake_save(root: Path, iteration: int) -> Path:
    def write(staging: Path) -> None:
        (staging / "model.safetensors").write_bytes(b"w" * 100)
        (staging / "sub").mkdir()
        (staging / "sub" / "state.pt").write_bytes(b"s" * 10)

    return ck.save_checkpoint(root, iteration, write, {"iteration": iteration})


def test_save_layout_tracker_and_marker(tmp_path):
    path = fake_save(tmp_path, 5)
    assert path == tmp_path / "iter_0000005"
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_bytes() == b"5"
    marker = json.loads((path / ck.COMPLETE_MARKER).read_text())
    assert marker["files"] == {"model.safetensors": 100, "sub/state.pt": 10}
    assert ck.check_complete(path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000005", "latest_checkpointed_iteration.txt"]


def test_failed_save_leaves_previous_checkpoint(tmp_path):
    fake_save(tmp_path, 5)

    def explode(staging: Path) -> None:
        (staging / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        ck.save_checkpoint(tmp_path, 10, explode)
    assert ck.read_tracker(tmp_path) == 5
    assert ck.list_checkpoints(tmp_path) == [5]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda p: (p / "model.safetensors").write_bytes(b"w" * 10), "has 10 bytes, expected 100"),
    (lambda p: (p / "sub" / "state.pt").unlink(), "sub/state.pt is missing"),
    (lambda p: (p / ck.COMPLETE_MARKER).unlink(), "save did not finish"),
    (lambda p: (p / ck.COMPLETE_MARKER).write_text("{"), "unreadable"),
])
def test_incomplete_checkpoints(tmp_path, damage, reason):
    damage(fake_save(tmp_path, 5))
    assert reason in ck.check_complete(tmp_path / "iter_0000005")


def test_resume_from_tracker(tmp_path):
    assert ck.find_resume_checkpoint(tmp_path) is None
    fake_save(tmp_path, 5)
    fake_save(tmp_path, 10)
    point = ck.find_resume_checkpoint(tmp_path)
    assert (point.iteration, point.path, point.fallback_reason) == (10, tmp_path / "iter_0000010",
                                                                    None)


def test_fallback_when_tracker_names_a_truncated_checkpoint(tmp_path):
    fake_save(tmp_path, 5)
    (fake_save(tmp_path, 10) / "model.safetensors").write_bytes(b"w")
    point = ck.find_resume_checkpoint(tmp_path)
    assert point.iteration == 5
    assert "tracker names iteration 10" in point.fallback_reason
    assert "truncated" in point.fallback_reason
    assert "falling back to iteration 5" in point.fallback_reason


def test_fallback_when_tracker_names_a_missing_dir(tmp_path):
    fake_save(tmp_path, 5)
    ck.write_tracker(tmp_path, 15)
    fake_save(tmp_path, 20)  # newer than a tracker we then rewind: never used
    ck.write_tracker(tmp_path, 15)
    point = ck.find_resume_checkpoint(tmp_path)
    assert point.iteration == 5
    assert "iter_0000015 does not exist" in point.fallback_reason


def test_fallback_without_tracker_and_nothing_complete(tmp_path):
    fake_save(tmp_path, 5)
    (tmp_path / ck.TRACKER_FILENAME).unlink()
    point = ck.find_resume_checkpoint(tmp_path)
    assert point.iteration == 5 and "missing or unreadable" in point.fallback_reason
    (tmp_path / "iter_0000005" / ck.COMPLETE_MARKER).unlink()
    with pytest.raises(RuntimeError, match="no complete checkpoint"):
        ck.find_resume_checkpoint(tmp_path)


@pytest.mark.parametrize(("iterations", "complete", "keep_last", "keep_every", "protect", "gone"), [
    (range(10, 101, 10), range(10, 101, 10), 2, 50, (), [10, 20, 30, 40, 60, 70, 80]),
    (range(10, 101, 10), range(10, 101, 10), 3, None, (), [10, 20, 30, 40, 50, 60, 70]),
    (range(10, 101, 10), range(10, 101, 10), None, 50, (), []),
    # The newest is incomplete: the last two complete ones survive, the newest is left alone.
    ([10, 20, 30, 40], [10, 20, 30], 2, None, (), [10]),
    # The tracker's checkpoint is never deleted, even when outside the last K.
    ([10, 20, 30, 40], [10, 20, 30, 40], 1, None, (20,), [10, 30]),
])
def test_plan_retention(iterations, complete, keep_last, keep_every, protect, gone):
    assert ck.plan_retention(iterations, complete, keep_last, keep_every, protect) == gone


def test_plan_retention_refuses_to_keep_nothing():
    with pytest.raises(ValueError):
        ck.plan_retention([1, 2], [1, 2], 0)


def test_apply_retention_and_stale_temp(tmp_path):
    for iteration in (2, 4, 6, 8, 10):
        fake_save(tmp_path, iteration)
    (tmp_path / ".tmp-iter_0000012.abc").mkdir()
    assert ck.apply_retention(tmp_path, keep_last=2, keep_every=4) == [2, 6]
    assert ck.list_checkpoints(tmp_path) == [4, 8, 10]
    assert ck.remove_stale_temp(tmp_path) == [".tmp-iter_0000012.abc"]
    assert ck.find_resume_checkpoint(tmp_path).iteration == 10


@pytest.mark.parametrize(("files", "complete"), [
    ({".metadata": b"m", "__0_0.distcp": b"d", "common.pt": b"c", "metadata.json": b"{}"}, True),
    ({"__0_0.distcp": b"d", "metadata.json": b"{}"}, False),  # shards written, no .metadata
    ({"mp_rank_00/model_optim_rng.pt": b"x"}, True),  # Megatron's legacy torch format
])
def test_megatron_written_checkpoints(tmp_path, files, complete):
    path = tmp_path / "iter_0000050"
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    assert (ck.check_complete(path) is None) == complete


def test_a_writer_whose_lease_was_taken_is_fenced(tmp_path):
    # An orphan of job 41 (cut off, then back) and its requeued incarnation (restart 1).
    orphan = ck.take_lease(tmp_path, "41", 0)
    fake_save(tmp_path, 5)  # saves without a lease are not fenced (tools, tests)
    live = ck.take_lease(tmp_path, "41", 1)

    def write(staging: Path) -> None:
        (staging / "model.safetensors").write_bytes(b"o" * 10)

    with pytest.raises(ck.FencedError, match=r"taken by job 41 \(restart 1\)"):
        ck.save_checkpoint(tmp_path, 7, write, {}, orphan)
    with pytest.raises(ck.FencedError):
        ck.apply_retention(tmp_path, keep_last=1, lease=orphan)
    assert ck.list_checkpoints(tmp_path) == [5] and ck.read_tracker(tmp_path) == 5
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    ck.save_checkpoint(tmp_path, 7, write, {}, live)
    assert ck.read_tracker(tmp_path) == 7
    live.check()
