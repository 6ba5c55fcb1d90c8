"""MLflow down mid-campaign: training goes on, records wait in the spool, and reach the server
once it is back, in order and once.

The outage is the tracker's port going dead: the client reaches the real server through a
TCP proxy, and stopping the proxy refuses new connections and cuts open ones, as a dying server
does. Stopping and re-booting mlflow itself would add 20-60 s of imports to the suite and
nothing the client can tell apart (``MlflowServer.stop()/start()`` do that, same database and
port, for a test that needs it).
"""

from __future__ import annotations

import time

import pytest

from jobscripts import vocabulary
from operators.tracking import logparse, runs
from operators.tracking.client import make_client
from operators.tracking.settings import tracking_settings
from operators.tracking.spool import OPS, Spool
from operators.tracking.tracker import Tracker
from tests.support.mlflow_server import TcpProxy
from tests.tracking.logs import SEQ_LENGTH, VALUES_PER_ITERATION, segment_log

TOTAL = 300


def segment(first: int, last: int) -> list[vocabulary.Record]:
    return list(logparse.parse_lines(segment_log(first, last, TOTAL)))


@pytest.fixture
def proxy(mlflow_server):
    proxy = TcpProxy(mlflow_server.port).start()
    yield proxy
    proxy.stop()


def test_mlflow_down_then_back(experiment, tmp_path, mlflow_server, proxy):
    client = make_client(tracking_settings(mlflow_server.connection(port=proxy.port)))
    spool_dir = tmp_path / "spool"
    tracker = Tracker(client, spool_dir)
    parent = tracker.campaign_run(experiment, "demo", None)
    seg1 = tracker.child_run(parent, "segment-1", key="dr1:train:1")
    tracker.log_metrics(parent, segment(1, 100), seq_length=SEQ_LENGTH, timestamp_ms=1000)
    tracker.finish(seg1, "FINISHED")

    proxy.stop()  # MLflow goes away
    started = time.monotonic()
    assert tracker.campaign_run(experiment, "demo", parent) == parent  # DAG run 2 starts
    seg2 = tracker.child_run(parent, "segment-2", {"pp.kind": "segment"}, key="dr2:train:2")
    assert seg2.startswith("child:")  # a deferred reference, resolved when MLflow is back
    tracker.log_metrics(parent, segment(101, 200), seq_length=SEQ_LENGTH, timestamp_ms=2000)
    tracker.log_values(seg2, {"slurm_elapsed_s": 600.0}, step=2)
    log_file = tmp_path / "slurm-2.out"
    log_file.write_text("segment 2 log\n")
    tracker.log_artifact(seg2, log_file, "logs")
    tracker.finish(seg2, "FINISHED")
    assert time.monotonic() - started < 30  # no minutes of MLflow client retries
    spooled = (spool_dir / OPS).read_text().splitlines()
    assert len(spooled) == 5  # child, 1 metrics batch (1,000 values), values, artifact, finish
    saved_ops = (spool_dir / OPS).read_bytes()

    proxy.start()  # and comes back
    tracker.log_metrics(parent, segment(201, TOTAL), seq_length=SEQ_LENGTH, timestamp_ms=3000)
    assert not (spool_dir / OPS).exists()  # the backlog went first, then the new batch
    assert not (spool_dir / "rejected.jsonl").exists()

    # A crash before the watermark moved: the same ops replayed again add nothing.
    replay = Spool(tmp_path / "replay")
    replay.dir.mkdir()
    (replay.dir / OPS).write_bytes(saved_ops)
    (replay.dir / "files").symlink_to(spool_dir / "files", target_is_directory=True)
    Tracker(client, replay.dir).flush()

    loss = client.get_metric_history(parent, vocabulary.LM_LOSS)
    assert sorted(m.step for m in loss) == list(range(1, TOTAL + 1))  # continuous, no repeats
    history = client.get_metric_history(parent, "tokens_consumed")
    assert len(history) == TOTAL
    values = sum(len(client.get_metric_history(parent, name))
                 for name in client.get_run(parent).data.metrics)
    assert values == TOTAL * VALUES_PER_ITERATION

    child = runs.find_child(client, parent, "dr2:train:2")
    assert tracker.resolve(seg2) == child.info.run_id
    assert child is not None and child.info.status == "FINISHED"
    assert child.data.metrics == {"slurm_elapsed_s": 600.0}
    assert child.data.tags["pp.kind"] == "segment"
    assert [p for p, _ in client.artifact_files(child.info.run_id)] == ["logs/slurm-2.out"]
    assert client.get_run(parent).info.status == "RUNNING"
