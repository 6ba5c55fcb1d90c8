"""Benchmark: the same corpus tokenized on 1, 2 and 3 nodes of the local cluster, and the same
training campaign on 1 and 2 (issue 16 part 5). Prints one JSON line:

    {"bench": "scale", "tokenize_nodes": [1, 2, 3], "tokenize_tokens_per_s": [...],
     "train_nodes": [1, 2], "train_tokens_per_s": [...]}

Tokenize: the campaign's own jobs (operators/campaign/render/stages.py) on the shared corpus
(/work/shared/corpus, GPT-2 tokenizer), with the campaign's shipped ``jobscripts``: one job on
1 node; with ``data.array_tasks`` = N, an N-task array (``--exclusive`` here, so that Slurm
puts each task on its own node: on the local cluster every node declares 32 CPUs and would
take all three) and then the merge job (``afterok``), as ``data.tokenize`` submits them.
``tokenize_tokens_per_s`` = tokens / (first task's start to the merge's end, sacct's times):
what a user waits for, Slurm's scheduling of the merge included. The details (stderr) add each
task's own encoding rate (its ``tokens_per_s_this_run``) and the span of each phase.

Train: ``tests/bench/scale_train.py: train_tokens_per_s(nodes)`` when it is there, else null.

On one 2-core machine the three nodes share the two cores: more nodes cannot be faster here,
and the figures measure what distribution costs (per-task start-up: imports, tokenizer check;
the merge job; Slurm's scheduling), not a speed-up. Needs the cluster:
``flock -s /tmp/pp-cluster.lock python -m tests.bench.bench_scale``.
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make the repository importable
    sys.path.insert(0, str(ROOT))

SHARED = Path("/work/shared")
BENCH_ROOT = Path("/home/pretrain/pp-bench-scale")  # the cluster user's, on this machine
NODES = (1, 2, 3)
WORKERS = 2  # encoding threads per task: the cores a node of this machine has
CI_CAMPAIGN = ROOT / "tests" / "campaigns" / "ci_campaign.yaml"


def _hook():
    from operators.slurm.hook import SlurmHook
    from tests.support import cluster

    os.environ.update(cluster.connection_env())
    return SlurmHook(cluster.CONN_ID)


def _campaign(tasks: int):
    from operators.campaign.schema.load import campaign_from_dict
    from tests.campaign.util import edited, raw

    return campaign_from_dict(edited(raw(CI_CAMPAIGN), {
        "name": "bench_scale", "cluster.remote_root": str(BENCH_ROOT),
        "cluster.time_limit": "20", "data.array_tasks": tasks,
        "data.tokenize_workers": WORKERS}))


def _prepare(layout) -> None:
    """The corpus (Parquet shards, read as they are) and tokenizer where the campaign's
    tokenize job reads them; the cluster user owns the tree."""
    shutil.rmtree(BENCH_ROOT, ignore_errors=True)
    jsonl, tokenizer = Path(layout.jsonl), Path(layout.tokenizer)
    jsonl.mkdir(parents=True)
    for shard in sorted((SHARED / "corpus").glob("*.parquet")):
        shutil.copy(shard, jsonl / shard.name)
    shutil.copytree(SHARED / "tokenizers" / "gpt2", tokenizer)
    subprocess.run(["chown", "-R", "pretrain:pretrain", str(BENCH_ROOT)], check=True)


def _submit(hook, name: str, kwargs: dict, code_dir: str, **job) -> tuple[str, str]:
    from operators.campaign.adapters.code_ship import with_pythonpath
    from operators.slurm.jobkey import job_key
    from operators.slurm.operator import PYTHON_ENV, build_spec

    key = job_key("bench-scale", uuid.uuid4().hex[:8], name)
    run_dir = hook.run_dir(key)
    env = {PYTHON_ENV: hook.settings.remote_python,
           **with_pythonpath(dict(kwargs["environment"]), code_dir)}
    spec = build_spec(key, run_dir, kwargs["command"], {**kwargs["job"], **job}, env)
    return hook.submit(spec, run_dir), run_dir


def _ended(hook, job_id: str, timeout_s: float = 1200):
    from operators.slurm.states import Outcome, classify

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = hook.describe(job_id)
        if record and record.source == "sacct" and classify(record.state).terminal:
            if classify(record.state) is not Outcome.SUCCESS:
                raise SystemExit(f"job {job_id} ended {record.state} {record.state_detail}")
            return record
        time.sleep(2)
    raise SystemExit(f"job {job_id} did not end within {timeout_s} s")


def tokenize_once(hook, nodes: int) -> dict:
    """Tokenize the corpus with ``nodes`` array tasks (one job for 1); figures from sacct."""
    from jobscripts.shard_output import TASKS_DIR
    from operators.campaign.adapters.code_ship import ship
    from operators.campaign.render import stages
    from operators.campaign.render.layout import Layout

    campaign = _campaign(nodes)
    layout = Layout.for_campaign(campaign)
    tokens = Path(layout.tokens)  # a fresh run, not a resumed one (the corpus is below it)
    for path in [*tokens.glob("*_text_document*"), tokens / "manifest.json"]:
        path.unlink(missing_ok=True)
    shutil.rmtree(tokens / TASKS_DIR, ignore_errors=True)
    code_dir = ship(hook, layout)
    array = stages.tokenize_array(campaign, layout)
    if array is None:
        job_id, run_dir = _submit(hook, "tokenize", stages.tokenize(campaign, layout), code_dir)
        record = _ended(hook, job_id)
        first, last, tasks = record, record, []
    else:
        array_id, array_dir = _submit(hook, "tokenize.array", array, code_dir, exclusive=True)
        merge_id, run_dir = _submit(hook, "tokenize", stages.tokenize(campaign, layout),
                                    code_dir, dependency=f"afterok:{array_id}")
        first, last = _ended(hook, array_id), _ended(hook, merge_id)
        tasks = [hook.read_json(posixpath.join(array_dir, f"result_{t}.json"))
                 for t in range(nodes)]
    result = hook.read_json(posixpath.join(run_dir, "result.json"))
    seconds = (last.end - first.start).total_seconds()
    return {"nodes": nodes, "tokens": result["tokens"], "seconds": seconds,
            "tokens_per_s": round(result["tokens"] / seconds),
            "nodelist": first.nodelist, "fingerprint": result["manifest_fingerprint"],
            "tasks": [{"shards": t["shards"], "tokens": t["tokens"],
                       "tokens_per_s_this_run": t["tokens_per_s_this_run"],
                       "seconds": t["seconds"]} for t in tasks],
            "merge_seconds": last.elapsed_s if tasks else None}


def train_figures() -> tuple[list | None, str | None]:
    try:
        from tests.bench.scale_train import train_tokens_per_s
    except ImportError as exc:
        return None, f"tests/bench/scale_train.py not importable: {exc}"
    try:
        return [round(train_tokens_per_s(n)) for n in (1, 2)], None
    except Exception as exc:  # noqa: BLE001 - the tokenize half still prints
        return None, f"train_tokens_per_s failed: {type(exc).__name__}: {exc}"


def main() -> dict:
    hook = _hook()
    from operators.campaign.render.layout import Layout

    _prepare(Layout.for_campaign(_campaign(1)))
    runs = [tokenize_once(hook, n) for n in NODES]
    if len({r["fingerprint"] for r in runs}) != 1:
        raise SystemExit(f"the manifests differ between node counts: {runs}")
    # The training half can take long on a loaded machine: the tokenize figures come first.
    print(f"bench_scale tokenize: {json.dumps(runs)}", file=sys.stderr, flush=True)
    train, why = train_figures()
    details = {"tokenize_runs": runs, "train_note": why, "load_average": os.getloadavg()}
    print(f"bench_scale details: {json.dumps(details)}", file=sys.stderr)
    return {"bench": "scale", "tokenize_nodes": list(NODES),
            "tokenize_tokens_per_s": [r["tokens_per_s"] for r in runs],
            "train_nodes": [1, 2], "train_tokens_per_s": train}


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
