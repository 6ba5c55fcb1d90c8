"""The spool on its own, against a fake client: order, exactly-once replay, torn writes,
refused ops, and which errors count as an outage."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import requests

from operators.tracking import ops
from operators.tracking.availability import is_unavailable
from operators.tracking.spool import FILES, OPS, REJECTED, SENT, Spool, flush
from operators.tracking.tracker import Tracker


class FakeClient:
    """Records what reaches 'MLflow'; ``down`` makes every call fail like a refused socket."""

    tracking_uri = "file:///fake"  # not http: the tracker's health probe passes

    def __init__(self) -> None:
        self.down = False
        self.fail_after: int | None = None  # go down after this many more calls
        self.refuse_run: str | None = None
        self.calls: list[tuple] = []

    def _call(self, *what) -> None:
        if self.fail_after is not None:
            if self.fail_after == 0:
                self.down = True
            self.fail_after -= 1
        if self.down:
            raise requests.ConnectionError("[Errno 111] Connection refused")
        if what[1] == self.refuse_run:
            from mlflow.exceptions import MlflowException
            from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

            raise MlflowException("bad value", error_code=INVALID_PARAMETER_VALUE)
        self.calls.append(what)

    def log_batch(self, run_id, metrics=(), params=(), tags=()):
        self._call("batch", run_id, [(m.key, m.value, m.step) for m in metrics],
                   {p.key: p.value for p in params}, {t.key: t.value for t in tags})

    def get_run(self, run_id):
        self._call("get_run", run_id)
        return SimpleNamespace(data=SimpleNamespace(params={}))

    def log_artifact(self, run_id, path, artifact_path=None):
        with open(path) as f:
            self._call("artifact", run_id, artifact_path, f.read())

    def set_terminated(self, run_id, status):
        self._call("finish", run_id, status)


def metric_steps(calls) -> list[int]:
    return [step for call in calls if call[0] == "batch" for _, _, step in call[2]]


def test_down_then_back_replays_everything_in_order(tmp_path):
    client = FakeClient()
    tracker = Tracker(client, tmp_path / "spool")
    client.down = True
    tracker.log_values("r1", {"loss": 1.0}, step=1)
    tracker.set_tags("r1", {"stage": "train"})
    log_file = tmp_path / "job.log"
    log_file.write_text("segment 1 log")
    tracker.log_artifact("r1", log_file, "logs")
    log_file.unlink()  # a temp copy the caller cleans up: the spool kept its own
    tracker.finish("r1", "FINISHED")
    assert client.calls == []
    assert len((tmp_path / "spool" / OPS).read_text().splitlines()) == 4
    assert list((tmp_path / "spool" / FILES).rglob("job.log"))

    client.down = False
    tracker.log_values("r1", {"loss": 0.5}, step=2)  # flushes the backlog first
    assert [c[0] for c in client.calls] == ["batch", "batch", "artifact", "finish", "batch"]
    assert metric_steps(client.calls) == [1, 2]
    assert client.calls[2] == ("artifact", "r1", "logs", "segment 1 log")
    assert not (tmp_path / "spool" / OPS).exists()  # compacted once all was sent
    assert not (tmp_path / "spool" / FILES).exists()
    assert tracker.flush() == 0


def test_watermark_means_each_op_is_sent_once(tmp_path):
    spool = Spool(tmp_path)
    spool.append(ops.metric_ops("r1", [("m", float(i), i) for i in range(2500)], 7))
    client = FakeClient()
    client.fail_after = 2  # the server dies after two batches
    assert flush(spool, client) == 2
    assert json.loads((tmp_path / SENT).read_text())["offset"] > 0
    client.down, client.fail_after = False, None
    assert flush(spool, client) == 1
    assert metric_steps(client.calls) == list(range(2500))  # nothing twice, nothing lost


def test_torn_line_is_set_aside_and_does_not_block(tmp_path):
    spool = Spool(tmp_path)
    (tmp_path / OPS).write_text('{"id": "x", "op": "metr')  # a writer killed mid-line
    spool.append([ops.finish_op("r1", "FAILED")])
    client = FakeClient()
    assert flush(spool, client) == 1
    assert client.calls == [("finish", "r1", "FAILED")]
    rejected = [json.loads(line) for line in (tmp_path / REJECTED).read_text().splitlines()]
    assert rejected[0]["op"].startswith('{"id": "x"')


def test_refused_op_is_set_aside_and_the_rest_sent(tmp_path):
    client = FakeClient()
    client.refuse_run = "bad"
    tracker = Tracker(client, tmp_path)
    tracker.set_tags("bad", {"a": "1"})
    tracker.set_tags("good", {"b": "2"})
    assert [c[1] for c in client.calls] == ["good"]
    assert "INVALID_PARAMETER_VALUE" in (tmp_path / REJECTED).read_text()


def test_no_run_id_is_a_logged_no_op(tmp_path, caplog):
    client = FakeClient()
    tracker = Tracker(client, tmp_path)
    assert tracker.log_metrics(None, [], seq_length=8) == 0
    tracker.set_tags(None, {"a": "b"})
    assert client.calls == [] and "not tracked" in caplog.text


def test_outage_classification():
    from botocore.exceptions import EndpointConnectionError
    from mlflow.exceptions import MlflowException
    from mlflow.protos import databricks_pb2 as codes

    def as_mlflow_raises_it(inner: Exception) -> MlflowException:
        try:  # mlflow's http_request: `except Exception as e: raise MlflowException(...)`
            try:
                raise inner
            except Exception as exc:
                raise MlflowException(f"API request failed with exception {exc}") from None
        except MlflowException as outer:
            outer.__context__ = inner  # `from None` hid it; mlflow keeps it as context
            return outer

    assert is_unavailable(as_mlflow_raises_it(requests.ConnectionError("refused")))
    assert is_unavailable(as_mlflow_raises_it(requests.exceptions.RetryError("503 x 7")))
    assert is_unavailable(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert is_unavailable(MlflowException("busy", error_code=codes.TEMPORARILY_UNAVAILABLE))
    assert not is_unavailable(MlflowException("no", error_code=codes.INVALID_PARAMETER_VALUE))
    assert not is_unavailable(ValueError("bad"))


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_checkpoints_are_refused(tmp_path, kind):
    ckpt = tmp_path / "checkpoints"
    (ckpt / "iter_0000050").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("50")
    (ckpt / "iter_0000050" / "model.pt").write_text("w")
    target = ckpt if kind == "dir" else ckpt / "iter_0000050" / "model.pt"
    with pytest.raises(ValueError, match="checkpoint"):
        Tracker(FakeClient(), tmp_path / "spool").log_artifact("r1", target)
