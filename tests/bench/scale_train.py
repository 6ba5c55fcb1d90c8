"""The training half of the scale bench (issue 16 part 5): the same small reference campaign
as one segment job on 1 and on 2 nodes of the local cluster, through the worker's SlurmHook.

    from tests.bench.scale_train import train_tokens_per_s
    train_tokens_per_s(1), train_tokens_per_s(2)

Tokens per second of training steps only (segment.json's ``tokens_consumed /
train_seconds``: no imports, no rendezvous, no saves), so the figure is what distributing one
global batch over the nodes costs per step (gradient all-reduce over gloo/TCP, the stop
agreement). On one 2-core machine the nodes share the cores: this is the overhead of
distribution, not a speed-up. Needs the cluster: run under ``flock -s /tmp/pp-cluster.lock``.
"""

from __future__ import annotations

import json
import os
import posixpath
import tempfile
import uuid
from pathlib import Path

from jobscripts.job_files import SEGMENT_RESULT
from operators.campaign.render.layout import Layout
from operators.campaign.render.paths import RunInputs
from operators.campaign.render.reference import CONFIG_FILE, reference_segment
from operators.campaign.schema.load import campaign_from_dict
from operators.slurm.jobkey import job_key
from operators.slurm.operator import PYTHON_ENV, build_spec
from operators.slurm.states import classify
from tests.campaign.util import edited, raw
from tests.support import cluster
from tests.trainer.synthetic_data import base_config, write_dataset

CI_CAMPAIGN = Path(__file__).resolve().parents[1] / "campaigns" / "ci_campaign.yaml"
PREFIX = "synthetic_text_document"
ITERATIONS = 30
GLOBAL_BATCH = 16  # micro-batch 4: 4 micro-batches per step on 1 node, 2 per rank on 2


def _hook():
    from operators.slurm.hook import SlurmHook

    os.environ.update(cluster.connection_env())
    return SlurmHook(cluster.CONN_ID)


def _dataset(hook) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        local = write_dataset(Path(tmp) / PREFIX)
        data_dir = hook.run_dir(job_key("scale-train", uuid.uuid4().hex[:8], "data"))
        hook.upload(data_dir, {PREFIX + s: (local.parent / (PREFIX + s)).read_bytes()
                               for s in (".bin", ".idx")})
    return posixpath.join(data_dir, PREFIX)


def train_tokens_per_s(nodes: int, timeout_s: float = 900) -> float:
    """Training tokens per second of one segment job on ``nodes`` nodes."""
    hook = _hook()
    prefix = _dataset(hook)
    save = posixpath.join(posixpath.dirname(prefix), f"ckpt-{nodes}")
    config = base_config(Path(prefix), Path(save), train_iters=ITERATIONS,
                         global_batch_size=GLOBAL_BATCH, eval_interval=None)
    config.update(data_path=[prefix], save=save, segment_result=SEGMENT_RESULT)
    campaign = campaign_from_dict(edited(raw(CI_CAMPAIGN), {
        "cluster.nodes": nodes, "cluster.time_limit": "15",
        "training.global_batch_size": GLOBAL_BATCH}))
    request = reference_segment(campaign, Layout.for_campaign(campaign), RunInputs.of([prefix]))
    key = job_key("scale-train", uuid.uuid4().hex[:8], f"n{nodes}")
    run_dir = hook.run_dir(key)
    env = {PYTHON_ENV: hook.settings.remote_python, **request.environment}
    spec = build_spec(key, run_dir, request.command, request.job, env)
    job_id = hook.submit(spec, run_dir, {CONFIG_FILE: json.dumps(config)})

    def ended():
        record = hook.describe(job_id, name=key)
        if record and record.source == "sacct" and classify(record.state).terminal:
            return record
        return None

    record = cluster.wait_for(ended, timeout_s, f"scale-train job {job_id}", interval=2.0)
    segment = hook.read_json(posixpath.join(run_dir, SEGMENT_RESULT))
    if record.state != "COMPLETED" or not segment or segment.get("world_size") != nodes:
        raise RuntimeError(f"scale-train job {job_id} on {nodes} node(s) ended {record.state}: "
                           f"{segment and segment.get('error')}")
    return segment["tokens_consumed"] / segment["train_seconds"]


if __name__ == "__main__":
    print(json.dumps({"train_nodes": [1, 2],
                      "train_tokens_per_s": [round(train_tokens_per_s(n)) for n in (1, 2)]}))
