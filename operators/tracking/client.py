"""``make_client(settings)``: an MlflowClient for one tracking connection.

Task code only: importing this module imports mlflow (seconds). The client is MLflow's own with
the artifact uploads of runs stored on S3 routed through ``operators.tracking.s3`` and the
connection's keys and endpoint, instead of MLflow's S3 repository, which reads them from the
process environment (see s3.py for why). Runs whose artifacts live elsewhere (a server that
proxies artifacts, ``mlflow-artifacts:/``; a local path) keep MLflow's own upload.

Only ``log_artifact`` and ``log_artifacts`` are routed: write other artifacts (text, dicts,
figures) to a file first. Reads stay with MLflow's repository; list through ``artifact_files``.
"""

from __future__ import annotations

import posixpath
import threading

from mlflow import MlflowClient

from operators.tracking import s3
from operators.tracking.settings import TrackingSettings


class TrackingClient(MlflowClient):
    def __init__(self, settings: TrackingSettings) -> None:
        super().__init__(tracking_uri=settings.tracking_uri)
        self.settings = settings
        self._s3 = None
        self._lock = threading.Lock()  # boto3 builds clients non-thread-safely
        self._roots: dict[str, str] = {}  # run id -> artifact URI: it never changes

    def artifact_root(self, run_id: str) -> str:
        if run_id not in self._roots:
            self._roots[run_id] = self.get_run(run_id).info.artifact_uri
        return self._roots[run_id]

    def _s3_client(self):
        with self._lock:
            if self._s3 is None:
                self._s3 = s3.s3_client(self.settings)
            return self._s3

    def _s3_dest(self, run_id: str, artifact_path: str | None) -> str | None:
        root = self.artifact_root(run_id)
        if not root.startswith("s3://"):
            return None
        return posixpath.join(root, artifact_path) if artifact_path else root

    def _upload(self, run_id: str, local: str, artifact_path: str | None, mlflow_upload):
        dest = self._s3_dest(run_id, artifact_path)
        if dest is None:
            return mlflow_upload(run_id, local, artifact_path)
        s3.upload(self._s3_client(), local, dest)
        return None

    def log_artifact(self, run_id: str, local_path: str, artifact_path: str | None = None):
        return self._upload(run_id, local_path, artifact_path, super().log_artifact)

    def log_artifacts(self, run_id: str, local_dir: str, artifact_path: str | None = None):
        return self._upload(run_id, local_dir, artifact_path, super().log_artifacts)

    def artifact_files(self, run_id: str) -> list[tuple[str, int]]:
        """(path, size) of every artifact of the run, recursively."""
        dest = self._s3_dest(run_id, None)
        if dest is not None:
            return s3.list_files(self._s3_client(), dest)
        found, todo = [], [None]
        while todo:
            for info in self.list_artifacts(run_id, todo.pop()):
                if info.is_dir:
                    todo.append(info.path)
                else:
                    found.append((info.path, info.file_size or 0))
        return sorted(found)


def make_client(settings: TrackingSettings) -> TrackingClient:
    return TrackingClient(settings)
