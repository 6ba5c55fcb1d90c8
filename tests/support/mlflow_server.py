"""A real MLflow tracking server with its artifacts on a real (moto) S3 server, for tests.

Production's shape: ``mlflow server`` on a SQL store with ``--default-artifact-root s3://...``
and no artifact proxying, so clients write artifacts to S3 themselves through boto3 with the
keys of their Airflow connection, and the server reads them with its own (here: its process
environment, as a deployed server would have). Each server runs in its own process group,
started without waiting so several can boot at once (mlflow's imports take 10-30 s on 2 cores),
and stops with its whole group.

    with tracking_servers(tmp_path, "bucket") as (s3, mlflow):
        conn = mlflow.connection()          # for tracking_settings()
        env = {"AIRFLOW_CONN_MLFLOW_DEFAULT": mlflow.airflow_conn_json()}   # for Airflow
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
S3_KEY_ID = "pp-test-key-id"  # moto accepts any keys; these are checked never to leak
S3_SECRET = "pp-test-secret-never-logged"
BUCKET = "pp-artifacts"  # the session stack's artifact bucket (tests/conftest.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):  # noqa: S310 - loopback only
            return True
    except urllib.error.HTTPError:
        return True  # it answered
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


class _Server:
    """A subprocess in its own process group, logging to a file."""

    name = "server"

    host = "127.0.0.1"

    def __init__(self, port: int | None, log_path: Path) -> None:
        self.port = port or free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def ready_url(self) -> str:
        return self.url + "/"

    def start(self):
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv(), env=self.env(), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 180):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited rc={self.proc.returncode}; see "
                                   f"{self.log_path}:\n{self.log_path.read_text()[-3000:]}")
            if _answers(self.ready_url()):
                return self
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready in {timeout}s; see {self.log_path}")

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after 10 s; returns once the port is free."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait)
                break
        with contextlib.suppress(ProcessLookupError):  # workers that outlive the leader
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None
        deadline = time.monotonic() + 10
        while _answers(self.ready_url()) and time.monotonic() < deadline:
            time.sleep(0.1)

    def __enter__(self):
        return self.start().wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()


class MotoS3(_Server):
    """moto's standalone S3-compatible server."""

    name = "moto_server"

    def __init__(self, log_path: Path, port: int | None = None, host: str = "127.0.0.1") -> None:
        super().__init__(port, log_path)
        self.host = host  # the cluster's jobs reach it at cluster.address_for_jobs()

    def argv(self) -> list[str]:
        return [str(VENV_BIN / "moto_server"), "-H", self.host, "-p", str(self.port)]

    def client(self):
        import boto3

        return boto3.session.Session(
            aws_access_key_id=S3_KEY_ID, aws_secret_access_key=S3_SECRET,
            region_name="us-east-1").client("s3", endpoint_url=self.url)

    def create_bucket(self, bucket: str) -> None:
        self.client().create_bucket(Bucket=bucket)


class MlflowServer(_Server):
    """``mlflow server`` on SQLite, artifacts on ``artifact_root`` (s3://... on ``s3``)."""

    name = "mlflow server"

    def __init__(self, db_path: Path, artifact_root: str, s3: MotoS3 | None = None,
                 port: int | None = None, log_path: Path | None = None) -> None:
        super().__init__(port, log_path or db_path.with_suffix(".log"))
        self.db_path = db_path
        self.artifact_root = artifact_root
        self.s3 = s3

    def argv(self) -> list[str]:
        return [str(VENV_BIN / "mlflow"), "server",
                "--backend-store-uri", f"sqlite:///{self.db_path}",
                "--default-artifact-root", self.artifact_root, "--no-serve-artifacts",
                "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AWS_"))}
        # Job execution starts a job runner and a huey consumer: two more processes importing
        # mlflow, for features (GenAI jobs) this project does not use.
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        if self.s3 is not None:  # the server's own keys, to list and serve artifacts
            env.update({"MLFLOW_S3_ENDPOINT_URL": self.s3.url, "AWS_ACCESS_KEY_ID": S3_KEY_ID,
                        "AWS_SECRET_ACCESS_KEY": S3_SECRET, "AWS_DEFAULT_REGION": "us-east-1"})
        return env

    def ready_url(self) -> str:
        return self.url + "/health"

    def connection(self, *, port: int | None = None, experiment: str | None = None):
        """An Airflow-Connection-shaped object for ``tracking_settings`` (``port``: reach the
        server through another port, e.g. a ``TcpProxy``'s)."""
        import json
        from types import SimpleNamespace

        extra = {"artifact_location": self.artifact_root}
        if self.s3 is not None:
            extra["s3_endpoint_url"] = self.s3.url
        if experiment:
            extra["experiment"] = experiment
        return SimpleNamespace(conn_id="mlflow_test", conn_type="http", host="127.0.0.1",
                               port=port or self.port, schema="http", login=S3_KEY_ID,
                               password=S3_SECRET, extra=json.dumps(extra))

    def airflow_conn_json(self, *, port: int | None = None) -> str:
        """The same connection as ``AIRFLOW_CONN_<ID>`` JSON, for Airflow processes."""
        import json

        conn = self.connection(port=port)
        return json.dumps({"conn_type": conn.conn_type, "host": conn.host, "port": conn.port,
                           "schema": conn.schema, "login": conn.login,
                           "password": conn.password, "extra": json.loads(conn.extra)})


class TcpProxy:
    """127.0.0.1:<port> forwarded to a server's port: ``stop()`` is a network outage (new
    connections refused, open ones cut, as when the server dies), ``start()`` its end.

    Cheaper than restarting mlflow (20-60 s of imports on 2 cores) and, to a client, the same:
    its pooled connections break and new ones are refused until the port answers again.
    """

    def __init__(self, target_port: int, port: int | None = None) -> None:
        self.target_port = target_port
        self.port = port or free_port()
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                downstream, _ = listener.accept()
            except OSError:  # closed by stop()
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                downstream.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open.update((downstream, upstream))
            for src, dst in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):  # one side ended: end the other too
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            self._open.discard(src)
        src.close()  # each socket is the source of exactly one pump

    def stop(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        with self._lock:
            sockets, self._open = self._open, set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class TrackingStack:
    """moto S3 with ``bucket`` and an MLflow server storing artifacts under
    ``s3://<bucket>/mlflow``. ``start()`` boots both without waiting (mlflow's boot can then
    overlap other work), ``wait_ready()`` waits and creates the bucket, ``stop()`` ends both."""

    def __init__(self, home: Path, bucket: str) -> None:
        self.bucket = bucket
        self.s3 = MotoS3(home / "moto.log")
        self.mlflow = MlflowServer(home / "mlflow.db", f"s3://{bucket}/mlflow", self.s3)
        self._bucket_made = False

    def start(self) -> TrackingStack:
        self.s3.start()
        self.mlflow.start()
        return self

    def wait_ready(self, mlflow: bool = True) -> TrackingStack:
        self.s3.wait_ready(60)
        if not self._bucket_made:
            self.s3.create_bucket(self.bucket)
            self._bucket_made = True
        if mlflow:
            self.mlflow.wait_ready()
        return self

    def stop(self) -> None:
        self.mlflow.stop()
        self.s3.stop()


def experiment_runs(connection, experiment: str) -> tuple:
    """(a tracking client on ``connection``, every run of ``experiment``): what a campaign
    story reads its MLflow record from. The experiment must exist."""
    from operators.tracking.client import make_client
    from operators.tracking.settings import tracking_settings

    client = make_client(tracking_settings(connection))
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} for the campaign"
    return client, client.search_runs([found.experiment_id], max_results=1000)


@contextlib.contextmanager
def tracking_servers(home: Path, bucket: str, *, wait: bool = True):
    """``TrackingStack`` as a context manager yielding (s3, mlflow); ``wait=False`` returns
    while mlflow still boots (call ``mlflow.wait_ready()``)."""
    stack = TrackingStack(home, bucket).start()
    try:
        stack.wait_ready(mlflow=wait)
        yield stack.s3, stack.mlflow
    finally:
        stack.stop()
