"""``make demo``: the demo campaign through a real Airflow on the local cluster, with MLflow.

    python -m operators.demo up     # start MLflow + airflow standalone, run pretrain__demo
    python -m operators.demo down   # stop what `up` started
    python -m operators.demo up production   # run it on docker/local_stack.sh's running stack

Everything it starts runs in its own process group, recorded under ``.demo/``, so
``down`` stops exactly that. The local cluster itself is ``docker/local_cluster.sh``.
"""

from __future__ import annotations

import fcntl
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

from jobscripts.common import process_start_ticks, recorded_group_alive, stop_process_group
from jobscripts.vocabulary import EVAL_METRICS
from operators.campaign.adapters.checkpoint_eval_log import EVAL_TOKENS_CONSUMED
from operators.campaign.dag.eval_dag import (
    ANNOUNCED,
    EVALUATED,
    REUSED_KEY,
    SKIPPED,
    eval_dag_id,
    read_ledger,
)
from operators.campaign.render import checkpoint_eval
from operators.campaign.render.layout import Layout
from operators.campaign.schema.load import load_campaign
from operators.campaign.schema.naming import dag_id
from operators.local_airflow import standalone_settings

REPO = Path(__file__).resolve().parents[1]
STATE = REPO / ".demo"
CLUSTER_ENV = Path(os.environ.get("PP_CLUSTER_STATE", "/var/lib/pretrain-cluster")) / "airflow.env"
AIRFLOW_PORT, MLFLOW_PORT = 8080, 5000
DEMO = load_campaign(REPO / "dags" / "campaigns" / "demo.yaml")
DAG_ID = dag_id(DEMO)
EVAL_DAG_ID = eval_dag_id(DEMO)
LAYOUT = Layout.for_campaign(DEMO)
BIN = Path(sys.executable).parent
# The evaluation DAG's runs (one per checkpoint event, several at once) wait on Slurm deferred,
# outside the pool's slots: one slot only takes their short worker parts in turn, and Slurm
# queues their jobs on the nodes' CPUs.
EVAL_POOL_SLOTS = 1
ACTIVE_RUN_STATES = ("queued", "running")
# After the campaign's run: its last checkpoint's evaluation is usually the one the final
# evaluate reused, so little is left; bounded for a machine at load (vLLM's CPU engine start).
EVAL_WAIT_S = 1200
EVAL_POLL_S = 10


def _say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def _env() -> dict[str, str]:
    match = re.search(r"AIRFLOW_CONN_SLURM_LOCAL='(.*)'", CLUSTER_ENV.read_text())
    if not match:
        raise SystemExit(f"{CLUSTER_ENV} has no cluster connection: run `make cluster-up`")
    mlflow = {"conn_type": "http", "host": "127.0.0.1", "port": MLFLOW_PORT, "schema": "http",
              "extra": {"experiment": "demo"}}
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(standalone_settings(STATE / "airflow", REPO / "dags", AIRFLOW_PORT))
    env.update({
        "AIRFLOW__CORE__PARALLELISM": "4",
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
    # The leader's start time beside its PID: a record left by a demo whose machine rebooted
    # must not make `down` signal whatever process group now has that number.
    (STATE / f"{name}.pgid").write_text(f"{proc.pid} {process_start_ticks(proc.pid)}\n")


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


def hold_demo_lock(path: Path):
    """The open lock file that makes this the only ``make demo`` of the checkout (kept open
    until the process ends): a second one, run from another terminal, would start a second
    Airflow on the same home and trigger a second campaign run beside the first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = open(path, "a+")  # noqa: SIM115 - held for the life of the process
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise SystemExit(f"another `make demo` is running in this checkout (pid {holder}, "
                         f"lock {path}): wait for it to end, or stop it and its servers with "
                         "`make demo-down`") from None
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def up(stack: str = "standalone") -> int:
    started = time.monotonic()
    _lock = hold_demo_lock(STATE / "demo.lock")  # noqa: F841 - held until the process ends
    env = _env()
    if stack == "production":  # `make demo STACK=production` brought the stack up
        af, ml = _stack_urls()
        return _run_demo(env, af, ml, started)
    af = f"http://127.0.0.1:{AIRFLOW_PORT}"
    ml = f"http://127.0.0.1:{MLFLOW_PORT}"
    if _recorded_alive():
        # A finished demo leaves its servers up for the user to browse; this run starts them
        # afresh (this checkout's code) rather than beside them on the same ports.
        _say("stopping the previous demo's servers")
        down()
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
    _ensure_pool(af)
    # A fresh campaign each time: the demo shows the whole pipeline, not a no-op rerun.
    subprocess.run(["ssh", "-F", "/dev/null", "-o", "BatchMode=yes", *_ssh_args(env),
                    f"rm -rf {shlex.quote(LAYOUT.campaign_dir)}"], check=True)
    run = _get(f"{af}/api/v2/dags/{DAG_ID}/dagRuns",
               {"logical_date": None, "conf": {"skip_data_stage": False}}, "POST")
    run_id = run["dag_run_id"]
    _say(f"triggered {DAG_ID} run {run_id}; watch it at {af}/dags/{DAG_ID}")
    state = _wait("the demo campaign", lambda: (s := _get(
        f"{af}/api/v2/dags/{DAG_ID}/dagRuns/{run_id}")["state"]) in ("success", "failed") and s,
        3600, interval=5)  # 10 min on a quiet 2-core machine; 35+ at load 25
    campaign_s = time.monotonic() - started
    evals = _wait_for_evaluations(af) if DEMO.health.evaluate_checkpoints else []
    _report(af, ml, run_id, state, campaign_s, evals, time.monotonic() - started)
    return 0 if state == "success" else 1


def pool_request(campaign) -> dict:
    """The POST /api/v2/pools body of the pool the campaign's evaluation DAG runs in."""
    return {"name": campaign.health.eval_pool, "slots": EVAL_POOL_SLOTS,
            "description": f"{eval_dag_id(campaign)}: checkpoint evaluations (docs/health.md)",
            "include_deferred": False}


def _ensure_pool(af: str) -> None:
    """The evaluation DAG's pool, so a fresh clone needs no `airflow pools set` first."""
    if not (DEMO.health.evaluate_checkpoints and DEMO.health.eval_pool):
        return
    body = pool_request(DEMO)
    try:
        _get(f"{af}/api/v2/pools", body, "POST")
        _say(f"created the pool {body['name']} ({body['slots']} slot) for {EVAL_DAG_ID}")
    except urllib.error.HTTPError as exc:
        if exc.code != 409:  # 409: this Airflow home has it from an earlier demo
            raise SystemExit(f"creating the pool {body['name']}: HTTP {exc.code} "
                             f"{exc.read().decode(errors='replace')}") from None


def _eval_runs(af: str) -> list[dict]:
    return _get(f"{af}/api/v2/dags/{EVAL_DAG_ID}/dagRuns?limit=100")["dag_runs"]


def _wait_for_evaluations(af: str) -> list[dict]:
    """The evaluation DAG's runs once none is queued or running (two polls in a row: the
    last segment's asset event may still be turning into a run), or after EVAL_WAIT_S."""
    _say(f"waiting (up to {EVAL_WAIT_S // 60} min) for {EVAL_DAG_ID}'s runs to finish")
    deadline, quiet = time.monotonic() + EVAL_WAIT_S, 0
    runs: list[dict] = []
    while True:
        try:
            runs = _eval_runs(af)
            quiet = 0 if any(r["state"] in ACTIVE_RUN_STATES for r in runs) else quiet + 1
        except (urllib.error.URLError, ConnectionError, TimeoutError, KeyError):
            quiet = 0
        if quiet >= 2:
            return runs
        if time.monotonic() > deadline:
            _say(f"{EVAL_DAG_ID} still has runs going after {EVAL_WAIT_S // 60} min: "
                 "reporting what it finished")
            return runs
        time.sleep(EVAL_POLL_S)


def _ssh_args(env: dict[str, str]) -> list[str]:
    conn = json.loads(env["AIRFLOW_CONN_SLURM_LOCAL"])
    known_hosts = CLUSTER_ENV.parent / "known_hosts"
    return ["-i", conn["extra"]["key_file"], "-p", str(conn["port"]),
            "-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
            f"{conn['login']}@{conn['host']}"]


def _report(af: str, ml: str, run_id: str, state: str, campaign_s: float,
            eval_runs: list[dict], seconds: float) -> None:
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
    if DEMO.health.evaluate_checkpoints:
        _report_evaluations(af, ml, eval_runs)
    plot = STATE / "compare.png"
    subprocess.run([str(BIN / "pretrain-pipeline"), "compare", "demo", "--tracking-uri", ml,
                    "--output", str(plot)], check=False)
    _say(f"demo campaign {state} in {campaign_s / 60:.1f} min, "
         f"with its checkpoints' evaluations {seconds / 60:.1f} min")
    _say(f"Airflow: {af}/dags/{DAG_ID}   MLflow: {ml}   "
         f"loss and bits-per-byte plot: {plot}")
    _say("stop it all with `make demo-down`")


def _evaluation_line(af: str, run_id: str) -> str:
    """Which backend evaluated (vLLM's CPU build on the local cluster) and its figures."""
    try:
        value = _get(f"{af}/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/evaluate/"
                     "xcomEntries/return_value")["value"]
        value = json.loads(value) if isinstance(value, str) else value
        result = value["result"]
        reused = (f", reused from {EVAL_DAG_ID} ({value[REUSED_KEY]})"
                  if value.get(REUSED_KEY) else "")
        return (f"backend {result['backend']}, held-out perplexity {result['perplexity']:.2f}, "
                f"bits per byte {result['bits_per_byte']:.3f} over "
                f"{result['tokens_evaluated']} tokens{reused}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"no result ({type(exc).__name__}: {exc})"


def _duration_s(ti: dict) -> float | None:
    from datetime import datetime

    if not (ti.get("start_date") and ti.get("end_date")):
        return None
    start, end = (datetime.fromisoformat(ti[k].replace("Z", "+00:00"))
                  for k in ("start_date", "end_date"))
    return (end - start).total_seconds()


def _report_evaluations(af: str, ml: str, eval_runs: list[dict]) -> None:
    """The evaluation DAG's runs (with each job's time: what the per-checkpoint evaluation
    costs), the ledger's count, and one line per evaluated checkpoint from the campaign's
    MLflow run: the curve the MLflow UI and `pretrain-pipeline compare` draw."""
    for run in sorted(eval_runs, key=lambda r: r.get("start_date") or ""):
        try:
            tis = _get(f"{af}/api/v2/dags/{EVAL_DAG_ID}/dagRuns/{run['dag_run_id']}"
                       "/taskInstances")["task_instances"]
        except (OSError, ValueError, KeyError):
            tis = []
        times = ", ".join(f"{ti['task_id']} {ti['state']}"
                          + (f" {d:.0f} s" if (d := _duration_s(ti)) is not None else "")
                          for ti in sorted(tis, key=lambda t: t["start_date"] or ""))
        _say(f"  {EVAL_DAG_ID} {run['dag_run_id']}: {run['state']} ({times})")
    ledger = Path(checkpoint_eval.ledger_path(LAYOUT))
    states = read_ledger(ledger.read_text() if ledger.exists() else None)
    by_state = {s: sorted(i for i, v in states.items() if v == s)
                for s in (EVALUATED, SKIPPED, ANNOUNCED)}
    _say(f"  checkpoints evaluated: {len(by_state[EVALUATED])} {by_state[EVALUATED]}; "
         f"skipped (retention): {by_state[SKIPPED]}; not evaluated: {by_state[ANNOUNCED]}")
    try:
        mlflow_run = Path(LAYOUT.mlflow_run_id).read_text().strip()
        histories = {key: _get(f"{ml}/api/2.0/mlflow/metrics/get-history?run_id={mlflow_run}"
                               f"&metric_key={key}").get("metrics") or []
                     for key in EVALUATION_CURVE}
    except (OSError, ValueError) as exc:
        _say(f"  no evaluation curve in MLflow ({type(exc).__name__}: {exc})")
        return
    for line in evaluation_lines(histories):
        _say(f"  {line}")


# The campaign run's metrics one line per evaluated checkpoint shows, at step = iteration.
EVALUATION_CURVE = (EVAL_METRICS["bits_per_byte"], EVAL_METRICS["perplexity"],
                    EVAL_TOKENS_CONSUMED)


def evaluation_lines(histories: dict[str, list[dict]]) -> list[str]:
    """MLflow's metric histories (``metrics/get-history``'s ``metrics`` lists, per key of
    EVALUATION_CURVE) -> one line per iteration that has bits per byte, oldest first; a step
    logged twice keeps its newest value, as MLflow's charts do."""
    columns: dict[str, dict[int, float]] = {}
    for key, points in histories.items():
        latest: dict[int, float] = {}
        for point in sorted(points, key=lambda p: int(p.get("timestamp", 0))):
            latest[int(point.get("step", 0))] = float(point["value"])
        columns[key] = latest
    bpb, ppl, tokens = (columns.get(key, {}) for key in EVALUATION_CURVE)
    lines = []
    for iteration in sorted(bpb):
        seen = f"{tokens[iteration]:,.0f} tokens" if iteration in tokens else "tokens unknown"
        perplexity = f"{ppl[iteration]:.2f}" if iteration in ppl else "-"
        lines.append(f"checkpoint iteration {iteration:>4} ({seen}): bits per byte "
                     f"{bpb[iteration]:.3f}, perplexity {perplexity}")
    return lines


SERVERS = ("airflow", "mlflow")


def _recorded_group(name: str) -> int | None:
    """The process group of the demo's server ``name`` when its record names one that still
    runs; a stale record (its group gone, or its PID now another process's) is removed."""
    record = STATE / f"{name}.pgid"
    try:
        pgid, started = (int(field) for field in record.read_text().split())
    except FileNotFoundError:
        return None
    except ValueError:  # an older demo's record, PID alone: it cannot be told from a stranger
        _say(f"{record} names no start time; not signalling PID {record.read_text().strip()}")
        record.unlink()
        return None
    if recorded_group_alive(pgid, started):
        return pgid
    record.unlink()
    return None


def _recorded_alive() -> bool:
    return any(_recorded_group(name) is not None for name in SERVERS)


def down() -> int:
    for name in SERVERS:
        pgid = _recorded_group(name)
        if pgid is None:
            continue
        stop_process_group(pgid, ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 5)))
        (STATE / f"{name}.pgid").unlink(missing_ok=True)
        _say(f"stopped {name}")
    return 0


if __name__ == "__main__":
    commands = {"up": up, "down": down}
    if not 2 <= len(sys.argv) <= 3 or sys.argv[1] not in commands or (
            len(sys.argv) == 3 and sys.argv[1:] != ["up", "production"]):
        raise SystemExit("usage: python -m operators.demo up [production] | down")
    raise SystemExit(commands[sys.argv[1]](*sys.argv[2:]))
