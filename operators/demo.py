"""``make demo``: the demo campaign through a real Airflow on the local cluster, with MLflow.

    python -m operators.demo up     # start MLflow + airflow standalone, run pretrain__demo
    python -m operators.demo down   # stop what `up` started
    python -m operators.demo up production   # run it on docker/local_stack.sh's running stack

Everything it starts runs in its own process group, recorded under ``.demo/``, so
``down`` stops exactly that. The local cluster itself is ``docker/local_cluster.sh``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from jobscripts.common import process_group_alive
from operators.campaign.render.layout import Layout
from operators.campaign.schema.load import load_campaign
from operators.campaign.schema.naming import dag_id

REPO = Path(__file__).resolve().parents[1]
STATE = REPO / ".demo"
CLUSTER_ENV = Path(os.environ.get("PP_CLUSTER_STATE", "/var/lib/pretrain-cluster")) / "airflow.env"
AIRFLOW_PORT, MLFLOW_PORT = 8080, 5000
DEMO = load_campaign(REPO / "dags" / "campaigns" / "demo.yaml")
DAG_ID = dag_id(DEMO)
LAYOUT = Layout.for_campaign(DEMO)
BIN = Path(sys.executable).parent


def _say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def _env() -> dict[str, str]:
    match = re.search(r"AIRFLOW_CONN_SLURM_LOCAL='(.*)'", CLUSTER_ENV.read_text())
    if not match:
        raise SystemExit(f"{CLUSTER_ENV} has no cluster connection: run `make cluster-up`")
    mlflow = {"conn_type": "http", "host": "127.0.0.1", "port": MLFLOW_PORT, "schema": "http",
              "extra": {"experiment": "demo"}}
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update({
        "AIRFLOW_HOME": str(STATE / "airflow"), "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__CORE__PARALLELISM": "4",
        # Resume deferred tasks within 0.2 s of their trigger firing, not 1 s (README).
        "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.2",
        "AIRFLOW__API__PORT": str(AIRFLOW_PORT),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{AIRFLOW_PORT}",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{AIRFLOW_PORT}/execution/",
        "AIRFLOW_CONN_SLURM_LOCAL": match.group(1),
        "AIRFLOW_CONN_MLFLOW_DEFAULT": json.dumps(mlflow),
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
    })
    return env


def _start(name: str, argv: list[str], env: dict[str, str]) -> None:
    STATE.mkdir(exist_ok=True)
    log = open(STATE / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    (STATE / f"{name}.pgid").write_text(str(proc.pid))


def _get(url: str, body: dict | None = None, method: str = "GET"):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,  # noqa: S310 - loopback
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - loopback only
        return json.loads(resp.read() or b"null")


def _wait(what: str, check, timeout: float, interval: float = 2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except (urllib.error.URLError, ConnectionError, TimeoutError, KeyError):
            pass
        time.sleep(interval)
    raise SystemExit(f"timed out waiting for {what}; logs in {STATE}")


def _stack_urls() -> tuple[str, str]:
    """The Airflow and MLflow URLs of the running production stack (docker/local_stack.sh)."""
    out = subprocess.run(["bash", str(REPO / "docker" / "local_stack.sh"), "env"],
                         capture_output=True, text=True, check=True).stdout
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return values["PP_STACK_AIRFLOW_URL"], values["PP_STACK_MLFLOW_URL"]


def up(stack: str = "standalone") -> int:
    started = time.monotonic()
    env = _env()
    if stack == "production":  # `make demo STACK=production` brought the stack up
        af, ml = _stack_urls()
        return _run_demo(env, af, ml, started)
    af = f"http://127.0.0.1:{AIRFLOW_PORT}"
    ml = f"http://127.0.0.1:{MLFLOW_PORT}"
    _start("mlflow", [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port",
                      str(MLFLOW_PORT), "--workers", "1", "--backend-store-uri",
                      f"sqlite:///{STATE / 'mlflow.db'}", "--artifacts-destination",
                      str(STATE / "mlartifacts")], env)
    _start("airflow", [str(BIN / "airflow"), "standalone"], env)
    _say(f"starting MLflow ({ml}) and airflow standalone ({af}); logs in {STATE}")
    return _run_demo(env, af, ml, started)


def _run_demo(env: dict[str, str], af: str, ml: str, started: float) -> int:
    _wait("MLflow", lambda: urllib.request.urlopen(ml + "/health", timeout=5), 300)  # noqa: S310
    _wait("Airflow", lambda: _get(af + "/api/v2/monitor/health")["triggerer"]["status"]
          == "healthy", 300)
    _wait(f"DAG {DAG_ID} to be parsed", lambda: _get(f"{af}/api/v2/dags/{DAG_ID}"), 300)
    # A fresh campaign each time: the demo shows the whole pipeline, not a no-op rerun.
    subprocess.run(["ssh", "-F", "/dev/null", "-o", "BatchMode=yes", *_ssh_args(env),
                    f"rm -rf {shlex.quote(LAYOUT.campaign_dir)}"], check=True)
    run = _get(f"{af}/api/v2/dags/{DAG_ID}/dagRuns",
               {"logical_date": None, "conf": {"skip_data_stage": False}}, "POST")
    run_id = run["dag_run_id"]
    _say(f"triggered {DAG_ID} run {run_id}; watch it at {af}/dags/{DAG_ID}")
    state = _wait("the demo campaign", lambda: (s := _get(
        f"{af}/api/v2/dags/{DAG_ID}/dagRuns/{run_id}")["state"]) in ("success", "failed") and s,
        1800, interval=5)
    _report(af, ml, run_id, state, time.monotonic() - started)
    return 0 if state == "success" else 1


def _ssh_args(env: dict[str, str]) -> list[str]:
    conn = json.loads(env["AIRFLOW_CONN_SLURM_LOCAL"])
    known_hosts = CLUSTER_ENV.parent / "known_hosts"
    return ["-i", conn["extra"]["key_file"], "-p", str(conn["port"]),
            "-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
            f"{conn['login']}@{conn['host']}"]


def _report(af: str, ml: str, run_id: str, state: str, seconds: float) -> None:
    tasks = _get(f"{af}/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances")["task_instances"]
    for ti in sorted(tasks, key=lambda t: t["start_date"] or ""):
        _say(f"  {ti['task_id']:<20} {ti['state']}")
    history = Path(LAYOUT.segments_log)
    if history.exists():
        for line in history.read_text().splitlines():
            seg = json.loads(line)
            loss = (seg.get("last_train") or {}).get("lm_loss")
            val = (seg.get("last_validation") or {}).get("val_lm_loss")
            _say(f"  segment {seg['start_iteration']:>3} -> {seg['end_iteration']:>3} "
                 f"({seg['stop_reason']}): lm loss {loss}, validation loss {val}")
    _say(f"  evaluation: {_evaluation_line(af, run_id)}")
    plot = STATE / "compare.png"
    subprocess.run([str(BIN / "pretrain-pipeline"), "compare", "demo", "--tracking-uri", ml,
                    "--output", str(plot)], check=False)
    _say(f"demo campaign {state} in {seconds / 60:.1f} min")
    _say(f"Airflow: {af}/dags/{DAG_ID}   MLflow: {ml}   loss plot: {plot}")
    _say("stop it all with `make demo-down`")


def _evaluation_line(af: str, run_id: str) -> str:
    """Which backend evaluated (vLLM's CPU build on the local cluster) and its figures."""
    try:
        value = _get(f"{af}/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/evaluate/"
                     "xcomEntries/return_value")["value"]
        result = (json.loads(value) if isinstance(value, str) else value)["result"]
        return (f"backend {result['backend']}, held-out perplexity {result['perplexity']:.2f}, "
                f"bits per byte {result['bits_per_byte']:.3f} over "
                f"{result['tokens_evaluated']} tokens")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"no result ({type(exc).__name__}: {exc})"



def down() -> int:
    for name in ("airflow", "mlflow"):
        pgid_file = STATE / f"{name}.pgid"
        if not pgid_file.exists():
            continue
        pgid = int(pgid_file.read_text())
        for sig, wait in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and process_group_alive(pgid):
                time.sleep(0.5)
        pgid_file.unlink()
        _say(f"stopped {name}")
    return 0


if __name__ == "__main__":
    commands = {"up": up, "down": down}
    if not 2 <= len(sys.argv) <= 3 or sys.argv[1] not in commands or (
            len(sys.argv) == 3 and sys.argv[1:] != ["up", "production"]):
        raise SystemExit("usage: python -m operators.demo up [production] | down")
    raise SystemExit(commands[sys.argv[1]](*sys.argv[2:]))
